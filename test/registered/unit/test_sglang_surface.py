"""The table of what the plugin changes in sglang (``sglang_surface.SGLANG_SURFACE``), held to the
installed sglang, to the code and to its docs page.

Seen failing, planted once each: a hook row's attribute misspelled (``add_cli_argz``) failed
``test_every_hook_target_resolves``, a kernel row's (``flash_mla_with_kvcach``)
``test_every_other_target_resolves``; a registration outside the table (a second AROUND on
``NSATokenToKVPool.get_key_buffer``) and the ``RadixCache.insert`` row removed each failed
``test_flag_on_registers_exactly_the_hook_rows``; ``check_server_args``'s row in the flag-on scope
failed ``test_flag_off_registers_only_the_every_process_rows``; ``setattr(backend, "_cp_planted",
True)`` in ``forward_dispatch`` failed ``test_every_attribute_set_is_a_row``; a row for an
attribute nothing sets failed ``test_every_set_row_is_set_somewhere``; ``ReqToTokenPool.size`` as
an added attribute failed ``test_added_and_overwritten_attributes_are_told_apart``; a reason edited
without rendering failed ``test_the_page_is_the_rendering``; ``plugin.register`` without the
startup check failed ``test_a_missing_target_stops_registration``, and with the check resolving
the flag-on targets in every process ``test_the_flag_off_process_resolves_only_its_own_targets``;
``SglangSurfaceMismatch`` as a ``RuntimeError`` failed ``test_sglang_load_plugins_stops_too``
(sglang's loader logged it and went on); the scan without its call-swap or ``__class__`` forms
failed ``test_the_scan_sees_every_form_of_write``.
"""

import ast
import importlib.machinery
import inspect
import os
import pkgutil
import re
import tempfile
import textwrap
import unittest
from collections import Counter
from pathlib import Path
from unittest import mock

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv import plugin, sglang_surface
from sglang_cp_shared_kv.settings import CP_SHARED_KV_ENV
from sglang_cp_shared_kv.sglang_surface import (
    SGLANG_SURFACE,
    SGLANG_VERSION,
    Kind,
    Scope,
    SglangSurfaceMismatch,
    SurfaceRow,
    unresolved_targets,
)
from sglang_cp_shared_kv_testing import sgl_kernel_cpu_shim
from sglang_cp_shared_kv_testing.repo_scripts import load_script
from sglang_cp_shared_kv_testing.sglang_surface_scan import scan_product

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")

sgl_kernel_cpu_shim.install()  # the runtime hooks' sglang modules import sglang's host pools

HOOK_ROWS = [row for row in SGLANG_SURFACE if row.kind.is_hook]
SET_ROWS = [row for row in SGLANG_SURFACE if not row.kind.is_hook]  # every other row sets something
# A server-argument hook target sglang does not have (what another sglang would look like).
SERVER_ARGS_TYPO = SurfaceRow(
    "sglang.srt.server_args.ServerArgs", "add_cli_argz", Kind.AFTER, "planted", Scope.EVERY_PROCESS
)


class _RecordingRegistry:
    def __init__(self):
        self.registered = []

    def register(self, target, hook, hook_type):
        self.registered.append((target, hook_type.name))


def _registered(flag_on: bool):
    registry = _RecordingRegistry()
    with mock.patch.dict(os.environ, {CP_SHARED_KV_ENV: "1" if flag_on else "0"}):
        plugin.register(registry)
    return Counter(registry.registered)


def _hook_rows(scopes):
    return Counter((row.target, row.kind.name) for row in HOOK_ROWS if row.scope in scopes)


class TestTargetsResolve(CustomTestCase):
    def test_every_hook_target_resolves(self):
        self.assertEqual(unresolved_targets(HOOK_ROWS), [])

    def test_every_other_target_resolves(self):
        """Set rows: the owner exists; a function swapped for a call (or a class swapped) exists
        on it. ``sgl_kernel`` does not load without CUDA: its module's source is read instead."""
        for row in SET_ROWS:
            with self.subTest(target=row.target):
                if row.owner.startswith("sgl_kernel"):
                    self.assertIn(row.attribute, _top_level_names(row.owner))
                    continue
                owner = pkgutil.resolve_name(row.owner)
                if row.kind in (Kind.SET_DURING_CALL, Kind.CLASS_SWAP):
                    self.assertTrue(hasattr(owner, row.attribute))

    def test_added_and_overwritten_attributes_are_told_apart(self):
        """An added attribute is named nowhere in the source of its sglang class (and bases); an
        overwritten one is sglang's own, named there."""
        for row in SET_ROWS:
            if row.kind not in (Kind.ADDS_ATTRIBUTE, Kind.SETS_ATTRIBUTE):
                continue
            with self.subTest(target=row.target):
                named = re.search(rf"\b{re.escape(row.attribute)}\b", _sglang_class_source(row.owner))
                self.assertEqual(bool(named), row.kind is Kind.SETS_ATTRIBUTE)


