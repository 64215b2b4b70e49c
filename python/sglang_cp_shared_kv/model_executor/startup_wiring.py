"""Startup of shared KV on a model runner: every piece, in its order, from two hooks.

1. ``ModelRunnerKVCacheMixin._profile_available_bytes`` (AFTER, target worker): take the scratch
   decisions (``startup_rules.decide_decode_path`` and ``decide_scratch``, once per runner,
   remembered on it) and hold the scratch's bytes back from the KV budget, so that sglang sizes the pool from what remains.
2. ``ModelRunner.init_attention_backend`` (AFTER; pool, allocator and backend exist now), the one
   hook of ours on it, which runs, in order:

   a. the startup rules that need the model runner (draft worker or not, the pool's type, the
      allocator) and, on a draft worker (MTP), the draft pool's runtime over the target's layout
      and scratch (``cp_shared_kv_draft_pool.attach_draft_worker``); nothing more there (per-owner
      decode serves the target's decode only: the draft's decode steps gather,
      ``draft_decode_steps``);
   b. on the target worker: the gather scratch's slots (as the decision of 1 sized them), the
      prefetch's process group, the ``CpSharedKVRuntime`` on the pool, the host mirror of
      ``req_to_token`` and the metrics (``--enable-metrics``);
   c. per-owner decode, where the same decision says decode runs per owner
      (``per_owner_decode.decode_forward.attach``): it needs the runtime of b;
   d. the startup summary (CP rank 0).

The order is this module's code: the draft's runtime needs the target's (attached when the target
worker initialized, before the draft worker exists), per-owner decode needs the runtime. Every rank
runs the same steps with the same decision (server args, context length and settings are the same
on every rank), so every rank enters the same collectives (the prefetch group's creation).
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
from sglang.srt.plugins.hook_registry import HookType
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror import ReqToPageMirror
from sglang_cp_shared_kv.model_executor import cp_shared_kv_draft_pool
from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import CpSharedKVRuntime, runtime_of
from sglang_cp_shared_kv.model_executor.gather_scratch import (
    create_gather_scratch,
    create_prefetch_slot,
    reserve_scratch_bytes,
)
from sglang_cp_shared_kv.model_executor.peer_page_prefetch import (
    create_prefetch_group,
    indexer_layer_ids_of,
)
from sglang_cp_shared_kv.model_executor.per_owner_decode import decode_forward as per_owner_decode
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG
from sglang_cp_shared_kv.settings import cp_shared_kv_enabled, current_settings
from sglang_cp_shared_kv.startup_rules import decide_decode_path, decide_scratch, runtime_problems
from sglang_cp_shared_kv.startup_summary import effective_settings, summary_line

logger = logging.getLogger(__name__)

_DECISION_ATTR = "_cp_shared_kv_scratch_decision"
_MIXIN = "sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin"
_MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"


def scratch_decision_of(model_runner):
    """The runner's ``(settings, decode path, scratch decision)``: taken at its first use (the
    reservation, step 1) and read from the runner afterwards, so the attach builds exactly what was
    reserved."""
    decision = getattr(model_runner, _DECISION_ATTR, None)
    if decision is None:
        server_args = model_runner.server_args
        settings = current_settings()
        decode = decide_decode_path(server_args, settings)
        scratch = decide_scratch(server_args, settings, decode, model_runner.model_config.context_len)
        decision = (settings, decode, scratch)
        setattr(model_runner, _DECISION_ATTR, decision)
    return decision


# ---- 1. before the pool is sized ----


def reserve_scratch_before_pool_sizing(available_bytes, model_runner, *args, **kwargs):
    """AFTER ``_profile_available_bytes``: hold back the scratch's bytes from the KV budget."""
    if model_runner.is_draft_worker or not cp_shared_kv_enabled(model_runner.server_args):
        return None
    from sglang.srt.layers.dp_attention import get_attention_cp_size
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator

    server_args = model_runner.server_args
    page_size = server_args.page_size
    unreserved_tokens = (
        create_memory_pool_configurator(model_runner)
        .calculate_pool_sizes(available_bytes, page_size)
        .max_total_num_tokens
    )
    if server_args.max_total_tokens is not None:
        unreserved_tokens = min(unreserved_tokens, server_args.max_total_tokens)
    kv_row_bytes = model_runner.calculate_mla_kv_cache_dim() * model_runner.kv_cache_dtype.itemsize
    _, _, decision = scratch_decision_of(model_runner)
    reserve = reserve_scratch_bytes(
        available_bytes,
        unreserved_tokens,
        get_attention_cp_size(),
        kv_row_bytes,
        page_size,
        requested_prefetch_slot_tokens=decision.prefetch_slot_requested_tokens,
        prefill_slot0_tokens=decision.slot0.prefill_tokens,
    )
    logger.info(
        "CP shared KV: reserved %.2f GB of %.2f GB KV memory for the gather scratch",
        reserve / (1 << 30),
        available_bytes / (1 << 30),
    )
    return available_bytes - reserve


# ---- 2. once the pool, allocator and attention backend exist ----


