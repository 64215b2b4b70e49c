"""A shared-KV prefill CP group hands requests to a stock decode instance through the real mooncake
transfer path (stock sender bookkeeping, transfer worker, aux and status; our subclasses) over a
byte-copying fake engine. The decode pool it assembles must equal, byte for byte, the one stock
sglang assembles from a replicated (non-sharded) prefill pool, and the decode side must hear from
every CP rank, including ranks that own nothing of the request."""

import unittest
from unittest import mock

import numpy as np
import torch

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.disaggregation.mooncake import conn as shared_kv_conn
from sglang_cp_shared_kv.disaggregation.page_pairing import OwnedPagePairs
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv_testing import fake_pd_transfer as pd

register_cpu_ci(est_time=40, suite="stage-a-test-cpu")

PAGE = pd.PAGE
PHYSICAL_PAGES = 6  # per prefill rank
DECODE_PAGES = 60
ROOM = 4242
FIRST_TOKEN = 777


class Scenario:
    """One request: random logical pages (as the shared-KV allocator could hand out), random decode
    pages, a random chunking, and a replicated prefill pool of random bytes."""

    def __init__(self, cp_size, seed, tokens=None, draft=False):
        rng = np.random.default_rng(seed)
        self.cp_size = cp_size
        self.generator = torch.Generator().manual_seed(seed)
        capacity = cp_size * PHYSICAL_PAGES
        self.tokens = tokens or int(rng.integers(1, capacity * PAGE // 2))
        pages = -(-self.tokens // PAGE)
        allocatable = np.arange(cp_size, cp_size * (PHYSICAL_PAGES + 1))  # not the dummy pages
        self.logical_pages = rng.choice(allocatable, pages, replace=False)
        self.dst_pages = rng.choice(np.arange(1, DECODE_PAGES + 1), pages, replace=False)
        locs = np.concatenate([np.arange(q * PAGE, (q + 1) * PAGE) for q in self.logical_pages])
        self.logical_locs = torch.as_tensor(locs[: self.tokens])
        cuts = rng.integers(1, self.tokens, size=rng.integers(0, 5)) if self.tokens > 1 else []
        self.chunk_ends = sorted(set(int(c) for c in cuts)) + [self.tokens]
        self.replicated = pd.build_nsa_pool(cp_size * (PHYSICAL_PAGES + 1))
        pd.fill_random(self.replicated, self.generator)
        # The MTP draft's one-layer pool (KV and indexer K), indexed by the same logical pages.
        self.replicated_draft = None
        if draft:
            self.replicated_draft = pd.build_nsa_pool(cp_size * (PHYSICAL_PAGES + 1), layer_num=1)
            pd.fill_random(self.replicated_draft, self.generator)

    def run(self, shared_kv, all_cp_ranks=True, decode=None, draft_owner_shift=0):
        """Every CP rank prefills the request and sends; returns the decode instance and the ranks.

        ``draft_owner_shift`` (a planted bug): rank ``r``'s draft shard holds rank ``r + shift``'s pages."""
        draft = self.replicated_draft is not None
        decode = decode or pd.DecodeInstance.build(DECODE_PAGES, draft=draft)
        ranks = []
        for rank in range(self.cp_size):
            draft_pool = self.replicated_draft
            if shared_kv:
                layout = CpSharedKVLayout(self.cp_size, rank, PAGE)
                pool = pd.shard_of(self.replicated, layout, PHYSICAL_PAGES, self.generator)
                if draft:  # sharded by the same layout as the target's
                    draft_layout = CpSharedKVLayout(
                        self.cp_size, (rank + draft_owner_shift) % self.cp_size, PAGE
                    )
                    draft_pool = pd.shard_of(
                        self.replicated_draft, draft_layout, PHYSICAL_PAGES, self.generator
                    )
            else:
                pool = self.replicated  # stock CP prefill: every rank holds the whole KV
            prefill = pd.build_prefill_rank(
                cp_size=self.cp_size,
                cp_rank=rank,
                pool=pool,
                decode=decode,
                shared_kv=shared_kv,
                all_cp_ranks=all_cp_ranks,
                draft_pool=draft_pool,
            )
            pd.connect_decode(prefill, decode, ROOM, self.dst_pages, aux_index=1)
            pd.send_request(
                prefill,
                room=ROOM,
                logical_locs=self.logical_locs,
                chunk_ends=self.chunk_ends,
                first_output_id=FIRST_TOKEN,
                aux_index=1,
            )
            ranks.append(prefill)
        return decode, ranks

    def stock_reference(self):
        """What stock sglang 0.5.11 delivers from replicated KV (CP rank 0 sends, the others are dummy)."""
        decode, _ = self.run(shared_kv=False, all_cp_ranks=False)
        return decode


def pools_equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(pd.pool_page_views(a), pd.pool_page_views(b)))


class TestSharedKVPDTransfer(CustomTestCase):
    def test_decode_pool_matches_stock_transfer_from_replicated_pool(self):
        """cp 2/4/8, random pages and chunkings: KV rows and indexer-K pages the decode instance holds
        after the shared-KV sends equal, byte for byte, what stock sglang sends from a replicated pool."""
        for cp_size in (2, 4, 8):
            for seed in range(3):
                scenario = Scenario(cp_size, seed=100 * cp_size + seed)
                reference = scenario.stock_reference()
                decode, ranks = scenario.run(shared_kv=True)
                msg = f"cp {cp_size} seed {seed} chunks {scenario.chunk_ends}"
                for rank in ranks:
                    self.assertEqual(rank.engine.errors, [], msg)
                self.assertTrue(pools_equal(decode.pool, reference.pool), msg)
                # and the stock reference itself is the replicated pages at the decode's page ids
                expected = pd.build_nsa_pool(DECODE_PAGES)
                pd.copy_pages(scenario.replicated, scenario.logical_pages, expected, scenario.dst_pages)
                self.assertTrue(pools_equal(reference.pool, expected), msg)
                self.assertEqual(int(decode.metadata.output_ids[1][0]), FIRST_TOKEN, msg)

    def test_every_cp_rank_reports_once_even_owning_nothing(self):
        """A one-page request lives on one rank; the others own nothing of it, send no KV, and still
        send aux and their Success, so the decode instance gets the cp_size arrivals it waits for."""
        for cp_size in (2, 4, 8):
            scenario = Scenario(cp_size, seed=7, tokens=40)
            owner = int(scenario.logical_pages[0]) % cp_size
            decode, ranks = scenario.run(shared_kv=True)
            expected = pd.decode_expected_responses(cp_size, all_cp_ranks=True)
            self.assertEqual(expected, cp_size)
            self.assertEqual(decode.senders_done(ROOM), set(range(cp_size)))
            self.assertEqual(len(decode.statuses), cp_size)  # one status per rank, none twice
            self.assertFalse(decode.failed(ROOM))
            aux_bytes = sum(ranks[0].manager.kv_args.aux_item_lens)  # one metadata slot
            for rank_id, prefill in enumerate(ranks):
                sent = sum(n for _, _, n in prefill.engine.copies)
                if rank_id == owner:
                    self.assertGreater(sent, aux_bytes)
                else:
                    self.assertEqual(sent, aux_bytes, f"cp {cp_size}: rank {rank_id} sent KV it does not own")
            for prefill in ranks:
                self.assertEqual(prefill.manager.check_status(ROOM), KVPoll.Success)

    def test_stock_decode_waits_for_one_sender_per_cp_rank(self):
        """The decode-side count this design relies on (sglang 0.5.11 _resolve_rank_mapping): with
        SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER every prefill CP rank, without it rank 0 only."""
        for cp_size in (2, 4, 8):
            self.assertEqual(pd.decode_expected_responses(cp_size, all_cp_ranks=True), cp_size)
            self.assertEqual(pd.decode_expected_responses(cp_size, all_cp_ranks=False), 1)

    def test_a_pairing_off_by_one_page_is_caught(self):
        """The byte comparison is sharp: pairing each owned page with the next position's decode page
        changes the assembled pool."""
        real = shared_kv_conn.owned_page_pairs

        def off_by_one(layout, logical_pages, dst_pages):
            pairs = real(layout, logical_pages, dst_pages)
            dst = np.asarray(dst_pages)
            shifted = dst[np.minimum(pairs.positions + 1, len(dst) - 1)].astype(np.int32)
            return OwnedPagePairs(pairs.positions, pairs.src_pages, shifted)

        scenario = Scenario(4, seed=5, tokens=9 * PAGE)
        reference = scenario.stock_reference()
        with mock.patch.object(shared_kv_conn, "owned_page_pairs", off_by_one):
            decode, _ = scenario.run(shared_kv=True)
        self.assertFalse(pools_equal(decode.pool, reference.pool))

    def test_a_rank_sending_pages_it_does_not_own_is_caught(self):
        """Reading another rank's logical page from this rank's physical pool delivers wrong bytes."""

        def wrong_owner(layout, logical_pages, dst_pages):
            logical = np.asarray(logical_pages, dtype=np.int64)
            positions = np.flatnonzero((logical + 1) % layout.cp_size == layout.cp_rank)
            return OwnedPagePairs(
                positions,
                (logical[positions] // layout.cp_size).astype(np.int32),
                np.asarray(dst_pages)[positions].astype(np.int32),
            )

        scenario = Scenario(2, seed=6, tokens=6 * PAGE)
        reference = scenario.stock_reference()
        with mock.patch.object(shared_kv_conn, "owned_page_pairs", wrong_owner):
            decode, _ = scenario.run(shared_kv=True)
        self.assertFalse(pools_equal(decode.pool, reference.pool))

    def test_the_pd_smokes_planted_bug_changes_the_decode_pool(self):
        """``pd-send-wrong-page`` (scripts/smoke_plugin, planted in the GPU PD smoke to show its decode
        pool audit catches a wrong page) does move pages on the real send path."""
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "scripts" / "smoke_plugin"))
        from cp_shared_kv_smoke_hooks import planted_bugs

        manager_class = shared_kv_conn.CpSharedKVMooncakeKVManager
        real = manager_class.send_kvcache

        def planted(manager, *args):
            return planted_bugs.send_one_page_off(real, manager, *args)

        scenario = Scenario(2, seed=8, tokens=12 * PAGE)
        reference = scenario.stock_reference()
        decode, _ = scenario.run(shared_kv=True)
        self.assertTrue(pools_equal(decode.pool, reference.pool))
        with mock.patch.object(manager_class, "send_kvcache", planted):
            decode, _ = scenario.run(shared_kv=True)
        self.assertFalse(pools_equal(decode.pool, reference.pool))

    def test_hisparse_decode_fails_the_request_cleanly(self):
        """A decode server with --enable-hisparse asks for token-granular transfer: refused per request,
        reported Failed to the decode side, no bytes of KV sent."""
        scenario = Scenario(2, seed=8, tokens=3 * PAGE)
        decode = pd.DecodeInstance.build(DECODE_PAGES)
        original = decode.register_info

        def hisparse_info():
            info = original()
            info.enable_hisparse = True
            return info

        decode.register_info = hisparse_info
        scenario.run(shared_kv=True, decode=decode)
        self.assertTrue(decode.failed(ROOM))
        self.assertTrue(pools_equal(decode.pool, pd.build_nsa_pool(DECODE_PAGES)))


class TestDraftPoolTransfer(CustomTestCase):
    """PD prefill with MTP: each CP rank sends the draft KV and draft indexer-K pages it owns (the
    draft pool sharded by the target's layout), by the target's page pairs, and a stock decode
    instance with MTP on ends up with the complete draft pool, exactly what stock sends from
    replicated pools. Planted: every rank's draft shard holding the next rank's pages (caught)."""

    def _expected(self, scenario):
        target = pd.build_nsa_pool(DECODE_PAGES)
        pd.copy_pages(scenario.replicated, scenario.logical_pages, target, scenario.dst_pages)
        draft = pd.build_nsa_pool(DECODE_PAGES, layer_num=1)
        pd.copy_pages(scenario.replicated_draft, scenario.logical_pages, draft, scenario.dst_pages)
        return target, draft

    def test_decode_receives_the_complete_draft_pool(self):
        for cp_size in (2, 8):
            for seed in range(2):
                scenario = Scenario(cp_size, seed=700 + 10 * cp_size + seed, draft=True)
                reference = scenario.stock_reference()
                decode, ranks = scenario.run(shared_kv=True)
                msg = f"cp {cp_size} seed {seed} chunks {scenario.chunk_ends}"
                for rank in ranks:
                    self.assertEqual(rank.engine.errors, [], msg)
                target, draft = self._expected(scenario)
                self.assertTrue(pools_equal(decode.pool, target), msg)
                self.assertTrue(pools_equal(decode.draft_pool, draft), msg)
                self.assertTrue(pools_equal(reference.draft_pool, draft), msg)  # stock, replicated
                self.assertEqual(decode.senders_done(ROOM), set(range(cp_size)), msg)

    def test_draft_pages_from_the_wrong_owner_are_caught(self):
        scenario = Scenario(2, seed=7, tokens=6 * PAGE, draft=True)
        decode, _ = scenario.run(shared_kv=True, draft_owner_shift=1)
        target, draft = self._expected(scenario)
        self.assertTrue(pools_equal(decode.pool, target))  # the target is unaffected
        self.assertFalse(pools_equal(decode.draft_pool, draft))


class TestOneBadRequestFailsAlone(CustomTestCase):
    """A request whose indexer-K pages cannot be paired (``owned_page_pairs`` raises ValueError in
    ``maybe_send_extra``) fails alone, as stock reports a failed transfer: Failed on the prefill rank
    with a reason, Failed to the decode side, no metadata; the transfer thread lives on, the decode
    session stays usable, and the next request arrives whole.

    Failed before the fix: the ValueError escaped ``maybe_send_extra`` and the stock transfer worker
    turned it into "Transfer thread failed ... Prefill instance ... is dead" (the thread's end)."""

    CP_SIZE = 2
    BAD_ROOM, GOOD_ROOM = 1001, 1002
    BAD_AUX, GOOD_AUX = 1, 2

    def test_a_bad_indexer_pairing_fails_its_request_alone(self):
        generator = torch.Generator().manual_seed(3)
        replicated = pd.build_nsa_pool(self.CP_SIZE * (PHYSICAL_PAGES + 1))
        pd.fill_random(replicated, generator)
        requests = {  # room: (logical pages, decode pages, aux slot)
            self.BAD_ROOM: (np.array([2, 3, 4]), np.array([1, 2, 3]), self.BAD_AUX),
            self.GOOD_ROOM: (np.array([5, 6, 7, 8]), np.array([10, 11, 12, 13]), self.GOOD_AUX),
        }
        decode = pd.DecodeInstance.build(DECODE_PAGES)
        real_position_aligned = shared_kv_conn.position_aligned
        corrupting = {"on": False}

        def negative_first_page(prefill_pages, dst_pages):
            prefill, dst, aligned = real_position_aligned(prefill_pages, dst_pages)
            if corrupting["on"]:
                prefill = np.array(prefill, copy=True)
                prefill[0] = -1  # owned_page_pairs: "negative logical page"
            return prefill, dst, aligned

        ranks = []
        for rank in range(self.CP_SIZE):
            layout = CpSharedKVLayout(self.CP_SIZE, rank, PAGE)
            pool = pd.shard_of(replicated, layout, PHYSICAL_PAGES, generator)
            prefill = pd.build_prefill_rank(cp_size=self.CP_SIZE, cp_rank=rank, pool=pool, decode=decode)
            for room, (_, dst_pages, aux) in requests.items():
                pd.connect_decode(prefill, decode, room, dst_pages, aux_index=aux)
            ranks.append(prefill)

        with mock.patch.object(shared_kv_conn, "position_aligned", negative_first_page):
            for room, (logical_pages, _, aux) in requests.items():
                corrupting["on"] = room == self.BAD_ROOM
                locs = torch.as_tensor(np.concatenate([np.arange(q * PAGE, (q + 1) * PAGE) for q in logical_pages]))
                for prefill in ranks:
                    try:
                        pd.send_request(prefill, room=room, logical_locs=locs, chunk_ends=[len(locs)],
                                        first_output_id=FIRST_TOKEN + room, aux_index=aux)  # fmt: skip
                    except RuntimeError as e:
                        self.fail(f"the transfer thread died on room {room}: {e}")

        for prefill in ranks:
            manager = prefill.manager
            self.assertEqual(manager.check_status(self.BAD_ROOM), KVPoll.Failed)
            self.assertIn("negative logical page", manager.failure_records[self.BAD_ROOM])
            self.assertEqual(manager.check_status(self.GOOD_ROOM), KVPoll.Success)
            self.assertNotIn(pd.DECODE_SESSION, manager.failed_sessions)
            self.assertEqual(prefill.engine.errors, [])
        self.assertTrue(decode.failed(self.BAD_ROOM))
        self.assertEqual(decode.senders_done(self.BAD_ROOM), set())
        self.assertFalse(decode.failed(self.GOOD_ROOM))
        self.assertEqual(decode.senders_done(self.GOOD_ROOM), set(range(self.CP_SIZE)))
        self.assertNotEqual(int(decode.metadata.output_ids[self.BAD_AUX][0]), FIRST_TOKEN + self.BAD_ROOM)
        self.assertEqual(int(decode.metadata.output_ids[self.GOOD_AUX][0]), FIRST_TOKEN + self.GOOD_ROOM)
        logical, dst, _ = requests[self.GOOD_ROOM]
        expected = pd.build_nsa_pool(DECODE_PAGES)
        pd.copy_pages(replicated, logical, expected, dst)
        index = torch.as_tensor(dst)
        for got, want in zip(pd.pool_page_views(decode.pool), pd.pool_page_views(expected)):
            self.assertTrue(torch.equal(got[index], want[index]))


class TestTransferSetup(CustomTestCase):
    def test_flag_off_means_stock_classes(self):
        """Without the flag on ServerArgs the layout is None: both subclasses behave as stock."""
        from types import SimpleNamespace

        from sglang.srt.disaggregation.utils import DisaggregationMode

        off = SimpleNamespace(enable_nsa_prefill_cp_shared_kv=False)
        allocators = CpSharedKVLayout(4, 1, PAGE)
        self.assertIsNone(
            shared_kv_conn.cp_shared_kv_transfer_layout(off, DisaggregationMode.PREFILL, allocators)
        )
        on = SimpleNamespace(enable_nsa_prefill_cp_shared_kv=True)
        layout = shared_kv_conn.cp_shared_kv_transfer_layout(on, DisaggregationMode.PREFILL, allocators)
        self.assertIs(layout, allocators)  # the allocator's object, not a rebuilt equal one
        with self.assertRaisesRegex(ValueError, "prefill server"):
            shared_kv_conn.cp_shared_kv_transfer_layout(on, DisaggregationMode.DECODE, allocators)
        with self.assertRaisesRegex(ValueError, "no shared-KV allocator"):
            shared_kv_conn.cp_shared_kv_transfer_layout(on, DisaggregationMode.PREFILL, None)

    def test_manager_refuses_without_all_cp_ranks_transfer(self):
        """Without SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER only rank 0 would send: refused."""
        decode = pd.DecodeInstance.build(4)
        with self.assertRaisesRegex(ValueError, "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"):
            pd.build_prefill_rank(
                cp_size=2, cp_rank=0, pool=pd.build_nsa_pool(2), decode=decode, all_cp_ranks=False
            )


if __name__ == "__main__":
    unittest.main()
