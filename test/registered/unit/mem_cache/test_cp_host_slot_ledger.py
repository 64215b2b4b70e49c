"""The host-slot ledger: every rank's free host slots, from which every rank decides host writes alone.

Its arithmetic; that slots taken or freed behind the cache's back (or a host eviction that forgets the
ledger) fail loudly at the next host write instead of splitting the ranks' trees; and that ranks with
host pools of different sizes are refused at startup.
"""

import unittest

import numpy as np
import torch.distributed as dist

# First: installs the CPU kernel shim that importing sglang's memory pools needs.
from sglang_cp_shared_kv_testing.cp_hicache_stack import (
    NSA_PAGE_SIZE as PAGE,
    build_cp_hicache_stack,
    settle_write_acks,
)
from sglang_cp_shared_kv.mem_cache.cp_host_slot_ledger import CpHostSlotLedger
from sglang_cp_shared_kv_testing.multi_rank import RanksFailed, run_ranks, single_process_group
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")


class _HostPool:
    def __init__(self, free):
        self.free = free

    def available_size(self):
        return self.free


class TestLedgerArithmetic(CustomTestCase):
    def setUp(self):
        self.pool = _HostPool(free=10 * PAGE)
        self.ledger = CpHostSlotLedger([10 * PAGE] * 3, cp_rank=1, page_size=PAGE, host_pool=self.pool)

    def test_slots_per_rank_follow_page_owners(self):
        slots = self.ledger.slots_of_pages(np.array([2, 0, 2, 2]))
        self.assertEqual(slots.tolist(), [PAGE, 0, 3 * PAGE])

    def test_fits_and_shortfall_look_at_every_rank(self):
        self.ledger.free[:] = [10 * PAGE, 10 * PAGE, 2 * PAGE]
        need = np.array([0, PAGE, 3 * PAGE])
        self.assertFalse(self.ledger.fits(need))  # rank 2 is short although this rank (1) is not
        self.assertEqual(self.ledger.shortfall(need).tolist(), [0, 0, PAGE])
        self.assertTrue(self.ledger.fits(np.array([PAGE, PAGE, 2 * PAGE])))

    def test_take_and_give_back_move_every_rank_and_check_this_ones_pool(self):
        need = np.array([PAGE, 2 * PAGE, 0])
        self.pool.free -= 2 * PAGE
        self.ledger.take(need)
        self.assertEqual(self.ledger.free.tolist(), [9 * PAGE, 8 * PAGE, 10 * PAGE])
        self.pool.free += 2 * PAGE
        self.ledger.give_back(need)
        self.assertEqual(self.ledger.free.tolist(), [10 * PAGE] * 3)

    def test_taking_more_than_is_free_raises(self):
        with self.assertRaisesRegex(RuntimeError, "only"):
            self.ledger.take(np.array([11 * PAGE, 0, 0]))

    def test_giving_back_more_than_exists_raises(self):
        with self.assertRaisesRegex(RuntimeError, "more than"):
            self.ledger.give_back(np.array([PAGE, 0, 0]))

    def test_own_entry_out_of_step_with_the_pool_raises(self):
        self.pool.free -= PAGE
        with self.assertRaisesRegex(RuntimeError, "cp rank 1 counts 640 free host slots"):
            self.ledger.check_own_entry("now")


def _seq(first, num_pages):
    return list(range(first, first + num_pages * PAGE))


class TestLedgerInTheCache(CustomTestCase):
    def setUp(self):
        self.stack = build_cp_hicache_stack(
            cp_size=2, cp_rank=0, group=single_process_group(), physical_pages=8
        )
        self.cache, self.host = self.stack.cache, self.stack.controller.mem_pool_host

    def _insert(self, tokens):
        locs = self.stack.allocator.alloc(len(tokens))
        self.cache.insert(InsertParams(key=RadixKey(tokens), value=locs))
        settle_write_acks(self.cache)

    def test_writes_and_host_evictions_keep_every_rank_counted(self):
        self._insert(_seq(0, 4))  # pages alternate owners: 2 pages on each rank
        free = self.host.size - 2 * PAGE
        self.assertEqual(self.cache.host_ledger.free.tolist(), [free, free])
        self.cache.evict(EvictParams(num_tokens=4 * PAGE))
        self.cache.evict_host(self.host.size)
        self.assertEqual(self.cache.host_ledger.free.tolist(), [self.host.size] * 2)

    def test_slots_taken_behind_the_caches_back_fail_the_next_write(self):
        taken = self.host.alloc(PAGE)
        with self.assertRaisesRegex(RuntimeError, "outside CpHiRadixCache"):
            self._insert(_seq(0, 2))
        self.host.free(taken)

    def test_a_host_eviction_that_forgets_the_ledger_fails_the_next_write(self):
        self._insert(_seq(0, 2))
        self.cache.evict(EvictParams(num_tokens=2 * PAGE))
        self.cache.host_ledger.give_back = lambda slots_by_rank: None  # planted
        self.cache.evict_host(self.host.size)
        with self.assertRaisesRegex(RuntimeError, "outside CpHiRadixCache"):
            self._insert(_seq(10_000, 2))

    def test_reset_frees_every_rank(self):
        self._insert(_seq(0, 4))
        self.cache.reset()
        self.assertEqual(self.cache.host_ledger.free.tolist(), [self.host.size] * 2)


def _rank_with_own_host_ratio(rank, world_size):
    build_cp_hicache_stack(
        cp_size=2, cp_rank=rank, group=dist.group.WORLD, physical_pages=8,
        hicache_ratio=(2.0, 3.0)[rank],
    )  # fmt: skip


class TestUnequalHostPoolsAreRefused(CustomTestCase):
    def test_startup_names_the_flags(self):
        with self.assertRaises(RanksFailed) as caught:
            run_ranks(_rank_with_own_host_ratio, 2, timeout_s=60)
        self.assertIn("--hicache-ratio / --hicache-size", str(caught.exception))


if __name__ == "__main__":
    unittest.main()
