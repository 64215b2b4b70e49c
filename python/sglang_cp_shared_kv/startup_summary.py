"""What a shared-KV server runs with, in words: the startup summary and ``check_launch``'s report.

One function per source of truth, so the summary logged when the runtime attaches (once per server,
on CP rank 0: every rank decides the same, see ``settings``) and the report of ``check_launch``
(before any GPU) say the same thing from the same rules: the decode path (``decode_path``), decode
CUDA graphs, MTP, the prefetch slot, how the gather scratch's slot 0 is sized (``scratch_sizing``)
and, once the pool exists, the logical capacity. The server's summary prints the decision its
startup took (``scratch_sizing.ScratchDecision``); ``check_launch`` takes it by the same rule.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from sglang_cp_shared_kv.model_executor.decode_path import decode_gather_reason, is_pd_prefill_server
from sglang_cp_shared_kv.model_executor.scratch_sizing import ScratchDecision, decide_scratch
from sglang_cp_shared_kv.settings import PREFETCH_SLOT_AUTO, current_settings


def effective_settings(
    server_args,
    context_len: Optional[int],
    logical_tokens: Optional[int] = None,
    scratch_tokens: Optional[int] = None,
    prefetch_slot_tokens: Optional[int] = None,
    decision: Optional[ScratchDecision] = None,
) -> List[Tuple[str, str]]:
    """``(name, value)`` rows; the pool-dependent ones (``logical_tokens``, ``scratch_tokens``,
    ``prefetch_slot_tokens``: logical tokens) say when they are known if not given. ``decision``:
    the server's scratch decision (``startup_wiring``); None: taken here by the same rule."""
    settings = current_settings()
    if decision is None and context_len is not None:
        decision = decide_scratch(server_args, context_len)
    if is_pd_prefill_server(server_args):
        decode = "none (PD prefill server: the decode server decodes)"
    else:
        reason = (
            decode_gather_reason(server_args) if decision is None else decision.decode_gather_reason
        )
        decode = "per owner" if reason is None else f"page gather ({reason})"
    graphs = "off (--disable-cuda-graph)" if server_args.disable_cuda_graph else "on (per-owner decode)"
    mtp = server_args.speculative_algorithm or "off"
    if server_args.speculative_algorithm and settings.mtp:
        mtp += " (opt-in)"
    if prefetch_slot_tokens is not None:
        prefetch = f"on ({prefetch_slot_tokens} tokens in slot 1)" if prefetch_slot_tokens else "off"
    elif settings.prefetch_slot_auto:
        prefetch = f"on ({PREFETCH_SLOT_AUTO}: context length + one chunk, +25%)"
    else:
        prefetch = f"on ({settings.prefetch_slot_tokens} tokens)" if settings.prefetch_slot_tokens else "off"
    if decision is None:
        scratch = "unknown (no model config)"
    else:
        sizing = decision.slot0
        rule = "prefill batches only" if sizing.prefill_only else "the logical capacity"
        scratch = f"{rule} ({sizing.reason})"
    if scratch_tokens is not None:
        scratch = f"{scratch_tokens} tokens, {scratch}"
    capacity = (
        f"{logical_tokens} tokens (cp_size {server_args.attn_cp_size} x physical)"
        if logical_tokens is not None
        else f"cp_size {server_args.attn_cp_size} x the physical pool (known once memory is profiled)"
    )
    hicache = (
        f"on (--hicache-ratio {server_args.hicache_ratio}, {server_args.hicache_write_policy})"
        if server_args.enable_hierarchical_cache
        else "off"
    )
    backend = getattr(server_args, "hicache_storage_backend", None)
    storage = (
        f"{backend} (owner-free page keys, each rank stores the pages it owns)" if backend else "off"
    )
    return [
        ("CP size", str(server_args.attn_cp_size)),
        ("page size", str(server_args.page_size)),
        ("KV cache dtype", str(server_args.kv_cache_dtype)),
        ("NSA prefill / decode impl", f"{server_args.nsa_prefill_backend} / {server_args.nsa_decode_backend}"),
        ("decode", decode),
        ("decode CUDA graphs", graphs),
        ("MTP", mtp),
        ("layer-ahead prefetch", prefetch),
        ("gather scratch slot 0", scratch),
        ("logical capacity", capacity),
        ("HiCache", hicache),
        ("L3 storage", storage),
        ("PD", str(server_args.disaggregation_mode)),
    ]


def summary_line(rows: List[Tuple[str, str]]) -> str:
    return "; ".join(f"{name}: {value}" for name, value in rows)
