"""Per-owner NSA decode under CUDA graphs: static owner tables refreshed on the device before each replay.

A replayed graph reads the same tensors it was captured with. Per-owner decode reads, besides what
sglang's NSA backend keeps static (``decode_cuda_graph_metadata``), this rank's owner tables
(``owner_decode_tables``: physical block table, logical page columns, owned lengths) and the
deep_gemm schedule of the owned lengths. Everything derived from them inside the forward (local
positions and rows of the score columns, candidates, the global selection, attention indices,
partials and their merge) is computed by kernels the graph captured, so it follows the tables.

* ``ModelRunner.init_device_graphs`` (BEFORE, ``bind_graph_decode``; every attach hook has run):
  bind the runner's pool state (``CpSharedKVState``) and its per-owner decode to its backend and
  move per-owner decode's collectives to the CP ``GroupCoordinator`` (below). Nothing is bound
  without CUDA graphs or per-owner decode.
* ``OwnerTableBuffers`` (one per backend, made AFTER ``init_cuda_graph_state``: ``max_num_tokens``
  rows, the backend's static ``real_page_table`` width) holds the tables; a batch of ``bs`` uses
  rows ``[:bs]``. Only one graph replays at a time, as for sglang's own static metadata.
* ``init_forward_metadata_capture_cuda_graph`` (AFTER): build the tables of the capture batch into
  the buffers, a static schedule tensor for this ``bs``, and the per-owner forward over both, begun
  through the pool's state like an eager one, without a plan (so the captured forward reads them).
* ``init_forward_metadata_replay_cuda_graph`` and ``..._from_precomputed`` (AFTER): sglang has just
  copied the replay's page table and lengths into its static metadata; rebuild this rank's tables
  from them and ``copy_`` into the buffers, and the schedule into its static tensor. Device work
  only (elementwise maps, one sort per row, a deep_gemm metadata kernel): no host sync, so the
  replay launches without waiting for the GPU. Columns past a request's pages in sglang's static
  table may be stale; the table builder masks them by length.

Collectives: a captured collective must be issued on a communicator sglang's ``graph_capture()``
switches to capture mode. It covers the TP group (custom all-reduce, PyNccl on the capture
stream), the PP group and the MoE groups. Under NSA prefill CP with shared KV the attention CP
group is the TP group's ``GroupCoordinator`` itself (``attn_cp_size == tp_size``, so sglang sets
``_ATTN_CP = _TP``), so ``coordinator_collectives`` issues the candidate all-gather and the LSE
merge through that coordinator: PyNccl (enabled inside ``graph_capture``) during capture, and
``torch.distributed`` on its device group when eager, exactly as sglang's own TP collectives in a
captured decode. torch 2.11's ProcessGroupNCCL would also let a capture record its collectives (it
only refuses NCCL older than 2.9.6), but it runs them on its own internal stream, joined to the
capture stream by events, with work objects its watchdog tracks; sglang's graph runner never
captures through that path (its own table: torch.distributed "disabled" in graph mode), so it is
not used here.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Optional

import torch

from sglang.srt.plugins.hook_registry import HookType
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.model_executor.cp_shared_kv_state import serving_state
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG
from sglang_cp_shared_kv.model_executor.per_owner_decode.owner_decode_tables import (
    OwnerDecodeTables,
    build_owner_decode_tables,
)
from sglang_cp_shared_kv.observability.cp_shared_kv_metrics import metrics as cp_metrics
from sglang_cp_shared_kv.model_executor.per_owner_decode.decode_forward import _STATE_ATTR

logger = logging.getLogger(__name__)

_BACKEND = "sglang.srt.layers.attention.nsa_backend.NativeSparseAttnBackend"
_BUFFERS_ATTR = "_cp_per_owner_graph_buffers"
_BOUND_ATTR = "_cp_per_owner_graph_bound"  # the pool's CpSharedKVState, once bound


class OwnerTableBuffers:
    """Static owner tables of every captured batch size (rows ``[:bs]`` of ``max_bs``)."""

    def __init__(self, max_bs: int, width_pages: int, page_size: int, device):
        self.page_size = page_size
        self.physical_page_table = torch.zeros((max_bs, width_pages), dtype=torch.int32, device=device)
        self.logical_page_column = torch.full(
            (max_bs, width_pages), -1, dtype=torch.int32, device=device
        )
        self.owned_seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        # bs -> static deep_gemm schedule of the owned lengths (None where deep_gemm is absent).
        self.schedules: Dict[int, Optional[torch.Tensor]] = {}

    @property
    def width_pages(self) -> int:
        return self.physical_page_table.shape[1]

    def tables(self, bs: int) -> OwnerDecodeTables:
        """Views of rows ``[:bs]``: what a captured forward reads."""
        return OwnerDecodeTables(
            page_size=self.page_size,
            physical_page_table=self.physical_page_table[:bs],
            logical_page_column=self.logical_page_column[:bs],
            owned_seq_lens=self.owned_seq_lens[:bs],
        )

    def refresh(
        self,
        layout: CpSharedKVLayout,
        real_page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        schedule_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ) -> OwnerDecodeTables:
        """Rebuild rows ``[:bs]`` from a batch's logical ``real_page_table`` [bs, <= width] and
        ``seq_lens`` [bs], in place; refresh (or, the first time for ``bs``, create) its schedule."""
        bs, width = real_page_table.shape
        if width > self.width_pages:
            raise ValueError(
                f"per-owner decode graphs: a page table of {width} pages exceeds the static "
                f"{self.width_pages}"
            )
        fresh = build_owner_decode_tables(layout, real_page_table, seq_lens[:bs])
        static = self.tables(bs)
        static.physical_page_table[:, :width].copy_(fresh.physical_page_table)
        static.physical_page_table[:, width:].zero_()
        static.logical_page_column[:, :width].copy_(fresh.logical_page_column)
        static.logical_page_column[:, width:].fill_(-1)
        static.owned_seq_lens.copy_(fresh.owned_seq_lens)
        schedule = None if schedule_fn is None else schedule_fn(static.owned_seq_lens)
        held = self.schedules.get(bs)
        if schedule is None or held is None:
            # First build for ``bs`` (capture): the tensor the graph will read from now on.
            self.schedules[bs] = None if schedule is None else schedule.clone()
        elif held.shape != schedule.shape:
            # Replacing it would leave the captured graph reading the old one.
            raise ValueError(
                f"per-owner decode graphs: the indexer schedule of batch size {bs} changed shape "
                f"({tuple(held.shape)} -> {tuple(schedule.shape)})"
            )
        else:
            held.copy_(schedule)
        return static


# ---- collectives a graph can capture ----


def coordinator_collectives(coordinator, cp_size: int):
    """(all_gather, all_reduce_sum) through sglang's ``GroupCoordinator`` (see module docstring).

    ``all_gather``: [...] -> [cp_size, ...]; ``all_reduce_sum``: [...] -> [...] (a new tensor).
    Fixed shapes, no host data: capturable."""

    def all_gather(tensor: torch.Tensor) -> torch.Tensor:
        source = tensor.contiguous()
        out = source.new_empty((cp_size * source.shape[0], *source.shape[1:]))
        coordinator.all_gather_into_tensor(out, source)
        return out.view(cp_size, *source.shape)

    def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
        return coordinator.all_reduce(tensor.contiguous().clone())

    return all_gather, all_reduce_sum


# ---- hooks ----


def bound_state(backend):
    """The pool's ``CpSharedKVState`` bound to ``backend`` for graphs (``bind_graph_decode``), or
    None."""
    return getattr(backend, _BOUND_ATTR, None)


def buffers_of(backend) -> Optional[OwnerTableBuffers]:
    return getattr(backend, _BUFFERS_ATTR, None)


def bind_graph_decode(model_runner) -> bool:
    """Before sglang captures decode graphs: bind this runner's pool state (and its per-owner
    decode, for the kernel hooks) to its backend and move per-owner decode's collectives to the
    attention CP ``GroupCoordinator``. False (nothing bound) unless the server runs graphs and
    decode per owner."""
    from sglang.srt.distributed.parallel_state import get_tp_group
    from sglang.srt.layers.dp_attention import get_attention_cp_group

    if model_runner.server_args.disable_cuda_graph:
        return False
    state = serving_state(model_runner.token_to_kv_pool)
    if state is None or state.per_owner is None:
        return False
    coordinator = get_attention_cp_group()
    if coordinator is not get_tp_group():
        raise ValueError(
            f"{FLAG} with CUDA graphs: the attention CP group must be the TP group (the one "
            f"sglang's graph_capture() makes capturable); use --disable-cuda-graph"
        )
    per_owner = state.per_owner
    per_owner.all_gather, per_owner.all_reduce_sum = coordinator_collectives(
        coordinator, state.spec.layout.cp_size
    )
    backend = model_runner.attn_backend
    setattr(backend, _STATE_ATTR, per_owner)
    setattr(backend, _BOUND_ATTR, state)
    logger.info("CP shared KV: decode CUDA graphs capture per-owner decode (static owner tables)")
    return True


def init_device_graphs_before(model_runner, *args, **kwargs):
    """BEFORE ``ModelRunner.init_device_graphs``: every attach hook has run by then."""
    if serving_state(model_runner.token_to_kv_pool) is not None:
        bind_graph_decode(model_runner)


def init_cuda_graph_state_after(result, backend, max_bs, max_num_tokens, *args, **kwargs):
    """AFTER ``init_cuda_graph_state``: the owner tables' static buffers."""
    if bound_state(backend) is None:
        return None
    page_table = backend.decode_cuda_graph_metadata["page_table"]
    page_size = backend.real_page_size
    width_pages = -(-page_table.shape[1] // page_size)
    buffers = OwnerTableBuffers(max_num_tokens, width_pages, page_size, page_table.device)
    setattr(backend, _BUFFERS_ATTR, buffers)
    return None


def capture_metadata_after(result, backend, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                           forward_mode, *args, **kwargs):
    """AFTER ``init_forward_metadata_capture_cuda_graph``: the forward about to be captured runs
    per owner over the static tables of ``bs``."""
    state, buffers = bound_state(backend), buffers_of(backend)
    if state is None or buffers is None:
        return None
    if not forward_mode.is_decode():
        raise ValueError(f"{FLAG}: CUDA graphs capture decode only, not {forward_mode.name}")
    begin_static_forward(state, backend, bs, buffers)
    return None


def replay_metadata_after(result, backend, bs, *args, **kwargs):
    """AFTER ``init_forward_metadata_replay_cuda_graph`` (and ``..._from_precomputed``): refresh
    the static tables of ``bs`` from the replay's page table and lengths."""
    state, buffers = bound_state(backend), buffers_of(backend)
    if state is None or buffers is None:
        return None
    begin_static_forward(state, backend, bs, buffers)
    if cp_metrics() is not None:
        cp_metrics().observe_usage()  # the eager path samples in begin_forward, which a replay skips
    return None


def begin_static_forward(state, backend, bs: int, buffers: OwnerTableBuffers) -> None:
    """Capture or replay: build the batch's tables into the buffers, and the forward runs per
    owner over them, without a plan (``CpSharedKVState.begin_captured_per_owner_forward``)."""
    metadata = backend.forward_metadata
    schedule_fn = state.per_owner.schedule_fn
    tables = buffers.refresh(
        state.spec.layout,
        metadata.real_page_table[:bs],
        metadata.cache_seqlens_int32[:bs],
        schedule_fn if metadata.paged_mqa_schedule_metadata is not None else None,
    )
    state.begin_captured_per_owner_forward(tables, buffers.schedules.get(bs))


def register_hooks(registry) -> None:
    registry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.init_device_graphs",
        init_device_graphs_before,
        HookType.BEFORE,
    )
    registry.register(f"{_BACKEND}.init_cuda_graph_state", init_cuda_graph_state_after, HookType.AFTER)
    registry.register(
        f"{_BACKEND}.init_forward_metadata_capture_cuda_graph", capture_metadata_after, HookType.AFTER
    )
    for method in (
        "init_forward_metadata_replay_cuda_graph",
        "init_forward_metadata_replay_cuda_graph_from_precomputed",
    ):
        registry.register(f"{_BACKEND}.{method}", replay_metadata_after, HookType.AFTER)