def attach_after_attention_backend(result, model_runner, *args, **kwargs):
    """AFTER ``ModelRunner.init_attention_backend``: steps a-d of the module docstring, in order."""
    if not cp_shared_kv_enabled(model_runner.server_args):
        return None
    if model_runner.is_draft_worker:
        cp_shared_kv_draft_pool.attach_draft_worker(model_runner)  # a (draft)
        return None
    pool = model_runner.token_to_kv_pool
    settings, decode, decision = scratch_decision_of(model_runner)
    runtime = runtime_of(pool)
    attached_now = runtime is None
    if attached_now:
        runtime = attach_target_runtime(model_runner, settings, decode, decision)  # a, b
    if per_owner_decode.per_owner_of(pool) is None:
        per_owner_decode.attach(  # c
            runtime, model_runner.server_args.nsa_decode_backend, decode.gather_reason
        )
    if attached_now:
        log_startup_summary(model_runner, runtime)
    return None


def attach_target_runtime(model_runner, settings, decode, decision) -> CpSharedKVRuntime:
    """Steps a and b on the target worker; returns the pool's runtime."""
    from sglang.srt.distributed.parallel_state import get_world_group
    from sglang.srt.layers.dp_attention import get_attention_cp_group
    from sglang_cp_shared_kv.mem_cache.allocator import CPSharedPagedTokenToKVPoolAllocator

    pool = model_runner.token_to_kv_pool
    reasons = runtime_problems(model_runner.server_args, settings, decode)
    if type(pool) is not NSATokenToKVPool:
        reasons.append(f"{FLAG} needs an NSATokenToKVPool, got {type(pool).__name__} (HiSparse?)")
    if reasons:
        raise ValueError("; ".join(reasons))
    allocator = model_runner.token_to_kv_pool_allocator
    if not isinstance(allocator, CPSharedPagedTokenToKVPoolAllocator):
        raise ValueError(
            f"{FLAG}: the token allocator must be CPSharedPagedTokenToKVPoolAllocator, got "
            f"{type(allocator).__name__}"
        )
    layout = allocator.layout  # the one layout (built by the allocator, installed with the capacity)
    if getattr(model_runner.server_args, "enable_metrics", False):
        from sglang_cp_shared_kv.observability import cp_shared_kv_metrics

        labels = cp_shared_kv_metrics.sglang_metric_labels(model_runner)
        cp_shared_kv_metrics.install(layout.cp_rank, labels=labels).watch(allocator=allocator)
    cp_group = get_attention_cp_group()
    scratch = create_gather_scratch(pool, layout.cp_size, decision.slot0.prefill_tokens)
    context_len = model_runner.model_config.context_len
    if decision.slot0.prefill_only and scratch.size < context_len:
        logger.warning(
            "CP shared KV: the gather scratch holds %d tokens, less than the context length %d: "
            "requests whose context does not fit are rejected",
            scratch.size,
            context_len,
        )
    prefetch_slot = create_prefetch_slot(
        pool, layout.cp_size, decision.prefetch_slot_requested_tokens
    )
    prefetch_group = None
    if prefetch_slot is not None:
        # Every rank reaches this point (attach runs on every TP worker), as new_group requires.
        prefetch_group = create_prefetch_group(
            cp_group.ranks,
            coordination_group=get_world_group().cpu_group,
            backend=dist.get_backend(cp_group.device_group),
        )
    runtime = CpSharedKVRuntime(
        pool,
        layout,
        scratch,
        cp_group.device_group,
        prefetch_slot=prefetch_slot,
        prefetch_group=prefetch_group,
        indexer_layer_ids=indexer_layer_ids_of(model_runner.model),
        scratch_serves_decode=not decision.slot0.prefill_only,
    )
    # The plan's page ids come from this host mirror, fed by every writer of req_to_token.
    ReqToPageMirror.attach(model_runner.req_to_token_pool, pool.page_size)
    return runtime


def log_startup_summary(model_runner, runtime: CpSharedKVRuntime) -> None:
    """The one startup line of the server (CP rank 0; every rank sized the same: sglang takes the
    minimum of the profiled pool sizes over the TP group, and every rank reads the same settings)."""
    layout = runtime.layout
    if layout.cp_rank != 0:
        return
    slots = runtime.pipeline.slots
    settings, decode, decision = scratch_decision_of(model_runner)
    rows = effective_settings(
        model_runner.server_args,
        settings,
        decode,
        decision,
        logical_tokens=layout.cp_size * runtime.pool.size,
        scratch_tokens=runtime.scratch.size,
        prefetch_slot_tokens=slots[1].size if len(slots) > 1 else 0,
    )
    logger.info("%s on: %s", FLAG, summary_line(rows))


def register_hooks(registry) -> None:
    registry.register(
        f"{_MIXIN}._profile_available_bytes", reserve_scratch_before_pool_sizing, HookType.AFTER
    )
    registry.register(
        f"{_MODEL_RUNNER}.init_attention_backend", attach_after_attention_backend, HookType.AFTER
    )
