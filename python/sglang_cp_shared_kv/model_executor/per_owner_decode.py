"""Per-owner NSA decode wired into sglang's decode forward: no page gather, a fixed exchange per layer.

In a decode forward each rank scores and attends over its own physical pool only:

1. ``begin_forward`` (called by the backend's metadata hook, ``peer_page_reads``): no peer-page plan
   (``CpSharedKVRuntime.plan = None``: the store hooks store owner-filtered rows and gather
   nothing); instead this rank's block tables (``owner_decode_tables``) and the deep_gemm schedule
   for its owned lengths. The pool getters then serve the physical buffers (``serves_physical``).
2. ``NativeSparseAttnBackend.get_indexer_metadata`` AFTER: ``PerOwnerIndexerMetadata``, whose
   ``attn_metadata`` carries the owned block table and lengths, and whose ``topk_transform`` turns
   the scores of owned tokens into candidates, all-gathers them, selects the global top-k and
   returns this rank's attention indices (physical rows it owns, -1 elsewhere; see
   ``decode_topk_merge``). sglang's ``Indexer._get_topk_paged`` runs unchanged around it; with
   ``SGLANG_NSA_FUSE_TOPK`` (sglang's default) ``forward_decode`` passes those indices to the kernel
   as they are. ``skip_topk`` layers reuse them (no exchange).
3. ``NativeSparseAttnBackend._forward_flashmla_kv`` AROUND: sglang's own kernel call, with the
   ``softmax_lse`` it drops kept (the call site's ``flash_mla_with_kvcache`` is wrapped for the
   duration), then the LSE merge over the attention CP group (``attention_lse_merge``, scaled sum):
   every rank returns the same output.

Served: decode forwards (not idle, not speculative) with ``flashmla_kv`` decode and fused top-k.
``attach`` decides once per server from state identical on every rank; otherwise decode keeps the page
gather, and the log says so. Prefill keeps the plan path. Eager only: CUDA-graph decode stays refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Optional

import torch

from sglang.srt.layers.attention.nsa_backend import NSAIndexerMetadata
from sglang.srt.plugins.hook_registry import HookType
from sglang_cp_shared_kv.model_executor.attention_lse_merge import (
    merge_by_scaled_sum,
    natural_lse,
    process_group_collectives,
)
from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import runtime_of
from sglang_cp_shared_kv.model_executor.decode_topk_merge import (
    local_candidates,
    owned_attention_indices,
    select_global,
)
from sglang_cp_shared_kv.model_executor.owner_decode_tables import (
    OwnerDecodeTables,
    build_owner_decode_tables,
)

logger = logging.getLogger(__name__)

_BACKEND = "sglang.srt.layers.attention.nsa_backend.NativeSparseAttnBackend"
_STATE_ATTR = "_cp_per_owner_decode"
SERVED_DECODE_IMPL = "flashmla_kv"
# flash_mla_with_kvcache with indices returns a natural-log LSE shaped [B, H, 1].
FLASHMLA_KV_LSE_BASE = math.e


@dataclasses.dataclass
class OwnerForward:
    """What one decode forward needs on this rank (built once, read by every layer)."""

    tables: OwnerDecodeTables
    paged_mqa_schedule: Optional[torch.Tensor]
    local_columns: dict = dataclasses.field(default_factory=dict)  # width -> (positions, rows)

    def columns(self, width_tokens: int):
        if width_tokens not in self.local_columns:
            self.local_columns[width_tokens] = (
                self.tables.local_positions(width_tokens),
                self.tables.local_physical_rows(width_tokens),
            )
        return self.local_columns[width_tokens]


class PerOwnerDecode:
    """Per-owner decode state of one runtime; constructing it attaches it to the runtime's pool."""

    def __init__(self, runtime, schedule_fn=None):
        self.runtime = runtime
        self.cp_rank = runtime.layout.cp_rank
        self.group = runtime.cp_group
        self.all_gather, self.all_reduce_sum = process_group_collectives(runtime.cp_group)
        # (owned_seq_lens int32 [B]) -> deep_gemm schedule metadata; None where deep_gemm is absent.
        self.schedule_fn = schedule_fn
        self.forward: Optional[OwnerForward] = None
        setattr(runtime.pool, _STATE_ATTR, self)

    def begin_forward(self, backend, forward_batch) -> bool:
        """Take over a decode forward (True), or leave it to the page gather (False)."""
        mode = forward_batch.forward_mode
        if not mode.is_decode() or mode.is_idle():
            self.forward = None
            return False
        runtime = self.runtime
        runtime.plan = None  # stores: owner-filtered only, no scratch, no gather
        runtime.kv_layer_in_scratch = runtime.index_layer_in_scratch = None
        metadata = backend.forward_metadata
        tables = build_owner_decode_tables(
            runtime.layout, metadata.real_page_table, metadata.cache_seqlens_int32
        )
        schedule = None
        if metadata.paged_mqa_schedule_metadata is not None and self.schedule_fn is not None:
            schedule = self.schedule_fn(tables.owned_seq_lens)
        self.forward = OwnerForward(tables, schedule)
        setattr(backend, _STATE_ATTR, self)  # the attention hook finds the forward's state here
        return True

    def select(self, logits: torch.Tensor, topk: int) -> torch.Tensor:
        """Scores of this rank's owned tokens [B, L] -> its attention indices [B, topk] int32.
        Every rank calls it once per top-k layer (one all-gather), whatever it owns."""
        positions, rows = self.forward.columns(logits.shape[1])
        candidates = local_candidates(logits, positions, rows, topk)
        selection = select_global(self.all_gather(candidates.keys))  # [cp_size, B, k] keys
        return owned_attention_indices(selection, candidates, self.cp_rank)

    def merge(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """This rank's partial [T, H, D] and LSE [T, H] (kernel's base) -> the merged output."""
        lse = natural_lse(lse, FLASHMLA_KV_LSE_BASE)
        return merge_by_scaled_sum(out, lse, self.all_gather, self.all_reduce_sum)


def per_owner_of(pool) -> Optional[PerOwnerDecode]:
    return getattr(pool, _STATE_ATTR, None)


def serves_physical(runtime) -> bool:
    """True while a per-owner decode forward runs: the getters serve the physical pool."""
    state = per_owner_of(runtime.pool)
    return state is not None and state.forward is not None


def begin_forward(runtime, backend, forward_batch) -> bool:
    """Hook point of the backend's metadata hook: True when this forward is decoded per owner."""
    state = per_owner_of(runtime.pool)
    return state is not None and state.begin_forward(backend, forward_batch)


@dataclasses.dataclass(frozen=True)
class PerOwnerIndexerMetadata(NSAIndexerMetadata):
    """sglang's indexer metadata over this rank's owned pages; top-k through ``PerOwnerDecode``."""

    per_owner: Optional[PerOwnerDecode] = None

    def topk_transform(self, logits: torch.Tensor, topk: int, **kwargs) -> torch.Tensor:
        if kwargs.get("ks") is not None or kwargs.get("cu_seqlens_q") is not None:
            raise ValueError("per-owner decode top-k serves the paged decode indexer only")
        return self.per_owner.select(logits, topk)


def indexer_metadata_per_owner(result, backend, layer_id, forward_batch, *args, **kwargs):
    """AFTER ``get_indexer_metadata``: in a per-owner forward, score the owned pages."""
    runtime = runtime_of(forward_batch.token_to_kv_pool)
    state = None if runtime is None else per_owner_of(runtime.pool)
    if state is None or state.forward is None or result is None:
        return None
    tables = state.forward.tables
    attn_metadata = dataclasses.replace(
        result.attn_metadata,
        real_page_table=tables.physical_page_table,
        cache_seqlens_int32=tables.owned_seq_lens,
    )
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(NSAIndexerMetadata)}
    fields.update(
        attn_metadata=attn_metadata,
        paged_mqa_schedule_metadata=state.forward.paged_mqa_schedule,
        per_owner=state,
    )
    return PerOwnerIndexerMetadata(**fields)


