"""Per-owner decode through sglang's own decode methods, on 2 and 3 gloo ranks: the hooked
``get_indexer_metadata`` + ``Indexer._get_topk_paged`` + ``forward_decode`` give every rank the
output a replicated pool gives, without the gather scratch, for each decode impl served
(``flashmla_kv`` over fp8 KV, ``flashmla_sparse`` and ``fa3`` over bf16 KV).

Each rank holds a real ``NSATokenToKVPool`` shard (cut from one replicated pool by the layout) and
runs two decode steps of three layers (top-k, ``skip_topk`` reusing its indices, top-k) over a batch
with requests longer and shorter than top-k, one of a single page (a rank owns none of its rows)
and a padded one (``req_to_token`` row 0): the backend's metadata hook (per-owner begin, no plan),
sglang's paged indexer (deep_gemm replaced by its torch reference) and ``forward_decode`` (its
owner-filtered store, ``get_key_buffer``, the impl's kernel replaced by its torch reference). The
parent checks every rank's output equals the others' and the replicated attention's (bf16
tolerance), padded rows give exactly 0, the ranks' indices cover the replicated selection exactly
once, the decode rows were stored, and the scratch stayed untouched. The merge runs in the form the
rule picks with the default setting (one all-gather of partial + LSE at these batch sizes, asserted
from what every rank ran); once more with the setting off (the scaled sum, today's merge before the
one exchange) for fa3, whose outputs the one-exchange run's must equal within the tolerance.

Planted bugs (``per_owner_decode_hooked.PLANTS``, applied to the run only), each made this test fail;
each but the two kernel-convention plants also runs on a batch without the case it targets, where
it passes, so the case is what catches it: a ``skip_topk`` layer's partial not merged; the
selection's padding attending row 0 (short requests); the dummy page owned by rank 0 (padded
requests); an empty partial's LSE entering the global LSE (a rank owning none of a request's rows);
the second step reusing the first step's tables; fa3 without the compaction; the kernel's LSE base;
the one exchange reading each rank's LSE from the wrong bytes of the gathered buffer (passes with
the scaled sum, which reads no packed buffer).
Earlier plants, also caught (then reverted): the attention hook returning the partial without the
merge; the indexer hook keeping the logical ``real_page_table``; the getters never told to serve the
physical pool (then ``serves_physical``, now ``CpSharedKVState.reads_physical_pool``, always False);
``attach`` ignoring SGLANG_NSA_FUSE_TOPK.
"""

import os
import unittest

import torch
from types import SimpleNamespace
from unittest import mock

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.settings import DECODE_PATH_ENV
from sglang_cp_shared_kv_testing import per_owner_decode_hooked as hooked

register_cpu_ci(est_time=300, suite="stage-a-test-cpu")


def attach_as_startup_decides(runtime):
    """``attach`` with the decision of the runtime's spec (the startup's, for its decode impl and
    this process's settings when the runtime was built)."""
    from sglang_cp_shared_kv.model_executor.per_owner_decode.decode_forward import attach

    return attach(runtime.state)


PAGE = hooked.PAGE
TOPK = 128
# longer than k, shorter than k, a single page (a rank owns none of its rows), exactly k
SEQ_LENS = (300, 100, 40, 128)
FULL = dict(seq_lens=SEQ_LENS, topk=TOPK, padded=1, layers=("topk", "skip", "topk"), steps=2)
IMPLS = (("flashmla_kv", "fp8"), ("flashmla_sparse", "bf16"), ("fa3", "bf16"))
REL_TOL = 2e-2


def scenario(impl="flashmla_kv", **overrides):
    kv_dtype = dict(IMPLS)[impl]
    return hooked.Scenario(**{**FULL, "decode_impl": impl, "kv_dtype": kv_dtype, **overrides})


