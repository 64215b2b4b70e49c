"""A shared-KV prefill CP group handing requests to a decode instance, in one process on the CPU.

For unit tests of ``disaggregation/``. Real parts: sglang's ``NSATokenToKVPool`` (one physical shard
per prefill CP rank, the decode pool, and a replicated reference pool), ``MetadataBuffers``, the
scheduler's ``send_kv_chunk``, the stock ``MooncakeKVSender`` bookkeeping and ``add_transfer_request``,
the stock mooncake ``transfer_worker`` / ``_send_kvcache_generic`` / ``send_aux``, and our subclasses.
Not real:

* ``CopyingTransferEngine`` replaces the mooncake transfer engine: ``batch_transfer_sync`` copies
  bytes with ``memmove``, after checking that every source range lies in a buffer the sending rank
  registered and every destination range in one the decode instance registered (a wrong page id
  fails the transfer instead of touching foreign memory).
* The KV managers are built without their ``__init__`` (which binds ZMQ sockets, registers with a
  bootstrap server and starts threads): ``build_prefill_manager`` sets the attributes the transfer
  path reads; ``drain`` runs the stock transfer worker in the calling thread until its queue is
  empty. The bootstrap handshake is replaced by ``connect_decode`` (what the prefill bootstrap
  thread stores when the decode's metadata arrives), status messages to the decode are recorded.
* ``decode_expected_responses`` runs the stock decode-side ``_resolve_rank_mapping`` on a stub to
  learn how many prefill senders a stock decode instance waits for.

With a draft pool (MTP), both sides register it after the target's, as stock 0.5.11 does
(``disaggregation/prefill.py`` and ``decode.py`` append ``draft_token_to_kv_pool``'s KV buffers to
``kv_data_ptrs`` and, for an NSA draft pool, its indexer buffers to ``state_data_ptrs``): the
transfer then moves the draft's pages with the target's, by the same page pairs.
"""

from __future__ import annotations

import ctypes
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from sglang_cp_shared_kv_testing import sgl_kernel_cpu_shim

sgl_kernel_cpu_shim.install()

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll  # noqa: E402
from sglang.srt.disaggregation.common.conn import CommonKVManager, PrefillServerInfo  # noqa: E402
from sglang.srt.disaggregation.common.utils import FastQueue  # noqa: E402
from sglang.srt.disaggregation.mooncake.conn import KVArgsRegisterInfo, TransferInfo  # noqa: E402
from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode, MetadataBuffers  # noqa: E402
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool  # noqa: E402

from sglang_cp_shared_kv.disaggregation.mooncake.conn import (  # noqa: E402
    CpSharedKVMooncakeKVManager,
    CpSharedKVMooncakeKVSender,
    check_cp_shared_kv_transfer_setup,
    cp_shared_kv_transfer_layout,
)
from sglang_cp_shared_kv.disaggregation.mooncake.request_failures import RequestTransferFailures  # noqa: E402
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout  # noqa: E402

PAGE = 64  # NSATokenToKVPool's page size
DECODE_SESSION = "decode-0:12345"
DECODE_ENDPOINT = ("127.0.0.1", 17000)


class CopyingTransferEngine:
    """``batch_transfer_sync`` = bounds-checked ``memmove``; one per prefill rank.

    ``refuse`` (fault injection): a call with any destination range inside one of these (start, end)
    ranges returns -1 and copies nothing, as mooncake does when it rejects a call (a full TCP queue)."""

    def __init__(self, peers: Dict[str, List[Tuple[int, int]]]):
        self.local: List[Tuple[int, int]] = []  # (start, end) registered by this rank
        self.peers = peers  # session id -> the peer's registered (start, end) ranges
        self.copies: List[Tuple[int, int, int]] = []
        self.errors: List[str] = []
        self.refuse: List[Tuple[int, int]] = []
        self.refused_calls = 0

    def batch_register(self, ptrs, lengths) -> int:
        self.local += [(int(p), int(p) + int(n)) for p, n in zip(ptrs, lengths)]
        return 0

    def batch_transfer_sync(self, session_id, buffers, peer_buffer_addresses, lengths) -> int:
        peer = self.peers.get(session_id)
        if peer is None:
            self.errors.append(f"unknown session {session_id}")
            return -1
        for src, dst, n in zip(buffers, peer_buffer_addresses, lengths):
            if not _inside(self.local, src, n):
                self.errors.append(f"source [{src}, {src + n}) outside this rank's registered buffers")
                return -1
            if not _inside(peer, dst, n):
                self.errors.append(f"destination [{dst}, {dst + n}) outside the peer's registered buffers")
                return -1
        if any(_overlaps(self.refuse, dst, n) for dst, n in zip(peer_buffer_addresses, lengths)):
            self.refused_calls += 1
            return -1
        for src, dst, n in zip(buffers, peer_buffer_addresses, lengths):
            ctypes.memmove(dst, src, n)
            self.copies.append((src, dst, n))
        return 0


