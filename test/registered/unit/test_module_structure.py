"""Structure the package keeps: floors that imports only run down (``FLOORS``), no import circle
among product modules or packages (lazy imports included), the startup rules a leaf of pure
functions (``startup_rules``), hook registration reached only from ``plugin.py``, one home and one
spelling of the flag, its field and every setting's name (``settings``), no test-only module
imported by product code, the environment read only by ``settings`` and only at startup, one
``CpSharedKVSpec`` per model runner built in one place (with the layout), one state object on the
pool, nothing set on the model runner but its capacity, one ordered startup hook on
``ModelRunner.init_attention_backend`` (``startup_wiring``), the startup decisions taken in one
place, and one per-forward dispatcher (``forward_dispatch``) as the only caller of the plan,
draft-step and per-owner entries; no product module over 650 lines, and the test-only and dead code
that left the product (``GONE_FROM_THE_PRODUCT``) stays out.

Planted once each (besides those each test names): an ``os.environ.get`` left in
``gather_scratch`` failed ``test_the_environment_is_read_only_by_settings``; the startup attach
rebuilding ``CpSharedKVLayout(...)`` failed ``test_the_layout_is_built_once``; ``settings``
importing ``server_args`` failed ``test_settings_is_a_leaf``; per-owner decode's attach registered
again as a second AFTER hook of ``init_attention_backend`` failed
``test_one_hook_on_init_attention_backend``; ``peer_page_reads`` calling ``runtime.begin_forward``
again failed ``test_only_the_dispatcher_begins_a_forward``; ``per_owner_decode.decode_forward``
importing ``forward_dispatch`` (a dispatcher module reaching back) failed
``test_no_import_circle``."""

import ast
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="stage-a-test-cpu")

PACKAGE = "sglang_cp_shared_kv"
ROOT = Path(__file__).resolve().parents[3] / "python" / PACKAGE


TEST_SUPPORT = "sglang_cp_shared_kv_testing"  # the tests' package, beside the product's

# One concept a module: no product module is longer than this.
MAX_MODULE_LINES = 650
# Modules still over it, each with the change that brings it under; one under it now must leave.
OVER_THE_LINE_LIMIT = {
    f"{PACKAGE}.startup_rules": "one table of every startup rule (the leaf); split by area next",
}
# Code only tests, checks and benchmarks used, and code nobody called, that left the product package
# ("<module file stem>.<qualified name>"): the tests' own helpers live in the tests' package or test.
GONE_FROM_THE_PRODUCT = (
    "decode_topk_merge.replicated_topk_positions",
    "decode_topk_merge.same_selection_up_to_ties",
    "decode_topk_merge.selected_positions",
    "decode_topk_merge.all_gather_candidates",
    "decode_topk_merge.GlobalSelection.selected_count",
    "peer_page_plan.PeerPagePlan.fill_locs",
    "peer_page_plan.PeerPagePlan.fill_lookup",
    "cp_hybrid_cache_controller.CpHybridCacheController.reserve_host_slots",
    "cp_shared_kv_metrics.uninstall",
    "scratch_sizing.prefill_batch_scratch_pages",
    "startup_rules.ScratchDecision.decode_per_owner",
)
# The floors of the product package, low to high: a module imports only from a lower floor or from
# within its own package (root modules: from root modules of its floor). The root leaves say what a
# launch is (the settings, the startup rules and the summary in words); the runtime's packages
# build on them; the root wiring (the flag's sglang hooks, ``check_launch``, the plugin's entry
# point) sits on top. A new package or root module must be given its floor here.
FLOORS = {
    "settings": 0,
    "startup_rules": 0,
    "startup_summary": 0,  # logged by model_executor.startup_wiring, so it sits with the rules
    "sglang_surface": 0,  # the table of what the plugin changes in sglang: data the plugin checks
    "observability": 1,
    "mem_cache": 2,
    "model_executor": 3,
    "managers": 4,
    "disaggregation": 5,
    "server_args": 6,
    "check_launch": 6,
    "plugin": 6,
}
# Imports allowed to run up a floor, with the reason each cannot go down (none today).
UPWARD_EXCEPTIONS = {}


def unit_of(module: str):
    """The package (or root module) ``module`` belongs to; None for the root package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def is_root_module(module: str) -> bool:
    return len(module.split(".")) == 2 and not (ROOT / module.split(".")[1]).is_dir()


def product_modules():
    """Module name -> parsed source of every module of the product package."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        modules[name] = ast.parse(path.read_text())
    return modules