class TestStartupCheck(CustomTestCase):
    def test_a_missing_target_stops_registration(self):
        registry = _RecordingRegistry()
        with mock.patch.object(sglang_surface, "SGLANG_SURFACE", SGLANG_SURFACE + (SERVER_ARGS_TYPO,)):
            with self.assertRaises(SglangSurfaceMismatch) as raised:
                with mock.patch.dict(os.environ, {CP_SHARED_KV_ENV: "0"}):
                    plugin.register(registry)
        message = str(raised.exception)
        self.assertIn("sglang.srt.server_args.ServerArgs.add_cli_argz", message)
        self.assertIn(f"written for sglang {SGLANG_VERSION}", message)
        self.assertRegex(message, r"the installed sglang \S+ lacks 1 of its hook targets")
        self.assertEqual(registry.registered, [])  # nothing half-registered

    def test_sglang_load_plugins_stops_too(self):
        """Through sglang's own loader, which logs and skips a plugin raising an ``Exception``."""
        import sglang.srt.plugins as sglang_plugins

        env = {CP_SHARED_KV_ENV: "0", "SGLANG_PLUGINS": "cp_shared_kv"}
        with (
            mock.patch.object(sglang_surface, "SGLANG_SURFACE", SGLANG_SURFACE + (SERVER_ARGS_TYPO,)),
            mock.patch.object(sglang_plugins, "_plugins_loaded", False),
            mock.patch.dict(os.environ, env),
            self.assertRaises(SglangSurfaceMismatch),
        ):
            sglang_plugins.load_plugins()

    def test_the_flag_off_process_resolves_only_its_own_targets(self):
        """The CLI process (flag off) registers only the server-argument hooks and resolves only
        theirs: a missing runtime target stops the flag-on processes, not the CLI."""
        typo = SurfaceRow("sglang.srt.not_a_module.Thing", "method", Kind.AROUND, "planted")
        with mock.patch.object(sglang_surface, "SGLANG_SURFACE", SGLANG_SURFACE + (typo,)):
            with mock.patch.dict(os.environ, {CP_SHARED_KV_ENV: "0"}):
                plugin.register(_RecordingRegistry())
            with self.assertRaises(SglangSurfaceMismatch):
                with mock.patch.dict(os.environ, {CP_SHARED_KV_ENV: "1"}):
                    plugin.register(_RecordingRegistry())


class TestRegisteredHooksAreTheTable(CustomTestCase):
    def test_flag_on_registers_exactly_the_hook_rows(self):
        registered = _registered(flag_on=True)
        table = _hook_rows((Scope.EVERY_PROCESS, Scope.FLAG_ON))
        self.assertEqual(registered - table, Counter(), "registered outside the table")
        self.assertEqual(table - registered, Counter(), "rows nothing registers")

    def test_flag_off_registers_only_the_every_process_rows(self):
        self.assertEqual(_registered(flag_on=False), _hook_rows((Scope.EVERY_PROCESS,)))


class TestSetAttributesAreTheTable(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.scan = scan_product()

    def test_every_attribute_set_is_a_row(self):
        self.assertEqual(self.scan.unresolved, [], "setattr with a name the scan cannot tell")
        listed = {row.attribute for row in SET_ROWS}
        outside = sorted(f"{w.name} ({w.where})" for w in self.scan.writes if w.name not in listed)
        self.assertEqual(outside, [])

    def test_every_set_row_is_set_somewhere(self):
        self.assertEqual(sorted({row.attribute for row in SET_ROWS} - self.scan.names), [])

    def test_the_scan_sees_every_form_of_write(self):
        """The scan on a planted package: each form its docstring lists is found, writes on
        ``self``, on names a class of the package declares and on TreeNode fields are not."""
        source = textwrap.dedent(
            """
            from unittest import mock

            ATTR = "_by_constant"

            class Ours:
                def __init__(self):
                    self.declared = 0

            def swap(module, name, value):
                setattr(module, name, value)

            def writes(pool, node, controller, ours, kernels):
                setattr(pool, ATTR, 1)
                setattr(pool, "_by_literal", 1)
                pool.by_assignment = 1
                pool.by_augmented += 1
                controller.__class__ = Ours
                swap(kernels, "swapped_kernel", None)
                ours.declared = 1
                node.lock_ref = 0
                with mock.patch("sglang.srt.somewhere.patched_function"):
                    pass

            def dynamic(obj, names):
                for name in names:
                    setattr(obj, name, None)
            """
        )
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "planted"
            root.mkdir()
            (root / "module.py").write_text(source)
            scan = scan_product(root)
        self.assertEqual(
            scan.names,
            {"_by_constant", "_by_literal", "by_assignment", "by_augmented", "__class__",
             "swapped_kernel", "patched_function"},
        )
        self.assertEqual(len(scan.unresolved), 1)  # ``dynamic``'s setattr


class TestDocsPage(CustomTestCase):
    def test_the_page_is_the_rendering(self):
        renderer = load_script("scripts/render_sglang_surface.py")
        self.assertEqual(renderer.PAGE.read_text(), renderer.render())


def _top_level_names(module_name: str) -> set:
    """Names a module defines at top level, read from its source without importing it."""
    package, _, module = module_name.partition(".")
    spec = importlib.machinery.PathFinder.find_spec(package)
    spec = importlib.machinery.PathFinder.find_spec(module_name, spec.submodule_search_locations)
    tree = ast.parse(Path(spec.origin).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _sglang_class_source(owner: str) -> str:
    cls = pkgutil.resolve_name(owner)
    return "\n".join(
        inspect.getsource(base) for base in cls.__mro__ if base.__module__.startswith("sglang.")
    )


if __name__ == "__main__":
    unittest.main()
