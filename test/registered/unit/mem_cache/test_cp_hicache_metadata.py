"""CpHiCacheNodeMetadata: the per-rank host-backup state a split or load-back must keep exact."""

import random
import unittest

import numpy as np
import torch

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.mem_cache.cp_hicache_metadata import CpHiCacheNodeMetadata

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

PAGE = 4


def _meta(owner_pages, rank, first_host_slot=100):
    """Metadata of a node whose k-th page is owned by owner_pages[k], seen from ``rank``."""
    owner_ranks = torch.tensor(owner_pages, dtype=torch.int8).repeat_interleave(PAGE)
    positions = torch.nonzero(owner_ranks == rank).flatten().to(torch.int64)
    host = torch.arange(len(positions), dtype=torch.int64) + first_host_slot
    return CpHiCacheNodeMetadata(len(owner_ranks), positions, host, owner_ranks)


class TestSplit(CustomTestCase):
    def test_page_aligned_split_keeps_slot_of_each_position(self):
        meta = _meta([0, 1, 0, 1, 0], rank=0)  # rank 0 holds pages 0, 2, 4
        parent, child = meta.split(2 * PAGE)
        self.assertEqual(parent.logical_len, 2 * PAGE)
        self.assertEqual(parent.owned_positions.tolist(), list(range(PAGE)))
        self.assertEqual(parent.host_indices.tolist(), list(range(100, 100 + PAGE)))
        self.assertEqual(child.logical_len, 3 * PAGE)
        # pages 2 and 4 of the node are pages 0 and 2 of the child
        self.assertEqual(
            child.owned_positions.tolist(), list(range(PAGE)) + list(range(2 * PAGE, 3 * PAGE))
        )
        # their host slots are the 2nd and 3rd owned pages, not the first split_len entries
        self.assertEqual(child.host_indices.tolist(), list(range(100 + PAGE, 100 + 3 * PAGE)))
        self.assertEqual(child.owner_ranks.tolist(), [0] * PAGE + [1] * PAGE + [0] * PAGE)

    def test_split_at_zero_and_at_end(self):
        meta = _meta([1, 0, 1], rank=1)
        parent, child = meta.split(0)
        self.assertEqual((parent.logical_len, parent.num_owned), (0, 0))
        self.assertTrue(torch.equal(child.owned_positions, meta.owned_positions))
        self.assertTrue(torch.equal(child.host_indices, meta.host_indices))
        parent, child = meta.split(meta.logical_len)
        self.assertTrue(torch.equal(parent.host_indices, meta.host_indices))
        self.assertEqual((child.logical_len, child.num_owned), (0, 0))

    def test_split_with_nothing_owned_on_this_rank(self):
        meta = _meta([0, 0, 1], rank=2)
        self.assertEqual(meta.num_owned, 0)
        parent, child = meta.split(PAGE)
        self.assertEqual((parent.logical_len, parent.num_owned), (PAGE, 0))
        self.assertEqual((child.logical_len, child.num_owned), (2 * PAGE, 0))
        self.assertEqual(child.owner_ranks.tolist(), [0] * PAGE + [1] * PAGE)

    def test_split_then_concat_round_trips(self):
        meta = _meta([2, 0, 1, 2, 2, 0], rank=2, first_host_slot=8)
        for split_len in range(0, meta.logical_len + 1, PAGE):
            parent, child = meta.split(split_len)
            self.assertEqual(parent.num_owned + child.num_owned, meta.num_owned)
            joined = CpHiCacheNodeMetadata.concat([parent, child])
            self.assertEqual(joined.logical_len, meta.logical_len)
            self.assertTrue(torch.equal(joined.owned_positions, meta.owned_positions))
            self.assertTrue(torch.equal(joined.host_indices, meta.host_indices))
            self.assertTrue(torch.equal(joined.owner_ranks, meta.owner_ranks))

    def test_invalid_split_lengths_raise(self):
        meta = _meta([0, 1], rank=0)
        for bad in (-1, meta.logical_len + 1):
            with self.assertRaises(ValueError):
                meta.split(bad)
        with self.assertRaises(TypeError):
            meta.split(1.0)


