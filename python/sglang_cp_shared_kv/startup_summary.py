"""What a shared-KV server runs with, in words: the startup summary and ``check_launch``'s report.

Both say the same thing from the same decisions (``startup_rules``): the decode path, decode CUDA
graphs, MTP, the prefetch slot, how the gather scratch's slot 0 is sized and, once the pool exists,
the logical capacity. The server's summary, logged once per server when the runtime attaches (CP
rank 0: every rank decides the same), prints the decisions of its spec
(``model_executor.cp_shared_kv_spec``); ``check_launch`` takes them by the same rules before any GPU.

A root leaf beside ``startup_rules`` (it imports nothing of the runtime), so that the attach can log
it without importing upward.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from sglang_cp_shared_kv.settings import PREFETCH_SLOT_AUTO, CpSharedKVSettings
from sglang_cp_shared_kv.startup_rules import DecodePath, ScratchDecision


def effective_settings(
    server_args,
    settings: CpSharedKVSettings,
    decode: DecodePath,
    scratch: Optional[ScratchDecision],
    logical_tokens: Optional[int] = None,
    scratch_tokens: Optional[int] = None,
    prefetch_slot_tokens: Optional[int] = None,
) -> List[Tuple[str, str]]:
    """``(name, value)`` rows; the pool-dependent ones (``logical_tokens``, ``scratch_tokens``,
    ``prefetch_slot_tokens``: logical tokens) say when they are known if not given. ``scratch``:
    None where the context length is unknown (no model config)."""
    if decode.pd_prefill:
        decode_text = "none (PD prefill server: the decode server decodes)"
    else:
        reason = decode.gather_reason
        decode_text = "per owner" if reason is None else f"page gather ({reason})"
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
    if scratch is None:
        slot0 = "unknown (no model config)"
    else:
        sizing = scratch.slot0
        rule = "prefill batches only" if sizing.prefill_only else "the logical capacity"
        slot0 = f"{rule} ({sizing.reason})"
    if scratch_tokens is not None:
        slot0 = f"{scratch_tokens} tokens, {slot0}"
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
        ("decode", decode_text),
        ("decode CUDA graphs", graphs),
        ("MTP", mtp),
        ("layer-ahead prefetch", prefetch),
        ("gather scratch slot 0", slot0),
        ("logical capacity", capacity),
        ("HiCache", hicache),
        ("L3 storage", storage),
        ("PD", str(server_args.disaggregation_mode)),
    ]


def summary_line(rows: List[Tuple[str, str]]) -> str:
    return "; ".join(f"{name}: {value}" for name, value in rows)
