"""The MTP draft's KV pool under shared KV: sharded by the target's layout, served by its own runtime.

sglang 0.5.11's EAGLE worker gives the draft model runner the target's ``req_to_token_pool`` and
token allocator and its own KV pool, built from the target's ``memory_pool_config``
(``EAGLEWorker.__init__``, ``ModelRunnerKVCacheMixin.init_memory_pool``). For DeepSeek-V3.2 / GLM-5
the draft is the NextN layer, whose attention has an NSA indexer, so that pool is an
``NSATokenToKVPool`` of one layer with indexer K. Under shared KV the config still holds the
target's *physical* tokens (the capacity hook publishes the logical capacity on the target runner
only), while the shared allocator hands out *logical* locs. The draft pool is therefore exactly one
rank's shard of a one-layer logical pool: every logical loc the allocator can hand out has a
physical row on its owner (``CpSharedKVLayout``), and no byte more is needed than stock allocates.

So the draft pool is sharded like the target's: it gets a ``CpSharedKVState`` of its own with the
target's spec (the same object: layout, settings, decode path, scratch decision) and the target's
host mirror, and a second ``CpSharedKVRuntime``; the owner-filtered writes, the per-forward plan
and the gather of the hooks serve it unchanged (they find the runtime through
``runtime_of(forward_batch.token_to_kv_pool)``); the draft's
multi-step decode gets one plan per step (``draft_decode_steps``), so the shared scratch must hold
a gathering decode (the default decode path), except on a PD prefill server, which runs no decode
step (a draft step reaching the plan there raises, ``CpSharedKVRuntime.plan_draft_step``). It
shares the
target's gather scratch (slot 0, one layer at the logical capacity): target and draft forwards run
one after the other on the same stream, and every forward plans and assembles its own layers before
reading them. The draft runs the serial path (one layer: nothing to prefetch behind).

Replicating the draft pool at the logical capacity was the alternative; docs/speculative-decoding.md
gives the numbers against it (memory stock never reserved, and the PD transfer and HiCache pair the
draft's pages with the target's physical pages).

``attach_draft_worker`` (called by ``startup_wiring`` after ``ModelRunner.init_attention_backend``
on the draft worker) attaches it; the startup rules accept MTP only with its opt-in
(``startup_rules.speculative_problems``), so without it this is never reached in a server.
"""

from __future__ import annotations

import logging

from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import CpSharedKVRuntime, runtime_of
from sglang_cp_shared_kv.model_executor.cp_shared_kv_state import CpSharedKVState, state_of
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG
from sglang_cp_shared_kv.settings import DECODE_PATH_ENV, GATHER, PER_OWNER

logger = logging.getLogger(__name__)


def draft_pool_problems(target_pool, draft_pool) -> list[str]:
    """Why ``draft_pool`` cannot be sharded by the target's layout (empty: it can).

    The layout maps logical page ``q`` to physical page ``q // cp_size`` on every pool it serves, so
    the draft pool must hold the same physical pages as the target's, in the same row formats (the
    shared scratch stores both)."""
    if type(draft_pool) is not NSATokenToKVPool:
        return [f"{FLAG}: the draft pool must be an NSATokenToKVPool, got {type(draft_pool).__name__}"]
    problems = []
    for name in ("size", "page_size", "dtype", "kv_cache_dim", "index_head_dim"):
        draft_value, target_value = getattr(draft_pool, name), getattr(target_pool, name)
        if draft_value != target_value:
            problems.append(
                f"{FLAG}: the draft pool's {name} is {draft_value}, the target's {target_value}; a "
                f"draft pool sharded by the target's layout needs the same"
            )
    return problems


def attach_draft_runtime(
    draft_pool: NSATokenToKVPool, target_pool: NSATokenToKVPool
) -> CpSharedKVRuntime:
    """Attach a state and a runtime to ``draft_pool`` with the spec, mirror, CP group and scratch of
    ``target_pool``'s. On a PD prefill server (the spec's decode path says so) the draft runs
    extends only, which a prefill-sized scratch serves."""
    target = runtime_of(target_pool)
    if target is None:
        raise ValueError(f"{FLAG}: the target pool has no runtime; attach the target's first")
    if state_of(draft_pool) is not None:
        raise ValueError(f"{FLAG}: the draft pool already has a runtime")
    spec = target.state.spec
    problems = draft_pool_problems(target_pool, draft_pool)
    if not spec.decode.pd_prefill and not spec.scratch_serves_decode:
        # The draft's decode steps always gather (draft_decode_steps), over the whole batch.
        problems.append(
            f"{FLAG}: the draft's decode steps gather pages, but the gather scratch was sized for "
            f"prefill batches only ({DECODE_PATH_ENV}={PER_OWNER}); {DECODE_PATH_ENV}={GATHER} "
            f"sizes it for them"
        )
    if problems:
        raise ValueError("; ".join(problems))
    state = CpSharedKVState(draft_pool, spec)
    state.mirror = target.state.mirror  # the target's and the draft's req_to_token are one table
    # indexer_layer_ids None: the NextN layer computes its own top-k (skip_topk is False for it).
    return CpSharedKVRuntime(state, target.scratch, target.cp_group)


def attach_draft_worker(model_runner) -> None:
    """The draft worker's step of the startup (``startup_wiring``, after
    ``ModelRunner.init_attention_backend``; MTP, flag on): the draft pool's runtime.

    The draft shares the target's allocator, whose pool is the target's, whose state and runtime
    attached when the target worker initialized: the spec judged and decided there (the same server
    args, in this process) serves the draft as it is, and the host mirror of the shared
    ``req_to_token`` is already there."""
    draft_pool = model_runner.token_to_kv_pool
    if runtime_of(draft_pool) is not None:
        return
    if model_runner.server_args.speculative_algorithm is None:
        raise ValueError(f"{FLAG}: a draft worker without --speculative-algorithm")
    attach_draft_runtime(draft_pool, model_runner.token_to_kv_pool_allocator.get_kvcache())
    logger.info(
        "CP shared KV runtime on the draft pool: %d physical tokens, %d layer(s), the target's layout",
        draft_pool.size,
        draft_pool.layer_num,
    )