def forward_flashmla_kv_per_owner(original, backend, *args, **kwargs):
    """AROUND ``_forward_flashmla_kv``: sglang's kernel call keeping the LSE, then the merge."""
    state = getattr(backend, _STATE_ATTR, None)
    if state is None or state.forward is None:
        return original(backend, *args, **kwargs)
    with _kept_lse() as kept:
        out = original(backend, *args, **kwargs)  # [B, 1, H, D], heads already un-padded
    batch, q_len, heads, dim = out.shape
    lse = kept["lse"][:, :heads, :].transpose(1, 2).reshape(batch * q_len, heads)
    merged = state.merge(out.reshape(batch * q_len, heads, dim), lse)
    return merged.reshape(batch, q_len, heads, dim)


@contextlib.contextmanager
def _kept_lse():
    """Wrap ``sgl_kernel.flash_mla.flash_mla_with_kvcache`` (the backend imports it at call time)
    so the call returns as before and its ``softmax_lse`` is kept."""
    import sgl_kernel.flash_mla as flash_mla

    kernel = flash_mla.flash_mla_with_kvcache
    kept = {}

    def keeping(*args, **kwargs):
        out, lse = kernel(*args, **kwargs)
        kept["lse"] = lse
        return out, lse

    flash_mla.flash_mla_with_kvcache = keeping
    try:
        yield kept
    finally:
        flash_mla.flash_mla_with_kvcache = kernel


