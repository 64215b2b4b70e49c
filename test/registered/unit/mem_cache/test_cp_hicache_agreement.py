"""Two CP ranks in two processes (gloo): a host or device allocation that fails on one rank only must
not split the tree, leak slots, or leave acks unmatched.

Each rank runs a real CpHiRadixCache; rank 1 is made short of host slots (slots taken directly from its
host pool) or gets injected device allocation failures. The parent process compares what both ranks
report.
"""

import unittest

import torch.distributed as dist

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.testing.multi_rank import run_ranks

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
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sglang_cp_shared_kv.testing.cp_hicache_stack import (
        settle_write_acks,
        build_cp_hicache_stack,
        owned_host_slots_in_tree,
        tree_signature,
    )

    stack = build_cp_hicache_stack(
        cp_size=CP_SIZE, cp_rank=rank, group=dist.group.WORLD, physical_pages=16
    )
    cache, allocator, host = stack.cache, stack.allocator, stack.controller.mem_pool_host
    report = {}

    def insert(tokens):
        locs = allocator.alloc(len(tokens))
        cache.insert(InsertParams(key=RadixKey(tokens), value=locs))
        settle_write_acks(cache)

    def node_of(tokens):
        return cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).last_device_node

    def snapshot(name, extra_host_slots=0):
        report[name] = {
            "tree": tree_signature(cache),
            "host_used": stack.controller.physical_host_slots_used(),
            "host_in_tree": owned_host_slots_in_tree(cache) + extra_host_slots,
            "free_pages_by_owner": [p.tolist() for p in allocator.free_pages_by_owner],
            "ongoing_writes": len(cache.ongoing_write_through),
            "write_acks_left": len(cache.cache_controller.ack_write_queue),
        }

    # 1. Two host-only nodes, then rank 1 keeps only one free host page.
    x1, x2, y = _seq(0, 2), _seq(10_000, 2), _seq(20_000, 4)
    insert(x1)
    insert(x2)
    cache.evict(EvictParams(num_tokens=10 * PAGE))
    hoards = [host.alloc(host.available_size() - PAGE)] if rank == 1 else []
    # y needs 2 pages on each rank: rank 1 is short, both must evict x1 and x2, then both back y up.
    insert(y)
    report["y_host_len"] = node_of(y).host_len
    snapshot("write_after_agreed_eviction", sum(len(h) for h in hoards))

    # 2. Rank 1 has no host page left and nothing is evictable: nobody backs z up, nothing leaks.
    if rank == 1:
        hoards.append(host.alloc(host.available_size()))
    z = _seq(30_000, 2)
    insert(z)
    report["z_host_len"] = node_of(z).host_len
    snapshot("write_refused_everywhere", sum(len(h) for h in hoards))
    for hoard in hoards:
        host.free(hoard)

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
        for report in (r0, r1):
            self.assertEqual(report["host_used"], report["host_in_tree"], f"{name}: host slots leak")
            self.assertEqual((report["ongoing_writes"], report["write_acks_left"]), (0, 0), name)
        return r0, r1

    def test_zero_owned_rank_acks_its_write(self):
        self._assert_consistent("zero_owned_ack")
        self.assertEqual(sorted(self._both("one_page_owned")), [0, PAGE])

    def test_host_shortage_on_one_rank_evicts_the_same_nodes_everywhere(self):
        r0, _ = self._assert_consistent("write_after_agreed_eviction")
        self.assertEqual(self._both("y_host_len"), (4 * PAGE, 4 * PAGE))
        # x1 and x2 are gone on both ranks: only y remains.
        self.assertEqual(len(r0["tree"]), 1)

    def test_write_refused_by_one_rank_is_refused_by_all(self):
        self._assert_consistent("write_refused_everywhere")
        self.assertEqual(self._both("z_host_len"), (0, 0))

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
