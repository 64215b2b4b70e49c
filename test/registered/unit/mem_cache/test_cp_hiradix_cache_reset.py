"""``CpHiRadixCache.reset`` with a host write and a load-back still in flight (``/flush_cache`` right
after the last request: sglang's idle check ignores HiCache writes) leaves, on every CP rank alike, the
state a freshly built cache has: no write or load-back tracked, so an idle scheduler's ``writing_check``
enters no collective, and the cache works afterwards.

Failed before the fix (reset kept ``ongoing_write_through`` / ``ongoing_load_back``): every one of the
ten idle ``writing_check``s entered the write-ack all-reduce (10 instead of 0), ``settle_write_acks``
raised "1 writes still in flight", and the state differed from a fresh cache's.
"""

import unittest

import torch.distributed as dist

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing.multi_rank import run_ranks

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

CP_SIZE = 2
IDLE_CHECKS = 10


def _state(cache) -> dict:
    """What a reset must bring back to the fresh cache's values (identical on every rank)."""
    controller = cache.cache_controller
    return {
        "ongoing_write_through": sorted(cache.ongoing_write_through),
        "ongoing_load_back": sorted(cache.ongoing_load_back),
        "ongoing_prefetch": sorted(cache.ongoing_prefetch),
        "ongoing_backup": sorted(cache.ongoing_backup),
        "write_acks_in_flight": cache._write_acks_in_flight is not None,
        "ack_write_queue": len(controller.ack_write_queue),
        "ack_load_queue": len(controller.ack_load_queue),
        "root_children": len(cache.root_node.children),
        "evictable_leaves": len(cache.evictable_leaves),
        "evictable_host_leaves": len(cache.evictable_host_leaves),
        "evictable_size": cache.evictable_size(),
        "protected_size": cache.protected_size(),
        "host_logical_tokens": cache.host_logical_tokens,
        "host_free_slots": cache.cache_controller.mem_pool_host.available_size(),
        "ledger_free_slots": [int(n) for n in cache.host_ledger.free],
    }


def _count_collectives(cache) -> list:
    """Count every collective the cache enters (blocking helper and the async write-ack count)."""
    entered = []
    blocking, async_start = cache._all_reduce_attn_groups, cache._start_all_reduce_attn_groups

    def counted_blocking(tensor, op):
        entered.append("blocking")
        return blocking(tensor, op)

    def counted_async(tensor, op):
        entered.append("write acks")
        return async_start(tensor, op)

    cache._all_reduce_attn_groups = counted_blocking
    cache._start_all_reduce_attn_groups = counted_async
    return entered


def _rank(rank, world_size):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sglang_cp_shared_kv_testing.cp_hicache_stack import (
        NSA_PAGE_SIZE,
        build_cp_hicache_stack,
        settle_write_acks,
    )

    def build():
        return build_cp_hicache_stack(
            cp_size=CP_SIZE, cp_rank=rank, group=dist.group.WORLD, physical_pages=16
        )

    def tokens(first, pages):
        return list(range(first, first + pages * NSA_PAGE_SIZE))

    fresh = _state(build().cache)
    stack = build()
    cache = stack.cache

    def insert(key):
        locs = stack.allocator.alloc(len(key))
        cache.insert(InsertParams(key=RadixKey(key), value=locs))

    # A node backed up on host, evicted from the device, and loading back when reset comes.
    insert(tokens(0, 4))
    settle_write_acks(cache)
    cache.evict(EvictParams(num_tokens=100 * NSA_PAGE_SIZE))
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens(0, 4))))
    loaded = cache.load_back(match.last_host_node)
    # A node under write-through whose ack count was started by one writing_check.
    insert(tokens(50_000, 2))
    cache.writing_check()
    before_reset = _state(cache)

    cache.reset()
    after_reset = _state(cache)
    entered = _count_collectives(cache)
    for _ in range(IDLE_CHECKS):
        cache.writing_check()
    idle_collectives = list(entered)

    def settle_error():
        try:
            settle_write_acks(cache)
        except AssertionError as e:  # the number of checks depends on the tree: same on every rank
            return str(e)
        return None

    settle_error_after_reset = settle_error()
    # The reset cache serves again: a write is acked and backs the node up on every rank.
    insert(tokens(90_000, 2))
    settle_error_after_new_write = settle_error()
    return {
        "fresh": fresh,
        "load_back_started": loaded is not None,
        "before_reset": before_reset,
        "after_reset": after_reset,
        "idle_collectives": idle_collectives,
        "settle_error": settle_error_after_reset,
        "settle_error_after_new_write": settle_error_after_new_write,
        "after_new_write": _state(cache),
    }


class TestCpHiRadixCacheReset(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.reports = run_ranks(_rank, CP_SIZE, timeout_s=120)

    def test_the_scenario_has_a_write_and_a_load_back_in_flight_at_reset(self):
        for report in self.reports:
            self.assertTrue(report["load_back_started"])
            self.assertEqual(len(report["before_reset"]["ongoing_write_through"]), 1)
            self.assertEqual(len(report["before_reset"]["ongoing_load_back"]), 1)
            self.assertTrue(report["before_reset"]["write_acks_in_flight"])

    def test_reset_leaves_the_state_of_a_fresh_cache_on_every_rank(self):
        for rank, report in enumerate(self.reports):
            self.assertEqual(report["after_reset"], report["fresh"], f"rank {rank}")
        self.assertEqual(self.reports[0]["after_reset"], self.reports[1]["after_reset"])

    def test_an_idle_scheduler_enters_no_collective_after_reset(self):
        for report in self.reports:
            self.assertEqual(report["idle_collectives"], [])
            self.assertIsNone(report["settle_error"])

    def test_the_reset_cache_backs_up_new_writes(self):
        for report in self.reports:
            state = report["after_new_write"]
            self.assertIsNone(report["settle_error_after_new_write"])
            self.assertEqual(state["ongoing_write_through"], [])
            self.assertEqual(state["protected_size"], 0)
            self.assertEqual(state["host_logical_tokens"], 2 * 64)
        self.assertEqual(self.reports[0]["after_new_write"], self.reports[1]["after_new_write"])


if __name__ == "__main__":
    unittest.main()
