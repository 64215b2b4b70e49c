"""Static scan of the product package for attributes it sets on objects it does not own.

What ``sglang_cp_shared_kv.sglang_surface`` lists besides its hooks must be everything the product
writes on sglang's objects and modules; this scan finds those writes in the source (``ast``), so a
new one that the table does not list fails its test. Collected, by attribute name:

* ``setattr(obj, NAME, value)`` with NAME a string literal or a module-level string constant (of
  the module or imported from another product module), on any object but ``self`` / ``cls``;
* ``setattr(obj, name, value)`` where ``name`` is a parameter of the enclosing function: the
  constants its callers pass there (the per-call kernel swap); a ``setattr`` whose name is neither
  is reported as unresolved, so it cannot hide;
* ``obj.NAME = value`` (also augmented and annotated), ``obj`` any expression but ``self`` / ``cls``,
  and ``obj.__class__ = value``;
* ``mock.patch("sglang...")`` / ``mock.patch("sgl_kernel...")`` (the last component) and
  ``mock.patch.object(obj, "NAME")``.

Left out, as names the plugin owns: attributes a product class declares (in its body, or as
``self.NAME`` in its methods); the fields of sglang's radix ``TreeNode`` (``vars(TreeNode())``),
which the CP radix cache writes as HiRadixCache itself does when it builds and splits nodes; and
``NOT_SGLANG``, names written on objects that are neither sglang's nor of a product class.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Set

import sglang_cp_shared_kv

PRODUCT_ROOT = Path(sglang_cp_shared_kv.__file__).resolve().parent
_OWN_RECEIVERS = ("self", "cls")
_PATCHED_PACKAGES = ("sglang.", "sgl_kernel.")
NOT_SGLANG = {
    "chunk": "a threading.local of the PD transfer queue (ChunkTrackingQueue)",
    "writeable": "numpy's ndarray.flags (the allocator's read-only take index)",
}


@dataclass(frozen=True)
class AttributeWrite:
    """One write the scan found: the attribute's name and where (``path:line``)."""

    name: str
    where: str


@dataclass(frozen=True)
class SurfaceScan:
    writes: List[AttributeWrite]  # on objects the plugin does not own
    unresolved: List[str]  # ``path:line`` of setattr calls whose name the scan cannot tell

    @property
    def names(self) -> Set[str]:
        return {write.name for write in self.writes}


def scan_product(root: Path = PRODUCT_ROOT) -> SurfaceScan:
    modules = {_module_name(root, path): ast.parse(path.read_text()) for path in sorted(root.rglob("*.py"))}
    constants = {name: _string_constants(tree) for name, tree in modules.items()}
    owned = set().union(*(_declared_by_classes(tree) for tree in modules.values()))
    owned |= _tree_node_fields() | set(NOT_SGLANG)
    forwarders = _name_forwarding_functions(modules.values())
    writes: List[AttributeWrite] = []
    unresolved: List[str] = []
    for module, tree in modules.items():
        visible = dict(constants[module])
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in constants:
                for alias in node.names:
                    if alias.name in constants[node.module]:
                        visible[alias.asname or alias.name] = constants[node.module][alias.name]
        for name, line, resolved in _writes(tree, visible, forwarders):
            where = f"{module}:{line}"
            if not resolved:
                unresolved.append(where)
            elif name not in owned:
                writes.append(AttributeWrite(name, where))
    return SurfaceScan(writes, unresolved)


def _module_name(root: Path, path: Path) -> str:
    parts = (root.name,) + path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _string_constants(tree: ast.Module) -> Dict[str, str]:
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        found[target.id] = node.value.value
    return found


def _declared_by_classes(tree: ast.Module) -> Set[str]:
    declared = set()
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        for statement in cls.body:
            if isinstance(statement, ast.Assign):
                declared.update(t.id for t in statement.targets if isinstance(t, ast.Name))
            elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                declared.add(statement.target.id)
        for node in ast.walk(cls):
            if _is_store(node) and isinstance(node.value, ast.Name) and node.value.id == "self":
                declared.add(node.attr)
    return declared


def _tree_node_fields() -> Set[str]:
    from sglang.srt.mem_cache.radix_cache import TreeNode

    return set(vars(TreeNode()))


def _name_forwarding_functions(trees) -> Dict[str, int]:
    """Functions that ``setattr`` on an object and a name both given as parameters: name -> the
    position of the name parameter."""
    forwarders = {}
    for tree in trees:
        for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            params = [arg.arg for arg in function.args.args]
            for call in (n for n in ast.walk(function) if _is_call_to(n, "setattr")):
                name_arg = call.args[1] if len(call.args) > 1 else None
                if isinstance(name_arg, ast.Name) and name_arg.id in params:
                    forwarders[function.name] = params.index(name_arg.id)
    return forwarders


def _writes(tree: ast.Module, constants: Dict[str, str], forwarders: Dict[str, int]) -> Iterator[tuple]:
    """``(name, line, resolved)`` for every write the module docstring lists."""
    for node in ast.walk(tree):
        if _is_store(node) and not _is_own_receiver(node.value):
            yield node.attr, node.lineno, True
        elif _is_call_to(node, "setattr") and len(node.args) >= 2 and not _is_own_receiver(node.args[0]):
            name = _constant(node.args[1], constants)
            forwarded = isinstance(node.args[1], ast.Name) and _enclosing_forwarder(tree, node, forwarders)
            if name is not None:
                yield name, node.lineno, True
            elif not forwarded:
                yield None, node.lineno, False
        elif isinstance(node, ast.Call) and _callee_name(node) in forwarders:
            position = forwarders[_callee_name(node)]
            if len(node.args) > position:
                name = _constant(node.args[position], constants)
                yield name, node.lineno, name is not None
        elif isinstance(node, ast.Call) and _callee_name(node) == "patch" and node.args:
            target = _constant(node.args[0], constants)
            if target is not None and target.startswith(_PATCHED_PACKAGES):
                yield target.rsplit(".", 1)[1], node.lineno, True
        elif isinstance(node, ast.Call) and _callee_name(node) == "object" and len(node.args) >= 2:
            if isinstance(node.func, ast.Attribute) and _callee_name_of(node.func.value) == "patch":
                name = _constant(node.args[1], constants)
                yield name, node.lineno, name is not None


def _is_store(node) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)


def _is_own_receiver(node) -> bool:
    return isinstance(node, ast.Name) and node.id in _OWN_RECEIVERS


def _is_call_to(node, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name


def _callee_name(call: ast.Call):
    return _callee_name_of(call.func)


def _callee_name_of(func):
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _constant(node, constants: Dict[str, str]):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def _enclosing_forwarder(tree: ast.Module, call: ast.Call, forwarders: Dict[str, int]) -> bool:
    for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        if function.name in forwarders and any(n is call for n in ast.walk(function)):
            return True
    return False
