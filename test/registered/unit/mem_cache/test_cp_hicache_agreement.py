"""Two CP ranks in two processes (gloo): a write that does not fit on one rank's host pool, or a device
allocation that fails on one rank only, must not split the tree, leak slots, or leave acks unmatched.

Each rank runs a real CpHiRadixCache. Host shortage on one rank is real, not injected: nodes whose
pages all belong to rank 1 fill rank 1's host pool while rank 0's stays empty, and every rank must
still take the same decisions (from its host-slot ledger, without a collective). Device allocation
failures for load-backs are injected on rank 1.
"""

import unittest

import torch.distributed as dist

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing.multi_rank import run_ranks

register_cpu_ci(est_time=40, suite="stage-a-test-cpu")

PAGE = 64
CP_SIZE = 2


def _seq(first, num_pages):
    return list(range(first, first + num_pages * PAGE))


class _FailNextAllocs:
    """Makes the next ``count`` load-back allocations of one rank fail (injected device shortage)."""

    def __init__(self, allocator, count):
        self.count = count
        self.original = allocator.alloc_with_owners
        allocator.alloc_with_owners = self

    def __call__(self, page_owners):
        if self.count > 0:
            self.count -= 1
            return None
        return self.original(page_owners)


def _rank(rank, world_size):
    import numpy as np

    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sglang_cp_shared_kv_testing.cp_hicache_stack import (
        settle_write_acks,
        build_cp_hicache_stack,
        owned_host_slots_in_tree,
        tree_signature,
    )

    # 16 device pages and 17 host pages per rank.
    stack = build_cp_hicache_stack(
        cp_size=CP_SIZE, cp_rank=rank, group=dist.group.WORLD, physical_pages=16, hicache_ratio=1.01
    )
    cache, allocator, host = stack.cache, stack.allocator, stack.controller.mem_pool_host
    report = {"host_pages": host.size // PAGE}
    collectives = {"n": 0}
    all_reduce = dist.all_reduce

    def counted_all_reduce(*args, **kwargs):
        collectives["n"] += 1
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted_all_reduce

    def insert(tokens, owners=None):
        """Insert (write-through starts at once) and wait for the acks; returns the insert's collectives."""
        if owners is None:
            locs = allocator.alloc(len(tokens))
        else:
            locs = allocator.alloc_with_owners(np.array(owners))
        before = collectives["n"]
        cache.insert(InsertParams(key=RadixKey(tokens), value=locs))
        entered = collectives["n"] - before
        settle_write_acks(cache)
        return entered

    def node_of(tokens):
        return cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).last_device_node

    def host_node_of(tokens):
        return cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).last_host_node

    def snapshot(name):
        report[name] = {
            "tree": tree_signature(cache),
            "host_used": stack.controller.physical_host_slots_used(),
            "host_in_tree": owned_host_slots_in_tree(cache),
            "ledger_free": cache.host_ledger.free.tolist(),
            "free_pages_by_owner": [p.tolist() for p in allocator.free_pages_by_owner],
            "ongoing_writes": len(cache.ongoing_write_through),
            "write_acks_left": len(cache.cache_controller.ack_write_queue),
        }

    # 1. Two host-only nodes of 8 pages each, all on rank 1: rank 1 has 1 free host page, rank 0 17.
    x1, x2, y = _seq(0, 8), _seq(10_000, 8), _seq(20_000, 4)
    insert(x1, owners=[1] * 8)
    insert(x2, owners=[1] * 8)
    cache.evict(EvictParams(num_tokens=100 * PAGE))
    snapshot("rank1_host_nearly_full")
    # y needs 2 pages on each rank: rank 1 is short by one, so both evict x1 (the LRU host node, which
    # frees enough) and keep x2, then both back y up; no collective is needed for any of it.
    report["y_insert_collectives"] = insert(y)
    report["y_host_len"] = node_of(y).host_len
    report["x2_host_len"] = host_node_of(x2).host_len
    snapshot("write_after_agreed_eviction")

    # 2. z needs 8 pages on rank 1, which has 7 free and 15 if x2 goes, but x2 is protected (as during
    # a load-back): nobody backs z up, nothing is evicted, nothing leaks.
    x2_node = host_node_of(x2)
    x2_node.protect_host()
    z = _seq(30_000, 8)
    report["z_insert_collectives"] = insert(z, owners=[1] * 8)
    report["z_host_len"] = node_of(z).host_len
    snapshot("write_refused_everywhere")
    x2_node.release_host()

    # 3. Load-back with one injected device failure on rank 1: ranks agree, evict, retry, succeed.
    cache.evict(EvictParams(num_tokens=20 * PAGE))
    if rank == 1:
        _FailNextAllocs(allocator, count=1)
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(y)))
    locs = cache.load_back(match.last_host_node)
    report["loaded_locs"] = None if locs is None else locs.tolist()
    cache.ready_to_load_host_cache()
    cache.loading_check()
    snapshot("load_after_retry")

    # 4. Two injected failures on rank 1: nobody loads, allocators stay identical.
    cache.evict(EvictParams(num_tokens=20 * PAGE))
    if rank == 1:
        _FailNextAllocs(allocator, count=2)
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(y)))
    report["refused_load"] = cache.load_back(match.last_host_node)
    snapshot("load_refused")

    # 5. A one-page node lives on one rank only; the other acks a no-op write.
    one_page = _seq(90_000, 1)
    insert(one_page)
    report["one_page_owned"] = node_of(one_page).cp_hicache.num_owned
    snapshot("zero_owned_ack")

    return report


