"""The smoke's plant ``draft-stale-load-back`` on the real CP HiCache stack (cp 2, every rank's view
in one process, ``sglang_cp_shared_kv_testing/cp_hicache_stack.py``): with the plant's hooks applied, a host load-back
restores the target's pages and leaves the draft KV and indexer K of the loaded-back prefix stale;
without them both come back. Then the same rows through the smoke's pool dumps and the cached-prefix
ledger: the planted load-back fails it, the clean one passes (the GPU serve run relies on exactly
that catch).
"""

import sys
import tempfile
import unittest
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch

from sglang_cp_shared_kv_testing.cp_hicache_stack import (
    build_cp_hicache_stack,
    clear_device_pool,
    count_owned_pattern_mismatches,
    settle_write_acks,
    write_owned_pattern,
)
from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks
from sglang_cp_shared_kv_testing.multi_rank import single_process_group

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "scripts" / "smoke_plugin"))
from cp_shared_kv_smoke_hooks import kv_audit, kv_audit_compare, planted_bugs  # noqa: E402

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

PAGE = 64
PREFIX = list(range(4 * PAGE))
SUFFIX_A, SUFFIX_B = list(range(1000, 1000 + PAGE)), list(range(2000, 2000 + PAGE))  # whole pages


def _dump(view, draft_view, run_dir, rid, locs, token_ids, cached_tokens, rank):
    """What the smoke's pool dump of a finished request writes on this rank (its owned rows: the dump
    finds the layout through the pools' runtime, here a stand-in holding the stack's layout)."""
    from sglang_cp_shared_kv.model_executor.cp_shared_kv_state import CpSharedKVState, state_of

    for pool in (view.kv_pool, draft_view.kv_pool):
        if state_of(pool) is None:
            state = CpSharedKVState(pool, SimpleNamespace(layout=view.layout))
            state.runtime = SimpleNamespace(layout=view.layout)
    n = len(token_ids)
    req_to_token = torch.zeros((2, n), dtype=torch.int64)
    req_to_token[1] = locs
    cache = SimpleNamespace(
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: view.kv_pool),
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
    )
    req = SimpleNamespace(rid=rid, kv_committed_len=n, req_pool_idx=1, cached_tokens=cached_tokens,
                          origin_input_ids=token_ids, output_ids=[])  # fmt: skip
    with mock.patch.object(kv_audit, "_rank", return_value=rank):
        kv_audit.dump_finished_request(run_dir, cache, req, draft_view.kv_pool)


class TestDraftStaleLoadBackPlant(CustomTestCase):
    def _round_trip(self, plant: bool):
        """Request 0 computes PREFIX + SUFFIX_A (target and draft rows written by their owners) and
        finishes; the prefix is backed up, evicted, the device cleared; request 1 (PREFIX + SUFFIX_B)
        loads the prefix back into other locs. Returns (target, draft) mismatches of the prefix at
        its new locs, summed over ranks, and the ledger of the two requests' dumps."""
        group = single_process_group()
        views = [
            build_cp_hicache_stack(cp_size=2, cp_rank=rank, group=group, physical_pages=12, draft_layers=1)
            for rank in range(2)
        ]
        run_dir = Path(self.tmp.name) / ("planted" if plant else "clean")
        register = (lambda registry: planted_bugs.register_hooks(registry, "draft-stale-load-back")) if plant else (lambda registry: None)
        mismatches = [0, 0]
        with applied_hooks(register):
            for rank, view in enumerate(views):
                cache, allocator, draft = view.cache, view.allocator, view.draft_view()
                locs = allocator.alloc(len(PREFIX) + len(SUFFIX_A))
                prefix_locs = locs[: len(PREFIX)]
                write_owned_pattern(view, prefix_locs, seed=1)
                write_owned_pattern(draft, prefix_locs, seed=11)
                write_owned_pattern(view, locs[len(PREFIX) :], seed=3)
                write_owned_pattern(draft, locs[len(PREFIX) :], seed=13)
                _dump(view, draft, run_dir, "smoke-0-a", locs, PREFIX + SUFFIX_A, 0, rank)
                cache.insert(InsertParams(key=RadixKey(PREFIX), value=locs[: len(PREFIX)]))
                allocator.free(locs[len(PREFIX) :])
                settle_write_acks(cache)
                cache.evict(EvictParams(num_tokens=len(PREFIX)))
                clear_device_pool(view)
                clear_device_pool(draft, kv_byte=0x3C, index_byte=0x3C)  # stale, nonzero bytes
                allocator.alloc(2 * PAGE)  # the load-back gets other locs
                match = cache.match_prefix(MatchPrefixParams(key=RadixKey(PREFIX + SUFFIX_B)))
                self.assertEqual(match.host_hit_length, len(PREFIX))
                new_prefix = cache.load_back(match.last_host_node)
                cache.ready_to_load_host_cache()
                cache.loading_check()
                self.assertFalse(torch.equal(new_prefix, locs[: len(PREFIX)]))
                mismatches[0] += count_owned_pattern_mismatches(view, new_prefix, seed=1)
                mismatches[1] += count_owned_pattern_mismatches(draft, new_prefix, seed=11)
                suffix = allocator.alloc(len(SUFFIX_B))
                write_owned_pattern(view, suffix, seed=2)
                write_owned_pattern(draft, suffix, seed=12)
                _dump(view, draft, run_dir, "smoke-1-b", torch.cat([new_prefix, suffix]), PREFIX + SUFFIX_B,
                      len(PREFIX), rank)  # fmt: skip
        return mismatches, kv_audit_compare.cached_row_ledger(run_dir, PAGE, bigram_keys=False)

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def test_clean_load_back_restores_the_draft_and_passes_the_ledger(self):
        (target, draft), ledger = self._round_trip(plant=False)
        self.assertEqual((target, draft), (0, 0))
        self.assertEqual(ledger.positions_checked, len(PREFIX))
        self.assertEqual(ledger.draft_positions_checked, len(PREFIX))
        self.assertEqual(ledger.draft_failures(), [])
        self.assertEqual(ledger.target_kv_rows_changed + ledger.target_index_rows_changed, 0)

    def test_planted_load_back_leaves_the_draft_stale_and_fails_the_ledger(self):
        (target, draft), ledger = self._round_trip(plant=True)
        self.assertEqual(target, 0)  # the target's pages came back
        self.assertGreater(draft, 0)
        self.assertEqual(ledger.draft_kv_rows_changed, len(PREFIX))
        self.assertEqual(ledger.draft_index_rows_changed, len(PREFIX))
        self.assertEqual(ledger.target_kv_rows_changed, 0)
        self.assertEqual(len(ledger.draft_failures()), 1)


if __name__ == "__main__":
    unittest.main()
