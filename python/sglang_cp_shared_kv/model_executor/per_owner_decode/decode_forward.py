"""Per-owner NSA decode wired into sglang's decode forward: no page gather, a fixed exchange per layer.

In a decode forward each rank scores and attends over its own physical pool only:

1. ``begin_forward`` (asked by the per-forward dispatcher through the pool's state,
   ``CpSharedKVState.begin_per_owner_forward``, which then runs the forward without a peer-page
   plan: the store hooks store owner-filtered rows and gather nothing): this rank's block tables
   (``owner_decode_tables``) and the deep_gemm schedule for its owned lengths. The pool getters
   then serve the physical buffers (``CpSharedKVState.reads_physical_pool``).
2. ``NativeSparseAttnBackend.get_indexer_metadata`` AFTER: ``PerOwnerIndexerMetadata``, whose
   ``attn_metadata`` carries the owned block table and lengths, and whose ``topk_transform`` turns
   the scores of owned tokens into candidates, all-gathers them, selects the global top-k and
   returns this rank's attention indices (physical rows it owns, -1 elsewhere; see
   ``decode_topk_merge``). sglang's ``Indexer._get_topk_paged`` runs unchanged around it; with
   ``SGLANG_NSA_FUSE_TOPK`` (sglang's default) ``forward_decode`` passes those indices to the kernel
   as they are. ``skip_topk`` layers reuse them (no exchange).
3. The decode impl's kernel call, AROUND (one hook per impl): sglang's own call, with the LSE it
   drops kept (the kernel is wrapped for the duration of the call), then the LSE merge over the
   attention CP group (``attention_lse_merge``: one all-gather of every rank's partial and LSE, or
   the scaled sum's two collectives where that form would move too many more bytes, by
   ``choose_merge_exchange``): every rank returns the same output.

   * ``_forward_flashmla_kv`` (fp8 KV, H200 default): ``flash_mla_with_kvcache`` skips -1 indices
     and returns a natural-log LSE [B, H_padded, 1].
   * ``_forward_flashmla_sparse`` (bf16 KV, ``--nsa-decode-backend flashmla_sparse``):
     ``flash_mla_sparse_fwd`` skips -1 indices and returns a base-2 LSE [T, H_padded].
   * ``_forward_fa3`` (bf16 KV, H200 default): ``flash_attn_with_kvcache`` with a page-size-1 table
     reads the first ``cache_seqlens`` entries and does not skip -1, so the hook moves this rank's
     owned indices to the front (``compact_owned_indices``) and passes their count as
     ``cache_seqlens``; ``return_softmax_lse`` gives the natural-log LSE ([H, T] varlen).

Served: decode forwards (not idle, not speculative) with one of ``SERVED_DECODE_IMPLS`` and fused
top-k, where the spec's decode path says decode runs per owner (``SGLANG_CP_SHARED_KV_DECODE``: by
default with ``fa3``). Whether it attaches is decided once per server at startup
(``startup_rules.decide_decode_path``, in the model runner's ``CpSharedKVSpec``), and
``startup_wiring`` calls ``attach`` with the pool's state; otherwise decode keeps the page gather,
and the log says why.
Prefill keeps the plan path. Decode CUDA graphs over it: ``per_owner_decode.cuda_graphs``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import logging
import math
from typing import Optional

import torch

from sglang.srt.layers.attention.nsa_backend import NSAIndexerMetadata
from sglang.srt.plugins.hook_registry import HookType
from sglang_cp_shared_kv.observability.cp_shared_kv_metrics import metrics as cp_metrics
from sglang_cp_shared_kv.model_executor.per_owner_decode.attention_lse_merge import (
    ONE_EXCHANGE,
    choose_merge_exchange,
    merge_by_all_gather,
    merge_by_scaled_sum,
    natural_lse,
    process_group_collectives,
)
from sglang_cp_shared_kv.model_executor.cp_shared_kv_state import serving_state
from sglang_cp_shared_kv.model_executor.per_owner_decode.decode_topk_merge import (
    compact_owned_indices,
    local_candidates,
    owned_attention_indices,
    select_global,
)
from sglang_cp_shared_kv.model_executor.per_owner_decode.owner_decode_tables import (
    OwnerDecodeTables,
    build_owner_decode_tables,
)

logger = logging.getLogger(__name__)

_BACKEND = "sglang.srt.layers.attention.nsa_backend.NativeSparseAttnBackend"
_NSA_BACKEND_MODULE = "sglang.srt.layers.attention.nsa_backend"
_STATE_ATTR = "_cp_per_owner_decode"
# NSA decode impls served per owner -> base of the LSE their kernel returns (see module docstring).
SERVED_DECODE_IMPLS = {"flashmla_kv": math.e, "flashmla_sparse": 2.0, "fa3": math.e}


@dataclasses.dataclass
class OwnerForward:
    """What one decode forward needs on this rank (built once, read by every layer).

    Under decode CUDA graphs one ``OwnerForward`` serves several runs of the forward: sglang's two
    eager warm-ups and the captured run (``cuda_graphs.capture_metadata_after`` builds it once, before
    them). The local columns derived from the tables are therefore computed once per *run*, at its
    first top-k layer (``begin_layer`` sees the layer ids restart), never carried from one run into
    the next: a captured run that reused a warm-up's columns would record no kernel computing them,
    and every replay would read the warm-up's tensors (capture-time values, then freed memory)."""

    tables: OwnerDecodeTables
    paged_mqa_schedule: Optional[torch.Tensor]
    local_columns: dict = dataclasses.field(default_factory=dict)  # width -> (positions, rows)
    last_layer_id: Optional[int] = None

    def begin_layer(self, layer_id: int) -> None:
        """Called for every top-k layer, in the forward's layer order: a layer id not above the
        last one starts a new run of the forward, which derives its columns afresh."""
        if self.last_layer_id is not None and layer_id <= self.last_layer_id:
            self.local_columns.clear()
        self.last_layer_id = layer_id

    def columns(self, width_tokens: int):
        if width_tokens not in self.local_columns:
            self.local_columns[width_tokens] = (
                self.tables.local_positions(width_tokens),
                self.tables.local_physical_rows(width_tokens),
            )
        return self.local_columns[width_tokens]