class TestCpHiCacheAgreement(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        # A rank that skips a collective fails the test within the timeout, not gloo's default 30 min.
        cls.reports = run_ranks(_rank, CP_SIZE, timeout_s=120)

    def _both(self, name):
        return self.reports[0][name], self.reports[1][name]

    def _assert_consistent(self, name):
        r0, r1 = self._both(name)
        self.assertEqual(r0["tree"], r1["tree"], f"{name}: the ranks' trees differ")
        self.assertEqual(r0["free_pages_by_owner"], r1["free_pages_by_owner"], name)
        self.assertEqual(r0["ledger_free"], r1["ledger_free"], f"{name}: the host ledgers differ")
        for rank, report in enumerate((r0, r1)):
            self.assertEqual(report["host_used"], report["host_in_tree"], f"{name}: host slots leak")
            free = self.reports[rank]["host_pages"] * PAGE - report["host_used"]
            self.assertEqual(report["ledger_free"][rank], free, f"{name}: rank {rank}'s ledger")
            self.assertEqual((report["ongoing_writes"], report["write_acks_left"]), (0, 0), name)
        return r0, r1

    def test_zero_owned_rank_acks_its_write(self):
        self._assert_consistent("zero_owned_ack")
        self.assertEqual(sorted(self._both("one_page_owned")), [0, PAGE])

    def test_host_pages_as_the_scenario_expects(self):
        self.assertEqual([r["host_pages"] for r in self.reports], [17, 17])
        r0, _ = self._assert_consistent("rank1_host_nearly_full")
        self.assertEqual(r0["ledger_free"], [17 * PAGE, PAGE])

    def test_host_shortage_on_one_rank_evicts_the_same_nodes_everywhere(self):
        r0, _ = self._assert_consistent("write_after_agreed_eviction")
        self.assertEqual(self._both("y_host_len"), (4 * PAGE, 4 * PAGE))
        # Only as much as rank 1 lacked: x1 is gone on both ranks, x2 stays on host.
        self.assertEqual(self._both("x2_host_len"), (8 * PAGE, 8 * PAGE))
        self.assertEqual(len(r0["tree"]), 2)
        self.assertEqual(r0["ledger_free"], [15 * PAGE, 7 * PAGE])

    def test_host_decisions_enter_no_collective(self):
        self.assertEqual(self._both("y_insert_collectives"), (0, 0))
        self.assertEqual(self._both("z_insert_collectives"), (0, 0))

    def test_write_refused_by_one_rank_is_refused_by_all(self):
        r0, _ = self._assert_consistent("write_refused_everywhere")
        self.assertEqual(self._both("z_host_len"), (0, 0))
        self.assertEqual(r0["ledger_free"], [15 * PAGE, 7 * PAGE])

    def test_load_back_failing_on_one_rank_retries_together(self):
        self._assert_consistent("load_after_retry")
        locs0, locs1 = self._both("loaded_locs")
        self.assertIsNotNone(locs0)
        self.assertEqual(locs0, locs1)
        self.assertEqual(len(locs0), 4 * PAGE)

    def test_load_back_refused_by_one_rank_is_refused_by_all(self):
        self._assert_consistent("load_refused")
        self.assertEqual(self._both("refused_load"), (None, None))


if __name__ == "__main__":
    unittest.main()
