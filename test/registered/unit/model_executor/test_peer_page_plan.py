"""PeerPagePlan: which pages a forward fetches and from whom, the scratch layout, index remapping."""

import random
import unittest

import torch

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.model_executor.peer_page_plan import build_peer_page_plan
from sglang_cp_shared_kv_testing.peer_page_plan_fills import fill_locs, fill_lookup

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")


def _req_to_token(rows, width=64):
    """req_to_token with row 0 = sglang's padding row; ``rows`` are lists of logical locs."""
    table = torch.zeros((len(rows) + 1, width), dtype=torch.int32)
    for i, locs in enumerate(rows, start=1):
        table[i, : len(locs)] = torch.tensor(locs, dtype=torch.int32)
    return table


def _locs_of_pages(pages, page_size, num_tokens):
    return [pages[p // page_size] * page_size + p % page_size for p in range(num_tokens)]


def _plans(cp_size, page_size, req_to_token, reqs, seq_lens, new, scratch_num_pages, pages=64):
    """Every rank's plan of a batch, fed the host page ids of ``req_to_token``'s rows (what the host
    mirror holds: the page of every ``page_size``-th position up to ``seq_len``)."""
    request_pages = [
        (req_to_token[r, :s:page_size] // page_size).numpy() for r, s in zip(reqs, seq_lens)
    ]
    old_page_counts = [-(-(s - k) // page_size) for s, k in zip(seq_lens, new)]
    return [
        build_peer_page_plan(
            layout=CpSharedKVLayout(cp_size, rank, page_size),
            request_pages=request_pages,
            old_page_counts=old_page_counts,
            num_logical_pages=pages,
            scratch_num_pages=scratch_num_pages,
            device="cpu",
        )
        for rank in range(cp_size)
    ]


class TestWhoSendsWhat(CustomTestCase):
    def test_old_pages_come_from_their_owners_in_owner_major_order(self):
        # cp 2, page 4: one request on logical pages [2, 5, 3, 4], 14 tokens, the last 6 new:
        # prefix 8 -> pages 2 and 5 hold older tokens (gathered), pages 3 and 4 only new (filled).
        table = _req_to_token([_locs_of_pages([2, 5, 3, 4], 4, 14)])
        plan0, plan1 = _plans(2, 4, table, [1], [14], [6], scratch_num_pages=16)
        self.assertEqual(plan0.gather_pages_per_rank, 1)
        # owner 0 sends page 2 (its physical page 1), owner 1 sends page 5 (physical page 2)
        self.assertEqual(plan0.send_physical_pages.tolist(), [1])
        self.assertEqual(plan1.send_physical_pages.tolist(), [2])
        expected_lookup = {2: 1, 5: 2, 3: 3, 4: 4}
        for plan in (plan0, plan1):
            for page, scratch_page in expected_lookup.items():
                self.assertEqual(int(plan.lookup[page]), scratch_page)
            self.assertEqual(int(plan.lookup.count_nonzero()), 4)
            self.assertEqual(fill_lookup(plan).nonzero().flatten().tolist(), [3, 4])
            self.assertEqual(plan.scratch_pages_used, 5)

    def test_rank_owning_nothing_still_sends_padding(self):
        # cp 4: both old pages owned by rank 1 -> n = 2; ranks 0, 2, 3 send their dummy page.
        table = _req_to_token([_locs_of_pages([5, 9], 4, 8)])
        plans = _plans(4, 4, table, [1], [8], [0], scratch_num_pages=16)
        self.assertEqual([p.gather_pages_per_rank for p in plans], [2, 2, 2, 2])
        self.assertEqual(plans[1].send_physical_pages.tolist(), [1, 2])
        for rank in (0, 2, 3):
            self.assertEqual(plans[rank].send_physical_pages.tolist(), [0, 0])
        # owner-major: rank 1's pages sit at 1 + 1*2 + j
        self.assertEqual(int(plans[0].lookup[5]), 3)
        self.assertEqual(int(plans[0].lookup[9]), 4)

    def test_padded_requests_and_dummy_pages_map_to_the_dummy_page(self):
        # A decode batch padded with a request on req_to_token row 0 (seq len 1).
        table = _req_to_token([_locs_of_pages([6], 4, 3)])
        plans = _plans(2, 4, table, [1, 0], [3, 1], [1, 1], scratch_num_pages=16)
        for plan in plans:
            self.assertEqual(int(plan.lookup[0]), 0)
            self.assertEqual(plan.lookup.nonzero().flatten().tolist(), [6])
            self.assertEqual(plan.remap_token_locs(torch.tensor([0, 1])).tolist(), [0, 1])

    def test_empty_batch_plans_nothing(self):
        plans = _plans(2, 4, _req_to_token([]), [], [], [], scratch_num_pages=4)
        for plan in plans:
            self.assertEqual(plan.gather_pages_per_rank, 0)
            self.assertEqual(plan.scratch_pages_used, 1)
            self.assertEqual(int(plan.lookup.count_nonzero()), 0)


class TestScratchCapacity(CustomTestCase):
    # cp 2: old pages 2, 4, 6 all owned by rank 0 (n = 3) and new pages 3, 5.
    TABLE = _req_to_token([_locs_of_pages([2, 4, 6, 3, 5], 4, 20)])

    def test_unbalanced_batch_packs_owners_exactly(self):
        # Padded layout needs 1 + 2*3 + 2 = 9 pages; owners packed back to back need 1 + 3 + 2 = 6.
        plans = _plans(2, 4, self.TABLE, [1], [20], [8], scratch_num_pages=8)
        for plan in plans:
            self.assertTrue(plan.exact_layout)
            self.assertEqual(plan.gather_page_counts, (3, 0))
            self.assertEqual(plan.owner_slices(), [(0, 3), (3, 0)])
            self.assertEqual(plan.scratch_pages_used, 6)
            self.assertEqual(plan.num_fill_pages, 2)
            # Old pages 2, 4, 6 at scratch pages 1..3; new pages 3, 5 filled locally after them.
            self.assertEqual(plan.lookup[[2, 4, 6, 3, 5]].tolist(), [1, 2, 3, 4, 5])
        self.assertEqual(plans[0].send_physical_pages.tolist(), [1, 2, 3])
        self.assertEqual(plans[1].send_physical_pages.tolist(), [])

    def test_default_layout_when_it_fits(self):
        plans = _plans(2, 4, self.TABLE, [1], [20], [8], scratch_num_pages=9)
        self.assertFalse(plans[0].exact_layout)
        self.assertEqual(plans[0].num_fill_pages, 2)
        self.assertEqual(plans[1].send_physical_pages.tolist(), [0, 0, 0])

    def test_batch_larger_than_the_scratch_raises(self):
        with self.assertRaisesRegex(RuntimeError, "enable-nsa-prefill-cp-shared-kv"):
            _plans(2, 4, self.TABLE, [1], [20], [8], scratch_num_pages=5)


class TestRemapReadsTheReplicatedRows(CustomTestCase):
    """Simulated assembly: every rank's shard + gather + local fill must reproduce the replica."""

    def _random_batch(self, rng, cp_size, page_size, physical_pages):
        free = list(range(cp_size, cp_size * (physical_pages + 1)))
        rng.shuffle(free)
        rows, seq_lens, new = [], [], []
        for _ in range(rng.randrange(1, 5)):
            seq_len = rng.randrange(1, 6 * page_size)
            shared = rows[-1][: page_size * rng.randrange(0, 2)] if rows else []
            num_pages = -(-seq_len // page_size) - len(shared) // page_size
            if len(free) < num_pages or len(shared) >= seq_len:
                continue
            pages = [loc // page_size for loc in shared[::page_size]]
            pages += [free.pop() for _ in range(num_pages)]
            rows.append(_locs_of_pages(pages, page_size, seq_len))
            seq_lens.append(seq_len)
            new.append(rng.randrange(1, seq_len - len(shared) + 1))
        return rows, seq_lens, new

    def test_random_batches(self):
        rng = random.Random(0)
        layouts = set()
        for cp_size, page_size in [(1, 4), (2, 4), (3, 2), (4, 64), (8, 4)]:
            physical_pages = 8
            num_logical_pages = cp_size * (physical_pages + 1)
            for trial in range(40):
                # Every other batch on a scratch of just its worst-case page count (4 requests of
                # at most 6 pages): too small for most padded layouts, so exact layouts are checked.
                scratch_num_pages = cp_size * physical_pages + 1 if trial % 2 else 1 + 4 * 6
                rows, seq_lens, new = self._random_batch(rng, cp_size, page_size, physical_pages)
                table = _req_to_token(rows, width=6 * page_size)
                reqs = list(range(1, len(rows) + 1))
                plans = _plans(
                    cp_size, page_size, table, reqs, seq_lens, new, scratch_num_pages,
                    pages=num_logical_pages,
                )
                self._check(plans, table, reqs, seq_lens, new, physical_pages)
                layouts.add(plans[0].exact_layout)
        self.assertEqual(layouts, {False, True})

    def _check(self, plans, table, reqs, seq_lens, new, physical_pages):
        page_size = plans[0].layout.page_size
        for plan in plans[1:]:
            self.assertTrue(torch.equal(plan.lookup, plans[0].lookup))
            self.assertEqual(plan.gather_pages_per_rank, plans[0].gather_pages_per_rank)
        # The replicated pool holds, at every row, that row's logical loc. Each shard holds the
        # rows of its owned pages (physical page p stores logical page logical_page_of(p)).
        physical = torch.arange(physical_pages + 1)
        shards = [
            plan.layout.rows_of_pages(plan.layout.logical_page_of(physical) * page_size).view(
                -1, page_size
            )
            for plan in plans
        ]
        scratch = torch.full((plans[0].scratch_pages_used, page_size), -1, dtype=torch.int64)
        # The all-gather (padded layout) or the per-owner broadcasts (exact), simulated.
        for (start, count), shard, plan in zip(plans[0].owner_slices(), shards, plans):
            scratch[1 + start : 1 + start + count] = shard[plan.send_physical_pages]
        for rank, plan in enumerate(plans):
            # Every rank fills the rows this forward writes, through its own plan.
            written = torch.cat(
                [table[r, s - k : s].long() for r, s, k in zip(reqs, seq_lens, new)]
            )
            filled = scratch.clone()
            filled.view(-1)[fill_locs(plan, written)] = written
            filled[0] = -1  # dummy page: garbage by design
            for r, s in zip(reqs, seq_lens):
                logical = table[r, :s]
                got = filled.view(-1)[plan.remap_token_locs(logical).long()]
                self.assertTrue(torch.equal(got, logical.long()), (rank, r, s))
                page_ids = logical[::page_size] // page_size
                first_rows = filled[plan.remap_pages(page_ids).long(), 0]
                self.assertTrue(torch.equal(first_rows // page_size, page_ids.long()))

    def test_remap_keeps_dtype_and_slot(self):
        table = _req_to_token([_locs_of_pages([7, 2], 4, 6)])
        plan = _plans(2, 4, table, [1], [6], [6], scratch_num_pages=8)[1]
        locs = table[1, :6]
        remapped = plan.remap_token_locs(locs)
        self.assertEqual(remapped.dtype, torch.int32)
        self.assertEqual((remapped % 4).tolist(), (locs % 4).tolist())
        self.assertEqual(plan.remap_pages(torch.tensor([7, 2], dtype=torch.int32)).dtype, torch.int32)


if __name__ == "__main__":
    unittest.main()