def _inside(regions, start: int, length: int) -> bool:
    return any(lo <= start and start + length <= hi for lo, hi in regions)


def _overlaps(regions, start: int, length: int) -> bool:
    return any(start < hi and lo < start + length for lo, hi in regions)


def build_nsa_pool(pages: int, *, layer_num: int = 2, kv_lora_rank: int = 16, rope_dim: int = 8):
    """A real CPU ``NSATokenToKVPool`` with ``pages`` pages after sglang's dummy page 0."""
    return NSATokenToKVPool(
        size=pages * PAGE,
        page_size=PAGE,
        kv_lora_rank=kv_lora_rank,
        dtype=torch.bfloat16,
        qk_rope_head_dim=rope_dim,
        layer_num=layer_num,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=kv_lora_rank + rope_dim,
    )


def pool_page_views(pool: NSATokenToKVPool) -> List[torch.Tensor]:
    """Every buffer of ``pool`` as uint8 ``[num_pages, bytes_per_page]`` (KV layers, then indexer)."""
    views = []
    for buffer in pool.kv_buffer:
        views.append(buffer.view(torch.uint8).reshape(buffer.shape[0] // PAGE, -1))
    for buffer in pool.index_k_with_scale_buffer:
        views.append(buffer.view(torch.uint8).reshape(buffer.shape[0], -1))
    return views


def fill_random(pool: NSATokenToKVPool, generator: torch.Generator) -> None:
    for view in pool_page_views(pool):
        view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, generator=generator))


def copy_pages(src_pool, src_pages, dst_pool, dst_pages) -> None:
    """Whole pages (KV rows and indexer page) ``src_pool[src_pages[k]] -> dst_pool[dst_pages[k]]``."""
    src_index = torch.as_tensor(np.asarray(src_pages, dtype=np.int64))
    dst_index = torch.as_tensor(np.asarray(dst_pages, dtype=np.int64))
    for src, dst in zip(pool_page_views(src_pool), pool_page_views(dst_pool)):
        dst[dst_index] = src[src_index]


def shard_of(replicated: NSATokenToKVPool, layout: CpSharedKVLayout, physical_pages: int, generator):
    """Rank ``layout.cp_rank``'s physical pool as owner-filtered writes leave it: each owned logical
    page ``q`` at physical page ``q // cp_size``; unowned pages of ``replicated`` nowhere; every other
    byte random."""
    shard = build_nsa_pool(physical_pages, layer_num=replicated.layer_num)
    fill_random(shard, generator)
    physical = np.arange(1, physical_pages + 1)
    logical = np.array([layout.logical_page_of(int(p)) for p in physical])
    copy_pages(replicated, logical, shard, physical)
    return shard


def kv_buf_infos(pool: NSATokenToKVPool, draft_pool: Optional[NSATokenToKVPool] = None):
    """KV buffers a KV manager registers: the target's layers, then the draft's (stock order)."""
    ptrs, lens, item_lens = pool.get_contiguous_buf_infos()
    if draft_pool is not None:
        draft = draft_pool.get_contiguous_buf_infos()
        ptrs, lens, item_lens = ptrs + draft[0], lens + draft[1], item_lens + draft[2]
    return ptrs, lens, item_lens


