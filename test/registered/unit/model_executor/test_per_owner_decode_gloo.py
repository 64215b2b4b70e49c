"""Per-owner decode through sglang's own decode methods, on 2 and 3 gloo ranks: the hooked
``get_indexer_metadata`` + ``Indexer._get_topk_paged`` + ``_forward_flashmla_kv`` give every rank the
output a replicated pool gives, without the gather scratch.

Each rank holds a real fp8 ``NSATokenToKVPool`` shard (cut from one replicated pool by the layout)
and runs: the backend's metadata hook (per-owner begin, no plan), the decode token's KV store
through the owner-filtered hook, sglang's paged indexer (deep_gemm replaced by its torch reference)
and sglang's ``_forward_flashmla_kv`` (FlashMLA replaced by its torch reference). The parent checks
every rank's output equals the others' and the replicated attention's (bf16 tolerance), that the
ranks' indices cover the replicated selection exactly once, and that the scratch stayed untouched.
The same layer also runs through the decode-graph hooks (``per_owner_decode_graphs``: static owner
tables made at capture from capture-time contents, refreshed by the replay hook): it passes, and
fails when the refresh is left out (a stale static buffer).

Planted bugs, each made this test fail (then reverted): the attention hook returning the partial
without the merge; the indexer hook keeping the logical ``real_page_table``; ``serves_physical``
always False (getters demand the scratch: RuntimeError); ``attach`` ignoring SGLANG_NSA_FUSE_TOPK.
"""

import unittest
from types import SimpleNamespace

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.testing import per_owner_decode_hooked as hooked
from sglang_cp_shared_kv.testing.multi_rank import run_ranks

register_cpu_ci(est_time=240, suite="stage-a-test-cpu")

PAGE = hooked.PAGE
TOPK = 128
SEQ_LENS = [900, 128, 70, 400]  # one of exactly k, one shorter than k


class TestPerOwnerDecodeGloo(CustomTestCase):
    def test_every_rank_gets_the_replicated_output(self):
        for cp_size in (2, 3):
            results = run_ranks(hooked.run_rank, cp_size, (SEQ_LENS, TOPK, "cpu"))
            case = hooked.make_case(cp_size, SEQ_LENS, "cpu")
            expected, locs = hooked.replicated_reference(case, results, TOPK)
            comparison = hooked.compare(case, results, expected, locs, rel_tol=2e-2)
            with self.subTest(cp_size=cp_size):
                self.assertEqual(tuple(results[0]["out"].shape), (len(SEQ_LENS), 1, hooked.HEADS, 512))
                self.assertTrue(hooked.passed(comparison), comparison)
                self.assertLess(comparison["rel_err"], 1e-2)
                # the torch quantizer on CPU: the stored rows are the replicated pool's bytes
                for result in results:
                    self.assertTrue(
                        (result["stored_rows"] == case.kv_rows_new[result["stored_locs"]]).all()
                    )


class TestPerOwnerDecodeStartup(CustomTestCase):
    def _runtime(self):
        from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
        from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import CpSharedKVRuntime
        from sglang_cp_shared_kv.testing.multi_rank import single_process_group
        from sglang_cp_shared_kv.testing.runtime_check import make_nsa_pool

        pool = make_nsa_pool(2 * PAGE, "fp8", 1, "cpu")
        scratch = make_nsa_pool(2 * PAGE, "fp8", 1, "cpu")
        return CpSharedKVRuntime(pool, CpSharedKVLayout(1, 0, PAGE), scratch, single_process_group())

    def test_graph_hooks_serve_the_replayed_batch(self):
        """Through the decode-graph hooks (tables built at capture from capture-time contents,
        refreshed by the replay hook) the layer gives the replicated output; without the refresh
        (a stale static buffer) it does not."""
        for mode, should_pass in (("graph-replay", True), ("graph-stale", False)):
            results = run_ranks(hooked.run_rank, 2, (SEQ_LENS, TOPK, "cpu", mode))
            case = hooked.make_case(2, SEQ_LENS, "cpu")
            expected, locs = hooked.replicated_reference(case, results, TOPK)
            comparison = hooked.compare(case, results, expected, locs, rel_tol=2e-2)
            with self.subTest(mode=mode):
                self.assertEqual(hooked.passed(comparison), should_pass, comparison)

    def test_attaches_only_for_flashmla_kv_with_fused_top_k(self):
        from sglang.srt.environ import envs
        from sglang_cp_shared_kv.model_executor import per_owner_decode

        runtime = self._runtime()
        self.assertIsNone(per_owner_decode.attach(runtime, "fa3"))
        self.assertIsNone(per_owner_decode.per_owner_of(runtime.pool))
        with envs.SGLANG_NSA_FUSE_TOPK.override(False):
            self.assertIsNone(per_owner_decode.attach(runtime, "flashmla_kv"))
        state = per_owner_decode.attach(runtime, "flashmla_kv")
        self.assertIs(per_owner_decode.per_owner_of(runtime.pool), state)
        self.assertFalse(per_owner_decode.serves_physical(runtime))  # no decode forward begun

    def test_every_target_resolves_in_sglang(self):
        import pkgutil

        from sglang_cp_shared_kv.model_executor import per_owner_decode

        registered = []
        registry = SimpleNamespace(register=lambda target, hook, kind: registered.append(target))
        per_owner_decode.register_hooks(registry)
        for target in registered:
            owner, name = target.rsplit(".", 1)
            self.assertTrue(callable(getattr(pkgutil.resolve_name(owner), name)), target)


if __name__ == "__main__":
    unittest.main()
