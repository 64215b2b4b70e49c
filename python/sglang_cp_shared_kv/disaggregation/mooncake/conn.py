"""Mooncake KV manager and sender of a shared-KV prefill server.

What stock sglang 0.5.11 does, with ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1`` on both servers:

* Decode side (``CommonKVManager._resolve_rank_mapping``): it sends its page ids to every prefill
  CP rank and waits for ``attn_cp_size`` Success messages, one per distinct sender
  (``prefill_unique_rank``); a request is done when that many arrived (mooncake ``decode_thread``).
* Prefill side: ``send_kv_chunk`` calls ``sender.send(logical pages of the chunk, ...)`` on every
  rank; the stock sender keeps a contiguous range of the chunk per rank and the transfer worker
  writes it, position by position, into ``dst_kv_indices[index_slice]``. On the last chunk every
  rank also sends the NSA indexer-K pages of the whole request (``state_indices``, pages
  ``0 .. seq_len``, paired position by position with the decode's ``dst_state_indices``), the
  metadata (aux) and its Success status.

With shared KV the stock range is wrong twice over: a rank holds every ``cp_size``-th page, not a
range, and it holds them at physical page numbers, while ``req_to_token`` (and so every index the
stock path hands the transfer worker) is logical. Here:

* ``CpSharedKVMooncakeKVSender.send`` enqueues every chunk on every rank unfiltered, exactly as the
  stock sender does without CP: the logical pages and their position range in the request. So all
  ranks walk the same chunk sequence, and every rank reaches the last chunk, whatever it owns.
* ``CpSharedKVMooncakeKVManager.send_kvcache`` (KV) and ``maybe_send_extra`` (indexer K) keep the
  positions this rank owns, translate them to physical pages and pair them with the decode pages of
  the same positions (``page_pairing.owned_page_pairs``), then run the stock transfer. A rank
  owning nothing of a chunk transfers nothing for it; on the last chunk it still sends aux and its
  Success status, so the decode instance counts ``cp_size`` arrivals and never waits forever.
* The blocks of one batch reach the engine in calls of at most ``MAX_BLOCKS_PER_TRANSFER_CALL``
  (``_transfer_data``; why: ``transfer_blocks.py``).
* Any failure of any part of a request's transfer (pages that cannot be paired; an engine call
  failing for the KV, the indexer K or the MTP draft's rows) fails that request alone, on every rank
  and on decode, and the decode session stays usable for later requests: ``request_failures.py``
  says how (stock would mark the whole decode session dead, or ignore a failed indexer-K send).

Everything else (bootstrap, the transfer worker, aux, status, timeouts) is stock. With
``--enable-nsa-prefill-cp-shared-kv`` off on the server (``cp_shared_kv_layout is None``) both
classes are the stock ones.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from typing import List, Optional

import numpy as np

from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager, MooncakeKVSender
from sglang.srt.disaggregation.utils import DisaggregationMode

from sglang_cp_shared_kv.disaggregation.mooncake.request_failures import RequestTransferFailures
from sglang_cp_shared_kv.disaggregation.page_pairing import owned_page_pairs, position_aligned
from sglang_cp_shared_kv.disaggregation.transfer_blocks import MAX_BLOCKS_PER_TRANSFER_CALL, bounded_calls
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.settings import ALL_CP_RANKS_ENV, CP_SHARED_KV_FLAG, cp_shared_kv_enabled

logger = logging.getLogger(__name__)


# The allocator's layout of the pool whose bootstrap queue is building a KV manager right now: sglang
# hands the manager only the pool's buffers (``KVArgs``), so ``transfer_class_hooks`` sets this
# around ``PrefillBootstrapQueue._init_kv_manager`` and the manager's ``__init__`` reads it.
_pool_layout: contextvars.ContextVar = contextvars.ContextVar("cp_shared_kv_pool_layout", default=None)


@contextlib.contextmanager
def managers_built_for(layout: Optional[CpSharedKVLayout]):
    """KV managers constructed inside translate through ``layout`` (the allocator's)."""
    token = _pool_layout.set(layout)
    try:
        yield
    finally:
        _pool_layout.reset(token)


def cp_shared_kv_transfer_layout(
    server_args, disaggregation_mode, layout: Optional[CpSharedKVLayout]
) -> Optional[CpSharedKVLayout]:
    """The layout a prefill rank's transfers translate through (the allocator's ``layout``), or
    None with the flag off."""
    if not cp_shared_kv_enabled(server_args):
        return None
    if disaggregation_mode != DisaggregationMode.PREFILL:
        raise ValueError(
            f"{CP_SHARED_KV_FLAG} is supported on the prefill server of PD disaggregation only "
            f"(this KV manager is in mode {disaggregation_mode.value})"
        )
    if layout is None:
        raise ValueError(
            f"{CP_SHARED_KV_FLAG}: no shared-KV allocator serves the KV pool this PD manager sends "
            "from (the layout comes from the allocator, through PrefillBootstrapQueue)"
        )
    return layout


def check_cp_shared_kv_transfer_setup(manager: "CpSharedKVMooncakeKVManager") -> None:
    """What the startup rule checks, checked again where the transfers happen."""
    if not manager.is_mla_backend or getattr(manager.kv_args, "state_type", "none") != "nsa":
        raise ValueError(
            f"{CP_SHARED_KV_FLAG} with PD disaggregation needs an NSA KV pool (MLA KV + indexer-K "
            f"state pages); got is_mla_backend={manager.is_mla_backend}, "
            f"state_type={getattr(manager.kv_args, 'state_type', None)!r}"
        )
    if not manager.enable_all_cp_ranks_for_transfer:
        raise ValueError(
            f"{CP_SHARED_KV_FLAG} with --disaggregation-mode prefill needs {ALL_CP_RANKS_ENV}=1 on the "
            "prefill and the decode server: every CP rank holds a share of each request's pages"
        )


class CpSharedKVMooncakeKVManager(MooncakeKVManager):
    """``MooncakeKVManager`` whose KV and indexer-K transfers send only this rank's pages."""

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend: Optional[bool] = False):
        # Set before the stock __init__ starts the transfer threads that read them.
        self.cp_shared_kv_failures = RequestTransferFailures()
        self.cp_shared_kv_layout = cp_shared_kv_transfer_layout(
            server_args, disaggregation_mode, _pool_layout.get()
        )
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if self.cp_shared_kv_layout is not None:
            check_cp_shared_kv_transfer_setup(self)
            logger.info(
                "%s: PD prefill rank %d/%d sends the KV and indexer-K pages it owns",
                CP_SHARED_KV_FLAG,
                self.cp_shared_kv_layout.cp_rank,
                self.cp_shared_kv_layout.cp_size,
            )

    def transfer_worker(self, queue, executor, staging_buffer=None):
        """The stock worker, on a queue that tells ``send_kvcache`` which request a chunk belongs to."""
        if self.cp_shared_kv_layout is None:
            return super().transfer_worker(queue, executor, staging_buffer)
        return super().transfer_worker(self.cp_shared_kv_failures.tracking(queue), executor, staging_buffer)

    def _fail_request(self, room: Optional[int], session_id: str, what: str, why: str) -> int:
        """Fail ``room`` alone (``request_failures.py``); returns what the failing part returns to the
        stock worker: 0, so that it marks no session, or -1 outside a tracked worker (stock's failure)."""
        reason = f"{CP_SHARED_KV_FLAG}: {what} of room {room} not sent to {session_id}: {why}"
        logger.error(reason)
        if room is None:
            return -1
        self.record_failure(room, reason)
        self.cp_shared_kv_failures.fail(room, session_id, reason)
        return 0

    def _transfer_data(self, mooncake_session_id, transfer_blocks):
        """Stock's one engine call per batch, split into calls of at most
        ``MAX_BLOCKS_PER_TRANSFER_CALL`` blocks, in order; the first failing call's status is returned
        and the rest are not sent (the part that called it then fails its request)."""
        if self.cp_shared_kv_layout is None:
            return super()._transfer_data(mooncake_session_id, transfer_blocks)
        for call in bounded_calls(transfer_blocks, MAX_BLOCKS_PER_TRANSFER_CALL):
            status = super()._transfer_data(mooncake_session_id, call)
            if status != 0:
                return status
        return 0

    def send_kvcache(self, mooncake_session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, executor):
        """KV pages of one chunk (the target's and, with MTP, the draft's layers): ``prefill_kv_indices``
        are the chunk's logical pages, ``dst_kv_indices`` the decode pages of the same positions; send
        the owned ones from their physical pages."""
        layout = self.cp_shared_kv_layout
        if layout is None:
            return super().send_kvcache(
                mooncake_session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, executor
            )
        room = self.cp_shared_kv_failures.current_room()
        if self.cp_shared_kv_failures.has_failed(room, mooncake_session_id):
            return 0  # an earlier chunk failed: nothing more of this request is sent
        try:
            pairs = owned_page_pairs(layout, prefill_kv_indices, dst_kv_indices)
        except ValueError as e:
            return self._fail_request(room, mooncake_session_id, "KV chunk", str(e))
        status = super().send_kvcache(
            mooncake_session_id, pairs.src_pages, dst_kv_ptrs, pairs.dst_pages, executor
        )
        if status != 0:
            return self._fail_request(room, mooncake_session_id, "KV chunk", f"transfer engine status {status}")
        return 0

    def maybe_send_extra(
        self,
        req,
        prefill_state_indices: List[int],
        dst_state_data_ptrs: List[int],
        executor,
        target_rank_registration_info=None,
    ):
        """NSA indexer-K pages of the whole request (last chunk; the draft's too with MTP): the owned
        positions only, from their physical pages, into the decode's ``dst_state_indices`` of the same
        positions. The stock worker ignores the result: a failure fails the request through
        ``send_aux``."""
        layout = self.cp_shared_kv_layout
        if layout is None or getattr(self.kv_args, "state_type", "none") != "nsa":
            return super().maybe_send_extra(
                req, prefill_state_indices, dst_state_data_ptrs, executor, target_rank_registration_info
            )
        session = req.mooncake_session_id
        if self.cp_shared_kv_failures.has_failed(req.room, session):
            return 0
        prefill, dst, aligned = position_aligned(prefill_state_indices, req.dst_state_indices)
        if not aligned:
            logger.warning(
                "%s: room %s has %d indexer pages on prefill, %d on decode; pairing the first %d",
                CP_SHARED_KV_FLAG,
                req.room,
                len(prefill_state_indices),
                len(req.dst_state_indices),
                len(prefill),
            )
        try:
            pairs = owned_page_pairs(layout, prefill, dst)
        except ValueError as e:
            return self._fail_request(req.room, session, "indexer-K pages", str(e))
        owned_req = dataclasses.replace(req, dst_state_indices=pairs.dst_pages.tolist())
        status = super().maybe_send_extra(
            owned_req,
            pairs.src_pages.tolist(),
            dst_state_data_ptrs,
            executor,
            target_rank_registration_info,
        )
        if status != 0:
            return self._fail_request(req.room, session, "indexer-K pages", f"transfer engine status {status}")
        return 0

    def send_aux(self, req, prefill_aux_index, dst_aux_ptrs):
        """Stock, except for a request whose transfer failed on this rank: no metadata, and -1, so the
        stock worker sets the room Failed and tells the decode Failed (``request_failures.py``)."""
        if self.cp_shared_kv_layout is not None:
            if self.cp_shared_kv_failures.take(req.room, req.mooncake_session_id) is not None:
                return -1
        return super().send_aux(req, prefill_aux_index, dst_aux_ptrs)

    def send_kvcache_hisparse(self, mooncake_session_id, prefill_kv_indices, *args, **kwargs):
        if self.cp_shared_kv_layout is None:
            return super().send_kvcache_hisparse(mooncake_session_id, prefill_kv_indices, *args, **kwargs)
        return self._fail_request(
            self.cp_shared_kv_failures.current_room(),
            mooncake_session_id,
            "KV chunk",
            "the decode server runs --enable-hisparse, whose token-granular transfer is not supported "
            "from a shared-KV prefill server",
        )

    def send_kvcache_slice(self, mooncake_session_id, prefill_kv_indices, *args, **kwargs):
        if self.cp_shared_kv_layout is None:
            return super().send_kvcache_slice(mooncake_session_id, prefill_kv_indices, *args, **kwargs)
        # Reached only for non-MLA pools with different attention TP sizes; NSA pools are MLA.
        return self._fail_request(
            self.cp_shared_kv_failures.current_room(),
            mooncake_session_id,
            "KV chunk",
            "head-sliced KV transfer is not supported",
        )


class CpSharedKVMooncakeKVSender(MooncakeKVSender):
    """Enqueues every chunk on every CP rank, unfiltered (the manager keeps the owned pages)."""

    def send(self, kv_indices: np.ndarray, state_indices: Optional[List[int]] = None):
        if getattr(self.kv_mgr, "cp_shared_kv_layout", None) is None:
            return super().send(kv_indices, state_indices)
        # The stock sender's bookkeeping without its CP-range filter: identical on every rank.
        index_slice = slice(self.curr_idx, self.curr_idx + len(kv_indices))
        self.curr_idx += len(kv_indices)
        if self.curr_idx != self.num_kv_indices:
            self.kv_mgr.add_transfer_request(self.bootstrap_room, kv_indices, index_slice, False)
        else:
            self.kv_mgr.add_transfer_request(
                self.bootstrap_room,
                kv_indices,
                index_slice,
                True,
                aux_index=self.aux_index,
                state_indices=state_indices,
            )
