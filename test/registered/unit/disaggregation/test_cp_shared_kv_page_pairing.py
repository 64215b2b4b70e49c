"""Which pages each prefill CP rank sends and where they land: the ranks' sends must partition every
chunk (each position sent once, by its owner, from its physical page, to the decode page of the same
position), for KV chunks and for the whole-request indexer-K state pages alike."""

import unittest

import numpy as np

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.disaggregation.page_pairing import owned_page_pairs, position_aligned
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout

register_cpu_ci(est_time=5, suite="stage-a-test-cpu")

PAGE = 64


def random_request(rng, cp_size, pages, physical_pages_per_rank=40, decode_pages=500):
    """Distinct logical pages a shared-KV allocator could hand out (never logical pages 0..cp_size-1,
    which map to every rank's dummy page 0), and distinct decode pages."""
    logical = rng.choice(np.arange(cp_size, cp_size * (physical_pages_per_rank + 1)), pages, replace=False)
    dst = rng.choice(np.arange(1, decode_pages + 1), pages, replace=False)
    return logical, dst


def random_chunks(rng, pages):
    """Split ``pages`` positions into consecutive chunks of random length (some of one page)."""
    cuts = sorted(set(rng.integers(1, pages, size=rng.integers(0, 6)).tolist())) if pages > 1 else []
    bounds = [0] + cuts + [pages]
    return [(a, b) for a, b in zip(bounds, bounds[1:])]


class TestOwnedPagePairs(CustomTestCase):
    def test_known_example(self):
        """cp 4: logical pages 4..7 and 9 at positions 0..4; rank 1 owns 5 (phys 1) and 9 (phys 2)."""
        layout = CpSharedKVLayout(cp_size=4, cp_rank=1, page_size=PAGE)
        pairs = owned_page_pairs(layout, [4, 5, 6, 7, 9], [100, 101, 102, 103, 104])
        self.assertEqual(pairs.positions.tolist(), [1, 4])
        self.assertEqual(pairs.src_pages.tolist(), [1, 2])
        self.assertEqual(pairs.dst_pages.tolist(), [101, 104])
        self.assertEqual(pairs.src_pages.dtype, np.int32)
        self.assertEqual(pairs.dst_pages.dtype, np.int32)

    def test_ranks_partition_every_chunk(self):
        """cp 2/4/8, random page lists and chunkings: every position of every chunk is paired by
        exactly one rank, its owner, from the physical page holding it, to the same position's
        decode page."""
        rng = np.random.default_rng(1234)
        for cp_size in (2, 4, 8):
            for trial in range(25):
                pages = int(rng.integers(1, 30))
                logical, dst = random_request(rng, cp_size, pages)
                for start, end in random_chunks(rng, pages):
                    chunk_logical, chunk_dst = logical[start:end], dst[start:end]
                    seen = np.zeros(end - start, dtype=int)
                    for rank in range(cp_size):
                        layout = CpSharedKVLayout(cp_size, rank, PAGE)
                        pairs = owned_page_pairs(layout, chunk_logical, chunk_dst)
                        seen[pairs.positions] += 1
                        # owned, and read back from the physical page that stores that logical page
                        self.assertTrue((chunk_logical[pairs.positions] % cp_size == rank).all())
                        self.assertEqual(
                            [layout.logical_page_of(int(p)) for p in pairs.src_pages],
                            chunk_logical[pairs.positions].tolist(),
                        )
                        self.assertEqual(pairs.dst_pages.tolist(), chunk_dst[pairs.positions].tolist())
                    self.assertTrue((seen == 1).all(), f"cp {cp_size} trial {trial}: {seen}")

    def test_rank_owning_nothing_of_a_chunk_pairs_nothing(self):
        """A chunk whose pages all live on rank 0 leaves the other ranks an empty (not failing) share."""
        for cp_size in (2, 4, 8):
            logical = np.array([cp_size * k for k in (1, 3, 4)])
            dst = np.array([7, 8, 9])
            for rank in range(cp_size):
                pairs = owned_page_pairs(CpSharedKVLayout(cp_size, rank, PAGE), logical, dst)
                self.assertEqual(len(pairs), 3 if rank == 0 else 0)
            empty = owned_page_pairs(CpSharedKVLayout(cp_size, 1, PAGE), [], [])
            self.assertEqual((len(empty), empty.src_pages.dtype), (0, np.int32))

    def test_physical_runs_stay_contiguous(self):
        """Consecutive logical pages of one request become consecutive physical pages on each rank,
        so the stock transfer still merges them into one block per run."""
        cp_size = 4
        logical = np.arange(8, 8 + 16)
        for rank in range(cp_size):
            pairs = owned_page_pairs(CpSharedKVLayout(cp_size, rank, PAGE), logical, logical + 100)
            self.assertTrue((np.diff(pairs.src_pages) == 1).all())

    def test_misaligned_lists_are_refused(self):
        layout = CpSharedKVLayout(2, 0, PAGE)
        with self.assertRaises(ValueError):
            owned_page_pairs(layout, [2, 3, 4], [10, 11])
        with self.assertRaises(ValueError):
            owned_page_pairs(layout, [-2], [10])


class TestIndexerStatePairing(CustomTestCase):
    def test_state_pages_of_whole_request_partition_by_owner(self):
        """Indexer-K state pages (positions 0..seq_len of the request, sent on the last chunk) pair like
        KV pages: owned positions only, physical source, same-position decode page."""
        rng = np.random.default_rng(99)
        for cp_size in (2, 4, 8):
            logical, dst = random_request(rng, cp_size, 23)
            prefill, decode, aligned = position_aligned(logical.tolist(), dst.tolist())
            self.assertTrue(aligned)
            covered = []
            for rank in range(cp_size):
                layout = CpSharedKVLayout(cp_size, rank, PAGE)
                pairs = owned_page_pairs(layout, prefill, decode)
                covered += pairs.positions.tolist()
                self.assertTrue((pairs.src_pages == logical[pairs.positions] // cp_size).all())
                self.assertTrue((pairs.dst_pages == dst[pairs.positions]).all())
            self.assertEqual(sorted(covered), list(range(23)))

    def test_unequal_state_lists_pair_their_common_prefix(self):
        """As stock sglang does for NSA state pages: the longer list is cut, and the cut is reported."""
        prefill, decode, aligned = position_aligned([4, 5, 6, 7], [10, 11, 12])
        self.assertFalse(aligned)
        self.assertEqual((prefill.tolist(), decode.tolist()), ([4, 5, 6], [10, 11, 12]))


if __name__ == "__main__":
    unittest.main()