class TestSlotsByRank(CustomTestCase):
    """``slots_by_rank`` (kept from the write for host eviction) follows splits and concats exactly."""

    def _with_slots(self, owner_pages, rank, cp_size):
        meta = _meta(owner_pages, rank)
        slots = np.bincount(owner_pages, minlength=cp_size).astype(np.int64) * PAGE
        return CpHiCacheNodeMetadata(
            meta.logical_len, meta.owned_positions, meta.host_indices, meta.owner_ranks, slots
        )

    def _counted(self, meta, cp_size):
        return np.bincount(meta.owner_ranks.numpy(), minlength=cp_size).tolist()

    def test_split_and_concat_keep_the_counts_of_the_owners(self):
        rng = random.Random(5)
        for _ in range(200):
            cp = rng.randint(1, 8)
            owner_pages = [rng.randrange(cp) for _ in range(rng.randint(1, 9))]
            meta = self._with_slots(owner_pages, rng.randrange(cp), cp)
            split_len = PAGE * rng.randint(0, len(owner_pages))
            parent, child = meta.split(split_len)
            for part in (parent, child):
                self.assertEqual(part.slots_by_rank.tolist(), self._counted(part, cp))
                self.assertIs(part.host_slots_by_rank(cp), part.slots_by_rank)
            # A split of a split (match splits the upper half again) stays exact too.
            inner, _ = child.split(PAGE * rng.randint(0, child.logical_len // PAGE))
            self.assertEqual(inner.slots_by_rank.tolist(), self._counted(inner, cp))
            joined = CpHiCacheNodeMetadata.concat([parent, child])
            self.assertEqual(joined.slots_by_rank.tolist(), meta.slots_by_rank.tolist())

    def test_without_kept_slots_they_are_counted(self):
        meta = _meta([2, 0, 2], rank=0)
        self.assertIsNone(meta.slots_by_rank)
        self.assertEqual(meta.host_slots_by_rank(4).tolist(), [PAGE, 0, 2 * PAGE, 0])
        parent, child = meta.split(PAGE)
        self.assertIsNone(parent.slots_by_rank)
        self.assertIsNone(child.slots_by_rank)
        kept = self._with_slots([2, 0, 2], 0, 4)
        self.assertIsNone(CpHiCacheNodeMetadata.concat([kept, meta]).slots_by_rank)


class TestValidation(CustomTestCase):
    def _kwargs(self, **override):
        kwargs = dict(
            logical_len=8,
            owned_positions=torch.tensor([0, 1, 2, 3], dtype=torch.int64),
            host_indices=torch.tensor([4, 5, 6, 7], dtype=torch.int64),
            owner_ranks=torch.zeros(8, dtype=torch.int8),
        )
        kwargs.update(override)
        return kwargs

    def test_valid_metadata_builds(self):
        self.assertEqual(CpHiCacheNodeMetadata(**self._kwargs()).num_owned, 4)

    def test_every_listed_invariant_is_enforced(self):
        bad_cases = {
            "length mismatch": dict(host_indices=torch.tensor([4, 5, 6], dtype=torch.int64)),
            "unsorted": dict(owned_positions=torch.tensor([0, 2, 1, 3], dtype=torch.int64)),
            "duplicate": dict(owned_positions=torch.tensor([0, 1, 1, 3], dtype=torch.int64)),
            "out of range": dict(owned_positions=torch.tensor([5, 6, 7, 8], dtype=torch.int64)),
            "negative": dict(owned_positions=torch.tensor([-1, 0, 1, 2], dtype=torch.int64)),
            "int32 positions": dict(owned_positions=torch.tensor([0, 1, 2, 3], dtype=torch.int32)),
            "2-D host": dict(host_indices=torch.tensor([[4, 5, 6, 7]], dtype=torch.int64)),
            "owners too short": dict(owner_ranks=torch.zeros(7, dtype=torch.int8)),
            "negative owner": dict(owner_ranks=-torch.ones(8, dtype=torch.int8)),
            "negative length": dict(logical_len=-8),
            "slots miscounted": dict(slots_by_rank=np.array([4], dtype=np.int64)),
            "slots int32": dict(slots_by_rank=np.array([8], dtype=np.int32)),
            "slots too short": dict(owner_ranks=torch.tensor([0] * 4 + [1] * 4, dtype=torch.int8),
                                    slots_by_rank=np.array([4], dtype=np.int64)),
        }
        for name, override in bad_cases.items():
            with self.subTest(name), self.assertRaises(ValueError):
                CpHiCacheNodeMetadata(**self._kwargs(**override))
        with self.assertRaises(TypeError):
            CpHiCacheNodeMetadata(**self._kwargs(host_indices=[4, 5, 6, 7]))

    def test_non_cpu_tensors_are_refused(self):
        # "meta" stands in for a device tensor: anything not on the CPU must be refused.
        on_meta = torch.empty(4, dtype=torch.int64, device="meta")
        for field in ("owned_positions", "host_indices"):
            with self.subTest(field), self.assertRaises(ValueError):
                CpHiCacheNodeMetadata(**self._kwargs(**{field: on_meta}))


if __name__ == "__main__":
    unittest.main()
