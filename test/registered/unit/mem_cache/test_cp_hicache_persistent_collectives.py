"""CpHiRadixCache's agreement collectives (load-back allocation, host eviction count, write acks, load acks) reduce tensors preallocated once, not a tensor built per call, and a ``writing_check`` enters
exactly one collective with writes in flight and none without (the write-ack count is reduced through
``_start_all_reduce_attn_groups``, which falls back to the blocking helper on a one-process group)."""

import sys
import unittest
from collections import defaultdict

# First: installs the CPU kernel shim that importing sglang's memory pools needs.
from sglang_cp_shared_kv_testing.cp_hicache_stack import (
    NSA_PAGE_SIZE,
    build_cp_hicache_stack,
    settle_write_acks,
)
from sglang_cp_shared_kv_testing.multi_rank import single_process_group
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")


class _RecordedCollectives:
    """Wraps ``_all_reduce_attn_groups``: keeps every reduced tensor (alive, so identity is meaningful)
    by the cache method that reduced it."""

    def __init__(self, cache):
        self.by_site = defaultdict(list)
        self.original = cache._all_reduce_attn_groups
        cache._all_reduce_attn_groups = self

    def __call__(self, tensor, op):
        self.by_site[sys._getframe(1).f_code.co_name].append(tensor)
        self.original(tensor, op)

    def count(self) -> int:
        return sum(len(tensors) for tensors in self.by_site.values())


def _seq(first, num_pages):
    return list(range(first, first + num_pages * NSA_PAGE_SIZE))


class TestPersistentCollectiveTensors(CustomTestCase):
    def setUp(self):
        self.stack = build_cp_hicache_stack(
            cp_size=2, cp_rank=0, group=single_process_group(), physical_pages=32
        )
        self.cache = self.stack.cache
        self.recorded = _RecordedCollectives(self.cache)

    def _insert(self, tokens):
        locs = self.stack.allocator.alloc(len(tokens))
        self.cache.insert(InsertParams(key=RadixKey(tokens), value=locs))

    def test_every_agreement_reuses_one_tensor_per_site(self):
        cache = self.cache
        for i in range(3):
            self._insert(_seq(10_000 * (i + 1), 2))
            settle_write_acks(cache)
        cache.evict(EvictParams(num_tokens=100 * NSA_PAGE_SIZE))  # all host-only now
        for tokens in (_seq(10_000, 2), _seq(20_000, 2)):
            match = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
            self.assertIsNotNone(cache.load_back(match.last_host_node))
            cache.loading_check()
        cache.evict(EvictParams(num_tokens=100 * NSA_PAGE_SIZE))
        cache.evict_host(1)
        cache.evict_host(1)
        sites = self.recorded.by_site
        for site in ("_all_ranks_ok", "_max_over_ranks", "_start_all_reduce_attn_groups", "loading_check"):
            tensors = sites[site]
            self.assertGreaterEqual(len(tensors), 2, site)
            self.assertTrue(all(t is tensors[0] for t in tensors), f"{site} built a new tensor")
        self.assertEqual(
            set(sites), {"_all_ranks_ok", "_max_over_ranks", "_start_all_reduce_attn_groups", "loading_check"}
        )

    def test_writing_check_enters_one_collective_only_with_writes_in_flight(self):
        cache = self.cache
        cache.writing_check()
        self.assertEqual(self.recorded.count(), 0)
        self._insert(_seq(10_000, 2))
        self.assertEqual(len(cache.ongoing_write_through), 1)
        before = self.recorded.count()
        cache.writing_check()  # agrees on the finished ack; applied at the next check
        self.assertEqual(self.recorded.count() - before, 1)
        self.assertEqual(len(cache.ongoing_write_through), 1)
        before = self.recorded.count()
        cache.writing_check()  # applies it; nothing left in flight, so no new collective
        self.assertEqual(self.recorded.count() - before, 0)
        self.assertEqual(len(cache.ongoing_write_through), 0)
        self.assertEqual(len(cache.cache_controller.ack_write_queue), 0)
        cache.writing_check()
        self.assertEqual(self.recorded.count() - before, 0)

if __name__ == "__main__":
    unittest.main()