def state_buf_infos(pool: NSATokenToKVPool, draft_pool: Optional[NSATokenToKVPool] = None):
    """Indexer-K state buffers: the target's, then the NSA draft pool's (stock order)."""
    ptrs, lens, item_lens = pool.get_state_buf_infos()
    if draft_pool is not None:
        draft = draft_pool.get_state_buf_infos()
        ptrs, lens, item_lens = ptrs + draft[0], lens + draft[1], item_lens + draft[2]
    return ptrs, lens, item_lens


@dataclass
class DecodeInstance:
    """The stock decode server's side: its pool, metadata buffers, and what prefill ranks told it."""

    pool: NSATokenToKVPool
    metadata: MetadataBuffers
    statuses: List[Tuple[int, int, int]] = field(default_factory=list)  # (room, status, prefill rank)
    draft_pool: Optional[NSATokenToKVPool] = None  # the MTP draft's pool (stock decode with MTP on)

    @classmethod
    def build(cls, pages: int, metadata_slots: int = 4, draft: bool = False) -> "DecodeInstance":
        return cls(
            build_nsa_pool(pages),
            MetadataBuffers(metadata_slots, 8, torch.float32),
            draft_pool=build_nsa_pool(pages, layer_num=1) if draft else None,
        )

    def regions(self) -> List[Tuple[int, int]]:
        ptrs, lens, _ = kv_buf_infos(self.pool, self.draft_pool)
        state_ptrs, state_lens, _ = state_buf_infos(self.pool, self.draft_pool)
        aux_ptrs, aux_lens, _ = self.metadata.get_buf_infos()
        return [(p, p + n) for p, n in zip(ptrs + state_ptrs + aux_ptrs, lens + state_lens + aux_lens)]

    def buffer_regions(self, part: str) -> List[Tuple[int, int]]:
        """(start, end) of one part's decode buffers: ``kv``, ``draft_kv``, ``indexer``, ``draft_indexer``
        or ``aux`` (where a fault is injected with ``CopyingTransferEngine.refuse``)."""
        pool = self.draft_pool if part.startswith("draft_") else self.pool
        if part == "aux":
            ptrs, lens, _ = self.metadata.get_buf_infos()
        elif part.endswith("indexer"):
            ptrs, lens, _ = pool.get_state_buf_infos()
        else:
            ptrs, lens, _ = pool.get_contiguous_buf_infos()
        return [(p, p + n) for p, n in zip(ptrs, lens)]

    def register_info(self) -> KVArgsRegisterInfo:
        kv_ptrs, _, kv_item_lens = kv_buf_infos(self.pool, self.draft_pool)
        state_ptrs, _, state_item_lens = state_buf_infos(self.pool, self.draft_pool)
        aux_ptrs, _, _ = self.metadata.get_buf_infos()
        return KVArgsRegisterInfo(
            room="None",
            endpoint=DECODE_ENDPOINT[0],
            dst_port=DECODE_ENDPOINT[1],
            mooncake_session_id=DECODE_SESSION,
            dst_kv_ptrs=kv_ptrs,
            dst_aux_ptrs=aux_ptrs,
            dst_state_data_ptrs=state_ptrs,
            dst_tp_rank=0,
            dst_attn_tp_size=1,
            dst_kv_item_len=kv_item_lens[0],
            dst_state_item_lens=state_item_lens,
            dst_state_dim_per_tensor=[],
        )

    def senders_done(self, room: int) -> set:
        """Distinct prefill senders that reported Success for ``room`` (what decode_thread counts)."""
        return {rank for r, status, rank in self.statuses if r == room and status == KVPoll.Success}

    def failed(self, room: int) -> bool:
        return any(r == room and status == KVPoll.Failed for r, status, _ in self.statuses)


