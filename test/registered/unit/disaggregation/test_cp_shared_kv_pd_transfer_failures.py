"""Any failure of any part of a request's transfer from a shared-KV prefill CP group fails that
request on every prefill rank and on decode, and only that request: a later request to the same
decode instance arrives whole.

Real stock transfer worker, sender bookkeeping, ``send_kv_chunk`` and status logic over CPU pools
(``sglang_cp_shared_kv_testing/fake_pd_transfer.py``); faults are injected on ONE prefill rank (the engine refusing calls
into one part of the decode's buffers, as mooncake does on a full TCP queue, or pages that cannot be
paired). Before the fix (``disaggregation/mooncake/request_failures.py``), each case failed:

* KV, draft KV and KV pairing: the stock worker marked the decode session dead, so the next,
  well-formed request failed with "Decode instance could be dead";
* indexer K and the draft's indexer K: the stock worker ignored ``maybe_send_extra``'s result and every
  rank reported Success with stale indexer pages on decode.
"""

import unittest
from unittest import mock

import numpy as np
import torch

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.disaggregation.mooncake import conn as shared_kv_conn
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv_testing import fake_pd_transfer as pd

register_cpu_ci(est_time=15, suite="stage-a-test-cpu")

PAGE = pd.PAGE
CP_SIZE = 2
PHYSICAL_PAGES = 6
DECODE_PAGES = 24
FAULTY_RANK = 1
BAD_ROOM, GOOD_ROOM = 501, 502
REQUESTS = {  # room: (logical pages, decode pages, aux slot, chunk ends in tokens)
    BAD_ROOM: (np.array([2, 3, 4, 5]), np.array([1, 2, 3, 4]), 1, [2 * PAGE, 4 * PAGE]),
    GOOD_ROOM: (np.array([6, 7, 8, 9]), np.array([10, 11, 12, 13]), 2, [3 * PAGE - 5, 4 * PAGE]),
}
FIRST_TOKEN = 900


