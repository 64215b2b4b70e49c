"""Load-back completion on two CP ranks (gloo) whose copies finish at different times: every rank
releases a load's lock, and so changes ``evictable_size_``, at the same ``loading_check``, and the
evictions that follow leave identical trees.

The load's lock is the node's only one (a request declined by stock's ``PrefillAdder`` right after
``init_load_back``). Rank 1's copy finishes two checks after rank 0's. Failed before the fix (stock
``loading_check``, no collective): rank 0 released the lock at the first check, its ``evictable_size_``
was 256 against rank 1's 0, and the following ``evict`` dropped the node's device copy on rank 0 only.
"""

import unittest

import torch.distributed as dist

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing.completion_skew import StrictLateEvent
from sglang_cp_shared_kv_testing.multi_rank import run_ranks

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

PAGE = 64
CP_SIZE = 2
LATE_RANK, LATE_QUERIES = 1, 2
STEPS = 4


def _rank(rank, world_size):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sglang_cp_shared_kv_testing.cp_hicache_stack import (
        build_cp_hicache_stack,
        settle_write_acks,
        tree_signature,
    )

    stack = build_cp_hicache_stack(cp_size=CP_SIZE, cp_rank=rank, group=dist.group.WORLD, physical_pages=16)
    cache, allocator = stack.cache, stack.allocator
    prefix = list(range(4 * PAGE))
    cache.insert(InsertParams(key=RadixKey(prefix), value=allocator.alloc(len(prefix))))
    settle_write_acks(cache)
    cache.evict(EvictParams(num_tokens=len(prefix)))  # host only now

    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(prefix)))
    assert cache.load_back(match.last_host_node) is not None
    cache.ready_to_load_host_cache()
    if rank == LATE_RANK:
        queue = cache.cache_controller.ack_load_queue
        ack = queue[-1]
        queue[-1] = type(ack)(ack[0], StrictLateEvent(ack[1], LATE_QUERIES), ack[2])
    # The request is declined: nothing but the load holds the node.

    timeline = []
    for step in range(STEPS):
        cache.loading_check()
        loaded = (len(cache.ongoing_load_back), cache.evictable_size(), cache.protected_size())
        cache.evict(EvictParams(num_tokens=len(prefix)))
        timeline.append((step, loaded, cache.evictable_size(), tree_signature(cache)))
    return timeline


class TestLoadAcksAgreeAcrossRanks(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.timelines = run_ranks(_rank, CP_SIZE, timeout_s=120)

    def test_trees_and_evictable_sizes_agree_at_every_step(self):
        for mine, other in zip(*self.timelines):
            self.assertEqual(mine, other, f"ranks differ at step {mine[0]}")

    def test_the_load_is_released_once_both_copies_finished(self):
        released = [step for step, (ongoing, _, _), _, _ in self.timelines[0] if ongoing == 0]
        self.assertEqual(released[0], LATE_QUERIES)  # rank 1's copy reports finished at its third query
        _, _, evictable_after, signature = self.timelines[0][-1]
        self.assertEqual(evictable_after, 0)
        self.assertTrue(all(value is None for _, _, value, _, _ in signature))  # evicted, host only


if __name__ == "__main__":
    unittest.main()