# plant -> (impl, the comparison entry it breaks, the scenario without the case it targets or None)
PLANT_CASES = {
    "skip-layer-unmerged": ("flashmla_kv", "passed_tolerance", dict(layers=("topk", "topk", "topk"))),
    "short-pad-row-0": ("flashmla_kv", "passed_tolerance", dict(seq_lens=(300, 200, 129), padded=0)),
    "padded-row-owned": ("flashmla_sparse", "padded_rows_zero", dict(padded=0)),
    # without the case: long requests, every rank owns some of every token's selected rows
    "empty-partial-counted": ("flashmla_kv", "passed_tolerance", dict(seq_lens=(1000, 700, 900), padded=0)),
    "stale-tables": ("fa3", "indices_cover_selection", dict(steps=1)),
    "fa3-no-compaction": ("fa3", "passed_tolerance", None),
    "lse-natural": ("flashmla_sparse", "passed_tolerance", None),
    "packed-lse-misread": ("flashmla_kv", "passed_tolerance", dict(merge_one_exchange_max_extra_bytes=None)),
}


class TestPerOwnerDecodeGloo(CustomTestCase):
    def _check_passes(self, results, comparison, sc):
        self.assertTrue(hooked.passed(comparison), comparison)  # every rank's output identical, too
        self.assertLess(comparison["rel_err"], 1e-2)
        form = "all_gather" if sc.merge_one_exchange_max_extra_bytes is not None else "scaled_sum"
        self.assertEqual([r["merge_forms"] for r in results], [[form]] * len(results))
        out = results[0]["out"]
        self.assertEqual(len(out), sc.steps)
        self.assertEqual(tuple(out[0][0].shape), (sc.batch_size, hooked.HEADS, 512))
        # a rank owned none of a real request's selected rows: the empty-partial case ran
        self.assertGreater(sum(r["empty_partials"] for r in results), 0)

    def test_every_rank_gets_the_replicated_output_for_every_impl(self):
        scenarios = [scenario(impl) for impl, _ in IMPLS]
        # per-owner decode attached by the plugin's own hooks (ModelRunner.init_attention_backend)
        scenarios.append(scenario("flashmla_kv", hooks="plugin"))
        scenarios.append(scenario("fa3", merge_one_exchange_max_extra_bytes=None))  # the scaled sum
        outcomes = hooked.run_scenarios(2, scenarios, "cpu", REL_TOL)
        for sc, (results, comparison) in zip(scenarios, outcomes):
            with self.subTest(cp_size=2, impl=sc.decode_impl, hooks=sc.hooks, merge=sc.merge_one_exchange_max_extra_bytes):
                self._check_passes(results, comparison, sc)
        one_exchange, scaled_sum = outcomes[2][0][0]["out"], outcomes[-1][0][0]["out"]  # fa3, rank 0
        for step_one, step_sum in zip(one_exchange, scaled_sum):
            for layer_one, layer_sum in zip(step_one, step_sum):  # relative L2 per request, as compared
                diff = (layer_one.float() - layer_sum.float()).flatten(1).norm(dim=1)
                self.assertLessEqual(float((diff / layer_sum.float().flatten(1).norm(dim=1).clamp_min(1e-12)).max()), REL_TOL)
        sc = scenario("flashmla_kv")
        results, comparison = hooked.run_scenario(3, sc, "cpu", REL_TOL)
        with self.subTest(cp_size=3, impl="flashmla_kv"):
            self._check_passes(results, comparison, sc)

    def test_each_plant_fails_and_only_its_case_catches_it(self):
        scenarios, expect = [], []
        for plant, (impl, broken, without_case) in PLANT_CASES.items():
            scenarios.append(scenario(impl, plant=plant))
            expect.append((plant, broken, False))
            if without_case is not None:
                scenarios.append(scenario(impl, plant=plant, **without_case))
                expect.append((plant, "without its case", True))
        outcomes = hooked.run_scenarios(2, scenarios, "cpu", REL_TOL)
        for (plant, broken, should_pass), (results, comparison) in zip(expect, outcomes):
            with self.subTest(plant=plant, expect=broken):
                self.assertEqual(hooked.passed(comparison), should_pass, comparison)
                if not should_pass:
                    self.assertFalse(comparison[broken], comparison)
                elif plant == "empty-partial-counted":
                    self.assertEqual([r["empty_partials"] for r in results], [0, 0])


