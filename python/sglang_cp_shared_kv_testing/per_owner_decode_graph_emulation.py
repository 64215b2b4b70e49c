"""One per-owner NSA decode layer of every CP rank in one process, over static buffers, for graph checks.

NCCL cannot put two ranks on one GPU and gloo cannot be captured, so the CP ranks are emulated
inside one process: each rank's shard (KV rows in the decode impl's format: fp8 656-byte rows for
``flashmla_kv``, bf16 576-wide rows for ``flashmla_sparse`` and ``fa3``; indexer pages) and its
``OwnerTableBuffers`` live side by side, and the exchanges are device ops (the candidate all-gather a ``torch.stack``;
the merge in the form asked, ``merge_form``: the one exchange's packed partials stacked and merged
by ``attention_lse_merge.merge_gathered``, the fused kernel on CUDA, or the scaled sum's LSE stack
and sum over ranks). ``EmulatedDecodeLayer.step`` reads only static tensors, so it can
be captured in one CUDA graph and replayed after ``load`` wrote a new batch into them and
``refresh`` rebuilt the owner tables (what the replay metadata hook does on a server).

``fresh_step`` computes the same layer from tables built fresh from the batch (no static owner
tables): a replay whose tables were not refreshed differs from it. ``replicated`` is the same
layer over the replicated pool. Kernels are injected (``GraphKernels``): the real ones on an H200,
torch references on CPU; each impl's attention is called as the runtime calls it
(``nsa_decode_kernel_calls``: fa3 over the compacted owned indices, their count as
``cache_seqlens``, inside the captured layer) and its LSE read in the base per-owner decode declares
for it (``per_owner_decode.SERVED_DECODE_IMPLS``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.model_executor.per_owner_decode import attention_lse_merge as merge
from sglang_cp_shared_kv.model_executor.per_owner_decode.decode_topk_merge import (
    local_candidates,
    owned_attention_indices,
    select_global,
)
from sglang_cp_shared_kv.model_executor.per_owner_decode.owner_decode_tables import (
    OwnerDecodeTables,
    build_owner_decode_tables,
)
from sglang_cp_shared_kv.model_executor.per_owner_decode.decode_forward import (
    SERVED_DECODE_IMPLS,
    OwnerForward,
)
from sglang_cp_shared_kv.model_executor.per_owner_decode.cuda_graphs import OwnerTableBuffers
from sglang_cp_shared_kv_testing import nsa_decode_kernel_calls as calls
from sglang_cp_shared_kv_testing import nsa_decode_reference as ref
from sglang_cp_shared_kv_testing.decode_topk_reference import replicated_topk_positions, selected_positions
from sglang_cp_shared_kv_testing.per_owner_decode_hooked import KV_DIM, pool_rows

PAGE = 64
INDEX_HEADS = 32


@dataclass
class ImplAttention:
    """One decode impl's attention: ``metadata(lens)`` -> the kernel's schedule, refreshed outside
    the graph as sglang does (None where the kernel has none); ``call(q, rows, indices, sm_scale,
    lens, metadata)`` -> (out [B, H, 512], LSE [B, H] in the kernel's base)."""

    metadata: Callable
    call: Callable


def _no_metadata(lens):
    return None


@dataclass
class GraphKernels:
    """``logits(q_fp8, weights, pages, block_table, lens, schedule)`` -> [B, W * PAGE] float32;
    ``schedule(lens)`` -> indexer schedule or None; ``attention``: decode impl -> ``ImplAttention``
    (impls that do not run here are in ``skipped``, with the reason)."""

    logits: Callable
    schedule: Callable
    attention: Dict[str, ImplAttention]
    names: dict
    skipped: Dict[str, str] = field(default_factory=dict)


def reference_attention() -> Dict[str, ImplAttention]:
    """Every impl's call over its torch reference (fa3 and flashmla_sparse through the same calls as
    the real kernels: compaction, base-2 LSE)."""

    def flashmla_kv(q, rows, indices, sm_scale, lens, metadata):
        out, lse = ref.sparse_mla_decode_reference(q, ref.kv_rows_as_float(rows), indices, sm_scale)
        return out.to(q.dtype), lse

    def flashmla_sparse(q, rows, indices, sm_scale, lens, metadata):
        return calls.flashmla_sparse_call(ref.flash_mla_sparse_fwd_reference, q, rows, indices, sm_scale)

    def fa3(q, rows, indices, sm_scale, lens, metadata):
        return calls.fa3_call(ref.fa3_paged_decode_reference, q, rows, indices, sm_scale, lens)

    return {impl: ImplAttention(_no_metadata, fn)
            for impl, fn in (("flashmla_kv", flashmla_kv), ("flashmla_sparse", flashmla_sparse), ("fa3", fa3))}


def reference_kernels(decode_impls=calls.DECODE_IMPLS) -> GraphKernels:
    def logits(q_fp8, weights, pages, block_table, lens, schedule):
        return ref.paged_mqa_logits_reference(q_fp8, weights, pages, block_table, lens, PAGE)

    attention = reference_attention()
    names = {"indexer": "torch reference", "attention": "torch references"}
    return GraphKernels(logits, _no_metadata, {impl: attention[impl] for impl in decode_impls}, names)


@dataclass
class Batch:
    page_table: torch.Tensor  # [bs, W] int32 logical pages (0: padding, stale past the pages)
    seq_lens: torch.Tensor  # [bs] int32
    kv_rows: torch.Tensor  # replicated rows [cp * P * PAGE, 656] uint8 (fp8) or [.., 576] bf16
    index_pages: torch.Tensor  # replicated indexer pages [cp * P, PAGE * 132] uint8
    q_index: torch.Tensor  # [bs, INDEX_HEADS, 128] fp8
    weights: torch.Tensor  # [bs, INDEX_HEADS] float32
    q: torch.Tensor  # [bs, H, 576] bf16


def random_batch(g, cp_size, physical_pages, width_pages, seq_lens: List[int], heads, device,
                 kv_dtype: str = "fp8") -> Batch:
    """Requests of ``seq_lens`` (0: a padded request) on distinct random pages of a pool of
    ``cp_size * physical_pages`` logical pages, with random contents (KV rows as a ``kv_dtype``
    pool stores them)."""
    bs = len(seq_lens)
    table = torch.zeros((bs, width_pages), dtype=torch.int32)
    free = torch.arange(cp_size, cp_size * physical_pages)[torch.randperm(cp_size * (physical_pages - 1), generator=g)]
    taken = 0
    for b, seq_len in enumerate(seq_lens):
        if seq_len == 0:
            continue
        n = -(-seq_len // PAGE)
        table[b, :n] = free[taken : taken + n].to(torch.int32)
        table[b, n:] = free[torch.randint(0, free.numel(), (width_pages - n,), generator=g)].to(torch.int32)
        taken += n
    rows = cp_size * physical_pages * PAGE
    kv = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
    index_k = torch.randn(rows, 128, generator=g).to(torch.float8_e4m3fn)
    index_scale = torch.rand(rows, generator=g) + 0.5
    return Batch(
        page_table=table.to(device),
        seq_lens=torch.tensor([max(s, 1) for s in seq_lens], dtype=torch.int32, device=device),
        kv_rows=pool_rows(kv.to(device), kv_dtype),
        index_pages=ref.index_pages(index_k.to(device), index_scale.to(device), PAGE),
        q_index=torch.randn(bs, INDEX_HEADS, 128, generator=g).to(device).to(torch.float8_e4m3fn),
        weights=(torch.rand(bs, INDEX_HEADS, generator=g) * 0.1).to(device),
        q=(torch.randn(bs, heads, 576, generator=g) * 3.0).to(device).to(torch.bfloat16),
    )


class EmulatedDecodeLayer:
    """Static inputs of one decode layer of ``bs`` requests and every rank's shard and tables, for
    ``decode_impl`` (its KV row format, attention call and LSE base)."""

    def __init__(self, cp_size, physical_pages, width_pages, bs, heads, topk, kernels: GraphKernels, device,
                 decode_impl: str = "flashmla_kv", merge_form: str = merge.ONE_EXCHANGE):
        self.cp_size, self.physical_pages, self.topk, self.kernels = cp_size, physical_pages, topk, kernels
        self.merge_form = merge_form
        self.decode_impl = decode_impl
        self.kv_dtype = calls.KV_DTYPE_OF_IMPL[decode_impl]
        self.attention = kernels.attention[decode_impl]
        self.lse_base = SERVED_DECODE_IMPLS[decode_impl]
        self.bs, self.width_pages, self.heads = bs, width_pages, heads
        self.layouts = [CpSharedKVLayout(cp_size, r, PAGE) for r in range(cp_size)]
        self.page_table = torch.zeros((bs, width_pages), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(bs, dtype=torch.int32, device=device)
        self.q_index = torch.zeros((bs, INDEX_HEADS, 128), dtype=torch.float8_e4m3fn, device=device)
        self.weights = torch.zeros((bs, INDEX_HEADS), dtype=torch.float32, device=device)
        self.q = torch.zeros((bs, heads, 576), dtype=torch.bfloat16, device=device)
        kv_row_dtype = torch.uint8 if self.kv_dtype == "fp8" else torch.bfloat16
        self.kv_shards = [torch.zeros((physical_pages * PAGE, KV_DIM[self.kv_dtype]), dtype=kv_row_dtype,
                                      device=device) for _ in range(cp_size)]
        self.index_shards = [torch.zeros((physical_pages, PAGE * 132), dtype=torch.uint8, device=device)
                             for _ in range(cp_size)]
        self.buffers = [OwnerTableBuffers(bs, width_pages, PAGE, device) for _ in range(cp_size)]
        # Each rank's per-owner forward state, made once at the first refresh, as sglang's capture
        # metadata hook makes it once before its warm-ups and the capture: the captured step must
        # derive its columns itself (``OwnerForward.begin_layer``), not reuse a warm-up's.
        self.forwards: Optional[List[OwnerForward]] = None
        self.attention_metadata = None
        self.sm_scale = 576**-0.5

    # ---- host side of a replay: new contents, then the metadata refresh ----

    def load(self, batch: Batch) -> None:
        """Write ``batch`` into the static inputs and every rank's shard (copies, same storage)."""
        self.page_table.copy_(batch.page_table)
        self.seq_lens.copy_(batch.seq_lens)
        self.q_index.copy_(batch.q_index)
        self.weights.copy_(batch.weights)
        self.q.copy_(batch.q)
        for rank, layout in enumerate(self.layouts):
            physical = torch.arange(self.physical_pages, device=self.q.device)
            logical = layout.logical_page_of(physical)
            self.index_shards[rank].copy_(batch.index_pages[logical])
            rows = (logical[:, None] * PAGE + torch.arange(PAGE, device=self.q.device)).reshape(-1)
            self.kv_shards[rank].copy_(batch.kv_rows[rows])

    def refresh(self, skip_ranks=()) -> None:
        """What the replay metadata hook does: rebuild every rank's static tables (and schedule, and
        the attention kernel's metadata) from the static page table and lengths. ``skip_ranks``:
        ranks whose refresh is left out (the stale-buffer plant)."""
        for rank, (layout, buffers) in enumerate(zip(self.layouts, self.buffers)):
            if rank in skip_ranks:
                continue
            buffers.refresh(layout, self.page_table, self.seq_lens, self.kernels.schedule)
        if self.forwards is None:
            self.forwards = [OwnerForward(b.tables(self.bs), b.schedules.get(self.bs)) for b in self.buffers]
        metadata = self.attention.metadata(self._attention_lens())
        if self.attention_metadata is None or metadata is None:
            self.attention_metadata = metadata
        else:
            for held, new in zip(self.attention_metadata, metadata):
                held.copy_(new)

    def _attention_lens(self):
        return self.seq_lens.clamp(max=self.topk).to(torch.int32)

    # ---- the captured part ----

    def step(self) -> torch.Tensor:
        """Merged output [bs, H, 512] from static tensors only (capturable)."""
        return self._layer([b.tables(self.bs) for b in self.buffers],
                           [b.schedules.get(self.bs) for b in self.buffers], forwards=self.forwards)[0]

    def fresh_step(self, merge_form: Optional[str] = None) -> torch.Tensor:
        """The same layer from tables built fresh from the static page table (not captured), its
        merge in ``merge_form`` (default: the layer's)."""
        tables = [build_owner_decode_tables(l, self.page_table, self.seq_lens) for l in self.layouts]
        schedules = [self.kernels.schedule(t.owned_seq_lens) for t in tables]
        metadata = self.attention.metadata(self._attention_lens())
        return self._layer(tables, schedules, metadata, merge_form=merge_form)[0]

    def selection(self) -> torch.Tensor:
        return self._layer([b.tables(self.bs) for b in self.buffers],
                           [b.schedules.get(self.bs) for b in self.buffers], forwards=self.forwards)[1]

    def _layer(self, tables: List[OwnerDecodeTables], schedules, metadata=None, forwards=None, merge_form=None):
        """``forwards``: the ranks' per-owner forward states, whose columns the runtime derives
        (``OwnerForward.columns``, once per run); None derives them here (the fresh layer)."""
        metadata = self.attention_metadata if metadata is None else metadata
        merge_form = self.merge_form if merge_form is None else merge_form
        width = self.width_pages * PAGE
        candidates = []
        for rank, t in enumerate(tables):
            logits = self.kernels.logits(self.q_index, self.weights, self.index_shards[rank],
                                         t.physical_page_table, t.owned_seq_lens, schedules[rank])
            if forwards is None:
                positions, rows = t.local_positions(width), t.local_physical_rows(width)
            else:
                forwards[rank].begin_layer(0)  # one top-k layer per run
                positions, rows = forwards[rank].columns(width)
            candidates.append(local_candidates(logits.float(), t.owned_seq_lens, positions, rows, self.topk))
        selection = select_global(torch.stack([c.scores for c in candidates]), self.topk)  # the all-gather
        outs, lses = [], []
        for rank in range(self.cp_size):
            indices = owned_attention_indices(selection, candidates[rank], rank)
            out, lse = self.attention.call(self.q, self.kv_shards[rank], indices, self.sm_scale,
                                           self._attention_lens(), metadata)
            outs.append(out)
            lses.append(merge.natural_lse(lse, self.lse_base))
        positions = selected_positions(selection, torch.stack([c.positions for c in candidates]))
        if merge_form == merge.ONE_EXCHANGE:  # every rank merges the same gathered bytes
            gathered = torch.stack([merge.pack_partial(out, lse) for out, lse in zip(outs, lses)])
            return merge.merge_gathered(gathered, outs[0].shape[-1]), positions
        lse_all = merge.global_lse(torch.stack(lses))  # the LSE all-gather
        merged = torch.zeros_like(outs[0])
        for out, lse in zip(outs, lses):  # the sum all-reduce, rank by rank
            merged = merged + merge.scaled_partial(out, lse, lse_all).to(out.dtype)
        return merged, positions

    # ---- the replicated pool ----

    def replicated(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, selected positions) of the replicated pool for ``batch``."""
        lens = batch.seq_lens
        logits = self.kernels.logits(batch.q_index, batch.weights, batch.index_pages, batch.page_table,
                                     lens, self.kernels.schedule(lens)).float()
        positions = replicated_topk_positions(logits, lens, self.topk)
        slot = torch.arange(PAGE, device=lens.device)
        locs = (batch.page_table.long()[:, :, None] * PAGE + slot).reshape(lens.shape[0], -1)
        indices = torch.where(positions >= 0, locs.gather(1, positions.clamp(min=0).long()), -1)
        metadata = self.attention.metadata(lens.clamp(max=self.topk).to(torch.int32))
        out, _ = self.attention.call(batch.q, batch.kv_rows, indices, self.sm_scale,
                                     lens.clamp(max=self.topk).to(torch.int32), metadata)
        return out, positions


def rel_err(out: torch.Tensor, expected: torch.Tensor, rows: Optional[torch.Tensor] = None) -> float:
    """Largest relative L2 error over requests (``rows``: which to compare)."""
    diff = (out.float() - expected.float()).flatten(1)
    norm = expected.float().flatten(1).norm(dim=1).clamp_min(1e-12)
    err = diff.norm(dim=1) / norm
    if rows is not None:
        err = err[rows]
    return float(err.max()) if err.numel() else 0.0
