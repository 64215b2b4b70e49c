"""Logical KV capacity of a CP group that shares one page-sharded KV cache, and the spec's birth.

sglang profiles GPU memory and builds each rank's KV pool for the tokens that fit on that rank: the
*physical* capacity. With the shared cache every rank stores only the pages it owns, so the CP group
as a whole holds ``cp_size`` times as many *logical* tokens. The AROUND hook below, on the target
worker:

1. builds the model runner's ``CpSharedKVSpec`` (``cp_shared_kv_spec.build_spec``): the layout, the
   settings read once, the startup rules the runtime needs judged, the decode path and the scratch
   decision. Once per runner; everything after reads it;
2. runs the stock ``init_memory_pool``, which sizes and builds the physical pools unchanged but for
   the gather scratch's bytes, held back from the KV budget before sglang sizes the pool
   (``reserve_scratch_before_pool_sizing``, AFTER ``_profile_available_bytes``, with the spec being
   installed);
3. sets ``max_total_num_tokens = cp_size * physical tokens``. Everything that reads it afterwards
   sees logical tokens: ``TpModelWorker.max_total_num_tokens`` and ``max_req_len`` (through
   ``max_token_pool_size``), and through them the scheduler's admission, metrics and leak check
   ``available + evictable + protected == max_total_num_tokens``;
4. replaces the stock paged allocator by ``CPSharedPagedTokenToKVPoolAllocator`` over the same
   physical ``NSATokenToKVPool`` and the spec's layout; its ``available_size()`` starts at exactly
   that logical number;
5. attaches the pool's ``CpSharedKVState`` holding the spec, which the attach
   (``startup_wiring``) fills with the runtime, the mirror and per-owner decode.

Left physical on purpose: ``memory_pool_config`` (a draft worker sizes its own pool from it and
shares the target's allocator, so the draft worker is skipped here and reuses the target's spec),
``max_running_requests``, the ``--max-total-tokens`` cap (applied while profiling), and HiCache
host pools (sized from the device pool's physical ``size``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from typing import Iterator, Optional

from sglang.srt.layers.dp_attention import get_attention_cp_rank, get_attention_cp_size
from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseNSATokenToKVPool
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
from sglang.srt.plugins.hook_registry import HookType

from sglang_cp_shared_kv.mem_cache.allocator import CPSharedPagedTokenToKVPoolAllocator
from sglang_cp_shared_kv.mem_cache.owner_run_placement import owner_run_pages
from sglang_cp_shared_kv.model_executor.cp_shared_kv_spec import CpSharedKVSpec, build_spec
from sglang_cp_shared_kv.model_executor.cp_shared_kv_state import CpSharedKVState
from sglang_cp_shared_kv.model_executor.gather_scratch import reserve_scratch_bytes
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG
from sglang_cp_shared_kv.settings import cp_shared_kv_enabled

logger = logging.getLogger(__name__)

_MIXIN = "sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin"
INIT_MEMORY_POOL = f"{_MIXIN}.init_memory_pool"
PROFILE_AVAILABLE_BYTES = f"{_MIXIN}._profile_available_bytes"

# The spec of the runner whose pool is being built, for the reservation (step 2), which sglang calls
# from inside ``init_memory_pool``.
_spec_being_installed: contextvars.ContextVar = contextvars.ContextVar(
    "cp_shared_kv_spec_being_installed", default=None
)


def register_hooks(registry) -> None:
    registry.register(INIT_MEMORY_POOL, init_memory_pool_with_logical_capacity, HookType.AROUND)
    registry.register(PROFILE_AVAILABLE_BYTES, reserve_scratch_before_pool_sizing, HookType.AFTER)


def init_memory_pool_with_logical_capacity(original, runner, *args, **kwargs):
    """AROUND ``init_memory_pool``: steps 1-5 of the module docstring (target worker)."""
    if not cp_shared_kv_enabled(runner.server_args) or runner.is_draft_worker:
        return original(runner, *args, **kwargs)
    # The attention CP group exists by now: ModelRunner.__init__ runs init_torch_distributed
    # before initialize() calls init_memory_pool.
    spec = build_spec(
        runner.server_args,
        runner.model_config.context_len,
        get_attention_cp_size(),
        get_attention_cp_rank(),
    )
    with installing(spec):
        result = original(runner, *args, **kwargs)
    install_logical_capacity(runner, spec)
    return result


@contextlib.contextmanager
def installing(spec: CpSharedKVSpec) -> Iterator[None]:
    """While the stock ``init_memory_pool`` runs: the reservation reads ``spec``."""
    token = _spec_being_installed.set(spec)
    try:
        yield
    finally:
        _spec_being_installed.reset(token)


def spec_being_installed() -> Optional[CpSharedKVSpec]:
    return _spec_being_installed.get()


def reserve_scratch_before_pool_sizing(available_bytes, model_runner, *args, **kwargs):
    """AFTER ``_profile_available_bytes``: hold back the scratch's bytes from the KV budget, as the
    spec being installed decided them (nothing outside the capacity hook: draft worker, flag off)."""
    spec = spec_being_installed()
    if spec is None:
        return None
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
    reserve = reserve_scratch_bytes(
        available_bytes,
        unreserved_tokens,
        spec.layout.cp_size,
        kv_row_bytes,
        page_size,
        requested_prefetch_slot_tokens=spec.scratch.prefetch_slot_requested_tokens,
        prefill_slot0_tokens=spec.scratch.slot0.prefill_tokens,
    )
    logger.info(
        "CP shared KV: reserved %.2f GB of %.2f GB KV memory for the gather scratch",
        reserve / (1 << 30),
        available_bytes / (1 << 30),
    )
    return available_bytes - reserve


def install_logical_capacity(runner, spec: CpSharedKVSpec) -> CpSharedKVState:
    """Publish ``cp_size`` x the physical pool as ``runner``'s capacity; allocate logical locs by the
    spec's layout; attach the pool's state with the spec."""
    pool = runner.token_to_kv_pool
    if not isinstance(pool, NSATokenToKVPool) or isinstance(pool, HiSparseNSATokenToKVPool):
        raise ValueError(
            f"{FLAG} needs an NSATokenToKVPool (GLM-5 / DeepSeek-V3.2 without HiSparse); "
            f"this model built {type(pool).__name__}"
        )
    if runner.server_args.enable_return_routed_experts:
        # The routed-experts host buffer has max_total_num_tokens + page_size rows indexed by
        # out_cache_loc, but logical locs reach size + cp_size * page_size - 1.
        raise ValueError(f"{FLAG} does not support --enable-return-routed-experts")

    layout = spec.layout
    physical_tokens = pool.size
    logical_tokens = layout.cp_size * physical_tokens
    runner.token_to_kv_pool_allocator = CPSharedPagedTokenToKVPoolAllocator(
        logical_tokens,
        page_size=runner.page_size,
        dtype=runner.kv_cache_dtype,
        device=runner.device,
        kvcache=pool,
        need_sort=runner.token_to_kv_pool_allocator.need_sort,
        layout=layout,
        owner_run_pages=owner_run_pages(runner.server_args, layout.cp_size, runner.page_size),
    )
    runner.max_total_num_tokens = logical_tokens
    logger.info(
        "CP shared KV capacity: %d physical tokens per rank, %d logical tokens per CP group "
        "(cp_size=%d, page_size=%d, pages per owner run %d)",
        physical_tokens,
        logical_tokens,
        layout.cp_size,
        runner.page_size,
        runner.token_to_kv_pool_allocator.owner_run_pages,
    )
    return CpSharedKVState(pool, spec)
