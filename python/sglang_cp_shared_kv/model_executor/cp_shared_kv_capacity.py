"""Logical KV capacity of a CP group that shares one page-sharded KV cache.

sglang profiles GPU memory and builds each rank's KV pool for the tokens that fit on that rank: the
*physical* capacity. With the shared cache every rank stores only the pages it owns, so the CP group
as a whole holds ``cp_size`` times as many *logical* tokens. The AROUND hook below lets the stock
``init_memory_pool`` size and build the physical pools unchanged, then, on the target worker:

* sets ``max_total_num_tokens = cp_size * physical tokens``. Everything that reads it afterwards sees
  logical tokens: ``TpModelWorker.max_total_num_tokens`` and ``max_req_len`` (through
  ``max_token_pool_size``), and through them the scheduler's admission, metrics and leak check
  ``available + evictable + protected == max_total_num_tokens``;
* replaces the stock paged allocator by ``CPSharedPagedTokenToKVPoolAllocator`` over the same
  physical ``NSATokenToKVPool``; its ``available_size()`` starts at exactly that logical number.

Left physical on purpose: ``memory_pool_config`` (a draft worker sizes its own pool from it and
shares the target's allocator, so the draft worker is skipped here), ``max_running_requests``, the
``--max-total-tokens`` cap (applied while profiling), and HiCache host pools (sized from the device
pool's physical ``size``).
"""

from __future__ import annotations

import logging

from sglang.srt.layers.dp_attention import get_attention_cp_rank, get_attention_cp_size
from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseNSATokenToKVPool
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
from sglang.srt.plugins.hook_registry import HookType

from sglang_cp_shared_kv.mem_cache.allocator import CPSharedPagedTokenToKVPoolAllocator
from sglang_cp_shared_kv.mem_cache.owner_run_placement import owner_run_pages
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG
from sglang_cp_shared_kv.settings import cp_shared_kv_enabled

logger = logging.getLogger(__name__)

INIT_MEMORY_POOL = (
    "sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin.init_memory_pool"
)


def register_hooks(registry) -> None:
    registry.register(INIT_MEMORY_POOL, init_memory_pool_with_logical_capacity, HookType.AROUND)


def init_memory_pool_with_logical_capacity(original, runner, *args, **kwargs):
    """AROUND ``init_memory_pool``: stock physical sizing, then logical capacity (target worker)."""
    result = original(runner, *args, **kwargs)
    if cp_shared_kv_enabled(runner.server_args) and not runner.is_draft_worker:
        # The attention CP group exists by now: ModelRunner.__init__ runs init_torch_distributed
        # before initialize() calls init_memory_pool.
        install_logical_capacity(runner, get_attention_cp_size(), get_attention_cp_rank())
    return result


def install_logical_capacity(runner, cp_size: int, cp_rank: int) -> None:
    """Publish ``cp_size`` x the physical pool as ``runner``'s capacity; allocate logical locs."""
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

    physical_tokens = pool.size
    logical_tokens = cp_size * physical_tokens
    runner.token_to_kv_pool_allocator = CPSharedPagedTokenToKVPoolAllocator(
        logical_tokens,
        page_size=runner.page_size,
        dtype=runner.kv_cache_dtype,
        device=runner.device,
        kvcache=pool,
        need_sort=runner.token_to_kv_pool_allocator.need_sort,
        cp_size=cp_size,
        cp_rank=cp_rank,
        owner_run_pages=owner_run_pages(runner.server_args, cp_size, runner.page_size),
    )
    runner.max_total_num_tokens = logical_tokens
    logger.info(
        "CP shared KV capacity: %d physical tokens per rank, %d logical tokens per CP group "
        "(cp_size=%d, page_size=%d, pages per owner run %d)",
        physical_tokens,
        logical_tokens,
        cp_size,
        runner.page_size,
        runner.token_to_kv_pool_allocator.owner_run_pages,
    )
