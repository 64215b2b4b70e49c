"""CpHybridCacheController: logical locs in, exactly this rank's physical shards moved (KV and indexer).

Real layout, real NSA device pool, real host pools (CPU); data is checked byte for byte.
"""

import unittest

import numpy as np
import torch

from sglang_cp_shared_kv_testing.cp_hicache_stack import (
    build_cp_hicache_stack,
    clear_device_pool,
    count_owned_pattern_mismatches,
    write_owned_pattern,
)
from sglang_cp_shared_kv_testing.multi_rank import single_process_group
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=25, suite="stage-a-test-cpu")

PAGE = 64


def _locs_of_pages(pages):
    """Logical locs of the given logical pages, in order (a node's value)."""
    pages = torch.tensor(pages, dtype=torch.int64)
    return (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)


def _reserve_host_slots(controller, locs):
    """A write's plan with its host slots taken (``host_indices`` stays ``None`` if the pool is short),
    as the cache takes them once its ledger says the write fits everywhere."""
    reservation = controller.plan_host_write(locs)
    controller.take_host_slots(reservation)
    return reservation


class _CallCounter:
    """Counts calls of one host pool method (shadowed on the instance), to prove no transfer runs."""

    def __init__(self, test, obj, name):
        self.calls = 0
        original = getattr(obj, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        setattr(obj, name, counted)
        test.addCleanup(delattr, obj, name)


class TestCpHybridCacheController(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        group = single_process_group()
        # Rank 1's view of a 2-rank layout: it owns the odd logical pages.
        cls.stack = build_cp_hicache_stack(cp_size=2, cp_rank=1, group=group, physical_pages=8)

    def setUp(self):
        super().setUp()
        self.stack.cache.reset()
        self.stack.allocator.clear()
        clear_device_pool(self.stack)
        self.controller = self.stack.controller
        self.host = self.controller.mem_pool_host
        self.kv_host = self.host.anchor_entry.host_pool
        self.index_host = next(e.host_pool for e in self.host.entries if e.share_indices_with_anchor)
        self.kv_host.kv_buffer.zero_()
        self.index_host.index_k_with_scale_buffer.zero_()

    def _host_kv_rows(self, slots, layer):
        rows = self.kv_host.kv_buffer[layer]
        return rows.view(torch.uint8).view(rows.shape[0], -1)[slots]

    def _device_kv_rows(self, rows, layer):
        buffer = self.stack.kv_pool.kv_buffer[layer]
        return buffer.view(torch.uint8).view(buffer.shape[0], -1)[rows]

    def test_write_allocates_and_moves_only_owned_rows(self):
        locs = _locs_of_pages([2, 3, 4, 5, 7])  # rank 1 owns pages 3, 5, 7
        write_owned_pattern(self.stack, locs, seed=1)
        used_before = self.controller.physical_host_slots_used()

        reservation = _reserve_host_slots(self.controller, locs)
        self.assertTrue(reservation.ok)
        self.assertEqual(reservation.required_host_slots, 3 * PAGE)
        self.assertEqual(self.controller.physical_host_slots_used() - used_before, 3 * PAGE)
        owned = self.stack.layout.owned_by_this_rank(locs)
        self.assertEqual(reservation.owned_positions.tolist(), torch.nonzero(owned).flatten().tolist())
        self.assertEqual(reservation.owned_positions.dtype, torch.int64)
        self.assertTrue(
            torch.equal(
                reservation.physical_device_indices,
                self.stack.layout.physical_locs_or_dummy(locs[owned]),
            )
        )
        self.assertEqual(reservation.owner_ranks.tolist(), (locs // PAGE % 2).tolist())

        metadata = self.controller.write_reserved(reservation, node_id=7)
        self.assertEqual(len(self.controller.ack_write_queue), 1)
        self.assertEqual(self.controller.ack_write_queue[0].node_ids, [7])
        self.assertEqual(metadata.logical_len, len(locs))
        self.assertEqual(metadata.host_indices.device.type, "cpu")

        physical = reservation.physical_device_indices
        for layer in range(self.stack.kv_pool.layer_num):
            # KV: host slot i holds owned position i's device row.
            self.assertTrue(
                torch.equal(
                    self._host_kv_rows(metadata.host_indices, layer),
                    self._device_kv_rows(physical, layer),
                )
            )
            # Indexer: the same rows, page by page.
            host_pages = metadata.host_indices[::PAGE] // PAGE
            device_pages = physical[::PAGE] // PAGE
            self.assertTrue(
                torch.equal(
                    self.index_host.index_k_with_scale_buffer[layer][host_pages],
                    self.stack.kv_pool.index_k_with_scale_buffer[layer][device_pages],
                )
            )
            # Nothing else reached the host pools.
            untouched = torch.ones(self.kv_host.size, dtype=torch.bool)
            untouched[metadata.host_indices] = False
            self.assertEqual(int(self._host_kv_rows(untouched, layer).count_nonzero()), 0)

    def test_zero_owned_write_takes_no_slot_launches_nothing_and_acks_once(self):
        locs = _locs_of_pages([2, 4])  # both on rank 0
        backups = _CallCounter(self, self.host, "backup_from_device_all_layer")
        used_before = self.controller.physical_host_slots_used()
        reservation = _reserve_host_slots(self.controller, locs)
        self.assertTrue(reservation.ok)
        self.assertEqual(reservation.required_host_slots, 0)
        metadata = self.controller.write_reserved(reservation, node_id=11)
        self.assertEqual((metadata.logical_len, metadata.num_owned), (len(locs), 0))
        self.assertEqual(self.controller.physical_host_slots_used(), used_before)
        self.assertEqual(backups.calls, 0)
        self.assertEqual([ack.node_ids for ack in self.controller.ack_write_queue], [[11]])
        self.assertTrue(self.controller.ack_write_queue[0].finish_event.query())

    def test_host_shortage_exposes_required_slots_and_takes_nothing(self):
        locs = _locs_of_pages([3, 5])
        hoard = self.host.alloc(self.host.available_size() - PAGE)  # leave one page
        used_before = self.controller.physical_host_slots_used()
        reservation = _reserve_host_slots(self.controller, locs)
        self.assertFalse(reservation.ok)
        self.assertEqual(reservation.required_host_slots, 2 * PAGE)
        self.assertEqual(self.controller.physical_host_slots_used(), used_before)
        self.host.free(hoard)

    def test_load_places_owned_positions_on_new_locs_of_the_same_owner(self):
        locs = _locs_of_pages([3, 4, 5, 6])
        write_owned_pattern(self.stack, locs, seed=2)
        metadata = self.controller.write_reserved(
            _reserve_host_slots(self.controller, locs), node_id=1
        )
        clear_device_pool(self.stack)
        # Occupy pages so that the new locs differ from the old ones.
        self.stack.allocator.alloc(3 * PAGE)

        new_locs = self.controller.alloc_logical_locs(metadata)
        self.assertEqual(len(new_locs), len(locs))
        self.assertFalse(torch.equal(new_locs, locs))
        owner_of_page = self.stack.layout.owner_of_page
        self.assertEqual(
            owner_of_page(new_locs // PAGE).tolist(), owner_of_page(locs // PAGE).tolist()
        )
        self.controller.load_reserved(metadata, new_locs, node_id=1)
        self.assertGreaterEqual(self.controller.start_loading(), 0)
        self.assertEqual(count_owned_pattern_mismatches(self.stack, new_locs, seed=2), 0)
        self.assertEqual([ack.node_ids for ack in self.controller.ack_load_queue], [[1]])

    def test_zero_owned_load_returns_full_locs_and_one_producer_event(self):
        locs = _locs_of_pages([2, 4, 6])
        metadata = self.controller.write_reserved(
            _reserve_host_slots(self.controller, locs), node_id=3
        )
        self.assertEqual(metadata.num_owned, 0)
        kv_loads = _CallCounter(self, self.kv_host, "load_to_device_per_layer")
        index_loads = _CallCounter(self, self.index_host, "load_to_device_per_layer")
        new_locs = self.controller.alloc_logical_locs(metadata)
        self.assertEqual(len(new_locs), len(locs))
        self.controller.load_reserved(metadata, new_locs, node_id=3)
        self.assertGreaterEqual(self.controller.start_loading(), 0)
        self.assertEqual((kv_loads.calls, index_loads.calls), (0, 0))
        self.assertEqual([ack.node_ids for ack in self.controller.ack_load_queue], [[3]])

    def test_load_onto_another_ranks_page_is_refused(self):
        locs = _locs_of_pages([3, 4])
        metadata = self.controller.write_reserved(
            _reserve_host_slots(self.controller, locs), node_id=5
        )
        with self.assertRaises(ValueError):
            # Page 3's bytes are on rank 1's host; page 8 lives on rank 0.
            self.controller.load_reserved(metadata, _locs_of_pages([8, 4]), node_id=5)

    def test_locs_that_are_not_whole_aligned_pages_are_refused_before_any_slot_is_taken(self):
        # Ownership is decided on page heads only, so a head off a page boundary must be loud.
        used_before = self.controller.physical_host_slots_used()
        for locs in (_locs_of_pages([3, 5]) + 1, _locs_of_pages([3])[: PAGE // 2]):
            with self.assertRaisesRegex(ValueError, "whole pages"):
                _reserve_host_slots(self.controller, locs)
        self.assertEqual(self.controller.physical_host_slots_used(), used_before)
        metadata = self.controller.write_reserved(
            _reserve_host_slots(self.controller, _locs_of_pages([3, 4])), node_id=6
        )
        with self.assertRaisesRegex(ValueError, "whole pages"):
            self.controller.load_reserved(metadata, _locs_of_pages([5, 4]) + 1, node_id=6)

    def test_host_slots_off_a_page_boundary_are_refused(self):
        # Host slots of a node are whole host pages (the indexer moves them page by page). A host
        # free list that lost its alignment (slots freed behind the cache's back) must be loud.
        host = self.stack.kv_host
        host.free_slots = torch.cat((host.free_slots[PAGE // 2 :], host.free_slots[: PAGE // 2]))
        with self.assertRaisesRegex(ValueError, "host slots are not whole pages"):
            _reserve_host_slots(self.controller, _locs_of_pages([3]))

    def test_plan_matches_a_per_loc_reference_when_all_some_or_none_owned(self):
        # plan_host_write works on page heads and takes a shortcut when every page is this rank's;
        # every field must equal what the per-loc masks of the layout give.
        layout, rng = self.stack.layout, np.random.default_rng(9)
        for case in range(60):
            owned, other = 2 * rng.permutation(np.arange(1, 9)) + 1, 2 * rng.permutation(np.arange(1, 9))
            kind = case % 3
            pages = {0: owned[:3], 1: other[:3]}.get(kind, np.concatenate([owned[:2], other[:2]]))
            locs = _locs_of_pages(rng.permutation(pages).tolist())
            plan = self.controller.plan_host_write(locs)
            mask = layout.owned_by_this_rank(locs)
            self.assertTrue(torch.equal(plan.owned_positions, torch.nonzero(mask).flatten()), case)
            self.assertEqual(plan.owned_positions.dtype, torch.int64)
            self.assertTrue(
                torch.equal(plan.physical_device_indices, layout.physical_locs_or_dummy(locs[mask]))
            )
            owners = layout.owner_of_page(locs // PAGE).to(torch.int8)
            self.assertTrue(torch.equal(plan.owner_ranks, owners))
            self.assertEqual(plan.page_owners.tolist(), owners[::PAGE].tolist())

    def test_stock_physical_entry_points_refuse_logical_locs(self):
        with self.assertRaises(RuntimeError):
            self.controller.write(device_indices=_locs_of_pages([3]), node_id=1)
        with self.assertRaises(RuntimeError):
            self.controller.load(host_indices=torch.arange(PAGE), node_id=1)


if __name__ == "__main__":
    unittest.main()