def decode_expected_responses(prefill_cp_size: int, all_cp_ranks: bool = True) -> int:
    """How many prefill senders a stock tp-1 decode instance waits for (its own rank mapping)."""
    decode = SimpleNamespace(
        attn_tp_size=1,
        attn_cp_size=1,
        attn_cp_rank=0,
        pp_size=1,
        pp_rank=0,
        is_mla_backend=True,
        enable_all_cp_ranks_for_transfer=all_cp_ranks,
        kv_args=SimpleNamespace(engine_rank=0),
    )
    info = PrefillServerInfo(
        attn_tp_size=1,
        attn_cp_size=prefill_cp_size,
        dp_size=1,
        pp_size=1,
        page_size=PAGE,
        kv_cache_dtype="auto",
        follow_bootstrap_room=True,
    )
    CommonKVManager._resolve_rank_mapping(decode, info)
    return info.required_prefill_response_num


class _QueueDrained(BaseException):
    """Ends the stock transfer worker's endless loop (it catches ``Exception`` only)."""


class DrainingQueue(FastQueue):
    def get(self):
        with self._cond:
            if not self._buf:
                raise _QueueDrained()
            return self._buf.popleft()


@dataclass
class PrefillRank:
    manager: CpSharedKVMooncakeKVManager
    pool: NSATokenToKVPool
    metadata: MetadataBuffers
    engine: CopyingTransferEngine
    draft_pool: Optional[NSATokenToKVPool] = None  # kept alive: the engine holds raw pointers into it

    def drain(self) -> None:
        """Run the stock transfer worker on everything queued so far."""
        try:
            self.manager.transfer_worker(self.manager.transfer_queues[0], None)
        except _QueueDrained:
            pass


def build_prefill_rank(
    *,
    cp_size: int,
    cp_rank: int,
    pool: NSATokenToKVPool,
    decode: DecodeInstance,
    shared_kv: bool = True,
    all_cp_ranks: bool = True,
    draft_pool: Optional[NSATokenToKVPool] = None,
) -> PrefillRank:
    """One prefill CP rank's KV manager over ``pool`` (and the MTP ``draft_pool``), connected to
    ``decode``'s buffers."""
    server_args = SimpleNamespace(enable_nsa_prefill_cp_shared_kv=shared_kv, dp_size=1)
    metadata = MetadataBuffers(4, 8, torch.float32)
    engine = CopyingTransferEngine({DECODE_SESSION: decode.regions()})

    kv_args = KVArgs()
    kv_args.engine_rank = cp_rank
    kv_args.pp_rank = 0
    kv_args.system_dp_rank = 0
    kv_args.prefill_start_layer = pool.start_layer
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = kv_buf_infos(pool, draft_pool)
    kv_args.page_size = pool.page_size
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = metadata.get_buf_infos()
    kv_args.state_data_ptrs, kv_args.state_data_lens, kv_args.state_item_lens = state_buf_infos(
        pool, draft_pool
    )
    kv_args.state_type = "nsa"

    m = CpSharedKVMooncakeKVManager.__new__(CpSharedKVMooncakeKVManager)
    m.cp_shared_kv_failures = RequestTransferFailures()
    m.cp_shared_kv_layout = cp_shared_kv_transfer_layout(
        server_args, DisaggregationMode.PREFILL, CpSharedKVLayout(cp_size, cp_rank, pool.page_size)
    )
    # CommonKVManager.__init__, prefill branch
    m.kv_args, m.is_mla_backend, m.server_args = kv_args, True, server_args
    m.disaggregation_mode = DisaggregationMode.PREFILL
    m.attn_tp_size, m.attn_tp_rank, m.attn_cp_size, m.attn_cp_rank = 1, 0, cp_size, cp_rank
    m.pp_size, m.pp_rank, m.bootstrap_port = 1, 0, 0
    m.enable_all_cp_ranks_for_transfer = all_cp_ranks
    m.is_dummy_cp_rank = not all_cp_ranks and cp_size > 1 and cp_rank != 0
    m.request_status, m.failure_records, m.failure_lock = {}, {}, threading.Lock()
    m.transfer_infos, m.req_to_decode_prefix_len, m.decode_kv_args_table = {}, {}, {}
    # MooncakeKVManager.__init__, prefill branch (no threads: see PrefillRank.drain)
    m.engine = engine
    m.enable_staging = False
    m.session_failures, m.failed_sessions, m.session_lock = defaultdict(int), set(), threading.Lock()
    m.transfer_queues = [DrainingQueue()]
    m.enable_custom_mem_pool, m.custom_mem_pool_type = False, None
    m.register_buffer_to_engine()
    if m.cp_shared_kv_layout is not None:
        check_cp_shared_kv_transfer_setup(m)

    def record_status(remote, dst_port, room, status, prefill_rank):
        decode.statuses.append((int(room), int(status), int(prefill_rank)))

    m.sync_status_to_decode_endpoint = record_status
    return PrefillRank(m, pool, metadata, engine, draft_pool)


