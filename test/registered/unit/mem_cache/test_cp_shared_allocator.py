"""CPSharedPagedTokenToKVPoolAllocator: logical pages, stock semantics, balance, determinism, OOM."""

import json
import random
import textwrap
import unittest
import unittest.mock
from types import SimpleNamespace

import numpy as np
import torch

from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import (
    alloc_paged_token_slots_decode,
    alloc_paged_token_slots_extend,
)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.mem_cache.allocator import (
    CPSharedPagedTokenToKVPoolAllocator,
    _owner_quotas,
)
from sglang_cp_shared_kv_testing.triton_interpreted import run_interpreted

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")


def make_allocator(cp_size, num_physical_pages, page_size, cp_rank=0, need_sort=False):
    # The allocator reads only .size of its pool; the capacity test uses a real NSATokenToKVPool.
    pool = SimpleNamespace(size=num_physical_pages * page_size)
    return CPSharedPagedTokenToKVPoolAllocator(
        cp_size * pool.size, page_size, torch.bfloat16, "cpu", pool, need_sort,
        CpSharedKVLayout(cp_size, cp_rank, page_size),
    )


def free_counts(allocator):
    return [len(p) for p in allocator.free_pages_by_owner]


def snapshot(allocator):
    return [p.copy() for p in allocator.free_pages_by_owner + allocator.release_pages_by_owner]


def same_lists(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b))


def extend(allocator, reqs, targets):
    """alloc_extend for requests ``reqs`` (lists of held locs) growing to ``targets`` tokens."""
    prefix = torch.tensor([len(r) for r in reqs], dtype=torch.int64)
    seq = torch.tensor(targets, dtype=torch.int64)
    last = torch.tensor([r[-1] if r else -1 for r in reqs], dtype=torch.int64)
    num_tokens = int((seq - prefix).sum())
    return allocator.alloc_extend(prefix, prefix.clone(), seq, seq.clone(), last, num_tokens)


def decode(allocator, reqs):
    seq = torch.tensor([len(r) + 1 for r in reqs], dtype=torch.int64)
    # the scheduler reads last_loc out of req_to_token, which is int32
    last = torch.tensor([r[-1] for r in reqs], dtype=torch.int32)
    return allocator.alloc_decode(seq, seq.clone(), last)