class TestPerOwnerDecodeGraphHooks(CustomTestCase):
    def test_graph_hooks_serve_the_replayed_batch(self):
        """Through the decode-graph hooks (tables built at capture from capture-time contents,
        refreshed by the replay hook) the layer gives the replicated output for every impl (fp8 and
        bf16 KV); without the refresh (a stale static buffer) it does not."""
        cases = [(impl, kv_dtype, mode, should_pass) for impl, kv_dtype in IMPLS
                 for mode, should_pass in (("graph-replay", True), ("graph-stale", False))]
        scenarios = [
            hooked.Scenario(seq_lens=(900, 128, 70, 400), topk=128, graph=mode, decode_impl=impl, kv_dtype=kv_dtype)
            for impl, kv_dtype, mode, _ in cases
        ]
        outcomes = hooked.run_scenarios(2, scenarios, "cpu", rel_tol=2e-2)
        for (impl, _, mode, should_pass), (_, comparison) in zip(cases, outcomes):
            with self.subTest(impl=impl, mode=mode):
                self.assertEqual(hooked.passed(comparison), should_pass, comparison)


class TestPerOwnerDecodeStartup(CustomTestCase):
    def setUp(self):
        # Per-owner decode is opt-in: these tests judge what it does once opted in; the default
        # (gather) is asserted where the env is cleared explicitly.
        from sglang_cp_shared_kv.settings import PER_OWNER

        patcher = mock.patch.dict(os.environ, {DECODE_PATH_ENV: PER_OWNER})
        patcher.start()
        self.addCleanup(patcher.stop)

    def _runtime(self, decode_impl="flashmla_kv", kv_dtype="fp8"):
        """A runtime whose spec decided the decode path for ``decode_impl`` with this process's
        settings (as the capacity hook decides it)."""
        from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
        from sglang_cp_shared_kv_testing.multi_rank import single_process_group
        from sglang_cp_shared_kv_testing.runtime_check import make_nsa_pool
        from sglang_cp_shared_kv_testing.shared_kv_state import attach_runtime

        pool = make_nsa_pool(2 * PAGE, kv_dtype, 1, "cpu")
        scratch = make_nsa_pool(2 * PAGE, kv_dtype, 1, "cpu")
        layout = CpSharedKVLayout(1, 0, PAGE)
        return attach_runtime(pool, layout, scratch, single_process_group(), decode_impl=decode_impl)

    def test_attaches_only_for_served_impls_with_fused_top_k(self):
        from sglang.srt.environ import envs
        from sglang_cp_shared_kv.model_executor.per_owner_decode import (
            decode_forward as per_owner_decode,
        )

        for impl in ("trtllm", "tilelang", "aiter", None):
            runtime = self._runtime(impl)
            with self.assertLogs(per_owner_decode.logger, "INFO") as logs:
                self.assertIsNone(attach_as_startup_decides(runtime))
            self.assertIn("decode uses the page gather", logs.output[0])
            self.assertIsNone(per_owner_decode.per_owner_of(runtime.pool))
        with envs.SGLANG_NSA_FUSE_TOPK.override(False):
            self.assertIsNone(attach_as_startup_decides(self._runtime("flashmla_kv")))
        for impl, base in (("flashmla_kv", "e"), ("flashmla_sparse", 2), ("fa3", "e")):
            runtime = self._runtime(impl)
            state = attach_as_startup_decides(runtime)
            self.assertIs(per_owner_decode.per_owner_of(runtime.pool), state)
            self.assertEqual(state.decode_impl, impl)
            self.assertAlmostEqual(state.lse_base, 2.718281828459045 if base == "e" else 2.0)
            self.assertFalse(runtime.state.reads_physical_pool())  # no decode forward begun

    def test_decode_mode_env(self):
        from sglang_cp_shared_kv.model_executor.per_owner_decode import (
            decode_forward as per_owner_decode,
        )

        env = DECODE_PATH_ENV
        self.assertEqual(env, "SGLANG_CP_SHARED_KV_DECODE")
        with mock.patch.dict(os.environ, {env: "gather"}):
            runtime = self._runtime("flashmla_kv")
            with self.assertLogs(per_owner_decode.logger, "INFO") as logs:
                self.assertIsNone(attach_as_startup_decides(runtime))
            self.assertIn(f"{env}=gather", logs.output[0])
        with mock.patch.dict(os.environ, {env: "per_owner"}):
            self.assertIsNotNone(attach_as_startup_decides(self._runtime("flashmla_kv")))
        with mock.patch.dict(os.environ, {env: "per-owner"}):
            with self.assertRaisesRegex(ValueError, env):
                attach_as_startup_decides(self._runtime("flashmla_kv"))

    def _plugin_decode_forward(self, mode):
        """The plugin's runtime hooks applied; init_attention_backend on a model runner holding an
        attached runtime, then a decode forward's metadata hook. Returns (state, plan begun)."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang_cp_shared_kv import plugin
        from sglang_cp_shared_kv.model_executor import forward_dispatch
        from sglang_cp_shared_kv.model_executor.per_owner_decode import (
            decode_forward as per_owner_decode,
        )
        from sglang_cp_shared_kv_testing import sgl_kernel_cpu_shim
        from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks

        sgl_kernel_cpu_shim.install()  # the plugin's hook modules import sglang's host pools
        env = {} if mode is None else {DECODE_PATH_ENV: mode}
        with mock.patch.dict(os.environ, env), applied_hooks(plugin.register_runtime_hooks):
            if mode is None:
                os.environ.pop(DECODE_PATH_ENV, None)
            runtime = self._runtime()
            backend = SimpleNamespace(nsa_decode_impl="flashmla_kv", forward_metadata=None)
            hooked.init_attention_backend(runtime.pool, backend)
            state = per_owner_decode.per_owner_of(runtime.pool)
            forward_batch = SimpleNamespace(
                forward_mode=ForwardMode.DECODE, token_to_kv_pool=runtime.pool
            )
            plan = SimpleNamespace(remap_token_locs=lambda t: t, remap_pages=lambda t: t)
            metadata = SimpleNamespace(real_page_table="pages", cache_seqlens_int32="lens",
                                       page_table_1="locs", page_table_1_flattened=None,
                                       paged_mqa_schedule_metadata=None)
            backend.forward_metadata = metadata
            with mock.patch.object(runtime, "begin_forward", return_value=plan) as begin, \
                    mock.patch("dataclasses.replace", side_effect=lambda m, **kw: m), \
                    mock.patch.object(per_owner_decode, "build_owner_decode_tables") as tables:
                forward_dispatch.dispatch_forward_metadata(None, backend, forward_batch)
            return state, begin.called, tables.called

    def test_plugin_gathers_with_flashmla_kv_by_default_and_decodes_per_owner_on_request(self):
        # auto (the default) keeps flashmla_kv (fp8 KV) on the gather: not served per owner at CP 8 yet
        for mode in (None, "gather"):
            state, planned, per_owner_tables = self._plugin_decode_forward(mode)
            self.assertIsNone(state)
            self.assertTrue(planned)
            self.assertFalse(per_owner_tables)
        state, planned, per_owner_tables = self._plugin_decode_forward("per_owner")
        self.assertIsNotNone(state)
        self.assertEqual(state.decode_impl, "flashmla_kv")
        self.assertTrue(per_owner_tables)
        self.assertFalse(planned)
        with self.assertRaisesRegex(ValueError, "SGLANG_CP_SHARED_KV_DECODE"):
            self._plugin_decode_forward("sometimes")

    def test_every_target_resolves_in_sglang(self):
        import pkgutil

        from sglang_cp_shared_kv.model_executor.per_owner_decode import (
            decode_forward as per_owner_decode,
        )

        registered = []
        registry = SimpleNamespace(register=lambda target, hook, kind: registered.append(target))
        per_owner_decode.register_hooks(registry)
        for target in registered:
            owner, name = target.rsplit(".", 1)
            self.assertTrue(callable(getattr(pkgutil.resolve_name(owner), name)), target)


if __name__ == "__main__":
    unittest.main()
