"""One rank of an end-to-end check of the CP shared KV runtime against a replicated pool.

Every rank of a CP group (processes joined by a ``torch.distributed`` group) runs ``run_rank`` with
the same seed. It builds this rank's ``NSATokenToKVPool`` shard with a ``CpSharedKVRuntime`` and a
replicated pool of the full logical size that no runtime serves, then replays three forwards of a
small serving story through sglang's own store methods with our hooks applied (``apply_hooks``):

1. EXTEND of two fresh requests (every page is new: nothing to gather);
2. EXTEND of a request whose first page is a cached prefix of another, plus the second chunk of a
   request whose first chunk ended mid-page (old, new and mixed pages), with padded tokens;
   with ``hicache`` the prefix page is being loaded back layer by layer (``LayerWiseLoadBack``);
3. DECODE of the three requests (one opens a new page) plus a padded request (req_to_token row 0).

With ``draft`` the rank also holds an MTP draft pool (one NextN layer, KV and indexer K) sharded by
the same layout, with its own runtime sharing the target's scratch (``cp_shared_kv_draft_pool``):
after each forward's target layers the draft runs its layer on the same batch and mode, as sglang's
EAGLE worker runs its draft extend after a prefill (mode EXTEND); its DECODE is a decode of the draft
layer (the written token is the last one read), not one of EAGLE's draft steps (``draft_steps``
below). Its reads and, at the end, its rows are compared with a replicated one-layer pool like the
target's. With ``spec`` (needs ``draft``) two forwards of EAGLE's speculative step follow:

4. TARGET_VERIFY of the three requests, target layers only: ``DRAFT_TOKENS`` draft tokens each after
   the committed tokens (``seq_lens_cpu`` committed, as sglang's ``prepare_for_verify`` leaves it);
5. DRAFT_EXTEND, the draft layer only, over the tokens each request accepted (the rest dropped), as
   sglang's ``prepare_extend_after_decode`` leaves the batch; with ``spec_v2`` instead spec v2's
   DRAFT_EXTEND_V2 over every draft token the verify wrote (``seq_lens_cpu`` the committed lengths
   plus ``DRAFT_TOKENS``, as ``prepare_for_extend_to_fill_draft_kvcache`` leaves the batch).

With ``draft_steps`` (``--speculative-num-steps``, needs ``spec``) the next EAGLE draft follows:

6. EXTEND of four fresh requests (target and draft): 65 tokens (the last one alone on its page),
   62, 64 and 126 tokens;
7. the draft's multi-step decode over the seven requests and a padded one, as ``EAGLEWorker.draft``
   runs it: every step's metadata built at once through sglang's own
   ``NativeSparseAttnMultiStepBackend.init_forward_metadata`` (hooked by ``draft_decode_steps``;
   the per-step backends stand in for sglang's metadata and run ``forward_dispatch``' hook), then
   ``draft_steps - 1`` forwards of the draft layer, each selecting its plan as the
   ``ModelRunner.forward`` hook does, storing its token at ``seq_len + step`` and reading the
   committed tokens. The draft tokens of the 64-token request open a page at step 0, those of the
   62- and 126-token requests one each at step 2 (two rows on slot 0 of a new page: a write to an
   unplanned page would collide with the other in the scratch's dummy page, whatever the order).
   With ``draft_per_owner`` per-owner decode is attached to the draft's runtime first (as
   ``SGLANG_CP_SHARED_KV_DECODE=per_owner`` would), and the steps must still gather.

Layers in ``skip_index_layers`` behave like sglang's ``skip_topk`` layers: no indexer store, no
indexer read. With a ``prefetch_group`` the runtime gets a second scratch slot and forward 2 runs
the layer-ahead prefetch (``peer_page_prefetch``).

After each layer's stores it compares, bit for bit, what the kernels would read (the remapped
``NSAMetadata`` tables into the getters' buffers) with the replicated pool, and at the end this
rank's physical rows with the replicated rows of the logical locs they hold. Comparisons are
queued on the device and summed once at the end, so nothing waits for the GPU between layers
(a delay kernel before the reads, ``read_delay_ms``, can then expose a missing stream wait).

``plant`` switches on one deliberate bug (test harness only; see ``PLANTS``), so the tests can
show that the check catches it. Used by the gloo unit test and
``scripts/gpu/check_cp_shared_kv_runtime.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist

from sglang.srt.layers.attention.nsa.nsa_indexer import Indexer
from sglang.srt.layers.attention.nsa_backend import NSAMetadata
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror import ReqToPageMirror
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror_writers import ROWS_ATTR
from sglang.srt.layers.attention.nsa_backend import NativeSparseAttnMultiStepBackend
from sglang_cp_shared_kv.model_executor import (
    draft_decode_steps,
    owner_filtered_writes,
    forward_dispatch,
    peer_page_reads,
)
from sglang_cp_shared_kv.model_executor import sync_debug as sync_debug_exemptions
from sglang_cp_shared_kv.model_executor.cp_shared_kv_draft_pool import attach_draft_runtime
from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import (
    CpSharedKVRuntime,
    planned_lengths,
)
from sglang_cp_shared_kv_testing.shared_kv_state import attach_runtime
from sglang_cp_shared_kv.model_executor.per_owner_decode.decode_forward import PerOwnerDecode
from sglang_cp_shared_kv.model_executor.gather_scratch import (
    create_gather_scratch,
    create_prefetch_slot,
)
from sglang_cp_shared_kv.model_executor.scratch_rows import BatchRowMaps
from sglang_cp_shared_kv_testing.cuda_sync_counter import CudaSyncCounter
from sglang_cp_shared_kv_testing.nsa_cpu_kernels import IndexerStub, get_k_and_s_torch
from sglang_cp_shared_kv_testing.peer_page_plan_fills import fill_locs

PAGE_SIZE = 64
KV_DIMS = {"bf16": (torch.bfloat16, 576), "fp8": (torch.float8_e4m3fn, 656)}


# Deliberate bugs the check must catch (never on by default; applied to one runtime instance):
PLANTS = (
    # the prefetch packs a layer without waiting for its HiCache load-back
    "pack_before_load_back",
    # layer l+1's prefetch lands in the slot layer l is about to read (a slot reused too early)
    "prefetch_into_busy_slot",
    # the prefetch of layer l+1 does not wait for the compute stream (GPU: with read_delay_ms)
    "prefetch_without_waiting_for_reads",
    # a mixed page is taken whole from the prefetch: the store skips it (fill-only locs)
    "mixed_page_from_prefetch",
)
# Deliberate bugs of the draft pool's runtime (need ``draft``):
DRAFT_PLANTS = (
    # the first page of each draft store goes to the next rank instead of its owner
    "draft_page_to_wrong_owner",
    # a draft step runs on the previous step's plan (step 0 on its own)
    "draft_step_on_previous_plan",
    # draft steps planned by the decode rule (the last committed token taken as written by the step:
    # a page it opened is filled locally, not gathered; pages draft tokens open are not planned)
    "draft_step_planned_as_decode",
    # draft steps plan the committed tokens only: a page the step's token opens is not planned
    "draft_step_written_page_unplanned",
)


@dataclass
class RankResult:
    rows_compared: int = 0
    mismatches: int = 0
    prefetch_forwards: int = 0
    exact_layout_forwards: int = 0  # plans that packed owners exactly (per-owner broadcasts)
    draft_steps: int = 0  # draft decode step forwards run
    _pending: list = field(default_factory=list)
    # With sync_debug: synchronizing CUDA calls during the forwards, by owner (CudaSyncCounter), and
    # where; the gloo bounces exempted (sync_debug.exempted).
    syncs: Optional[dict] = None
    sync_sites: List[str] = field(default_factory=list)
    exempted_bounces: int = 0

    def compare(self, actual: torch.Tensor, expected: torch.Tensor) -> None:
        """Row-wise bit comparison (dim 0 = rows), queued on the device (see ``finish``)."""
        actual = actual.contiguous().view(torch.uint8).reshape(actual.shape[0], -1)
        expected = expected.contiguous().view(torch.uint8).reshape(expected.shape[0], -1)
        self.rows_compared += actual.shape[0]
        self._pending.append((actual != expected).any(dim=1).sum())

    def finish(self) -> "RankResult":
        if self._pending:
            self.mismatches += int(torch.stack(self._pending).sum())
        self._pending = []
        return self


class LayerWiseLoadBack:
    """A HiCache-like layer-wise load-back of some pages into a shard, standing in for
    ``LayerDoneCounter`` (``pool.layer_transfer_counter``).

    ``arm`` saves the true rows of the pages, overwrites them with garbage and registers itself;
    the rows of layer ``i`` land again only as the load would: on CUDA a load stream restores
    them after a delay kernel and records layer ``i``'s event, and ``wait_until(i)`` makes the
    current stream wait for it (what sglang's counter does); on CPU ``wait_until(i)`` restores
    layer ``i`` itself, so a pack that does not wait reads the garbage in both cases.
    """

    def __init__(self, shard: NSATokenToKVPool, physical_pages: torch.Tensor, delay_ms: float = 0):
        self.shard = shard
        self.pages = physical_pages.long()
        self.rows = (self.pages[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE, device=self.pages.device)).reshape(-1)
        self.delay_ms = delay_ms
        self.saved = []
        self.loaded = []
        self.events = []

    def arm(self) -> None:
        cuda = self.shard.kv_buffer[0].is_cuda
        for layer in range(self.shard.layer_num):
            kv, index = self.shard.kv_buffer[layer], self.shard.index_k_with_scale_buffer[layer]
            self.saved.append((kv[self.rows].clone(), index[self.pages].clone()))
            kv.view(torch.uint8)[self.rows] = 0x5A
            index[self.pages] = 0x5A
        self.loaded = [False] * self.shard.layer_num
        if cuda:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for layer in range(self.shard.layer_num):
                    if self.delay_ms:
                        torch.cuda._sleep(int(self.delay_ms * 2_000_000))
                    self._restore(layer)
                    event = torch.cuda.Event()
                    event.record(stream)
                    self.events.append(event)
        self.shard.register_layer_transfer_counter(self)

    def _restore(self, layer: int) -> None:
        kv_rows, index_pages = self.saved[layer]
        self.shard.kv_buffer[layer][self.rows] = kv_rows
        self.shard.index_k_with_scale_buffer[layer][self.pages] = index_pages
        self.loaded[layer] = True

    def wait_until(self, layer_index: int) -> None:
        if self.events:
            torch.cuda.current_stream().wait_event(self.events[layer_index])
        elif not self.loaded[layer_index]:
            self._restore(layer_index)

    def disarm(self) -> None:
        """Every layer landed (as after the forward), then unregister."""
        for layer in range(self.shard.layer_num):
            self.wait_until(layer)
        self.shard.layer_transfer_counter = None


def apply_plant(runtime: CpSharedKVRuntime, plant: Optional[str]) -> None:
    """Switch on one of ``PLANTS`` on ``runtime`` (instance attributes only)."""
    if plant is None:
        return
    pipeline = runtime.pipeline
    if plant == "pack_before_load_back":
        pipeline.wait_for_load_back = lambda layer_index: None
    elif plant == "prefetch_into_busy_slot":
        gather_into = pipeline.gather_into

        def into_the_other_slot(slot, layer_id, parts):
            other = pipeline.slots[1 - pipeline.slots.index(slot)]
            gather_into(other, layer_id, parts)

        pipeline.gather_into = into_the_other_slot
    elif plant == "prefetch_without_waiting_for_reads":
        # Only the prefetches issued at a layer's first store skip the wait. The forward's first
        # prefetch (``begin``) keeps it: that wait is also the one ordering the side stream after
        # the plan's upload on the compute stream, and a pack issued before its send list lands
        # reads a recycled block as page ids (an index_select device assert, not a mismatch).
        enter_layer, side_waits = pipeline.enter_layer, pipeline.side_waits_for_compute

        def enter_layer_without_waiting(layer_id):
            pipeline.side_waits_for_compute = lambda: None
            try:
                enter_layer(layer_id)
            finally:
                pipeline.side_waits_for_compute = side_waits

        pipeline.enter_layer = enter_layer_without_waiting
    elif plant == "mixed_page_from_prefetch":
        row_maps = runtime.row_maps

        def fill_only(plan, logical_locs):
            maps = row_maps(plan, logical_locs)
            locs = fill_locs(plan, logical_locs)
            rows = locs.long()
            return BatchRowMaps(
                scratch_locs=locs,
                scratch_rows=rows,
                physical_rows=maps.physical_rows,
                scratch_page_slot=(rows // PAGE_SIZE, rows % PAGE_SIZE),
                physical_page_slot=maps.physical_page_slot,
            )

        runtime.row_maps = fill_only
    else:
        raise ValueError(f"unknown plant {plant!r}; one of {PLANTS}")


def apply_draft_plant(runtime: CpSharedKVRuntime, plant: Optional[str]) -> None:
    """Switch on one of ``DRAFT_PLANTS`` on the draft pool's runtime."""
    if plant not in DRAFT_PLANTS:
        return
    if plant == "draft_step_on_previous_plan":
        begin_draft_step = runtime.begin_draft_step

        def on_the_previous_plan(backend):
            backends = [b for b, _ in runtime.draft_step_plans]
            index = backends.index(backend) if backend in backends else -1
            return begin_draft_step(backends[index - 1] if index > 0 else backend)

        runtime.begin_draft_step = on_the_previous_plan
        return
    if plant in ("draft_step_planned_as_decode", "draft_step_written_page_unplanned"):

        def lengths(forward_batch):
            seq_lens = np.asarray(forward_batch.seq_lens_cpu, dtype=np.int64)
            if plant == "draft_step_planned_as_decode":
                return planned_lengths(forward_batch)  # DECODE: (seq_lens, one new token)
            return seq_lens, np.zeros_like(seq_lens)

        def wrongly_planned(backend, forward_batch):
            plan = runtime.build_plan(forward_batch, *lengths(forward_batch))
            runtime.draft_step_plans.append((backend, plan))
            return plan

        runtime.plan_draft_step = wrongly_planned
        return
    layout, row_maps = runtime.layout, runtime.row_maps

    def first_page_to_the_next_rank(plan, logical_locs):
        maps = row_maps(plan, logical_locs)
        page = int(logical_locs[0]) // PAGE_SIZE  # harness only: a host read is fine here
        owner = page % layout.cp_size
        on_page = logical_locs // PAGE_SIZE == page
        slots = (logical_locs % PAGE_SIZE).long()
        rows = maps.physical_rows.clone()
        if layout.cp_rank == (owner + 1) % layout.cp_size:  # writes it over one of its own pages
            rows = torch.where(on_page, layout.physical_page_of(page) * PAGE_SIZE + slots, rows)
        elif layout.cp_rank == owner:  # and the owner does not write it
            rows = torch.where(on_page, slots, rows)
        return dataclasses.replace(
            maps, physical_rows=rows, physical_page_slot=(rows // PAGE_SIZE, rows % PAGE_SIZE)
        )

    runtime.row_maps = first_page_to_the_next_rank


def apply_hooks() -> None:
    """Patch sglang with our write and read hooks (process-wide: call in a dedicated process).

    Registrations inherited from a forked parent are dropped first, so only these hooks apply.
    """
    HookRegistry.reset()
    owner_filtered_writes.register_hooks(HookRegistry)
    peer_page_reads.register_hooks(HookRegistry)
    forward_dispatch.register_hooks(HookRegistry)
    draft_decode_steps.register_hooks(HookRegistry)
    HookRegistry.apply_hooks()


NUM_ROWS = 8  # req_to_token rows: 0 (padding) and seven requests


class _Story:
    """Requests, their logical pages (as the shared allocator would hand them out) and forwards."""

    def __init__(self, layout: CpSharedKVLayout, physical_pages: int, rng: random.Random, device):
        self.layout = layout
        # Allocatable logical pages: cp_size .. cp_size*(physical_pages+1)-1 (pages below are dummy).
        self.free_pages = list(range(layout.cp_size, layout.cp_size * (physical_pages + 1)))
        rng.shuffle(self.free_pages)
        self.req_to_token_pool = SimpleNamespace(
            req_to_token=torch.zeros((NUM_ROWS, 512), dtype=torch.int32, device=device)
        )
        self.req_to_token = self.req_to_token_pool.req_to_token
        # The plan's host mirror, fed from host data as the server's writers feed it.
        self.mirror = ReqToPageMirror.attach(self.req_to_token_pool, PAGE_SIZE)
        self.seq_lens = [0] * NUM_ROWS  # row 0 is sglang's padding row

    def append(self, req: int, num_tokens: int) -> list:
        """Allocate ``num_tokens`` new logical locs for ``req`` (page-aligned positions)."""
        locs = []
        for position in range(self.seq_lens[req], self.seq_lens[req] + num_tokens):
            if position % PAGE_SIZE == 0:
                page = self.free_pages.pop()
                self.mirror.write(req, position // PAGE_SIZE, [page])
            else:
                page = int(self.mirror.pages[req, position // PAGE_SIZE])
            locs.append(page * PAGE_SIZE + position % PAGE_SIZE)
        start = self.seq_lens[req]
        self.req_to_token[req, start : start + num_tokens] = torch.tensor(locs, dtype=torch.int32)
        self.seq_lens[req] += num_tokens
        return locs

    def share_prefix(self, dst: int, src: int, num_tokens: int) -> None:
        self.req_to_token[dst, :num_tokens] = self.req_to_token[src, :num_tokens]
        pages = -(-num_tokens // PAGE_SIZE)
        self.mirror.write(dst, 0, self.mirror.pages[src, :pages].copy())
        self.seq_lens[dst] = num_tokens


DRAFT_TOKENS = 4  # EAGLE top-k 1, 3 steps: speculative_num_draft_tokens
ACCEPTED_TOKENS = (2, 4, 1)  # per request of the verify forward


def _forward_batch(story, mode, reqs, new_counts, out_locs, pool, device, seq_lens_cpu=None):
    if seq_lens_cpu is None:
        seq_lens_cpu = [story.seq_lens[r] if r else 1 for r in reqs]
    return SimpleNamespace(
        forward_mode=mode,
        seq_lens_cpu=torch.tensor(seq_lens_cpu),
        extend_seq_lens_cpu=list(new_counts),
        req_pool_indices=torch.tensor(reqs, dtype=torch.int64, device=device),
        req_to_token_pool=story.req_to_token_pool,
        **{ROWS_ATTR: np.array(reqs, dtype=np.int64)},
        out_cache_loc=torch.tensor(out_locs, dtype=torch.int64, device=device),
        token_to_kv_pool=pool,
    )


def nsa_metadata_for(page_table_1: torch.Tensor, cache_seqlens=None) -> NSAMetadata:
    """A real ``NSAMetadata`` whose index tables come from ``page_table_1``; other fields are dummies
    (``cache_seqlens``: the tokens each request reads, int32, where given)."""
    unused = torch.zeros(1, dtype=torch.int32, device=page_table_1.device)
    return NSAMetadata(
        page_size=PAGE_SIZE,
        cache_seqlens_int32=unused if cache_seqlens is None else cache_seqlens,
        max_seq_len_q=1,
        max_seq_len_k=page_table_1.shape[1],
        cu_seqlens_q=unused,
        cu_seqlens_k=unused,
        page_table_1=page_table_1,
        real_page_table=page_table_1[:, ::PAGE_SIZE] // PAGE_SIZE,
        nsa_cache_seqlens_int32=unused,
        nsa_cu_seqlens_q=unused,
        nsa_cu_seqlens_k=unused,
        nsa_extend_seq_lens_list=[],
        nsa_seqlens_expanded=unused,
    )


def make_nsa_pool(size, dtype_name, num_layers, device) -> NSATokenToKVPool:
    dtype, kv_cache_dim = KV_DIMS[dtype_name]
    return NSATokenToKVPool(
        size=size,
        page_size=PAGE_SIZE,
        kv_lora_rank=512,
        dtype=dtype,
        qk_rope_head_dim=64,
        layer_num=num_layers,
        device=device,
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=kv_cache_dim,
    )


def run_rank(
    cp_rank: int,
    cp_size: int,
    group: dist.ProcessGroup,
    *,
    device: str,
    dtype_name: str,
    act_quant,
    seed: int = 0,
    num_layers: int = 2,
    physical_pages: int = 6,
    prefetch_group: Optional[dist.ProcessGroup] = None,
    prefetch_slot_tokens: Optional[int] = None,
    skip_index_layers: tuple = (),
    hicache: bool = False,
    plant: Optional[str] = None,
    read_delay_ms: float = 0,
    sync_debug: bool = False,
    draft: bool = False,
    spec: bool = False,
    spec_v2: bool = False,
    scratch_tokens: Optional[int] = None,
    draft_steps: int = 0,
    draft_per_owner: bool = False,
) -> RankResult:
    """Run the story on this rank (hooks must be applied); return what was compared.

    ``prefetch_group``: a second group over the same ranks; turns on the layer-ahead prefetch with
    a second slot of ``prefetch_slot_tokens`` tokens (default: the logical capacity).

    ``scratch_tokens``: slot 0 sized for prefill batches only (as with per-owner decode); the
    story then runs its two extend forwards and no decode forward (decode would not gather).

    ``sync_debug``: the forwards' plan, table remap, every layer's stores and the reads run inside a
    ``CudaSyncCounter``, which attributes each synchronizing CUDA call to its innermost package
    frame: ``ours`` must stay 0; ``stock`` (sglang's own setters and kernels, the replica's
    stores included) and ``harness`` (this check's stand-ins and comparisons) are reported.
    """
    if spec and not draft:
        raise ValueError("spec forwards need the draft pool (draft=True)")
    if spec_v2 and not spec:
        raise ValueError("spec v2's draft extend follows the verify (spec=True)")
    if (draft_steps or draft_per_owner) and not spec:
        raise ValueError("the draft's decode steps follow the speculative step (spec=True)")
    layout = CpSharedKVLayout(cp_size, cp_rank, PAGE_SIZE)
    shard = make_nsa_pool(physical_pages * PAGE_SIZE, dtype_name, num_layers, device)
    # Logical page ids reach cp_size * (physical_pages + 1) - 1 (ids below cp_size are dummies),
    # so the replica needs that many pages of rows.
    replica_pages = cp_size * (physical_pages + 1)
    replica = make_nsa_pool((replica_pages - 1) * PAGE_SIZE, dtype_name, num_layers, device)
    prefetch_slot = None
    if prefetch_group is not None:
        tokens = cp_size * shard.size if prefetch_slot_tokens is None else prefetch_slot_tokens
        prefetch_slot = create_prefetch_slot(shard, cp_size, tokens)
    indexer_layers = frozenset(set(range(num_layers)) - set(skip_index_layers))
    rng = random.Random(seed)
    data = torch.Generator().manual_seed(seed)
    story = _Story(layout, physical_pages, rng, device)
    runtime = attach_runtime(
        shard,
        layout,
        create_gather_scratch(shard, cp_size, scratch_tokens),
        group,
        req_to_token_pool=story.req_to_token_pool,
        scratch_serves_decode=scratch_tokens is None,
        prefetch_slot=prefetch_slot,
        prefetch_group=prefetch_group,
        indexer_layer_ids=indexer_layers,
    )
    draft_shard = draft_replica = draft_runtime = None
    if draft:
        draft_shard = make_nsa_pool(physical_pages * PAGE_SIZE, dtype_name, 1, device)
        draft_replica = make_nsa_pool((replica_pages - 1) * PAGE_SIZE, dtype_name, 1, device)
        draft_runtime = attach_draft_runtime(draft_shard, shard)
        apply_draft_plant(draft_runtime, plant)
    if plant not in DRAFT_PLANTS:
        apply_plant(runtime, plant)
    elif not draft:
        raise ValueError(f"plant {plant!r} needs draft=True (it is applied to the draft's runtime)")
    result = RankResult()
    backend = SimpleNamespace(forward_metadata=None)
    indexer = IndexerStub()

    counter = CudaSyncCounter()
    exempted_before = sync_debug_exemptions.exempted

    def run_forward(
        mode, reqs, new_counts, out_locs, load_back_pages=(), delay_ms=0.0, seq_lens_cpu=None,
        models=("target", "draft"),
    ):  # fmt: skip
        """``seq_lens_cpu``: what the batch says (default: every token read); ``models``: which of the
        target's layers and the draft's layer run (the draft's only with ``draft``)."""
        batch = _forward_batch(story, mode, reqs, new_counts, out_locs, shard, device, seq_lens_cpu)
        replica_batch = _forward_batch(
            story, mode, reqs, new_counts, out_locs, replica, device, seq_lens_cpu
        )
        seq_lens = [story.seq_lens[r] if r else 1 for r in reqs]  # tokens each request reads
        logical_table = story.req_to_token[batch.req_pool_indices, : max(seq_lens)]
        num_tokens = len(out_locs)
        # Everything a layer needs is on the device before the first layer: no host wait inside.
        inputs = [
            tuple(
                torch.randn(num_tokens, *shape, generator=data).to(torch.bfloat16).to(device)
                for shape in ((1, 512), (1, 64), (128,))
            )
            for _ in range(num_layers)
        ]
        reads = _ReadIndex(reqs, seq_lens, logical_table, device)
        load_back = None
        owned = [p for p in load_back_pages if layout.owner_of_page(p) == cp_rank]
        if owned:
            pages = torch.tensor([layout.physical_page_of(p) for p in owned], device=device)
            load_back = LayerWiseLoadBack(shard, pages, delay_ms=delay_ms)
            load_back.arm()
        backend.forward_metadata = nsa_metadata_for(logical_table)
        draft_inputs = None
        run_draft = draft and "draft" in models
        if run_draft:
            draft_inputs = tuple(
                torch.randn(num_tokens, *shape, generator=data).to(torch.bfloat16).to(device)
                for shape in ((1, 512), (1, 64), (128,))
            )
        with counter if sync_debug else contextlib.nullcontext():
            if "target" in models:
                _run_layers(batch, replica_batch, inputs, reads, load_back, delay_ms)
            elif load_back is not None:
                load_back.disarm()
            if run_draft:
                _run_draft_layer(
                    mode, reqs, new_counts, out_locs, draft_inputs, reads, logical_table, seq_lens_cpu
                )

    def _run_draft_layer(mode, reqs, new_counts, out_locs, draft_inputs, reads, logical_table, seq_lens_cpu):
        """The NextN layer (layer id 0 of its own one-layer pool) on the same batch and mode."""
        draft_batch = _forward_batch(
            story, mode, reqs, new_counts, out_locs, draft_shard, device, seq_lens_cpu
        )
        replica_batch = _forward_batch(
            story, mode, reqs, new_counts, out_locs, draft_replica, device, seq_lens_cpu
        )
        draft_backend = SimpleNamespace(forward_metadata=nsa_metadata_for(logical_table))
        forward_dispatch.dispatch_forward_metadata(None, draft_backend, draft_batch)
        nope, rope, key = draft_inputs
        for pool_batch in (draft_batch, replica_batch):
            pool = pool_batch.token_to_kv_pool
            Indexer._store_index_k_cache(indexer, pool_batch, 0, key, act_quant=act_quant)
            pool.set_mla_kv_buffer(SimpleNamespace(layer_id=0), pool_batch.out_cache_loc, nope, rope)
        _check_reads(0, reads, draft_backend.forward_metadata, draft_shard, draft_replica, result)

    def run_draft_decode_steps(reqs, num_steps):
        """``EAGLEWorker.draft`` with top-k 1: ``num_steps - 1`` forwards of the draft layer."""
        committed = [story.seq_lens[r] if r else 1 for r in reqs]
        written = num_steps - 1
        step_locs = []  # per request: the locs of its draft tokens, positions seq_len .. +written-1
        for r in reqs:
            if r == 0:
                step_locs.append([0] * written)  # padded: sglang's dummy loc
                continue
            step_locs.append(story.append(r, written))
            story.seq_lens[r] -= written  # the draft tokens are not committed
        all_locs = [loc for locs in step_locs for loc in locs]
        batches = [
            _forward_batch(story, ForwardMode.DECODE, reqs, [1] * len(reqs), all_locs, pool, device, committed)
            for pool in (draft_shard, draft_replica)
        ]  # fmt: skip
        logical_table = story.req_to_token[batches[0].req_pool_indices, : max(committed)]
        cache_seqlens = torch.tensor(committed, dtype=torch.int32, device=device)
        reads = _ReadIndex(reqs, committed, logical_table, device)
        multi_step = NativeSparseAttnMultiStepBackend.__new__(NativeSparseAttnMultiStepBackend)
        multi_step.speculative_num_steps, multi_step.topk = num_steps, 1
        multi_step.attn_backends = [
            _DraftStepBackend(step, nsa_metadata_for(logical_table, cache_seqlens))
            for step in range(written)
        ]
        draft_batch, replica_batch = batches
        # sglang's own loop over the step backends, through the hooks (draft_decode_steps).
        multi_step.init_forward_metadata(draft_batch)
        for step, step_backend in enumerate(multi_step.attn_backends):
            locs = torch.tensor([locs[step] for locs in step_locs], dtype=torch.int64, device=device)
            nope, rope, key = (
                torch.randn(len(reqs), *shape, generator=data).to(torch.bfloat16).to(device)
                for shape in ((1, 512), (1, 64), (128,))
            )
            for pool_batch in (draft_batch, replica_batch):
                pool_batch.out_cache_loc, pool_batch.attn_backend = locs, step_backend
            # What the ModelRunner.forward hook does before the step's forward.
            draft_decode_steps.select_draft_step_plan(None, draft_batch)
            for pool_batch in (draft_batch, replica_batch):
                pool = pool_batch.token_to_kv_pool
                Indexer._store_index_k_cache(indexer, pool_batch, 0, key, act_quant=act_quant)
                pool.set_mla_kv_buffer(SimpleNamespace(layer_id=0), pool_batch.out_cache_loc, nope, rope)
            _check_reads(0, reads, step_backend.forward_metadata, draft_shard, draft_replica, result)
            # Counted where the step ran on one of its forward's step plans.
            result.draft_steps += any(draft_runtime.plan is p for _, p in draft_runtime.draft_step_plans)

    def _run_layers(batch, replica_batch, inputs, reads, load_back, delay_ms):
        forward_dispatch.dispatch_forward_metadata(None, backend, batch)
        result.prefetch_forwards += runtime.pipeline.prefetching
        result.exact_layout_forwards += runtime.plan.exact_layout
        metadata = backend.forward_metadata
        for layer_id in range(num_layers):
            layer = SimpleNamespace(layer_id=layer_id)
            nope, rope, key = inputs[layer_id]
            stores_index = layer_id not in skip_index_layers
            for pool_batch in (batch, replica_batch):
                pool = pool_batch.token_to_kv_pool
                if stores_index:  # sglang's indexer stores before attention stores KV
                    Indexer._store_index_k_cache(
                        indexer, pool_batch, layer_id, key, act_quant=act_quant
                    )
                pool.set_mla_kv_buffer(layer, pool_batch.out_cache_loc, nope, rope)
            if delay_ms and device == "cuda":
                # Hold the compute stream before this layer's reads: a prefetch that does not wait
                # for them overwrites the slot first.
                torch.cuda._sleep(int(delay_ms * 2_000_000))
            _check_reads(layer_id, reads, metadata, shard, replica, result, stores_index)
        if load_back is not None:
            load_back.disarm()

    # 1. Two fresh requests.
    run_forward(ForwardMode.EXTEND, [1, 2], [70, 128], story.append(1, 70) + story.append(2, 128))
    # 2. Request 3 hits request 1's first page as cached prefix (loaded back from host with
    #    ``hicache``); request 1's second chunk starts mid-page (a mixed page); three padded
    #    tokens (loc 0).
    story.share_prefix(3, 1, PAGE_SIZE)
    prefix_page = int(story.req_to_token[1, 0]) // PAGE_SIZE
    out_locs = story.append(1, 40) + story.append(3, 50) + [0, 0, 0]
    run_forward(
        ForwardMode.EXTEND,
        [1, 3],
        [40, 50],
        out_locs,
        load_back_pages=(prefix_page,) if hicache else (),
        delay_ms=read_delay_ms,
    )
    # 3. Decode; request 2 opens a new page; one padded request (row 0).
    if scratch_tokens is None:
        out_locs = story.append(1, 1) + story.append(2, 1) + story.append(3, 1) + [0]
        run_forward(ForwardMode.DECODE, [1, 2, 3, 0], [1, 1, 1, 1], out_locs)
    if spec:
        # 4. Target verify: the draft tokens follow each request's committed tokens.
        reqs = [1, 2, 3]
        committed = [story.seq_lens[r] for r in reqs]
        out_locs = [loc for r in reqs for loc in story.append(r, DRAFT_TOKENS)]
        run_forward(
            ForwardMode.TARGET_VERIFY, reqs, [DRAFT_TOKENS] * len(reqs), out_locs,
            seq_lens_cpu=committed, models=("target",),
        )  # fmt: skip
        if spec_v2:
            # 5 (spec v2). Draft extend over every draft token, at the locs the verify wrote.
            run_forward(
                ForwardMode.DRAFT_EXTEND_V2, reqs, [DRAFT_TOKENS] * len(reqs), out_locs,
                models=("draft",),
            )  # fmt: skip
    if spec and not spec_v2:
        # 5. Draft extend over the accepted tokens; the rejected ones are no longer read.
        out_locs = []
        for r, start, accepted in zip(reqs, committed, ACCEPTED_TOKENS):
            story.seq_lens[r] = start + accepted
            out_locs += story.req_to_token[r, start : start + accepted].tolist()
        run_forward(
            ForwardMode.DRAFT_EXTEND, reqs, list(ACCEPTED_TOKENS), out_locs, models=("draft",)
        )

    if draft_steps:
        # 6. Four fresh requests: the last of 65 tokens opened its page; the draft tokens of the
        #    64-token request open a page at step 0, those of the 62- and 126-token ones at step 2.
        fresh = {4: 65, 5: 62, 6: 64, 7: 126}
        out_locs = [loc for r, n in fresh.items() for loc in story.append(r, n)]
        run_forward(ForwardMode.EXTEND, list(fresh), list(fresh.values()), out_locs)
        if draft_per_owner:
            PerOwnerDecode(draft_runtime.state)  # decode of the draft pool would run per owner
        # 7. The draft's decode steps over every request and a padded one.
        with counter if sync_debug else contextlib.nullcontext():
            run_draft_decode_steps([1, 2, 3, 4, 5, 6, 7, 0], draft_steps)

    _check_shard(layout, shard, replica, num_layers, result)
    if draft:
        _check_shard(layout, draft_shard, draft_replica, 1, result)
    if sync_debug:
        result.syncs = counter.counts() if counter.available else None
        result.sync_sites = [f"{owner}: {site}" for owner, site in counter.sites]
        result.exempted_bounces = sync_debug_exemptions.exempted - exempted_before
    return result.finish()


class _DraftStepBackend:
    """One step's ``NativeSparseAttnBackend`` of the multi-step backend: its metadata init stands
    in for sglang's (the committed tokens' tables of the whole batch) and then runs the backend's
    metadata hook as the hook registry would."""

    def __init__(self, step: int, metadata: NSAMetadata):
        self.speculative_step_id = step
        self._metadata = metadata
        self.forward_metadata = None

    def init_forward_metadata(self, forward_batch) -> None:
        self.forward_metadata = self._metadata
        forward_dispatch.dispatch_forward_metadata(None, self, forward_batch)


class _ReadIndex:
    """Host-built index tensors of one forward's reads (built before any layer runs)."""

    def __init__(self, reqs, seq_lens, logical_table, device):
        # Padded requests (req_to_token row 0) read the dummy page, as in stock sglang: not compared.
        self.rows = [row for row, req in enumerate(reqs) if req != 0]
        self.real_lens = [seq_lens[row] for row in self.rows]
        self.logical_table = logical_table
        self.seq_len_tensor = torch.tensor(self.real_lens, device=device)
        self.seq_len_cpu = torch.tensor(self.real_lens)
        self.rows_t = torch.tensor(self.rows, device=device)
        self.logical_pages = logical_table[self.rows_t, ::PAGE_SIZE] // PAGE_SIZE
        self.totals = (sum(self.real_lens), max(self.real_lens))


def _check_reads(layer_id, reads, metadata, shard, replica, result, stores_index=True):
    scratch_kv = shard.get_key_buffer(layer_id)
    replica_kv = replica.get_key_buffer(layer_id)
    for row, seq_len in zip(reads.rows, reads.real_lens):
        scratch_locs = metadata.page_table_1[row, :seq_len].long()
        logical_locs = reads.logical_table[row, :seq_len].long()
        result.compare(scratch_kv[scratch_locs], replica_kv[logical_locs])
    if not stores_index:  # a skip_topk layer reads the previous layer's top-k, not indexer K
        return
    scratch_pages = metadata.real_page_table[reads.rows_t]
    logical_pages, totals = reads.logical_pages, reads.totals
    # Prefill indexer read (ragged): the hooked getter and sglang's gather kernel.
    k, s = shard.get_index_k_scale_buffer(layer_id, reads.seq_len_tensor, scratch_pages, *totals)
    k_ref, s_ref = replica.get_index_k_scale_buffer(
        layer_id, reads.seq_len_tensor, logical_pages, *totals
    )
    result.compare(torch.cat([k, s], dim=1), torch.cat([k_ref, s_ref], dim=1))
    # Decode indexer read (paged): the whole buffer from the hooked getter, addressed by page.
    buffer = shard.get_index_k_with_scale_buffer(layer_id)
    k, s = get_k_and_s_torch(shard, buffer, scratch_pages, reads.seq_len_cpu, *totals)
    buffer = replica.get_index_k_with_scale_buffer(layer_id)
    k_ref, s_ref = get_k_and_s_torch(replica, buffer, logical_pages, reads.seq_len_cpu, *totals)
    result.compare(torch.cat([k, s], dim=1), torch.cat([k_ref, s_ref], dim=1))


def _check_shard(layout, shard, replica, num_layers, result) -> None:
    """Each real physical row holds exactly the replicated row of the logical loc it stores."""
    pages = torch.arange(1, shard.size // PAGE_SIZE + 1, device=shard.kv_buffer[0].device)
    logical_pages = layout.logical_page_of(pages)
    physical_locs = layout.rows_of_pages(pages * PAGE_SIZE)
    logical_locs = layout.rows_of_pages(logical_pages * PAGE_SIZE)
    for layer in range(num_layers):
        result.compare(shard.kv_buffer[layer][physical_locs], replica.kv_buffer[layer][logical_locs])
        result.compare(
            shard.index_k_with_scale_buffer[layer][pages],
            replica.index_k_with_scale_buffer[layer][logical_pages],
        )