def connect_decode(rank: PrefillRank, decode: DecodeInstance, room: int, dst_pages, aux_index: int) -> None:
    """What the prefill bootstrap thread stores when the decode's pre-allocation arrives."""
    rank.manager.decode_kv_args_table[DECODE_SESSION] = decode.register_info()
    dst = np.asarray(dst_pages, dtype=np.int32)
    rank.manager.transfer_infos.setdefault(room, {})[DECODE_SESSION] = TransferInfo(
        room=room,
        endpoint=DECODE_ENDPOINT[0],
        dst_port=DECODE_ENDPOINT[1],
        mooncake_session_id=DECODE_SESSION,
        dst_kv_indices=dst,  # no decode prefix: every page of the request
        dst_aux_index=aux_index,
        dst_state_indices=list(dst),  # decode's state indices: pages of positions 0 .. seq_len
        required_dst_info_num=1,
        is_dummy=False,
    )
    rank.manager.update_status(room, KVPoll.WaitingForInput)


@dataclass
class PrefillRequest:
    """The ``Req`` fields ``send_kv_chunk`` and ``MetadataBuffers.set_buf`` read."""

    rid: str
    bootstrap_room: int
    origin_input_ids: List[int]
    req_pool_idx: int
    metadata_buffer_index: int
    output_ids: List[int]
    fill_ids: List[int] = field(default_factory=list)
    start_send_idx: int = 0
    disagg_kv_sender: Optional[CpSharedKVMooncakeKVSender] = None
    cached_tokens: int = 0
    cached_tokens_device: int = 0
    cached_tokens_host: int = 0
    cached_tokens_storage: int = 0
    return_logprob: bool = False
    hidden_states_tensor: Optional[torch.Tensor] = None


def send_request(
    rank: PrefillRank,
    *,
    room: int,
    logical_locs: torch.Tensor,
    chunk_ends: List[int],
    first_output_id: int,
    aux_index: int = 0,
) -> None:
    """Prefill one request on ``rank`` the way the disaggregated prefill scheduler does: a sender,
    ``init`` with the page count, then ``send_kv_chunk`` after each chunk (the last one with
    ``last_chunk=True``), draining the transfer queue as the transfer thread would."""
    seq_len = len(logical_locs)
    if not chunk_ends or chunk_ends[-1] != seq_len:
        raise ValueError("chunk_ends must end at the request length")
    req_to_token = torch.zeros((1, seq_len), dtype=torch.int64)
    req_to_token[0] = logical_locs
    scheduler = SimpleNamespace(
        token_to_kv_pool_allocator=SimpleNamespace(page_size=PAGE, get_kvcache=lambda: rank.pool),
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        disagg_metadata_buffers=rank.metadata,
    )
    req = PrefillRequest(
        rid=f"room-{room}",
        bootstrap_room=room,
        origin_input_ids=list(range(seq_len)),
        req_pool_idx=0,
        metadata_buffer_index=aux_index,
        output_ids=[first_output_id],
    )
    req.disagg_kv_sender = CpSharedKVMooncakeKVSender(
        mgr=rank.manager,
        bootstrap_addr="127.0.0.1:0",
        bootstrap_room=room,
        dest_tp_ranks=[0],
        pp_rank=0,
    )
    req.disagg_kv_sender.init(-(-seq_len // PAGE), aux_index)
    for end in chunk_ends:
        req.fill_ids = req.origin_input_ids[:end]
        last = end == seq_len
        SchedulerDisaggregationPrefillMixin.send_kv_chunk(scheduler, req, last_chunk=last)
        rank.drain()
