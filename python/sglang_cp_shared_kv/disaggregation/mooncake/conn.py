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
* A request whose pages cannot be paired fails alone: ``send_kvcache`` returns -1 (stock's failed
  chunk), ``maybe_send_extra`` has ``send_aux`` report the failure (stock's failed last chunk); the
  transfer thread lives on.

Everything else (bootstrap, the transfer worker, aux, status, failures, timeouts) is stock. With
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

from sglang_cp_shared_kv.disaggregation.page_pairing import owned_page_pairs, position_aligned
from sglang_cp_shared_kv.disaggregation.transfer_blocks import MAX_BLOCKS_PER_TRANSFER_CALL, bounded_calls
from sglang_cp_shared_kv.server_args import ALL_CP_RANKS_ENV
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.server_args import CP_SHARED_KV_FLAG, cp_shared_kv_enabled

logger = logging.getLogger(__name__)


# The allocator's layout of the pool whose bootstrap queue is building a KV manager right now: sglang
# hands the manager only the pool's buffers (``KVArgs``), so ``disaggregation.utils`` sets this
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


def fail_state_send(manager: "CpSharedKVMooncakeKVManager", req, error: ValueError) -> int:
    """Fail ``req`` alone (``maybe_send_extra`` could not pair its indexer-K pages), the way stock
    reports a failed transfer of its last chunk.

    The stock transfer worker ignores ``maybe_send_extra``'s result and turns an exception into the
    end of the transfer thread (every later request of this prefill server would hang). So the
    failure is recorded here and ``send_aux``, which the worker calls next for the same request and
    destination, reports it: the worker then marks the room Failed and tells the decode side, and
    no metadata is sent. Unlike a -1 from ``send_kvcache`` this does not mark the decode session
    failed: nothing is wrong with it.
    """
    reason = f"{CP_SHARED_KV_FLAG}: indexer-K pages of room {req.room} not sent: {error}"
    logger.error(reason)
    manager.record_failure(req.room, reason)
    # One transfer thread handles a room, and the worker calls send_aux right after this.
    manager.cp_shared_kv_failed_state_sends.add((req.room, req.mooncake_session_id))
    return -1


class CpSharedKVMooncakeKVManager(MooncakeKVManager):
    """``MooncakeKVManager`` whose KV and indexer-K transfers send only this rank's pages."""

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend: Optional[bool] = False):
        # Set before the stock __init__ starts the transfer threads that read them.
        self.cp_shared_kv_failed_state_sends = set()  # see maybe_send_extra
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

    def _transfer_data(self, mooncake_session_id, transfer_blocks):
        """Stock's one engine call per batch, split into calls of at most
        ``MAX_BLOCKS_PER_TRANSFER_CALL`` blocks, in order; the first failing call's status is returned
        and the rest are not sent (stock then fails the request, as for a failed single call)."""
        if self.cp_shared_kv_layout is None:
            return super()._transfer_data(mooncake_session_id, transfer_blocks)
        for call in bounded_calls(transfer_blocks, MAX_BLOCKS_PER_TRANSFER_CALL):
            status = super()._transfer_data(mooncake_session_id, call)
            if status != 0:
                return status
        return 0

    def send_kvcache(self, mooncake_session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, executor):
        """KV pages of one chunk: ``prefill_kv_indices`` are the chunk's logical pages, ``dst_kv_indices``
        the decode pages of the same positions; send the owned ones from their physical pages."""
        layout = self.cp_shared_kv_layout
        if layout is None:
            return super().send_kvcache(
                mooncake_session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, executor
            )
        try:
            pairs = owned_page_pairs(layout, prefill_kv_indices, dst_kv_indices)
        except ValueError as e:
            logger.error("%s: KV chunk not sent: %s", CP_SHARED_KV_FLAG, e)
            return -1  # the stock worker fails this request and tells the decode side
        return super().send_kvcache(
            mooncake_session_id, pairs.src_pages, dst_kv_ptrs, pairs.dst_pages, executor
        )

    def maybe_send_extra(
        self,
        req,
        prefill_state_indices: List[int],
        dst_state_data_ptrs: List[int],
        executor,
        target_rank_registration_info=None,
    ):
        """NSA indexer-K pages of the whole request (last chunk): the owned positions only, from their
        physical pages, into the decode's ``dst_state_indices`` of the same positions."""
        layout = self.cp_shared_kv_layout
        if layout is None or getattr(self.kv_args, "state_type", "none") != "nsa":
            return super().maybe_send_extra(
                req, prefill_state_indices, dst_state_data_ptrs, executor, target_rank_registration_info
            )
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
            return fail_state_send(self, req, e)
        owned_req = dataclasses.replace(req, dst_state_indices=pairs.dst_pages.tolist())
        return super().maybe_send_extra(
            owned_req,
            pairs.src_pages.tolist(),
            dst_state_data_ptrs,
            executor,
            target_rank_registration_info,
        )

    def send_aux(self, req, prefill_aux_index, dst_aux_ptrs):
        """Stock, except for a request ``maybe_send_extra`` failed (``fail_state_send``)."""
        key = (req.room, req.mooncake_session_id)
        if self.cp_shared_kv_layout is not None and key in self.cp_shared_kv_failed_state_sends:
            self.cp_shared_kv_failed_state_sends.discard(key)
            return -1  # the request failed in maybe_send_extra: no metadata, status Failed
        return super().send_aux(req, prefill_aux_index, dst_aux_ptrs)

    def send_kvcache_hisparse(self, mooncake_session_id, prefill_kv_indices, *args, **kwargs):
        if self.cp_shared_kv_layout is None:
            return super().send_kvcache_hisparse(mooncake_session_id, prefill_kv_indices, *args, **kwargs)
        logger.error(
            "%s: the decode server runs --enable-hisparse, whose token-granular transfer is not "
            "supported from a shared-KV prefill server; request failed",
            CP_SHARED_KV_FLAG,
        )
        return -1

    def send_kvcache_slice(self, mooncake_session_id, prefill_kv_indices, *args, **kwargs):
        if self.cp_shared_kv_layout is None:
            return super().send_kvcache_slice(mooncake_session_id, prefill_kv_indices, *args, **kwargs)
        # Reached only for non-MLA pools with different attention TP sizes; NSA pools are MLA.
        logger.error("%s: head-sliced KV transfer is not supported; request failed", CP_SHARED_KV_FLAG)
        return -1


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
