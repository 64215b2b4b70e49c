"""End to end on every rank's view of a CP group: back up, evict from the device, load back into new
logical locs, and find every owned KV row and indexer page bit-exact at its new physical row.

Each rank's view is a real CpHiRadixCache with its own pools, fed the same calls, in one process.
"""

import unittest

import torch

from sglang_cp_shared_kv_testing.cp_hicache_stack import settle_write_acks
from sglang_cp_shared_kv_testing.cp_hicache_stack import (
    build_cp_hicache_stack,
    clear_device_pool,
    count_owned_pattern_mismatches,
    tree_signature,
    write_owned_pattern,
)
from sglang_cp_shared_kv_testing.multi_rank import single_process_group
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=25, suite="stage-a-test-cpu")

PAGE = 64
SEQ_A = list(range(6 * PAGE))  # 6 pages
SEQ_B = SEQ_A[: 3 * PAGE] + list(range(50_000, 50_000 + 2 * PAGE))  # shares 3 pages, then 2 more


def _nonzero_kv_rows(stack):
    rows = 0
    for layer in range(stack.kv_pool.layer_num):
        buffer = stack.kv_pool.kv_buffer[layer]
        rows += int(buffer.view(torch.uint8).view(buffer.shape[0], -1).any(dim=1).sum())
    return rows


class TestCpHiCacheRoundTrip(CustomTestCase):
    def _round_trip(self, cp_size, write_policy="write_through"):
        group = single_process_group()
        views = [
            build_cp_hicache_stack(
                cp_size=cp_size,
                cp_rank=rank,
                group=group,
                physical_pages=12,
                write_policy=write_policy,
            )
            for rank in range(cp_size)
        ]
        loaded = []
        for view in views:
            cache, allocator = view.cache, view.allocator
            full = allocator.available_size()
            locs_a = allocator.alloc(len(SEQ_A))
            write_owned_pattern(view, locs_a, seed=1)
            cache.insert(InsertParams(key=RadixKey(SEQ_A), value=locs_a))
            suffix_b = allocator.alloc(2 * PAGE)
            write_owned_pattern(view, suffix_b, seed=2)
            locs_b = torch.cat([locs_a[: 3 * PAGE], suffix_b])
            cache.insert(InsertParams(key=RadixKey(SEQ_B), value=locs_b))  # splits A's node
            settle_write_acks(cache)
            if write_policy == "write_back":
                self.assertEqual(view.controller.physical_host_slots_used(), 0)

            cache.evict(EvictParams(num_tokens=len(SEQ_A) + len(SEQ_B)))
            self.assertEqual(allocator.available_size(), full)
            clear_device_pool(view)
            allocator.alloc(2 * PAGE)  # take pages so that the load-back gets different locs

            match_a = cache.match_prefix(MatchPrefixParams(key=RadixKey(SEQ_A)))
            self.assertEqual(match_a.host_hit_length, len(SEQ_A))
            new_a = cache.load_back(match_a.last_host_node)
            cache.ready_to_load_host_cache()
            match_b = cache.match_prefix(MatchPrefixParams(key=RadixKey(SEQ_B)))
            self.assertEqual(match_b.host_hit_length, 2 * PAGE)
            new_suffix_b = cache.load_back(match_b.last_host_node)
            cache.ready_to_load_host_cache()
            cache.loading_check()
            self.assertEqual(cache.ongoing_load_back, {})

            self.assertFalse(torch.equal(new_a, locs_a))
            layout = view.layout
            self.assertTrue(
                torch.equal(layout.owner_of_page(new_a // PAGE), layout.owner_of_page(locs_a // PAGE))
            )
            self.assertEqual(count_owned_pattern_mismatches(view, new_a, seed=1), 0)
            self.assertEqual(count_owned_pattern_mismatches(view, new_suffix_b, seed=2), 0)
            owned_rows = int(layout.owned_by_this_rank(new_a).sum()) + int(
                layout.owned_by_this_rank(new_suffix_b).sum()
            )
            # Only owned rows were written into this rank's device pool.
            self.assertEqual(_nonzero_kv_rows(view), owned_rows * view.kv_pool.layer_num)
            loaded.append((new_a, new_suffix_b, owned_rows))

        # Every view took the same decisions and holds the same tree.
        for new_a, new_suffix_b, _ in loaded[1:]:
            self.assertTrue(torch.equal(new_a, loaded[0][0]))
            self.assertTrue(torch.equal(new_suffix_b, loaded[0][1]))
        for view in views[1:]:
            self.assertEqual(tree_signature(view.cache), tree_signature(views[0].cache))
        # Together the views restored every position exactly once.
        self.assertEqual(sum(rows for _, _, rows in loaded), len(SEQ_A) + 2 * PAGE)
        return views

    def test_round_trip_cp2(self):
        self._round_trip(cp_size=2)

    def test_round_trip_cp2_write_back_backs_up_on_eviction(self):
        self._round_trip(cp_size=2, write_policy="write_back")

    def test_round_trip_cp4_includes_ranks_owning_nothing_in_a_node(self):
        views = self._round_trip(cp_size=4)
        suffix = views[0].cache.match_prefix(MatchPrefixParams(key=RadixKey(SEQ_B))).last_device_node
        owners = set(suffix.cp_hicache.owner_ranks.tolist())
        self.assertLess(len(owners), 4)  # 2 pages over 4 ranks: some rank held none of B's suffix


if __name__ == "__main__":
    unittest.main()