class Workload:
    """Seeded random alloc/extend/decode/free driver that checks every invariant after each step."""

    def __init__(self, test, allocators, seed):
        self.test = test
        self.allocators = allocators  # same calls to every "rank"; outputs must agree
        self.main = allocators[0]
        self.rng = random.Random(seed)
        self.reqs = []  # held logical locs per live request (lists of ints)
        self.ooms = 0
        self.gap_opened = False  # by a free or an owner-pinned load-back

    def run(self, steps):
        ops = [
            self.new_requests,
            self.chunk,
            self.decode,
            self.free,
            self.alloc_pages,
            self.load_back,
        ]
        weights = [3, 2, 4, 2, 1, 1]
        for _ in range(steps):
            self.rng.choices(ops, weights)[0]()

    def call(self, fn, balanced=True):
        """Apply ``fn`` to every allocator; check the OOM contract or the balance rule."""
        a = self.main
        before_lists, before_avail, before_free = snapshot(a), a.available_size(), free_counts(a)
        outs = [fn(x) for x in self.allocators]
        for out in outs[1:]:
            self.test.assertEqual(out is None, outs[0] is None)
            if out is not None:
                self.test.assertTrue(torch.equal(out, outs[0]))
        for x in self.allocators[1:]:
            self.test.assertTrue(same_lists(snapshot(x), snapshot(a)))
        if outs[0] is None:
            self.ooms += 1
            self.test.assertEqual(a.available_size(), before_avail)
            if not a.need_sort:
                self.test.assertTrue(same_lists(snapshot(a), before_lists))
            return None
        if balanced and not a.need_sort:
            self.check_balance(before_free, free_counts(a))
        return outs[0].tolist()

    def check_balance(self, before, after):
        taken = [b - f for b, f in zip(before, after)]
        # Most-free rule: never take from an owner left with 2+ fewer free pages than another.
        for r in range(len(after)):
            if taken[r] > 0:
                self.test.assertGreaterEqual(after[r] + 1, max(after), (before, after))
        spread_before, spread_after = max(before) - min(before), max(after) - min(after)
        self.test.assertLessEqual(spread_after, max(spread_before, 1))
        if not self.gap_opened:
            self.test.assertLessEqual(spread_after, 1)

    def new_requests(self):
        lens = [self.rng.randint(1, 5 * self.main.page_size) for _ in range(self.rng.randint(1, 3))]
        out = self.call(lambda x: extend(x, [[] for _ in lens], lens))
        if out is not None:
            for n in lens:
                self.reqs.append(out[:n])
                out = out[n:]

    def chunk(self):
        if not self.reqs:
            return
        picked = self.rng.sample(range(len(self.reqs)), self.rng.randint(1, min(3, len(self.reqs))))
        targets = [len(self.reqs[i]) + self.rng.randint(1, 3 * self.main.page_size) for i in picked]
        out = self.call(lambda x: extend(x, [self.reqs[i] for i in picked], targets))
        if out is not None:
            for i, t in zip(picked, targets):
                n = t - len(self.reqs[i])
                self.reqs[i] = self.reqs[i] + out[:n]
                out = out[n:]

    def decode(self):
        if not self.reqs:
            return
        picked = self.rng.sample(range(len(self.reqs)), self.rng.randint(1, len(self.reqs)))
        out = self.call(lambda x: decode(x, [self.reqs[i] for i in picked]))
        if out is not None:
            for i, loc in zip(picked, out):
                self.reqs[i] = self.reqs[i] + [loc]

    def alloc_pages(self):
        # HiCache load-back style: whole pages, no continuation
        n = self.rng.randint(1, 4) * self.main.page_size
        out = self.call(lambda x: x.alloc(n))
        if out is not None:
            self.reqs.append(out)

    def load_back(self):
        # HiCache load-back: every page goes back to a named owner
        owners = torch.tensor(
            [self.rng.randrange(self.main.cp_size) for _ in range(self.rng.randint(1, 4))]
        )
        out = self.call(lambda x: x.alloc_with_owners(owners), balanced=False)
        if out is None:
            return
        ps, cp = self.main.page_size, self.main.cp_size
        self.test.assertEqual([loc // ps % cp for loc in out[::ps]], owners.tolist())
        self.reqs.append(out)
        self.gap_opened = True

    def free(self):
        if not self.reqs:
            return
        i = self.rng.randrange(len(self.reqs))
        locs = torch.tensor(self.reqs.pop(i), dtype=torch.int64)
        grouped = self.rng.random() < 0.3
        for x in self.allocators:
            if grouped:
                x.free_group_begin()
                x.free(locs[: len(locs) // 2])
                x.free(locs[len(locs) // 2 :])
                x.free_group_end()
            else:
                x.free(locs)
        self.gap_opened = True

    def check_state(self):
        a, t = self.main, self.test
        ps, cp = a.page_size, a.cp_size
        held_pages = []
        for locs in self.reqs:
            pages = [loc // ps for loc in locs]
            for pos, loc in enumerate(locs):
                # stock paged layout: token pos sits at slot pos % ps of the request's page pos // ps
                t.assertEqual(loc % ps, pos % ps)
                t.assertEqual(pages[pos], pages[pos - pos % ps])
            held_pages += sorted(set(pages))
        t.assertEqual(len(held_pages), len(set(held_pages)), "a page was handed out twice")
        valid = range(cp, cp * (a.num_physical_pages + 1))
        for page in held_pages:
            t.assertIn(page, valid)
            phys = a.layout.physical_page_of(page)
            t.assertTrue(1 <= phys <= a.num_physical_pages)
        free_pages = np.concatenate(a.free_pages_by_owner + a.release_pages_by_owner).tolist()
        t.assertFalse(set(free_pages) & set(held_pages))
        t.assertEqual(len(free_pages) + len(held_pages), cp * a.num_physical_pages)
        t.assertEqual(a.available_size(), a.size - ps * len(held_pages))


class TestCPSharedAllocatorBasics(CustomTestCase):
    def test_is_a_paged_allocator_with_logical_size(self):
        a = make_allocator(cp_size=4, num_physical_pages=5, page_size=64, cp_rank=3)
        self.assertIsInstance(a, PagedTokenToKVPoolAllocator)
        self.assertEqual((a.cp_size, a.cp_rank, a.physical_size), (4, 3, 5 * 64))
        self.assertEqual(a.layout.cp_rank, 3)
        self.assertEqual(a.size, 4 * 5 * 64)
        # the scheduler's leak check compares against max_total_num_tokens == size
        self.assertEqual(a.available_size(), a.size)
        pages = sorted(np.concatenate(a.free_pages_by_owner).tolist())
        self.assertEqual(pages, list(range(4, 4 * 6)))

    def test_rejects_inconsistent_sizes(self):
        pool = SimpleNamespace(size=4 * 64)
        with self.assertRaisesRegex(ValueError, "enable-nsa-prefill-cp-shared-kv"):
            CPSharedPagedTokenToKVPoolAllocator(
                4 * 64, 64, torch.bfloat16, "cpu", pool, False, CpSharedKVLayout(2, 0, 64)
            )
        with self.assertRaisesRegex(ValueError, "multiple of page_size"):
            CPSharedPagedTokenToKVPoolAllocator(
                2 * 100, 64, torch.bfloat16, "cpu", SimpleNamespace(size=100), False,
                CpSharedKVLayout(2, 0, 64),
            )

    def test_cpu_copy_is_refused(self):
        a = make_allocator(2, 4, 4)
        with self.assertRaisesRegex(ValueError, "enable-nsa-prefill-cp-shared-kv"):
            a.get_cpu_copy(torch.arange(8))
        with self.assertRaisesRegex(ValueError, "enable-nsa-prefill-cp-shared-kv"):
            a.load_cpu_copy(None, torch.arange(8))

    def test_extend_continues_partial_page_then_new_pages(self):
        a = make_allocator(cp_size=2, num_physical_pages=8, page_size=4)
        first = extend(a, [[]], [6]).tolist()
        self.assertEqual([loc % 4 for loc in first], [0, 1, 2, 3, 0, 1])
        more = extend(a, [first], [13]).tolist()
        # tokens 6, 7 finish the held page; 8..12 go to two new pages
        self.assertEqual(more[:2], [first[-1] + 1, first[-1] + 2])
        self.assertEqual([loc % 4 for loc in more[2:]], [0, 1, 2, 3, 0])
        self.assertEqual(a.available_size(), a.size - 4 * 4)
        # a decode inside the partial page takes no page, even from a full pool
        a.alloc(a.available_size())
        self.assertEqual(a.available_size(), 0)
        self.assertEqual(decode(a, [first + more]).tolist(), [more[-1] + 1])

    def test_single_request_pages_round_robin_over_owners(self):
        # On a balanced pool page j of a request lands on owner j % cp, so any run of its pages
        # (a radix node) is within one page per owner.
        for cp in (2, 3, 4, 8):
            a = make_allocator(cp_size=cp, num_physical_pages=40, page_size=4)
            out = extend(a, [[]], [4 * 23 + 1]).tolist()
            owners = [loc // 4 % cp for loc in out[::4]]
            self.assertEqual(owners, [j % cp for j in range(24)], cp)
            # decode growth and chunks of cp pages keep the pattern
            b = make_allocator(cp_size=cp, num_physical_pages=40, page_size=4)
            req = extend(b, [[]], [4 * cp]).tolist()
            req += extend(b, [req], [len(req) + 4 * cp]).tolist()
            for _ in range(4 * cp + 3):
                req += decode(b, [req]).tolist()
            owners = [loc // 4 % cp for loc in req[::4]]
            self.assertEqual(owners, [j % cp for j in range(len(owners))], cp)

    def test_backup_restore_and_clear(self):
        a = make_allocator(3, 6, 4)
        held = extend(a, [[]], [9])
        state = a.backup_state()
        lists = snapshot(a)
        extend(a, [[], []], [5, 17])
        a.free(held)
        a.restore_state(state)
        self.assertTrue(same_lists(snapshot(a), lists))
        a.clear()
        self.assertEqual(a.available_size(), a.size)

    def test_free_group_defers_until_end(self):
        a = make_allocator(2, 6, 4)
        held = extend(a, [[]], [16])
        a.free_group_begin()
        a.free(held[:8])
        a.free(held[8:])
        self.assertEqual(a.available_size(), a.size - 16)
        a.free_group_end()
        self.assertEqual(a.available_size(), a.size)

    def test_need_sort_releases_then_merges_sorted(self):
        a = make_allocator(2, 4, 4, need_sort=True)
        held = extend(a, [[]], [4 * 8]).tolist()  # the whole pool
        a.free(torch.tensor(held[4 * 6 :]))  # two pages: one per owner
        self.assertEqual(a.available_size(), 8)
        self.assertEqual(free_counts(a), [0, 0])
        # too big even with the released pages: nothing moves
        before = snapshot(a)
        self.assertIsNone(a.alloc(12))
        self.assertTrue(same_lists(snapshot(a), before))
        out = a.alloc(8)
        self.assertEqual({x // 4 for x in out.tolist()}, {x // 4 for x in held[24:]})
        self.assertEqual(a.available_size(), 0)


class TestCPSharedAllocatorOutOfMemory(CustomTestCase):
    def test_exact_demand_check_leaves_free_lists_untouched(self):
        a = make_allocator(cp_size=4, num_physical_pages=3, page_size=4)
        held = extend(a, [[]], [4 * 9 + 2]).tolist()  # 10 of 12 pages, last one partial
        lists, avail = snapshot(a), a.available_size()
        self.assertEqual(avail, 8)
        # needs 2 more tokens in the held page + 3 new pages: 1 page short
        self.assertIsNone(extend(a, [held], [4 * 13]))
        self.assertIsNone(extend(a, [held, []], [len(held) + 1, 4 * 2 + 1]))
        self.assertIsNone(a.alloc(12))
        self.assertTrue(same_lists(snapshot(a), lists))
        self.assertEqual(a.available_size(), avail)
        # exactly the free pages fits
        out = extend(a, [held], [4 * 12])
        self.assertEqual(len(out), 4 * 12 - len(held))
        self.assertEqual(a.available_size(), 0)
        self.assertIsNone(decode(a, [held + out.tolist()]))


class TestAllocWithOwners(CustomTestCase):
    def test_pages_land_on_the_named_owners(self):
        a = make_allocator(cp_size=4, num_physical_pages=3, page_size=4)
        owners = torch.tensor([2, 2, 0, 3])
        locs = a.alloc_with_owners(owners).tolist()
        pages = [loc // 4 for loc in locs[::4]]
        self.assertEqual([p % 4 for p in pages], [2, 2, 0, 3])
        self.assertEqual(locs, [p * 4 + s for p in pages for s in range(4)])
        self.assertEqual(free_counts(a), [2, 3, 1, 2])

    def test_interleaved_owners_take_each_owners_free_pages_in_page_order(self):
        # Every rank must place a load-back identically: owner r's k-th page is the k-th head of r's
        # free list, whatever the interleaving. Owners also come as the controller passes them: a
        # strided NumPy int8 view of the per-position owners.
        a = make_allocator(cp_size=3, num_physical_pages=4, page_size=2)
        owners_per_position = np.repeat(np.array([1, 0, 1, 2, 0, 1], dtype=np.int8), 2)
        locs = a.alloc_with_owners(owners_per_position[::2]).tolist()
        self.assertEqual([loc // 2 for loc in locs[::2]], [4, 3, 7, 5, 6, 10])
        self.assertEqual(locs[1::2], [loc + 1 for loc in locs[::2]])
        self.assertEqual(free_counts(a), [2, 1, 3])

    def test_short_owner_fails_untouched_even_when_total_fits(self):
        a = make_allocator(cp_size=2, num_physical_pages=3, page_size=4)
        lists = snapshot(a)
        self.assertIsNone(a.alloc_with_owners(torch.tensor([1, 1, 1, 1])))  # 6 free, owner 1 has 3
        self.assertTrue(same_lists(snapshot(a), lists))
        self.assertEqual(a.available_size(), a.size)
        with self.assertRaisesRegex(ValueError, "enable-nsa-prefill-cp-shared-kv"):
            a.alloc_with_owners(torch.tensor([2]))

    def test_need_sort_merges_released_pages_of_the_owner(self):
        a = make_allocator(cp_size=2, num_physical_pages=2, page_size=4, need_sort=True)
        held = a.alloc(16)
        a.free(held[:8])  # pages on owners 0 and 1 go to the release lists
        self.assertEqual(a.alloc_with_owners(torch.tensor([1])).tolist(), held[4:8].tolist())
        self.assertEqual(a.available_size(), 4)


class TestCPSharedAllocatorProperties(CustomTestCase):
    def test_random_workloads(self):
        configs = [(2, 64, 6), (3, 4, 7), (4, 4, 9), (8, 2, 5), (1, 4, 20)]
        for seed, (cp, ps, phys) in enumerate(configs):
            for need_sort in (False, True):
                with self.subTest(cp=cp, page_size=ps, need_sort=need_sort):
                    ranks = [
                        make_allocator(cp, phys, ps, cp_rank=r, need_sort=need_sort)
                        for r in (0, cp - 1)
                    ]
                    w = Workload(self, ranks, seed=1000 * seed + need_sort)
                    for _ in range(30):
                        w.run(8)
                        w.check_state()
                    self.assertGreater(w.ooms, 0, "workload never reached exhaustion")

    def test_balance_without_frees_stays_within_one_page(self):
        a = make_allocator(cp_size=8, num_physical_pages=30, page_size=4)
        w = Workload(self, [a], seed=7)
        for _ in range(80):
            w.rng.choice([w.new_requests, w.chunk, w.decode, w.alloc_pages])()
        used = [a.num_physical_pages - f for f in free_counts(a)]
        self.assertLessEqual(max(used) - min(used), 1)
        w.check_state()


class GeneralPathAllocator(CPSharedPagedTokenToKVPoolAllocator):
    """The allocator without its fast paths: every allocation through ``_assign_owners`` and the
    argsort in ``_pop_pages``, every free through the torch implementation the NumPy one replaced
    (the code before the fast paths)."""

    _owner_fast_path = False

    def free(self, free_index):
        if free_index.numel() == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group.append(free_index)
            return
        pages = torch.unique(free_index.to(torch.int64) // self.page_size)
        owner = self.layout.owner_of_page(pages)
        counts = torch.bincount(owner, minlength=self.cp_size).tolist()
        pages_by_owner = torch.split(pages[torch.argsort(owner, stable=True)], counts)
        target = self.release_pages_by_owner if self.need_sort else self.free_pages_by_owner
        for rank, freed in enumerate(pages_by_owner):
            if len(freed) > 0:
                target[rank] = np.concatenate((freed.numpy(), target[rank]))

    def _pop_pages(self, owner, quotas):
        taken = []
        for rank, quota in enumerate(quotas):
            if quota > 0:
                taken.append(self.free_pages_by_owner[rank][:quota])
                self.free_pages_by_owner[rank] = self.free_pages_by_owner[rank][quota:]
        if not taken:
            return self._empty_pages()
        by_owner = np.argsort(owner, kind="stable")
        take_index = np.empty(len(owner), dtype=np.int64)
        take_index[by_owner] = np.arange(len(owner))
        return np.concatenate(taken)[take_index]


def make_general_allocator(cp_size, num_physical_pages, page_size, need_sort=False):
    pool = SimpleNamespace(size=num_physical_pages * page_size)
    return GeneralPathAllocator(
        cp_size * pool.size, page_size, torch.bfloat16, "cpu", pool, need_sort,
        CpSharedKVLayout(cp_size, 0, page_size),
    )


class TestFastPathsMatchGeneralPath(CustomTestCase):
    """Fast paths (one owner, every page on its preferred owner, owners already grouped, the NumPy
    free) against the general path on the same calls: identical pages, identical free lists."""

    def test_random_workloads_against_the_general_path(self):
        configs = [(1, 4, 20), (1, 64, 6), (2, 64, 6), (2, 4, 11), (3, 4, 7), (4, 4, 9), (8, 2, 5)]
        for seed, (cp, ps, phys) in enumerate(configs):
            for need_sort in (False, True):
                with self.subTest(cp=cp, page_size=ps, need_sort=need_sort):
                    fast = make_allocator(cp, phys, ps, need_sort=need_sort)
                    general = make_general_allocator(cp, phys, ps, need_sort=need_sort)
                    w = Workload(self, [fast, general], seed=500 + 1000 * seed + need_sort)
                    for _ in range(40):
                        w.run(8)
                        w.check_state()
                    self.assertTrue(same_lists(snapshot(fast), snapshot(general)))

    def test_free_of_arbitrary_locs_matches_the_general_path(self):
        # Partial pages, repeats, any order, int32 or int64: the same pages back on the same lists.
        rng = random.Random(11)
        for trial in range(300):
            cp, ps = rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 2, 4, 64])
            phys, need_sort = rng.randint(2, 6), rng.random() < 0.5
            fast = make_allocator(cp, phys, ps, need_sort=need_sort)
            general = make_general_allocator(cp, phys, ps, need_sort=need_sort)
            held = fast.alloc(fast.available_size())
            general.alloc(general.available_size())
            for _ in range(3):
                locs = rng.choices(held.tolist(), k=rng.randint(1, len(held)))
                dtype = rng.choice([torch.int32, torch.int64])
                for a in (fast, general):
                    a.free(torch.tensor(locs, dtype=dtype))
                self.assertTrue(same_lists(snapshot(fast), snapshot(general)), trial)
                for p in fast.free_pages_by_owner + fast.release_pages_by_owner:
                    self.assertEqual(p.dtype, np.int64)

    def test_preferred_owners_skip_the_general_assignment(self):
        # On a balanced pool, allocs of whole rounds of cp pages (and then one page) give every page
        # its preferred owner: no _assign_owners, and the general path's pages.
        from sglang_cp_shared_kv.mem_cache import allocator as allocator_module

        for cp in (1, 2, 4):
            sizes = [4 * n for n in (cp, 2 * cp, 3 * cp, 1)]
            fast, general = make_allocator(cp, 12, 4), make_general_allocator(cp, 12, 4)
            with unittest.mock.patch.object(
                allocator_module, "_assign_owners", side_effect=AssertionError("general path")
            ):
                out = [fast.alloc(n).tolist() for n in sizes]
            self.assertEqual(out, [general.alloc(n).tolist() for n in sizes])
            self.assertTrue(same_lists(snapshot(fast), snapshot(general)))


class TestOwnerQuotas(CustomTestCase):
    def test_matches_one_page_at_a_time_from_the_most_free_owner(self):
        def reference(free, n, tie_start):
            free, quotas = list(free), [0] * len(free)
            order = [(tie_start + s) % len(free) for s in range(len(free))]
            for _ in range(n):
                rank = max(order, key=lambda r: (free[r], -order.index(r)))
                free[rank] -= 1
                quotas[rank] += 1
            return quotas

        rng = random.Random(3)
        for _ in range(3000):
            cp = rng.randint(1, 8)
            free = [rng.randint(0, 12) for _ in range(cp)]
            n, tie_start = rng.randint(0, sum(free)), rng.randrange(cp)
            self.assertEqual(_owner_quotas(free, n, tie_start), reference(free, n, tie_start))


class TestWithStockRadixCache(CustomTestCase):
    def test_scheduler_alloc_paths_evict_and_keep_the_pool_invariant(self):
        """sglang's own alloc_paged_token_slots_extend/decode over a real RadixCache: eviction frees
        logical pages back to their owners and available + evictable + protected + held == size, the
        scheduler's leak check with max_total_num_tokens = size."""
        ps = 4
        a = make_allocator(cp_size=2, num_physical_pages=6, page_size=ps)
        tree = RadixCache(
            CacheInitParams(
                disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=a, page_size=ps
            )
        )

        def lens(*xs):
            return torch.tensor(xs, dtype=torch.int64)

        def check(held_tokens):
            total = a.available_size() + tree.evictable_size() + tree.protected_size()
            self.assertEqual(total + held_tokens, a.size)

        def extend_new(n):
            return alloc_paged_token_slots_extend(
                tree, lens(0), lens(0), lens(n), lens(n), lens(-1), n
            )

        first = extend_new(40)
        tree.insert(InsertParams(key=RadixKey(list(range(40))), value=first))
        check(0)
        self.assertEqual(a.available_size(), 8)
        # 16 tokens (+ one page of headroom) do not fit in 8: the cached request is evicted first
        second = extend_new(15)
        self.assertEqual(tree.evictable_size(), 0)
        check(16)
        held = second.tolist()
        for _ in range(3):
            n = len(held)
            held += alloc_paged_token_slots_decode(
                tree, lens(n + 1), lens(n + 1), torch.tensor([held[-1]], dtype=torch.int32)
            ).tolist()
        self.assertEqual([loc % ps for loc in held], [i % ps for i in range(18)])
        check(20)
        a.free(torch.tensor(held))
        check(0)
        self.assertEqual(a.available_size(), a.size)


STOCK_PROBE = textwrap.dedent(
    """
    import json, torch
    import sglang.srt.mem_cache.allocator as stock

    captured = []
    kernel = stock.alloc_extend_kernel

    class Capture:
        def __getitem__(self, grid):
            def launch(*args):
                kernel[grid](*args)
                captured.append(args[4].clone())  # out_indices
            return launch

    stock.alloc_extend_kernel = Capture()
    page_size, sentinel = 4, 1000
    a = stock.PagedTokenToKVPoolAllocator(
        4 * page_size, page_size, torch.bfloat16, "cpu", None, need_sort=False
    )
    # Four free pages; the memory right after the free list holds sentinel page ids, so a read
    # past the list shows up in the kernel's output instead of as undefined memory.
    backing = torch.full((16,), sentinel, dtype=torch.int64)
    backing[:4] = a.free_pages
    a.free_pages = backing[:4]
    zero = torch.tensor([0])
    out = a.alloc_extend(zero, zero, torch.tensor([6 * page_size]), torch.tensor([6 * page_size]),
                         torch.tensor([-1]), 6 * page_size)
    print(json.dumps({"result_is_none": out is None, "free_pages": a.free_pages.tolist(),
                      "kernel_out": captured[0].tolist()}))
    """
)


class TestStockAllocExtendOnExhaustion(CustomTestCase):
    def test_stock_kernel_reads_past_free_list_before_its_check(self):
        """Stock 0.5.11 launches the Triton kernel (run on CPU by Triton's interpreter) before it
        compares the page demand with the free list: on exhaustion the kernel reads past the list.
        It still returns None afterwards; the harm is the out-of-bounds device read. Our allocator
        checks the exact demand first (TestCPSharedAllocatorOutOfMemory)."""
        report = run_interpreted(["-c", STOCK_PROBE], 300)
        self.assertTrue(report["result_is_none"])
        self.assertEqual(report["free_pages"], [1, 2, 3, 4])
        pages_read = {loc // 4 for loc in report["kernel_out"]}
        self.assertIn(1000, pages_read, report)


if __name__ == "__main__":
    unittest.main()
