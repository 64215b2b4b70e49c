"""CpHiRadixCache reads the clock once per tree operation (match_prefix, insert), not once per node
touched, and evicts in the same order as with a clock read per node (stock's), for every eviction policy."""

import unittest

# First: installs the CPU kernel shim that importing sglang's memory pools needs.
from sglang_cp_shared_kv_testing.cp_hicache_stack import settle_write_acks
from sglang_cp_shared_kv_testing.cp_hicache_stack import (
    NSA_PAGE_SIZE,
    build_cp_hicache_stack,
)
from sglang_cp_shared_kv_testing.multi_rank import single_process_group
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.mem_cache import cp_hiradix_cache as cp_module
from sglang_cp_shared_kv_testing.cp_hicache_simulation import WRITE_POLICIES
from sglang_cp_shared_kv_testing.eviction_log import (
    EVICTION_POLICIES,
    counting_clock,
    first_divergence,
    run_logged,
)

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")

NUM_OPS = 150


def _per_node_clock(cache) -> None:
    """The oracle: every touched or created node reads the clock itself, as in stock sglang."""
    cache._access_stamp = lambda: cp_module.time.monotonic()


def _run(eviction_policy, write_policy, seed, configure=None):
    return run_logged(eviction_policy, write_policy, seed, num_ops=NUM_OPS, configure=configure)


class TestOneClockReadPerOperation(CustomTestCase):
    def test_match_and_insert_read_the_clock_once(self):
        stack = build_cp_hicache_stack(cp_size=2, cp_rank=0, group=single_process_group(), physical_pages=16)
        cache = stack.cache
        # A path of three nodes (two splits), then a match and an insert along all of it.
        tokens = list(range(1, 6 * NSA_PAGE_SIZE + 1))
        for length in (6, 4, 2):
            key = tokens[: length * NSA_PAGE_SIZE]
            cache.insert(InsertParams(key=RadixKey(key), value=stack.allocator.alloc(len(key))))
        settle_write_acks(cache)
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        self.assertEqual(len(match.device_indices), len(tokens))
        with counting_clock() as clock:
            cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
            self.assertEqual(clock.reads, 1)
            cache.insert(InsertParams(key=RadixKey(tokens), value=match.device_indices.clone()))
            self.assertEqual(clock.reads, 2)
        node, depth = match.last_device_node, 0
        while node is not cache.root_node:
            self.assertEqual(node.last_access_time, cache._op_stamp)  # the insert's one stamp
            node, depth = node.parent, depth + 1
        self.assertEqual(depth, 3)

    def test_stamps_strictly_increase_between_operations(self):
        stack = build_cp_hicache_stack(cp_size=2, cp_rank=0, group=single_process_group(), physical_pages=4)
        cache = stack.cache
        with counting_clock() as clock:
            clock.namespace.monotonic = lambda: 5.0  # a clock that does not move
            stamps = []
            for _ in range(3):
                cache.match_prefix(MatchPrefixParams(key=RadixKey(list(range(NSA_PAGE_SIZE)))))
                stamps.append(cache._op_stamp)
        self.assertEqual(stamps, sorted(set(stamps)))


class TestSameOrderAsAClockReadPerNode(CustomTestCase):
    def test_every_eviction_policy(self):
        for i, eviction_policy in enumerate(EVICTION_POLICIES):
            write_policy = WRITE_POLICIES[i % len(WRITE_POLICIES)]
            with self.subTest(eviction_policy=eviction_policy, write_policy=write_policy):
                ours = _run(eviction_policy, write_policy, 11 + i)
                oracle = _run(eviction_policy, write_policy, 11 + i, configure=_per_node_clock)
                self.assertGreater(len(oracle), 40)
                self.assertEqual(ours, oracle, first_divergence(ours, oracle))

    def test_a_stale_stamp_is_caught(self):
        """Inserts that keep the previous operation's stamp reorder LRU eviction."""

        def insert_without_stamp(cache):
            insert = cache.insert

            def stale_insert(params):
                start, cache._start_tree_op = cache._start_tree_op, lambda: None
                try:
                    return insert(params)
                finally:
                    cache._start_tree_op = start

            cache.insert = stale_insert

        ours = _run("lru", "write_through", 11, configure=insert_without_stamp)
        oracle = _run("lru", "write_through", 11, configure=_per_node_clock)
        self.assertNotEqual(ours, oracle)


if __name__ == "__main__":
    unittest.main()
