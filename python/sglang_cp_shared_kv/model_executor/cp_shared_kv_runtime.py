"""Runtime of NSA prefill CP with a shared, page-sharded KV cache: the state the hooks share.

Each rank's ``NSATokenToKVPool`` stores only the logical pages it owns (physical rows, see
``CpSharedKVLayout``). ``CpSharedKVRuntime``, attached to that pool, makes it serve the whole
logical pool:

1. Writes (``owner_filtered_writes``): every store of MLA latent KV or indexer K keeps only owned
   locs, as physical rows; other rows sink into the dummy page 0.
2. Plan (``peer_page_reads``, once per forward, on the host): from the unfiltered batch, which pages
   every rank reads and where they go in the gather scratch; the backend's index tables are
   rewritten to scratch locs (``PeerPagePlan``). Page ids come from a host mirror of
   ``req_to_token`` (``ReqToPageMirror``), so planning never waits for the GPU.
3. Per layer (``peer_page_prefetch``): the gathered pages of a prefill forward's layer ``l+1``
   come from their owners on a side stream while layer ``l`` computes, into the other of two
   scratch slots; decode and forwards that do not fit the second slot gather each layer right
   after its store, on the compute stream. The store hooks (every rank runs them for the whole
   batch) store this forward's rows once, into the layer's slot, and copy the owned rows' bytes to
   the pool (``scratch_rows``). Attention and the indexer then read the slot through the pool
   getters.

The runtime is one part of its pool's ``CpSharedKVState`` (with the spec, the mirror and per-owner
decode), built at startup by ``startup_wiring``; the one hook here marks sglang's warm-up forwards
(``mark_dummy_run``). Anything this runtime cannot serve correctly raises a ``ValueError`` naming
the flags at startup; the rules themselves live with every other startup rule in
``startup_rules.runtime_problems``.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
from sglang.srt.plugins.hook_registry import HookType
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror_writers import ROWS_ATTR
from sglang_cp_shared_kv.model_executor.cp_shared_kv_state import CpSharedKVState, serving_state
from sglang_cp_shared_kv.model_executor.gather_scratch import SCRATCH_LAYER, SCRATCH_LAYER_ID
from sglang_cp_shared_kv.model_executor.peer_page_gather import as_pages, gather_peer_pages
from sglang_cp_shared_kv.model_executor.peer_page_plan import PeerPagePlan, build_peer_page_plan
from sglang_cp_shared_kv.model_executor.peer_page_prefetch import INDEX, KV, LayerPipeline
from sglang_cp_shared_kv.model_executor.scratch_rows import (
    BatchRowMaps,
    batch_row_maps,
    copy_index_k_rows,
    copy_kv_rows,
)
from sglang_cp_shared_kv.observability.cp_shared_kv_metrics import metrics as cp_metrics
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG
from sglang_cp_shared_kv.settings import DECODE_PATH_ENV, GATHER

logger = logging.getLogger(__name__)


def runtime_of(pool) -> Optional["CpSharedKVRuntime"]:
    """The runtime serving ``pool``; None for every other pool (the scratch itself included)."""
    state = serving_state(pool)
    return None if state is None else state.runtime


class CpSharedKVRuntime:
    """The page gather's state of one pool; constructing it attaches it to the pool's state.

    Every rank runs the same batches (the CP group is the TP group and schedules identically), so
    plans, and with them the decision to enter each collective, agree across ranks.
    """

    def __init__(
        self,
        state: CpSharedKVState,
        scratch: NSATokenToKVPool,
        cp_group: dist.ProcessGroup,
        prefetch_slot: Optional[NSATokenToKVPool] = None,
        prefetch_group: Optional[dist.ProcessGroup] = None,
        indexer_layer_ids: Optional[frozenset] = None,
    ):
        """``state``: the pool's (its spec gives the layout and the settings); ``scratch``: slot
        0; ``prefetch_slot`` / ``prefetch_group``: slot 1 and the process group of the layer-ahead
        prefetch (both or neither; neither: serial path only); ``indexer_layer_ids``: layers that
        store indexer K (None: all)."""
        if state.runtime is not None:
            raise ValueError(f"{FLAG}: this KV pool already has a runtime")
        pool, spec = state.pool, state.spec
        # Slot 0 holds the logical capacity, so decode forwards may gather (False: sized for prefill
        # batches only, decode runs per owner; see ``startup_rules.decide_scratch``).
        self.scratch_serves_decode = spec.scratch_serves_decode
        if self.scratch_serves_decode and scratch.size < spec.layout.cp_size * pool.size:
            raise ValueError(f"{FLAG}: the gather scratch is smaller than the logical capacity")
        if (prefetch_slot is None) != (prefetch_group is None):
            raise ValueError(f"{FLAG}: the prefetch needs both its scratch slot and its group")
        self.state = state
        self.pool = pool
        self.layout = spec.layout
        # The page-mirror check (a debugging aid), as the spec read the settings once for this process.
        self.check_page_mirror = spec.settings.check_page_mirror
        self.scratch = scratch
        self.cp_group = cp_group
        # Logical page ids that can exist: cp_size x (physical pages + the dummy page 0).
        self.num_logical_pages = spec.layout.cp_size * (pool.size // pool.page_size + 1)
        self.scratch_num_pages = scratch.size // scratch.page_size + 1
        self.plan: Optional[PeerPagePlan] = None
        # The EAGLE draft's steps: (step backend, its plan), planned together, each selected when
        # its step runs (``draft_decode_steps``).
        self.draft_step_plans: list = []
        self.planning_draft_steps = False
        slots = [scratch] + ([prefetch_slot] if prefetch_slot is not None else [])
        # Slot choice, prefetch and what each slot holds (reads of anything else raise).
        self.pipeline = LayerPipeline(pool, slots, prefetch_group, indexer_layer_ids)
        self._row_maps_cache: list = []  # [(plan, locs, BatchRowMaps)] of the current forward
        # True while an indexer store runs sglang's original into the physical pool (no forward
        # planned): its fused path fetches the buffer through ``get_index_k_with_scale_buffer``,
        # which must then return the physical buffer rather than the scratch.
        self.writing_physical = False
        # True inside ModelRunner._dummy_run (warm-up), whose batch is not built by init_new.
        self.in_dummy_run = False
        state.runtime = self

    # ---- plan ----

    def begin_forward(self, forward_batch) -> PeerPagePlan:
        """Plan the pages of ``forward_batch`` (called from the backend's metadata init).

        Host data only: lengths from ``seq_lens_cpu`` / ``extend_seq_lens_cpu``, rows from
        ``ForwardBatch.init_new`` (``ROWS_ATTR``), page ids from the ``req_to_token`` mirror. No
        device tensor is read, so launching the forward never waits for the GPU.
        """
        mode = forward_batch.forward_mode
        if mode.is_decode() and not self.scratch_serves_decode and not self.in_dummy_run:
            raise ValueError(
                f"{FLAG}: a decode forward reached the page gather (per-owner decode did not take "
                f"it), but the gather scratch was sized for prefill batches only; "
                f"{DECODE_PATH_ENV}={GATHER} sizes it for gathering decode"
            )
        self.draft_step_plans = []  # a forward of its own ends the draft steps' plans
        if cp_metrics() is not None:
            cp_metrics().observe_usage()
        self.plan = self.build_plan(forward_batch, *planned_lengths(forward_batch))
        # Target verify and draft extend run the whole batch on every rank, like decode: serial path.
        self.pipeline.begin(self.plan, is_decode=not mode.is_context_parallel_extend())
        return self.plan

    def clear_plan(self) -> None:
        """This forward runs without a plan (per-owner decode took it, ``CpSharedKVState``): the
        stores keep the owned rows and gather nothing."""
        self.plan = None

    def build_plan(
        self, forward_batch, seq_lens: np.ndarray, new_token_counts: np.ndarray
    ) -> PeerPagePlan:
        """The plan of ``forward_batch`` whose requests read ``seq_lens`` tokens, the last
        ``new_token_counts`` of them written by this forward (``planned_lengths``). Host only."""
        mirror = self.state.mirror
        rows = getattr(forward_batch, ROWS_ATTR, None)
        if rows is None and self.in_dummy_run:
            # ModelRunner._dummy_run's batch comes from DecodeInputBuffers: every request on row 0.
            rows = np.zeros(0, dtype=np.int64)
        if mirror is None or rows is None:
            raise RuntimeError(
                f"{FLAG}: no host mirror of req_to_token for this forward (the plan reads no device "
                f"tensor)"
            )
        # Batches padded for collectives point their extra requests at row 0 (sglang's padding row).
        rows = np.concatenate((rows, np.zeros(len(seq_lens) - len(rows), dtype=np.int64)))
        page_size = self.layout.page_size
        pages_read = -(-seq_lens // page_size)
        request_pages = [mirror.row_pages(r, p) for r, p in zip(rows.tolist(), pages_read.tolist())]
        if self.check_page_mirror:
            mirror.check(forward_batch.req_to_token_pool.req_to_token, rows.tolist(), seq_lens.tolist())
        return build_peer_page_plan(
            layout=self.layout,
            request_pages=request_pages,
            old_page_counts=(-(-(seq_lens - new_token_counts) // page_size)).tolist(),
            num_logical_pages=self.num_logical_pages,
            scratch_num_pages=self.scratch_num_pages,
            device=self.pool.device,
        )

    # ---- the EAGLE draft's multi-step decode (see draft_decode_steps) ----

    def begin_draft_step_planning(self) -> None:
        """Before ``NativeSparseAttnMultiStepBackend.init_forward_metadata`` plans every step."""
        self.planning_draft_steps = True
        self.draft_step_plans = []

    def end_draft_step_planning(self) -> None:
        """No step runs until it selects its plan (``begin_draft_step``): until then the stores
        have no plan and reads raise."""
        self.planning_draft_steps = False
        self.plan = None
        self.pipeline.clear()

    def plan_draft_step(self, backend, forward_batch) -> PeerPagePlan:
        """The plan of the draft step whose backend is ``backend`` (its ``speculative_step_id``),
        kept for that step (``begin_draft_step``); never per owner (draft steps gather)."""
        mode = forward_batch.forward_mode
        if not mode.is_decode():
            raise ValueError(f"{FLAG}: a draft step in forward mode {mode.name}")
        if not self.scratch_serves_decode:
            raise ValueError(
                f"{FLAG}: the draft's decode steps gather pages, but the gather scratch was sized "
                f"for prefill batches only; {DECODE_PATH_ENV}={GATHER} sizes it for gathering decode"
            )
        step = backend.speculative_step_id
        plan = self.build_plan(forward_batch, *draft_step_lengths(forward_batch, step))
        self.draft_step_plans.append((backend, plan))
        return plan

    def begin_draft_step(self, backend) -> bool:
        """The draft step of ``backend`` starts: its plan becomes the forward's (True), or
        ``backend`` is no draft step planned since the last forward of this runtime (False)."""
        for step_backend, plan in self.draft_step_plans:
            if step_backend is backend:
                self.plan = plan
                self.pipeline.begin(plan, is_decode=True)  # one store per layer and step
                return True
        return False

    # ---- writes (see owner_filtered_writes) ----

    def store_mla_kv(self, original, layer, logical_locs, cache_k_nope, cache_k_rope) -> None:
        """``set_mla_kv_buffer`` of the whole batch: once into the layer's slot, owned rows to the pool."""
        plan = self.plan
        if plan is None:  # nothing reads the scratch (per-owner decode, captured or not)
            physical_locs = self.layout.physical_locs_or_dummy(logical_locs)
            original(self.pool, layer, physical_locs, cache_k_nope, cache_k_rope)
            return
        self._refuse_graph_capture()
        layer_id = layer.layer_id
        slot, prefetched = self.pipeline.slot_for_store(layer_id, KV)
        maps = self.row_maps(plan, logical_locs)
        original(slot, SCRATCH_LAYER, maps.scratch_locs, cache_k_nope, cache_k_rope)
        layer_index = layer_id - self.pool.start_layer
        copy_kv_rows(slot.kv_buffer[SCRATCH_LAYER_ID], self.pool.kv_buffer[layer_index], maps)
        if not prefetched:
            self.wait_for_layer(layer_id)
            gather_peer_pages(
                plan,
                as_pages(self.pool.kv_buffer[layer_index], self.pool.page_size),
                as_pages(slot.kv_buffer[SCRATCH_LAYER_ID], slot.page_size),
                self.cp_group,
            )
        self.pipeline.mark_assembled(layer_id, KV)

    def store_index_k(self, original, indexer, forward_batch, layer_id, key, act_quant) -> None:
        """``Indexer._store_index_k_cache`` of the whole batch, same scheme as ``store_mla_kv``.

        sglang reads the locs from ``forward_batch.out_cache_loc`` (and the pool from
        ``forward_batch.token_to_kv_pool``) on all three of its branches, so both are swapped
        around the call and restored afterwards.
        """
        logical_locs = forward_batch.out_cache_loc
        pool = forward_batch.token_to_kv_pool
        plan = self.plan
        if plan is None:  # physical rows only (per-owner decode, captured or not)
            try:
                forward_batch.out_cache_loc = self.layout.physical_locs_or_dummy(logical_locs)
                self.writing_physical = True
                original(indexer, forward_batch, layer_id, key, act_quant=act_quant)
            finally:
                self.writing_physical = False
                forward_batch.out_cache_loc = logical_locs
            return
        self._refuse_graph_capture()
        slot, prefetched = self.pipeline.slot_for_store(layer_id, INDEX)
        maps = self.row_maps(plan, logical_locs)
        try:
            forward_batch.out_cache_loc = maps.scratch_locs
            forward_batch.token_to_kv_pool = slot
            original(indexer, forward_batch, SCRATCH_LAYER_ID, key, act_quant=act_quant)
        finally:
            forward_batch.out_cache_loc = logical_locs
            forward_batch.token_to_kv_pool = pool
        layer_index = layer_id - self.pool.start_layer
        pool_pages = self.pool.index_k_with_scale_buffer[layer_index]
        slot_pages = slot.index_k_with_scale_buffer[SCRATCH_LAYER_ID]
        copy_index_k_rows(slot_pages, pool_pages, maps, self.pool.page_size, self.pool.index_head_dim)
        if not prefetched:
            self.wait_for_layer(layer_id)
            gather_peer_pages(plan, pool_pages, slot_pages, self.cp_group)
        self.pipeline.mark_assembled(layer_id, INDEX)

    def row_maps(self, plan: PeerPagePlan, logical_locs: torch.Tensor) -> BatchRowMaps:
        """``BatchRowMaps`` of this forward's locs, built once per (plan, locs tensor)."""
        for cached_plan, cached_locs, maps in self._row_maps_cache:
            if cached_plan is plan and cached_locs is logical_locs:
                return maps
        maps = batch_row_maps(plan, self.layout, logical_locs)
        if self._row_maps_cache and self._row_maps_cache[0][0] is not plan:
            self._row_maps_cache = []
        # Holding the locs tensor keeps its identity from being reused within the forward.
        self._row_maps_cache = (self._row_maps_cache + [(plan, logical_locs, maps)])[-2:]
        return maps

    # ---- reads (see peer_page_reads) ----

    def kv_slot_for_read(self, layer_id: int) -> NSATokenToKVPool:
        """The slot holding layer ``layer_id``'s KV; raises unless its store assembled it."""
        return self.pipeline.slot_for_read(layer_id, KV)

    def index_slot_for_read(self, layer_id: int) -> NSATokenToKVPool:
        return self.pipeline.slot_for_read(layer_id, INDEX)

    def wait_for_layer(self, layer_id: int) -> int:
        """Wait for HiCache's load-back of this layer (as the pool getters do); return its index.

        Needed before packing pages for the gather: the packed pages may be the ones being loaded.
        """
        layer_index = layer_id - self.pool.start_layer
        if self.pool.layer_transfer_counter is not None:
            self.pool.layer_transfer_counter.wait_until(layer_index)
        return layer_index

    def _refuse_graph_capture(self) -> None:
        if torch.device(self.pool.device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(
                f"{FLAG} cannot run inside CUDA graphs (per-forward gather sizes vary); use "
                f"--disable-cuda-graph and --disable-piecewise-cuda-graph"
            )


def planned_lengths(forward_batch) -> tuple:
    """``(tokens each request reads, tokens this forward writes at their end)`` per request, int64
    NumPy, from host data only.

    * DECODE: one new token, the last of ``seq_lens_cpu`` (an EAGLE draft step: ``draft_step_lengths``).
    * EXTEND / MIXED: ``extend_seq_lens_cpu`` new tokens ending at ``seq_lens_cpu``.
    * TARGET_VERIFY (EAGLE, top-k 1): ``seq_lens_cpu`` are the committed lengths and the draft tokens
      follow them (sglang's ``prepare_for_verify`` writes them at ``seq_len .. seq_len + n - 1``); the
      NSA backend sets ``extend_seq_lens_cpu`` to ``n`` per request before this hook runs.
    * DRAFT_EXTEND (spec v1, after verify): ``extend_seq_lens_cpu`` accepted tokens ending at
      ``seq_lens_cpu`` (``prepare_extend_after_decode`` sets both).
    * DRAFT_EXTEND_V2 (spec v2, after verify): every draft token the verify wrote, accepted or not,
      ending at ``seq_lens_cpu``: ``prepare_for_extend_to_fill_draft_kvcache`` sets ``seq_lens_cpu``
      to the committed lengths plus the draft token count and ``extend_seq_lens_cpu`` to that count,
      and the NSA backend reads ``seq_lens`` tokens per request (``cache_seqlens``, no draft term).

    Other modes (SPLIT_PREFILL, DLLM_EXTEND, ...) raise ``ValueError``.
    """
    mode = forward_batch.forward_mode
    seq_lens = np.asarray(forward_batch.seq_lens_cpu, dtype=np.int64)
    if mode.is_decode_or_idle():
        return seq_lens, np.ones_like(seq_lens)
    if (
        mode.is_target_verify()
        or mode.is_draft_extend(include_v2=True)
        or mode.is_context_parallel_extend()
    ):
        if forward_batch.extend_seq_lens_cpu is None:
            raise ValueError(f"{FLAG}: forward mode {mode.name} without extend_seq_lens_cpu")
        new_token_counts = np.asarray(forward_batch.extend_seq_lens_cpu, dtype=np.int64)
        if mode.is_target_verify():
            return seq_lens + new_token_counts, new_token_counts
        return seq_lens, new_token_counts
    raise ValueError(f"{FLAG} does not support forward mode {mode.name}")


def draft_step_lengths(forward_batch, step: int) -> tuple:
    """``planned_lengths`` of step ``step`` of EAGLE's multi-step draft (top-k 1, forward mode DECODE).

    Every step's NSA metadata reads the committed ``seq_lens_cpu`` tokens (sglang builds it for all
    steps from the same batch, ``cache_seqlens = seq_lens``), while the step writes its token at
    position ``seq_len + step`` (``assign_draft_cache_locs`` hands each request the locs after its
    committed tokens, one per step), past what it reads. Planned: the pages of tokens
    ``0 .. seq_len + step``, of which the committed tokens' pages are old (gathered: written by
    earlier forwards, the last one too, whatever page it opened), and a page holding only this
    forward's draft tokens (opened by this step or an earlier one, read by none) is filled locally:
    it gives the step's row its own scratch row before it is copied to its owner.
    """
    seq_lens = np.asarray(forward_batch.seq_lens_cpu, dtype=np.int64)
    written = np.full_like(seq_lens, step + 1)  # tokens after the committed ones, this step's last
    return seq_lens + written, written


def mark_dummy_run(original, model_runner, *args, **kwargs):
    """AROUND ``ModelRunner._dummy_run``: its batch has no host rows; they are all row 0."""
    runtime = runtime_of(model_runner.token_to_kv_pool)
    if runtime is None:
        return original(model_runner, *args, **kwargs)
    runtime.in_dummy_run = True
    try:
        return original(model_runner, *args, **kwargs)
    finally:
        runtime.in_dummy_run = False


def register_hooks(registry) -> None:
    registry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner._dummy_run", mark_dummy_run, HookType.AROUND
    )