class TransferFaultCase:
    """Two requests through a cp-2 prefill group with MTP pools; ``inject`` arms one fault on
    ``FAULTY_RANK`` while the bad room is sent."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)
        self.replicated = pd.build_nsa_pool(CP_SIZE * (PHYSICAL_PAGES + 1))
        self.replicated_draft = pd.build_nsa_pool(CP_SIZE * (PHYSICAL_PAGES + 1), layer_num=1)
        pd.fill_random(self.replicated, self.generator)
        pd.fill_random(self.replicated_draft, self.generator)
        self.decode = pd.DecodeInstance.build(DECODE_PAGES, draft=True)
        self.ranks = []
        for rank in range(CP_SIZE):
            layout = CpSharedKVLayout(CP_SIZE, rank, PAGE)
            prefill = pd.build_prefill_rank(
                cp_size=CP_SIZE,
                cp_rank=rank,
                pool=pd.shard_of(self.replicated, layout, PHYSICAL_PAGES, self.generator),
                draft_pool=pd.shard_of(self.replicated_draft, layout, PHYSICAL_PAGES, self.generator),
                decode=self.decode,
            )
            for room, (_, dst_pages, aux, _) in REQUESTS.items():
                pd.connect_decode(prefill, self.decode, room, dst_pages, aux_index=aux)
            self.ranks.append(prefill)

    def send(self, room: int, engine_refuses=()) -> None:
        logical_pages, _, aux, chunk_ends = REQUESTS[room]
        locs = torch.as_tensor(np.concatenate([np.arange(q * PAGE, (q + 1) * PAGE) for q in logical_pages]))
        for rank_id, prefill in enumerate(self.ranks):
            prefill.engine.refuse = list(engine_refuses) if rank_id == FAULTY_RANK else []
            pd.send_request(prefill, room=room, logical_locs=locs, chunk_ends=chunk_ends,
                            first_output_id=FIRST_TOKEN + room, aux_index=aux)  # fmt: skip
            prefill.engine.refuse = []

    def scheduler_poll(self, room: int) -> KVPoll:
        """What every prefill rank's scheduler sees: the MIN of the ranks' polls over the CP group
        (``poll_and_all_reduce_attn_cp_tp_group``)."""
        return min(int(prefill.manager.check_status(room)) for prefill in self.ranks)


def _pairing_fails_for_bad_room(real):
    def pairs(layout, logical_pages, dst_pages):
        if int(np.asarray(dst_pages)[0]) == REQUESTS[BAD_ROOM][1][0] and layout.cp_rank == FAULTY_RANK:
            raise ValueError("planted: pages cannot be paired")
        return real(layout, logical_pages, dst_pages)

    return pairs


class TestATransferFailureFailsItsRequestAlone(CustomTestCase):
    def _check(self, case: TransferFaultCase, what: str):
        faulty = case.ranks[FAULTY_RANK].manager
        # The bad request: failed on every prefill rank and on decode, told once by the faulty rank.
        self.assertEqual(case.scheduler_poll(BAD_ROOM), KVPoll.Failed, what)
        self.assertEqual(faulty.check_status(BAD_ROOM), KVPoll.Failed, what)
        self.assertTrue(case.decode.failed(BAD_ROOM), what)
        self.assertNotIn(FAULTY_RANK, case.decode.senders_done(BAD_ROOM), what)
        told = [s for s in case.decode.statuses if s[0] == BAD_ROOM and s[2] == FAULTY_RANK]
        self.assertEqual(told, [(BAD_ROOM, int(KVPoll.Failed), FAULTY_RANK)], what)
        # Only it: no session is marked dead, and the next request arrives whole.
        for prefill in case.ranks:
            self.assertNotIn(pd.DECODE_SESSION, prefill.manager.failed_sessions, what)
            self.assertEqual(prefill.manager.check_status(GOOD_ROOM), KVPoll.Success, what)
        self.assertFalse(case.decode.failed(GOOD_ROOM), what)
        self.assertEqual(case.decode.senders_done(GOOD_ROOM), set(range(CP_SIZE)), what)
        logical, dst, aux, _ = REQUESTS[GOOD_ROOM]
        self.assertEqual(int(case.decode.metadata.output_ids[aux][0]), FIRST_TOKEN + GOOD_ROOM, what)
        index = torch.as_tensor(dst)
        for got_pool, source in ((case.decode.pool, case.replicated), (case.decode.draft_pool, case.replicated_draft)):
            expected = pd.build_nsa_pool(DECODE_PAGES, layer_num=source.layer_num)
            pd.copy_pages(source, logical, expected, dst)
            for got, want in zip(pd.pool_page_views(got_pool), pd.pool_page_views(expected)):
                self.assertTrue(torch.equal(got[index], want[index]), what)
        self.assertIn("not sent", faulty.failure_records[BAD_ROOM], what)  # the reason the scheduler reports

    def test_engine_failure_of_each_part(self):
        """The engine refuses the faulty rank's calls into the decode's KV, indexer-K, draft KV or draft
        indexer-K buffers while the bad request is sent."""
        for seed, part in enumerate(("kv", "indexer", "draft_kv", "draft_indexer")):
            with self.subTest(part=part):
                case = TransferFaultCase(seed)
                case.send(BAD_ROOM, engine_refuses=case.decode.buffer_regions(part))
                self.assertGreater(case.ranks[FAULTY_RANK].engine.refused_calls, 0, part)
                case.send(GOOD_ROOM)
                self._check(case, part)

    def test_kv_pages_that_cannot_be_paired(self):
        """``owned_page_pairs`` refuses the bad request's first KV chunk on the faulty rank: before
        the fix ``send_kvcache`` returned -1 and the stock worker marked the decode session dead."""
        case = TransferFaultCase(7)
        with mock.patch.object(
            shared_kv_conn, "owned_page_pairs", _pairing_fails_for_bad_room(shared_kv_conn.owned_page_pairs)
        ):
            case.send(BAD_ROOM)
        # nothing after the failing chunk was sent by the faulty rank
        self.assertEqual(case.ranks[FAULTY_RANK].engine.copies, [])
        case.send(GOOD_ROOM)
        self._check(case, "KV pairing")
        self.assertIn("cannot be paired", case.ranks[FAULTY_RANK].manager.failure_records[BAD_ROOM])

    def test_the_failure_mark_is_consumed(self):
        """A room's failure is reported once and forgotten: nothing is left for a later request that
        reuses the room number."""
        case = TransferFaultCase(9)
        case.send(BAD_ROOM, engine_refuses=case.decode.buffer_regions("kv"))
        for prefill in case.ranks:
            self.assertIsNone(prefill.manager.cp_shared_kv_failures.take(BAD_ROOM, pd.DECODE_SESSION))


if __name__ == "__main__":
    unittest.main()
