"""CpSharedKVLayout: the logical <-> physical bijection every other module relies on."""

import random
import unittest

import numpy as np
import torch

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout

register_cpu_ci(est_time=5, suite="stage-a-test-cpu")

CONFIGS = [(1, 64), (2, 1), (2, 64), (3, 4), (4, 64), (8, 64), (8, 16)]


class TestCpSharedKVLayout(CustomTestCase):
    def test_formula_on_known_pages(self):
        layout = CpSharedKVLayout(cp_size=4, cp_rank=2, page_size=64)
        # logical page 6 -> owner 2, physical page 1
        self.assertEqual(layout.owner_of_page(6), 2)
        self.assertEqual(layout.physical_page_of(6), 1)
        self.assertEqual(layout.logical_page_of(1), 6)
        self.assertEqual(layout.logical_page_of(1, rank=3), 7)
        # same answers element-wise on NumPy arrays and tensors, type kept
        pages = np.array([6, 7, 9])
        self.assertEqual(layout.owner_of_page(pages).tolist(), [2, 3, 1])
        self.assertEqual(layout.physical_page_of(torch.tensor(pages)).tolist(), [1, 1, 2])
        self.assertIsInstance(layout.logical_page_of(np.array([1])), np.ndarray)

    def test_every_logical_page_has_one_owner_and_round_trips(self):
        for cp_size, page_size in CONFIGS:
            pages = torch.arange(cp_size * 8, dtype=torch.int64)
            owners_seen = torch.zeros_like(pages)
            for rank in range(cp_size):
                layout = CpSharedKVLayout(cp_size, rank, page_size)
                owned = pages[layout.owner_of_page(pages) == rank]
                owners_seen[owned] += 1
                physical = layout.physical_page_of(owned)
                # physical pages of one rank are dense: 8 pages (dummy page 0 included), no collision
                self.assertEqual(sorted(physical.tolist()), list(range(8)))
                self.assertTrue(torch.equal(layout.logical_page_of(physical), owned))
            self.assertTrue(bool((owners_seen == 1).all()), (cp_size, page_size))

    def test_per_loc_mask_and_map_agree_with_the_page_formula(self):
        for cp_size, page_size in CONFIGS:
            locs = torch.arange(cp_size * page_size * 5, dtype=torch.int64)
            pages, slots = locs // page_size, locs % page_size
            for rank in range(cp_size):
                layout = CpSharedKVLayout(cp_size, rank, page_size)
                mask = layout.owned_by_this_rank(locs)
                self.assertTrue(torch.equal(mask, layout.owner_of_page(pages) == rank))
                expected = torch.where(
                    mask, layout.physical_page_of(pages) * page_size + slots, slots
                )
                self.assertTrue(torch.equal(layout.physical_locs_or_dummy(locs), expected))

    def test_physical_locs_or_dummy_keeps_int32(self):
        layout = CpSharedKVLayout(2, 1, 64)
        # pages 1 and 3 are rank 1's physical pages 0 and 1; page 2 is rank 0's
        locs = torch.tensor([64, 65, 200, 130], dtype=torch.int32)
        mapped = layout.physical_locs_or_dummy(locs)
        self.assertEqual(mapped.dtype, torch.int32)
        self.assertEqual(mapped.tolist(), [0, 1, 72, 2])

    def test_mapping_page_heads_then_expanding_equals_mapping_every_loc(self):
        # The allocator and the HiCache adapter map page heads and expand them: it must match the
        # per-loc map, for tensors and NumPy arrays alike.
        for cp_size, page_size in CONFIGS:
            pages = torch.tensor([5, 2, 9, 7, 3, 12], dtype=torch.int64) * cp_size // 2 + 1
            for rank in range(cp_size):
                layout = CpSharedKVLayout(cp_size, rank, page_size)
                owned_pages = pages[layout.owner_of_page(pages) == rank]
                owned_locs = layout.rows_of_pages(owned_pages * page_size)
                self.assertEqual(len(owned_locs), len(owned_pages) * page_size)
                physical_heads = layout.physical_page_of(owned_pages) * page_size
                self.assertTrue(
                    torch.equal(
                        layout.rows_of_pages(physical_heads),
                        layout.physical_locs_or_dummy(owned_locs),
                    ),
                    (cp_size, page_size, rank),
                )
                self.assertTrue(
                    np.array_equal(
                        layout.rows_of_pages(physical_heads.numpy()),
                        layout.rows_of_pages(physical_heads).numpy(),
                    )
                )
        layout = CpSharedKVLayout(2, 0, 4)
        expanded = layout.rows_of_pages(torch.tensor([8, 0], dtype=torch.int32))
        self.assertEqual(expanded.tolist(), [8, 9, 10, 11, 0, 1, 2, 3])
        self.assertEqual(expanded.dtype, torch.int32)
        self.assertEqual(layout.rows_of_pages(torch.empty(0, dtype=torch.int64)).numel(), 0)
        self.assertEqual(layout.rows_of_pages(np.array([4], dtype=np.int32)).dtype, np.int32)

    def test_per_rank_counts_of_page_aligned_range_differ_by_at_most_one_page(self):
        rng = random.Random(0)
        for cp_size, page_size in CONFIGS:
            layouts = [CpSharedKVLayout(cp_size, r, page_size) for r in range(cp_size)]
            for _ in range(50):
                start_page = rng.randrange(0, 100)
                num_pages = rng.randrange(0, 40)
                locs = torch.arange(
                    start_page * page_size, (start_page + num_pages) * page_size
                )
                counts = [int(l.owned_by_this_rank(locs).sum()) for l in layouts]
                self.assertEqual(sum(counts), locs.numel())
                self.assertLessEqual(max(counts) - min(counts), page_size)

    def test_invalid_arguments(self):
        with self.assertRaisesRegex(ValueError, "cp_size"):
            CpSharedKVLayout(0, 0, 64)
        with self.assertRaisesRegex(ValueError, "cp_rank"):
            CpSharedKVLayout(4, 4, 64)
        with self.assertRaisesRegex(ValueError, "cp_rank"):
            CpSharedKVLayout(4, -1, 64)
        with self.assertRaisesRegex(ValueError, "page_size"):
            CpSharedKVLayout(4, 0, 0)
        with self.assertRaisesRegex(TypeError, "page_size"):
            CpSharedKVLayout(4, 0, 64.0)


if __name__ == "__main__":
    unittest.main()
