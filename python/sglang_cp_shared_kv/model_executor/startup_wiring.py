"""Startup of shared KV on a model runner once its pool, allocator and attention backend exist.

Before this, the capacity hook (``cp_shared_kv_capacity``, AROUND ``init_memory_pool``) built the
runner's ``CpSharedKVSpec`` (the startup rules the runtime needs judged, the decode path and the
scratch decision, once), held the scratch's bytes back from the KV budget, and attached the pool's
``CpSharedKVState`` with the spec. ``ModelRunner.init_attention_backend`` (AFTER) is the one hook of
ours on the attach, which runs, in order:

a. the checks that need the model runner (the pool's type, the allocator) and, on a draft worker
   (MTP), the draft pool's runtime over the target's spec and scratch
   (``cp_shared_kv_draft_pool.attach_draft_worker``); nothing more there (per-owner decode serves
   the target's decode only: the draft's decode steps gather, ``draft_decode_steps``);
b. on the target worker: the gather scratch's slots (as the spec's decision sized them), the
   prefetch's process group, the ``CpSharedKVRuntime``, the host mirror of ``req_to_token`` and the
   metrics (``--enable-metrics``), all in the pool's state;
c. per-owner decode, where the spec says decode runs per owner
   (``per_owner_decode.decode_forward.attach``): it needs the runtime of b;
d. the startup summary (CP rank 0).

The order is this module's code: the draft's runtime needs the target's (attached when the target
worker initialized, before the draft worker exists), per-owner decode needs the runtime. Every rank
runs the same steps with the same spec (server args, context length and settings are the same on
every rank), so every rank enters the same collectives (the prefetch group's creation).
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
from sglang.srt.plugins.hook_registry import HookType
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror import ReqToPageMirror
from sglang_cp_shared_kv.model_executor import cp_shared_kv_draft_pool
from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import CpSharedKVRuntime
from sglang_cp_shared_kv.model_executor.cp_shared_kv_state import CpSharedKVState, state_of
from sglang_cp_shared_kv.model_executor.gather_scratch import (
    create_gather_scratch,
    create_prefetch_slot,
)
from sglang_cp_shared_kv.model_executor.peer_page_prefetch import (
    create_prefetch_group,
    indexer_layer_ids_of,
)
from sglang_cp_shared_kv.model_executor.per_owner_decode import decode_forward as per_owner_decode
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG
from sglang_cp_shared_kv.settings import cp_shared_kv_enabled
from sglang_cp_shared_kv.startup_summary import effective_settings, summary_line

logger = logging.getLogger(__name__)

_MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"


def attach_after_attention_backend(result, model_runner, *args, **kwargs):
    """AFTER ``ModelRunner.init_attention_backend``: steps a-d of the module docstring, in order."""
    if not cp_shared_kv_enabled(model_runner.server_args):
        return None
    if model_runner.is_draft_worker:
        cp_shared_kv_draft_pool.attach_draft_worker(model_runner)  # a (draft)
        return None
    pool = model_runner.token_to_kv_pool
    state = state_of(pool)
    if state is None:
        raise ValueError(
            f"{FLAG}: the KV pool ({type(pool).__name__}) has no shared-KV state; the capacity hook "
            f"on ModelRunner.init_memory_pool builds it with the CPSharedPagedTokenToKVPoolAllocator"
        )
    attached_now = state.runtime is None
    if attached_now:
        attach_target_runtime(model_runner, state)  # a, b
    if state.per_owner is None:
        per_owner_decode.attach(state)  # c
    if attached_now:
        log_startup_summary(model_runner, state)  # d
    return None


def attach_target_runtime(model_runner, state: CpSharedKVState) -> CpSharedKVRuntime:
    """Steps a and b on the target worker; returns the pool's runtime."""
    from sglang.srt.distributed.parallel_state import get_world_group
    from sglang.srt.layers.dp_attention import get_attention_cp_group
    from sglang_cp_shared_kv.mem_cache.allocator import CPSharedPagedTokenToKVPoolAllocator

    pool = state.pool
    if type(pool) is not NSATokenToKVPool:
        raise ValueError(f"{FLAG} needs an NSATokenToKVPool, got {type(pool).__name__} (HiSparse?)")
    allocator = model_runner.token_to_kv_pool_allocator
    allocates_by_the_spec = (
        isinstance(allocator, CPSharedPagedTokenToKVPoolAllocator)
        and allocator.layout is state.spec.layout
    )
    if not allocates_by_the_spec:
        raise ValueError(
            f"{FLAG}: the token allocator must be the CPSharedPagedTokenToKVPoolAllocator of the "
            f"spec's layout, got {type(allocator).__name__}"
        )
    layout = state.spec.layout
    decision = state.spec.scratch
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
        state,
        scratch,
        cp_group.device_group,
        prefetch_slot=prefetch_slot,
        prefetch_group=prefetch_group,
        indexer_layer_ids=indexer_layer_ids_of(model_runner.model),
    )
    # The plan's page ids come from this host mirror, fed by every writer of req_to_token.
    state.mirror = ReqToPageMirror.attach(model_runner.req_to_token_pool, pool.page_size)
    return runtime


def log_startup_summary(model_runner, state: CpSharedKVState) -> None:
    """The one startup line of the server (CP rank 0; every rank sized the same: sglang takes the
    minimum of the profiled pool sizes over the TP group, and every rank reads the same settings)."""
    spec, runtime = state.spec, state.runtime
    if spec.layout.cp_rank != 0:
        return
    slots = runtime.pipeline.slots
    rows = effective_settings(
        model_runner.server_args,
        spec.settings,
        spec.decode,
        spec.scratch,
        logical_tokens=spec.layout.cp_size * runtime.pool.size,
        scratch_tokens=runtime.scratch.size,
        prefetch_slot_tokens=slots[1].size if len(slots) > 1 else 0,
    )
    logger.info("%s on: %s", FLAG, summary_line(rows))


def register_hooks(registry) -> None:
    registry.register(
        f"{_MODEL_RUNNER}.init_attention_backend", attach_after_attention_backend, HookType.AFTER
    )
