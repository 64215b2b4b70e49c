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
    def test_formula_on_known_locs(self):
        layout = CpSharedKVLayout(cp_size=4, cp_rank=2, page_size=64)
        # logical page 6 -> owner 2, physical page 1; slot 5 kept
        loc = torch.tensor([6 * 64 + 5])
        self.assertEqual(layout.owner_of(loc).item(), 2)
        self.assertEqual(layout.logical_locs_to_physical(loc).item(), 64 + 5)
        self.assertEqual(layout.physical_locs_to_logical(torch.tensor([64 + 5])).item(), 6 * 64 + 5)
        self.assertEqual(layout.logical_page_of(1), 6)
        self.assertEqual(layout.physical_page_of(6), 1)

    def test_every_logical_loc_has_exactly_one_owner_and_round_trips(self):
        for cp_size, page_size in CONFIGS:
            locs = torch.arange(cp_size * page_size * 7, dtype=torch.int64)
            owners_seen = torch.zeros_like(locs)
            for rank in range(cp_size):
                layout = CpSharedKVLayout(cp_size, rank, page_size)
                mask = layout.owned_by_this_rank(locs)
                owners_seen += mask.long()
                owned = locs[mask]
                phys = layout.logical_locs_to_physical(owned)
                # physical rows of one rank are dense: 7 pages, no collision
                self.assertEqual(sorted(phys.tolist()), list(range(7 * page_size)))
                self.assertTrue(torch.equal(layout.physical_locs_to_logical(phys), owned))
                # NumPy twin agrees
                np_phys = layout.logical_locs_to_physical_np(owned.numpy())
                self.assertTrue(np.array_equal(np_phys, phys.numpy()))
                self.assertTrue(
                    np.array_equal(layout.physical_locs_to_logical_np(np_phys), owned.numpy())
                )
                self.assertTrue(
                    np.array_equal(layout.owned_by_this_rank_np(locs.numpy()), mask.numpy())
                )
            self.assertTrue(bool((owners_seen == 1).all()), (cp_size, page_size))

    def test_dtype_and_int32_preserved(self):
        layout = CpSharedKVLayout(2, 1, 64)
        locs = torch.tensor([64, 65, 200], dtype=torch.int32)
        phys = layout.logical_locs_to_physical(locs)
        self.assertEqual(phys.dtype, torch.int32)
        self.assertEqual(phys.tolist(), [0, 1, 72])

    def test_non_owned_loc_raises(self):
        layout = CpSharedKVLayout(4, 1, 64)
        with self.assertRaisesRegex(ValueError, "not owned by cp_rank 1"):
            layout.logical_locs_to_physical(torch.tensor([64, 128]))
        with self.assertRaisesRegex(ValueError, "not owned"):
            layout.logical_locs_to_physical_np(np.array([0]))
        # empty input is fine
        self.assertEqual(layout.logical_locs_to_physical(torch.empty(0, dtype=torch.int64)).numel(), 0)

    def test_mapping_page_heads_then_expanding_equals_mapping_every_loc(self):
        # The HiCache adapter maps only page heads and expands them: it must match the per-loc map.
        for cp_size, page_size in CONFIGS:
            pages = torch.tensor([5, 2, 9, 7, 3, 12], dtype=torch.int64) * cp_size // 2 + 1
            for rank in range(cp_size):
                layout = CpSharedKVLayout(cp_size, rank, page_size)
                owned_pages = pages[pages % cp_size == rank]
                owned_locs = layout.rows_of_pages(owned_pages * page_size)
                self.assertEqual(len(owned_locs), len(owned_pages) * page_size)
                heads = owned_locs[::page_size]
                self.assertTrue(
                    torch.equal(
                        layout.rows_of_pages(layout.logical_locs_to_physical(heads)),
                        layout.logical_locs_to_physical(owned_locs),
                    ),
                    (cp_size, page_size, rank),
                )
        layout = CpSharedKVLayout(2, 0, 4)
        expanded = layout.rows_of_pages(torch.tensor([8, 0], dtype=torch.int32))
        self.assertEqual(expanded.tolist(), [8, 9, 10, 11, 0, 1, 2, 3])
        self.assertEqual(expanded.dtype, torch.int32)
        self.assertEqual(layout.rows_of_pages(torch.empty(0, dtype=torch.int64)).numel(), 0)

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
        with self.assertRaises(ValueError):
            CpSharedKVLayout(2, 0, 64).physical_locs_to_logical(torch.tensor([-1]))


if __name__ == "__main__":
    unittest.main()