def product_module_lines():
    """Module name -> its number of lines, for every module of the product package."""
    return {
        ".".join(path.relative_to(ROOT.parent).with_suffix("").parts): len(path.read_text().splitlines())
        for path in ROOT.rglob("*.py")
    }


def definitions(module: str, tree) -> set:
    """``<module file stem>.<qualified name>`` of every function, class, class field or module-level
    name the module defines (nested classes and methods included)."""
    found = set()

    def visit(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(f"{prefix}.{node.name}")
                if isinstance(node, ast.ClassDef):
                    visit(node.body, f"{prefix}.{node.name}")
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                found.add(f"{prefix}.{node.target.id}")
            elif isinstance(node, ast.Assign):
                found.update(f"{prefix}.{t.id}" for t in node.targets if isinstance(t, ast.Name))

    visit(tree.body, module.rsplit(".", 1)[-1])
    return found


def _ours(module: str, package: str = PACKAGE) -> bool:
    return module == package or module.startswith(package + ".")


def imports_of(tree):
    """Every package module imported anywhere in the module, function bodies included."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and (_ours(node.module) or _ours(node.module, TEST_SUPPORT)):
            found.add(node.module)
            for alias in node.names:
                found.add(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if _ours(a.name) or _ours(a.name, TEST_SUPPORT)}
    return found


def _called_name(call: ast.Call):
    return getattr(call.func, "attr", getattr(call.func, "id", None))


def _first_circle(graph):
    """The first circle of ``graph`` (node -> nodes it imports) as ``a -> b -> a``, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return " -> ".join(path[path.index(nxt):] + [nxt])
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for name in sorted(graph):
        if name not in state:
            found = visit(name, [name])
            if found:
                return found
    return None


class TestModuleStructure(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.modules = product_modules()
        cls.graph = {
            name: {m for m in imports_of(tree) if m in cls.modules and m != name}
            for name, tree in cls.modules.items()
        }

    def test_no_import_circle(self):
        self.assertEqual(_first_circle(self.graph), None)

    def test_every_package_has_a_floor(self):
        units = {unit_of(name) for name in self.modules} - {None}
        self.assertEqual(units - set(FLOORS), set())

    def test_no_import_runs_up_a_floor(self):
        """Lazy imports included (a function-level import is an edge like any other). Planted,
        caught: ``mem_cache.tree_value_pages`` importing ``model_executor.cp_shared_kv_runtime``
        inside a function."""
        upward = []
        for name, imported in self.graph.items():
            source = unit_of(name)
            for target_module in imported:
                target = unit_of(target_module)
                if target is None or target == source:
                    continue
                if FLOORS[target] < FLOORS[source]:
                    continue
                if FLOORS[target] == FLOORS[source] and is_root_module(name) and is_root_module(target_module):
                    continue  # root modules of one floor (the circle tests keep them acyclic)
                if (name, target_module) not in UPWARD_EXCEPTIONS:
                    upward.append(f"{name} -> {target_module}")
        self.assertEqual(sorted(upward), [])

    def test_no_package_circle(self):
        """Packages and root modules as nodes: no circle among them either. Planted, caught:
        ``observability.cp_shared_kv_metrics`` importing ``mem_cache.allocator`` (a circle with
        ``mem_cache.cp_hybrid_cache_controller``), inside a function."""
        graph = {}
        for name, imported in self.graph.items():
            for target in imported:
                if None not in (unit_of(name), unit_of(target)) and unit_of(name) != unit_of(target):
                    graph.setdefault(unit_of(name), set()).add(unit_of(target))
        self.assertEqual(_first_circle(graph), None)

    def test_the_startup_rules_are_a_leaf(self):
        """Pure functions of server args and settings: nothing of the runtime (planted, caught:
        ``startup_rules`` importing ``model_executor.per_owner_decode`` inside a function)."""
        self.assertEqual(self.graph[f"{PACKAGE}.startup_rules"], {f"{PACKAGE}.settings"})

    def test_product_code_imports_no_test_helper(self):
        for name, tree in self.modules.items():
            helpers = {m for m in imports_of(tree) if _ours(m, TEST_SUPPORT)}
            self.assertEqual(helpers, set(), name)

    def test_the_product_package_holds_no_test_support(self):
        """The shims, fakes, simulations and drivers live in their own package beside the product
        (a built wheel carries the product alone, ``pyproject.toml``)."""
        self.assertFalse((ROOT / "testing").exists())
        self.assertTrue((ROOT.parent / TEST_SUPPORT / "__init__.py").is_file())
        pyproject = (ROOT.parents[1] / "pyproject.toml").read_text()
        self.assertIn(f'exclude = ["{TEST_SUPPORT}", "{TEST_SUPPORT}.*"]', pyproject)

    def test_no_product_module_is_over_the_line_limit(self):
        """Seen failing with ``mem_cache/cp_hiradix_cache.py`` at 1,247 lines, before its split."""
        over = {name: lines for name, lines in product_module_lines().items() if lines > MAX_MODULE_LINES}
        self.assertEqual(sorted(set(over) - set(OVER_THE_LINE_LIMIT)), [], f"over {MAX_MODULE_LINES} lines: {over}")
        for name in OVER_THE_LINE_LIMIT:
            self.assertIn(name, over, f"{name} is within the limit now: drop it from OVER_THE_LINE_LIMIT")

    def test_test_only_and_dead_code_is_gone_from_the_product(self):
        """Seen failing on the product before they left it: all 13 names found."""
        found = set().union(*(definitions(name, tree) for name, tree in self.modules.items()))
        self.assertEqual(sorted(found & set(GONE_FROM_THE_PRODUCT)), [])

    def test_the_flag_is_spelled_once(self):
        spelled = [
            name
            for name, tree in self.modules.items()
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value == "--enable-nsa-prefill-cp-shared-kv"
        ]
        self.assertEqual(spelled, [f"{PACKAGE}.settings"])

    def test_the_flag_field_is_spelled_once(self):
        """The ``ServerArgs`` field is read and set through ``settings.CP_SHARED_KV_FIELD`` (and
        ``cp_shared_kv_enabled``), never spelled as an attribute elsewhere. Planted, caught:
        ``server_args`` setting ``server_args.enable_nsa_prefill_cp_shared_kv`` directly."""
        field = "enable_nsa_prefill_cp_shared_kv"
        spelled = set()
        for name, tree in self.modules.items():
            for node in ast.walk(tree):
                if (
                    (isinstance(node, ast.Constant) and node.value == field)
                    or (isinstance(node, ast.Attribute) and node.attr == field)
                    or (isinstance(node, ast.keyword) and node.arg == field)
                ):
                    spelled.add(name)
        self.assertEqual(spelled, {f"{PACKAGE}.settings"})

    def test_every_setting_name_is_imported_from_settings(self):
        """The flag, its field, every variable name and the settings' functions have one home:
        everyone (product, test support, tests, scripts, benchmarks) imports them from
        ``settings``, never through a module that re-exports them, and no module of ours offers a
        ``FLAG`` of its own. Planted, caught: ``peer_page_reads`` importing ``FLAG`` from
        ``cp_shared_kv_runtime``; a test importing ``CP_SHARED_KV_ENV`` from ``server_args``."""
        settings_tree = self.modules[f"{PACKAGE}.settings"]
        names = {"FLAG"}
        for node in settings_tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
        repo = ROOT.parents[1]
        elsewhere = []
        for base in ("python", "test", "scripts", "benchmark"):
            for path in (repo / base).rglob("*.py"):
                for node in ast.walk(ast.parse(path.read_text())):
                    if (
                        isinstance(node, ast.ImportFrom)
                        and node.module
                        and (_ours(node.module) or _ours(node.module, TEST_SUPPORT))
                        and node.module != f"{PACKAGE}.settings"
                    ):
                        elsewhere += [
                            f"{path.relative_to(repo)}: {alias.name} from {node.module}"
                            for alias in node.names
                            if alias.name in names
                        ]
        self.assertEqual(elsewhere, [])

    def test_settings_is_a_leaf(self):
        """Every module may import it; it imports nothing of ours (no circle through settings)."""
        self.assertEqual(self.graph[f"{PACKAGE}.settings"], set())

    def test_the_environment_is_read_only_by_settings(self):
        """One parse rule: no other product module touches ``os.environ`` or ``os.getenv``."""
        readers = set()
        for name, tree in self.modules.items():
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "os"
                    and node.attr in ("environ", "getenv", "putenv")
                ):
                    readers.add(name)
        self.assertEqual(readers, {f"{PACKAGE}.settings"})

    def test_every_setting_variable_is_spelled_only_in_settings(self):
        spelled = {
            name
            for name, tree in self.modules.items()
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith(("SGLANG_CP_SHARED_KV", "SGLANG_DISAGGREGATION_ALL_CP_RANKS"))
            and node.value.split("=")[0].isupper()
        }
        self.assertEqual(spelled, {f"{PACKAGE}.settings"})

    def test_the_layout_is_built_once(self):
        """The spec's ``CpSharedKVLayout`` is the layout (the allocator holds it); the runtime, the
        CP HiRadixCache and the PD manager read it rather than rebuilding it from the CP group."""
        builders = {
            name
            for name, tree in self.modules.items()
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) == "CpSharedKVLayout"
        }
        self.assertEqual(builders, {f"{PACKAGE}.model_executor.cp_shared_kv_spec"})

    def test_only_the_plugin_calls_register_hooks(self):
        callers = set()
        for name, tree in self.modules.items():
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("register_hooks", "register_server_args_hooks")
                ):
                    callers.add(name)
        self.assertEqual(callers, {f"{PACKAGE}.plugin"})

    def test_one_hook_on_init_attention_backend(self):
        """Startup steps whose order matters (runtime, draft runtime, per-owner decode) run from
        one hook, in ``startup_wiring``'s code, not from hooks ordered by registration."""
        hooking = [
            name
            for name, tree in self.modules.items()
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "register"
            and node.args
            and ast.unparse(node.args[0]).rstrip("'\"").endswith(".init_attention_backend")
        ]
        self.assertEqual(hooking, [f"{PACKAGE}.model_executor.startup_wiring"])

    def test_only_the_dispatcher_begins_a_forward(self):
        """The per-forward decision (draft step / per owner / gather) is taken in one place: every
        call of ``begin_forward``, ``plan_draft_step`` or ``remap_index_tables`` is in
        ``forward_dispatch``, but for the pool's state handing the forward to per-owner decode."""
        entries = ("begin_forward", "plan_draft_step", "remap_index_tables")
        callers = set()
        for name, tree in self.modules.items():
            for function in ast.walk(tree):
                if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(function):
                    if not isinstance(node, ast.Call):
                        continue
                    called = getattr(node.func, "attr", getattr(node.func, "id", None))
                    if called in entries:
                        callers.add(f"{name}.{function.name}")
        self.assertEqual(
            callers,
            {
                f"{PACKAGE}.model_executor.forward_dispatch.dispatch_forward_metadata",
                f"{PACKAGE}.model_executor.cp_shared_kv_state.begin_per_owner_forward",
            },
        )

    def test_the_startup_decisions_are_taken_in_one_place(self):
        """The decode path and the scratch's sizes come from ``startup_rules.decide_decode_path`` and
        ``decide_scratch``, taken once per model runner where its spec is built (and by
        ``check_launch`` without a runner); nobody else asks the rules behind them again. Planted,
        caught: the draft's attach judging ``runtime_problems`` with a decode path of its own."""
        rules = (
            "decide_decode_path",
            "decide_scratch",
            "impl_gather_reason",
            "scratch_sizing",
            "configured_prefetch_slot_tokens",
            "logical_capacity_reason",
            "cuda_graph_problem",
            "runtime_problems",
        )
        callers = set()
        for name, tree in self.modules.items():
            if name == f"{PACKAGE}.startup_rules":
                continue
            for function in ast.walk(tree):
                if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(function):
                    if isinstance(node, ast.Call):
                        called = getattr(node.func, "attr", getattr(node.func, "id", None))
                        if called in rules:
                            callers.add(f"{name}.{function.name}")
        self.assertEqual(
            callers,
            {
                f"{PACKAGE}.model_executor.cp_shared_kv_spec.build_spec",
                f"{PACKAGE}.check_launch.check_launch",
            },
        )

    def test_the_spec_is_built_in_one_place(self):
        """``CpSharedKVSpec(`` is constructed once in the product, where the capacity is installed
        (``cp_shared_kv_spec.build_spec``, called by ``cp_shared_kv_capacity``); the draft reuses the
        target's. Planted, caught: the draft's attach building a spec of its own."""
        builders = set()
        for name, tree in self.modules.items():
            for function in ast.walk(tree):
                if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for node in ast.walk(function):
                        if isinstance(node, ast.Call) and _called_name(node) == "CpSharedKVSpec":
                            builders.add(f"{name}.{function.name}")
        self.assertEqual(builders, {f"{PACKAGE}.model_executor.cp_shared_kv_spec.build_spec"})
        callers = {
            name
            for name, tree in self.modules.items()
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and _called_name(node) == "build_spec"
        }
        self.assertEqual(callers, {f"{PACKAGE}.model_executor.cp_shared_kv_capacity"})

    def test_nothing_is_set_on_the_model_runner_but_its_capacity(self):
        """No decision rides on sglang's model runner (the spec lives in the pool's state); the
        capacity hook sets the two values sglang reads (the allocator and the logical capacity).
        Planted, caught: the scratch decision ``setattr`` on the runner again."""
        runner_names = ("runner", "model_runner")
        set_on_runner = set()
        for name, tree in self.modules.items():
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and _called_name(node) == "setattr":
                    target = node.args[0] if node.args else None
                    if isinstance(target, ast.Name) and target.id in runner_names:
                        set_on_runner.add(f"{name}: setattr")
                elif isinstance(node, (ast.Assign, ast.AugAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for target in targets:
                        if (
                            isinstance(target, ast.Attribute)
                            and isinstance(target.value, ast.Name)
                            and target.value.id in runner_names
                        ):
                            set_on_runner.add(f"{name}: {target.attr}")
        capacity = f"{PACKAGE}.model_executor.cp_shared_kv_capacity"
        self.assertEqual(
            set_on_runner,
            {f"{capacity}: token_to_kv_pool_allocator", f"{capacity}: max_total_num_tokens"},
        )

    def test_one_state_object_on_the_pool(self):
        """Everything shared KV keeps for a KV pool hangs off one attribute of it, the
        ``CpSharedKVState`` (spec, runtime, mirror, per-owner decode); nobody else sets an
        attribute on a pool. Planted, caught: the runtime setting ``_cp_shared_kv_runtime`` on its
        pool again."""
        pool_names = ("pool", "kvcache", "token_to_kv_pool")
        setters = {
            name
            for name, tree in self.modules.items()
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and _called_name(node) == "setattr"
            and node.args
            and isinstance(node.args[0], (ast.Name, ast.Attribute))
            and getattr(node.args[0], "id", getattr(node.args[0], "attr", None)) in pool_names
        }
        self.assertEqual(setters, {f"{PACKAGE}.model_executor.cp_shared_kv_state"})

    def test_per_owner_decode_and_the_page_gather_meet_in_the_pool_state(self):
        """Neither sets the other's state: a plan (the runtime's, the layer pipeline's) and a
        per-owner forward are set only by their own objects (``self.plan``, ``self.forward``); a
        per-owner forward clears the runtime's plan through ``CpSharedKVState``, and the draft steps
        and the decode graphs begin or end per-owner forwards through it too. Planted, caught:
        per-owner decode's ``begin_forward`` setting ``runtime.plan = None`` again; the draft steps
        setting ``state.forward = None``."""
        set_from_outside = set()
        for name, tree in self.modules.items():
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        if (
                            isinstance(target, ast.Attribute)
                            and target.attr in ("plan", "forward")
                            and not (isinstance(target.value, ast.Name) and target.value.id == "self")
                        ):
                            set_from_outside.add(f"{name}: {ast.unparse(target)}")
        self.assertEqual(set_from_outside, set())

    def test_only_startup_reads_the_settings(self):
        """The environment's settings are read where a launch is judged (``server_args``,
        ``check_launch``) and where the model runner's spec is built, once per process; per-forward
        code reads the spec. Planted, caught: the plan asking ``current_settings()`` for the
        page-mirror check again (the old ``mirror_check_enabled``)."""
        readers = ("current_settings", "current_settings_and_problems", "parse_settings")
        callers = set()
        for name, tree in self.modules.items():
            if name == f"{PACKAGE}.settings":
                continue
            for function in ast.walk(tree):
                if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for node in ast.walk(function):
                        if isinstance(node, ast.Call) and _called_name(node) in readers:
                            callers.add(f"{name}.{function.name}")
        self.assertEqual(
            callers,
            {
                f"{PACKAGE}.server_args.validate_cp_shared_kv_server_args",
                f"{PACKAGE}.check_launch.check_launch",
                f"{PACKAGE}.model_executor.cp_shared_kv_spec.build_spec",
            },
        )

if __name__ == "__main__":
    unittest.main()