class PerOwnerDecode:
    """Per-owner decode of one pool; constructing it attaches it to the pool's ``CpSharedKVState``
    (``state.per_owner``), whose runtime (attached first) gives the CP group and whose spec the
    settings (read once, at startup)."""

    def __init__(self, state, schedule_fn=None, decode_impl: str = "flashmla_kv"):
        if decode_impl not in SERVED_DECODE_IMPLS:
            raise ValueError(f"per-owner decode does not serve NSA decode impl {decode_impl!r}")
        self.decode_impl = decode_impl
        self.lse_base = SERVED_DECODE_IMPLS[decode_impl]
        self.layout = state.spec.layout
        self.cp_rank = self.layout.cp_rank
        # Bytes the one-exchange merge may add per layer (None: always the scaled sum).
        self.merge_one_exchange_max_extra_bytes = state.spec.settings.merge_one_exchange_max_extra_bytes
        self.all_gather, self.all_reduce_sum = process_group_collectives(state.runtime.cp_group)
        # (owned_seq_lens int32 [B]) -> deep_gemm schedule metadata; None where deep_gemm is absent.
        self.schedule_fn = schedule_fn
        self.forward: Optional[OwnerForward] = None
        state.per_owner = self

    def begin_forward(self, backend, forward_batch) -> bool:
        """Take over a decode forward (True), or leave it to the page gather (False)."""
        mode = forward_batch.forward_mode
        if not mode.is_decode() or mode.is_idle():
            self.end_forward()
            return False
        if cp_metrics() is not None:
            cp_metrics().observe_usage()
        metadata = backend.forward_metadata
        tables = build_owner_decode_tables(
            self.layout, metadata.real_page_table, metadata.cache_seqlens_int32
        )
        schedule = None
        if metadata.paged_mqa_schedule_metadata is not None and self.schedule_fn is not None:
            schedule = self.schedule_fn(tables.owned_seq_lens)
        self.begin_static_forward(tables, schedule)
        setattr(backend, _STATE_ATTR, self)  # the attention hook finds the forward's state here
        return True

    def begin_static_forward(self, tables: OwnerDecodeTables, paged_mqa_schedule) -> None:
        """A decode forward over ``tables`` (built here, or a graph's static ones)."""
        self.forward = OwnerForward(tables, paged_mqa_schedule)

    def end_forward(self) -> None:
        self.forward = None

    def select(self, logits: torch.Tensor, topk: int) -> torch.Tensor:
        """Scores of this rank's owned tokens [B, L] -> its attention indices [B, topk] int32.
        Every rank calls it once per top-k layer (one all-gather), whatever it owns."""
        positions, rows = self.forward.columns(logits.shape[1])
        owned_lens = self.forward.tables.owned_seq_lens
        candidates = local_candidates(logits, owned_lens, positions, rows, topk)
        selection = select_global(self.all_gather(candidates.scores), topk)  # [cp_size, B, k] scores
        if cp_metrics() is not None:
            cp_metrics().per_owner_exchanges.inc()
        return owned_attention_indices(selection, candidates, self.cp_rank)

    def merge(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """This rank's partial [T, H, D] and LSE [T, H] (kernel's base) -> the merged output. The
        form follows the batch's shape (``choose_merge_exchange``): fixed per captured batch size."""
        lse = natural_lse(lse, self.lse_base)
        if cp_metrics() is not None:
            cp_metrics().per_owner_exchanges.inc()
        tokens, heads, dim = out.shape
        form = choose_merge_exchange(
            tokens, heads, dim, out.element_size(), self.layout.cp_size,
            self.merge_one_exchange_max_extra_bytes,
        )
        if form == ONE_EXCHANGE:
            return merge_by_all_gather(out, lse, self.all_gather)
        return merge_by_scaled_sum(out, lse, self.all_gather, self.all_reduce_sum)


def per_owner_of(pool) -> Optional[PerOwnerDecode]:
    """Per-owner decode of ``pool`` (its state's); None where decode gathers or nothing serves it."""
    state = serving_state(pool)
    return None if state is None else state.per_owner


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
    state = per_owner_of(forward_batch.token_to_kv_pool)
    if state is None or state.forward is None or result is None:
        return None
    state.forward.begin_layer(layer_id)
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


def _serving(backend, decode_impl: str) -> Optional[PerOwnerDecode]:
    """The per-owner state when the running forward is decoded per owner with ``decode_impl``."""
    state = getattr(backend, _STATE_ATTR, None)
    if state is None or state.forward is None or state.decode_impl != decode_impl:
        return None
    return state


def forward_flashmla_kv_per_owner(original, backend, *args, **kwargs):
    """AROUND ``_forward_flashmla_kv``: sglang's kernel call keeping the LSE, then the merge."""
    state = _serving(backend, "flashmla_kv")
    if state is None:
        return original(backend, *args, **kwargs)
    import sgl_kernel.flash_mla as flash_mla  # the backend imports the kernel at call time

    with _kept_lse(flash_mla, "flash_mla_with_kvcache", lambda result: result[1]) as kept:
        out = original(backend, *args, **kwargs)  # [B, 1, H, D], heads already un-padded
    batch, q_len, heads, dim = out.shape
    lse = kept["lse"][:, :heads, :].transpose(1, 2).reshape(batch * q_len, heads)
    merged = state.merge(out.reshape(batch * q_len, heads, dim), lse)
    return merged.reshape(batch, q_len, heads, dim)


def forward_flashmla_sparse_per_owner(original, backend, *args, **kwargs):
    """AROUND ``_forward_flashmla_sparse``: sglang's kernel call keeping the (base-2) LSE, then the
    merge. -1 indices are skipped by the kernel, so the owned indices pass as they are."""
    state = _serving(backend, "flashmla_sparse")
    if state is None:
        return original(backend, *args, **kwargs)
    import sgl_kernel.flash_mla as flash_mla  # the backend imports the kernel at call time

    with _kept_lse(flash_mla, "flash_mla_sparse_fwd", lambda result: result[2]) as kept:
        out = original(backend, *args, **kwargs)  # [T, H, D], heads already un-padded
    heads = out.shape[1]
    return state.merge(out, kept["lse"][:, :heads])


def forward_fa3_per_owner(original, backend, *args, **kwargs):
    """AROUND ``_forward_fa3``: this rank's owned indices first, their count as ``cache_seqlens``
    (fa3 reads that many entries and does not skip -1), the kernel's LSE kept, then the merge."""
    state = _serving(backend, "fa3")
    if state is None:
        return original(backend, *args, **kwargs)
    call = _fa3_signature().bind(backend, *args, **kwargs)
    page_table, owned_counts = compact_owned_indices(call.arguments["page_table"])
    call.arguments["page_table"] = page_table
    call.arguments["cache_seqlens"] = owned_counts
    nsa_backend = importlib.import_module(_NSA_BACKEND_MODULE)  # binds the kernel at import
    keep = _kept_lse(nsa_backend, "flash_attn_with_kvcache", lambda result: result[1], lse_kwarg=True)
    with keep as kept:
        out = original(*call.args, **call.kwargs)
    lse = kept["lse"]
    heads, dim = out.shape[-2], out.shape[-1]
    # varlen q (sglang passes cu_seqlens_q): out [T, H, D], LSE [H, T]; else [B, S, H, D], [B, H, S]
    lse = lse.t() if lse.dim() == 2 else lse.transpose(1, 2).reshape(-1, heads)
    merged = state.merge(out.reshape(-1, heads, dim), lse)
    return merged.reshape(out.shape)


_FA3_SIGNATURE = None


def _fa3_signature() -> inspect.Signature:
    global _FA3_SIGNATURE
    if _FA3_SIGNATURE is None:
        backend_cls = importlib.import_module(_NSA_BACKEND_MODULE).NativeSparseAttnBackend
        _FA3_SIGNATURE = inspect.signature(inspect.unwrap(backend_cls._forward_fa3))
    return _FA3_SIGNATURE


@contextlib.contextmanager
def _kept_lse(module, name: str, lse_of, lse_kwarg: bool = False):
    """Wrap ``module.name`` (a kernel the backend looks up at call time) so the call returns what
    the backend expects and the LSE (``lse_of(result)``) is kept. ``lse_kwarg``: the kernel returns
    its LSE only when called with ``return_softmax_lse=True`` (fa3); the caller then gets ``out``."""
    kernel = getattr(module, name)
    kept = {}

    def keeping(*args, **kwargs):
        if lse_kwarg:
            kwargs["return_softmax_lse"] = True
            result = kernel(*args, **kwargs)
            kept["lse"] = lse_of(result)
            return result[0]
        result = kernel(*args, **kwargs)
        kept["lse"] = lse_of(result)
        return result

    setattr(module, name, keeping)
    try:
        yield kept
    finally:
        setattr(module, name, kernel)


# ---- startup ----


def attach(state) -> Optional[PerOwnerDecode]:
    """Attach per-owner decode to the pool's ``state`` (its runtime attached) unless the spec's
    decode path (the startup's one decision, the same on every rank) says decode gathers."""
    decode = state.spec.decode
    if decode.gather_reason is not None:
        logger.info("CP shared KV: decode uses the page gather: %s", decode.gather_reason)
        return None
    per_owner = PerOwnerDecode(state, schedule_fn=_deep_gemm_schedule(), decode_impl=decode.impl)
    logger.info(
        "CP shared KV: decode per owner with %s (local top-k + LSE merge, no page gather)",
        decode.impl,
    )
    return per_owner


def _deep_gemm_schedule():
    try:
        import deep_gemm
    except ImportError:
        return None
    num_sms = deep_gemm.get_num_sms()
    return lambda seq_lens: deep_gemm.get_paged_mqa_logits_metadata(seq_lens, 64, num_sms)


def register_forward_hooks(registry) -> None:
    """The hooks a decode forward runs through (no model runner needed: the GPU check uses these)."""
    registry.register(f"{_BACKEND}.get_indexer_metadata", indexer_metadata_per_owner, HookType.AFTER)
    registry.register(
        f"{_BACKEND}._forward_flashmla_kv", forward_flashmla_kv_per_owner, HookType.AROUND
    )
    registry.register(
        f"{_BACKEND}._forward_flashmla_sparse", forward_flashmla_sparse_per_owner, HookType.AROUND
    )
    registry.register(f"{_BACKEND}._forward_fa3", forward_fa3_per_owner, HookType.AROUND)


def register_hooks(registry) -> None:
    """Its attach is a step of ``startup_wiring``; here only the forward's hooks."""
    register_forward_hooks(registry)
