"""Apply some ``HookRegistry`` hooks for the duration of a test, then undo them.

``HookRegistry`` is process-global and cannot un-apply: ``reset()`` forgets registrations but leaves
the patched attributes in place, so a test that applied hooks would change sglang for every later
test in the same pytest process. ``applied_hooks(register_fn, ...)`` sets the registry's current
state aside, registers and applies only the given hooks, and on exit restores every patched
attribute (including module-level bindings that ``HookRegistry`` propagated) and the registry.
"""

from __future__ import annotations

import pkgutil
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

from sglang.srt.plugins.hook_registry import HookRegistry

_MISSING = object()


@contextmanager
def applied_hooks(*register_fns: Callable) -> Iterator[None]:
    """``register_fn(registry)`` for each given function, applied until the block exits."""
    saved_hooks = {target: list(hooks) for target, hooks in HookRegistry._hooks.items()}
    saved_patched = set(HookRegistry._patched)
    HookRegistry.reset()
    try:
        for register in register_fns:
            register(HookRegistry)
        originals = [_owner_and_raw(target) for target in HookRegistry._hooks]
        HookRegistry.apply_hooks()
        try:
            yield
        finally:
            for owner, name, raw in originals:
                _restore(owner, name, raw)
    finally:
        HookRegistry.reset()
        HookRegistry._hooks.update(saved_hooks)
        HookRegistry._patched.update(saved_patched)


def _owner_and_raw(target: str):
    owner_path, name = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    # A method inherited from a base class is not in the subclass __dict__: remember that, so the
    # restore deletes the override instead of copying the base's function onto the subclass.
    return owner, name, vars(owner).get(name, _MISSING)


def _restore(owner, name: str, raw) -> None:
    patched = vars(owner).get(name, _MISSING)
    if raw is _MISSING:
        if patched is not _MISSING:
            delattr(owner, name)
        return
    setattr(owner, name, raw)
    if patched is _MISSING or patched is raw:
        return
    # Undo HookRegistry's propagation of the patched object into ``from X import name`` bindings.
    for module in list(sys.modules.values()):
        module_vars = getattr(module, "__dict__", None)
        if not module_vars or module is owner:
            continue
        for attr, value in list(module_vars.items()):
            if value is patched:
                setattr(module, attr, raw)
