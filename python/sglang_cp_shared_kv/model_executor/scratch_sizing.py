"""How large the gather scratch's slots are, decided once per server, and how many scratch pages a
prefill batch can need.

``decide_scratch`` takes the whole decision (``ScratchDecision``: slot 0's rule, slot 1's request,
whether decode runs per owner) from the server args, the model's context length and the settings,
the same inputs on every rank. ``startup_wiring`` takes it once per model runner and hands it to the
reservation before the pool is sized, the runtime's attach and per-owner decode's attach; the
startup summary and ``check_launch`` print the same decision.

A forward that gathers reads every page its requests reference, one layer at a time, from the
scratch. A decode forward that gathers references every running request's whole context, so with
gathering decode slot 0 must hold one layer of the whole logical capacity (``cp_size x`` the
physical pool). When decode runs per owner (``decode_path``) only extend forwards gather, and an
extend forward references, per request, its prefix plus this forward's chunk, i.e. ``len(fill_ids)``
tokens. Slot 0 then only has to hold what admission lets into one prefill batch:

* size (``scratch_sizing``): ``SGLANG_CP_SHARED_KV_PREFILL_SCRATCH_TOKENS`` if set, else
  ``context_len + chunked_prefill_size`` (``+ max_prefill_tokens`` without chunked prefill): one
  request of the longest context plus one chunk's worth of other requests; rounded up to pages
  and at most the logical capacity;
* bound: ``1 + sum over requests of ceil(len(fill_ids) / page_size)`` scratch pages (the dummy
  page and each request's ``request_scratch_pages``). A plan needs at most that whatever the owners (``PeerPagePlan``'s
  exact layout), and admission (``managers.prefill_scratch_admission``) keeps every batch within it.

Slot 0 keeps the full logical capacity (the old size) when a decode forward may gather
(``SGLANG_CP_SHARED_KV_DECODE=gather``, a decode impl per-owner decode does not serve, the fused
top-k off) and with ``--enable-mixed-chunk`` (running decode requests, whole contexts, join the
extend batch). Every input is a server arg or an environment variable of the launching process,
identical on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sglang_cp_shared_kv.model_executor.decode_path import decode_gather_reason, impl_gather_reason
from sglang_cp_shared_kv.settings import PREFILL_SCRATCH_TOKENS_ENV, current_settings


@dataclass(frozen=True)
class ScratchSizing:
    """Slot 0's size rule. ``prefill_tokens`` None: the whole logical capacity (``reason`` says why)."""

    prefill_tokens: Optional[int]
    reason: str

    @property
    def prefill_only(self) -> bool:
        return self.prefill_tokens is not None


def configured_prefill_scratch_tokens() -> Optional[int]:
    """``SGLANG_CP_SHARED_KV_PREFILL_SCRATCH_TOKENS`` (None: unset); a ``ValueError`` unless > 0."""
    return current_settings().prefill_scratch_tokens


def default_prefill_scratch_tokens(
    context_len: int, chunked_prefill_size: Optional[int], max_prefill_tokens: Optional[int]
) -> int:
    """One request of the full context plus one chunk (or, without chunked prefill, one prefill
    budget) of other requests."""
    if chunked_prefill_size is not None and chunked_prefill_size > 0:
        extra = chunked_prefill_size
    elif max_prefill_tokens is not None and max_prefill_tokens > 0:
        extra = max_prefill_tokens
    else:
        extra = context_len
    return context_len + extra


def logical_capacity_reason(server_args) -> Optional[str]:
    """Why slot 0 must hold the whole logical capacity, or None: sized for prefill batches only."""
    gather_reason = decode_gather_reason(server_args)
    if gather_reason is not None:
        return f"decode gathers pages: {gather_reason}"
    if server_args.enable_mixed_chunk:
        return "--enable-mixed-chunk: running decode requests join extend batches"
    return None


def scratch_sizing(server_args, context_len: int) -> ScratchSizing:
    """Slot 0's rule for this server (same on every rank: server args and the environment)."""
    reason = logical_capacity_reason(server_args)
    if reason is not None:
        return ScratchSizing(None, reason)
    tokens = configured_prefill_scratch_tokens()
    if tokens is not None:
        return ScratchSizing(tokens, f"{PREFILL_SCRATCH_TOKENS_ENV}={tokens}")
    tokens = default_prefill_scratch_tokens(
        context_len, server_args.chunked_prefill_size, server_args.max_prefill_tokens
    )
    return ScratchSizing(
        tokens,
        f"context length {context_len} + chunked prefill {server_args.chunked_prefill_size}",
    )


def configured_prefetch_slot_tokens(context_len: int, chunked_prefill_size: Optional[int]) -> int:
    """Requested tokens of slot 1 before the capacity cap
    (``SGLANG_CP_SHARED_KV_PREFETCH_SLOT_TOKENS``, parsed in ``settings``; unset or 0: no slot 1, no layer-ahead prefetch, the default until the
    prefetch has been served and timed across GPUs; docs/runtime.md, section 3).

    ``auto``: one request of the full context length plus one chunk of new tokens, +25% for the
    padding of unbalanced owners (``1 + cp_size * n`` scratch pages for the gathered region).
    """
    settings = current_settings()
    if not settings.prefetch_slot_auto:
        return settings.prefetch_slot_tokens
    chunk = chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else context_len
    return (context_len + chunk) * 5 // 4


@dataclass(frozen=True)
class ScratchDecision:
    """What the gather scratch holds on this server, decided once (``decide_scratch``).

    ``slot0``: slot 0's rule (prefill batches only, or the logical capacity);
    ``prefetch_slot_requested_tokens``: slot 1's request before the capacity cap (0: no slot 1);
    ``decode_gather_reason``: why decode with this server's NSA decode impl gathers pages, None
    when per-owner decode attaches. sglang's NSA backend takes its decode impl from
    ``--nsa-decode-backend``, so the server args decide it before the backend exists. (A PD
    prefill server runs no decode forward, so its slot 0 holds prefill batches whatever this says.)
    """

    slot0: ScratchSizing
    prefetch_slot_requested_tokens: int
    decode_gather_reason: Optional[str]


def decide_scratch(server_args, context_len: int) -> ScratchDecision:
    """The one decision (same inputs on every rank: server args, context length, settings)."""
    return ScratchDecision(
        slot0=scratch_sizing(server_args, context_len),
        prefetch_slot_requested_tokens=configured_prefetch_slot_tokens(
            context_len, server_args.chunked_prefill_size
        ),
        decode_gather_reason=impl_gather_reason(
            server_args.nsa_decode_backend, server_args.speculative_algorithm
        ),
    )


def request_scratch_pages(context_tokens: int, page_size: int) -> int:
    """Scratch pages one request of ``context_tokens`` (prefix + chunk) can take in a plan."""
    return -(-max(context_tokens, 0) // page_size)