# ---- startup ----


def attach(runtime, decode_impl: str) -> Optional[PerOwnerDecode]:
    """Decide once (same inputs on every rank) whether decode runs per owner, and attach if so."""
    from sglang.srt.environ import envs

    reason = None
    if decode_impl != SERVED_DECODE_IMPL:
        reason = f"NSA decode impl {decode_impl!r} (per-owner decode serves {SERVED_DECODE_IMPL!r})"
    elif not envs.SGLANG_NSA_FUSE_TOPK.get():
        reason = "SGLANG_NSA_FUSE_TOPK is off (unfused top-k maps positions through page_table_1)"
    if reason is not None:
        logger.info("CP shared KV: decode uses the page gather: %s", reason)
        return None
    state = PerOwnerDecode(runtime, schedule_fn=_deep_gemm_schedule())
    logger.info("CP shared KV: decode per owner (local top-k + LSE merge, no page gather)")
    return state


def _deep_gemm_schedule():
    try:
        import deep_gemm
    except ImportError:
        return None
    num_sms = deep_gemm.get_num_sms()
    return lambda seq_lens: deep_gemm.get_paged_mqa_logits_metadata(seq_lens, 64, num_sms)


def attach_after_runtime(result, model_runner, *args, **kwargs):
    """AFTER ``ModelRunner.init_attention_backend`` (after the runtime's own attach)."""
    runtime = runtime_of(model_runner.token_to_kv_pool)
    if runtime is None or per_owner_of(runtime.pool) is not None:
        return None
    attach(runtime, model_runner.attn_backend.nsa_decode_impl)
    return None


def register_forward_hooks(registry) -> None:
    """The hooks a decode forward runs through (no model runner needed: the GPU check uses these)."""
    registry.register(f"{_BACKEND}.get_indexer_metadata", indexer_metadata_per_owner, HookType.AFTER)
    registry.register(
        f"{_BACKEND}._forward_flashmla_kv", forward_flashmla_kv_per_owner, HookType.AROUND
    )


def register_hooks(registry) -> None:
    register_forward_hooks(registry)
    registry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backend",
        attach_after_runtime,
        HookType.AFTER,
    )
