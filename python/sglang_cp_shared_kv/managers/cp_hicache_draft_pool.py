"""The MTP draft pool under CP HiCache: its host pools, and their registration with the controller.

sglang 0.5.11 registers the draft pool with HiCache from the scheduler
(``Scheduler._maybe_register_hicache_draft``): it builds a KV-only ``MLATokenToKVPoolHost`` with the
target's host slot count and calls ``set_draft_kv_pool``. For an NSA draft (the GLM-5 /
DeepSeek-V3.2 NextN layer) that is not enough: the draft's indexer K has no host pool, and the
KV host rows are built without the device's row width (fp8 rows are 656 bytes, the host's 576).
And the NSA controller (``HybridCacheController``) never reads ``has_draft``, so the draft host
pool would never be written or read anyway.

Under shared KV the draft pool is sharded by the target's layout (``cp_shared_kv_draft_pool``):
the draft rows of a node sit at the target's physical rows on the same owner. So the draft's host
copy shares the target's owner-pinned host slots one to one, and its pools mirror the target's
group: a KV host pool as wide as the device rows (the anchor) and an ``NSAIndexerPoolHost`` that
shares its slot indices, each with the target's host slot count for the draft's one layer. No
draft host slot is ever allocated from these pools: every backup and restore uses the target's
slots, so the host-slot ledger and every logical count stay as they are.

``register_draft_with_cp_hicache`` (AROUND the scheduler's method) builds that group instead of
stock's KV-only pool when the cache is ours, and hands it to ``CpHybridCacheController.set_draft_kv_pool``,
which checks it; ``start_writing`` / ``start_loading`` of the controller then move the draft with
the target's pages. Any other cache keeps stock's registration.
"""

from __future__ import annotations

import logging

from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
from sglang.srt.mem_cache.memory_pool_host import (
    HostPoolGroup,
    MLATokenToKVPoolHost,
    NSAIndexerPoolHost,
)
from sglang.srt.plugins.hook_registry import HookType

from sglang_cp_shared_kv.mem_cache.cp_hybrid_cache_controller import CpHybridCacheController
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG

logger = logging.getLogger(__name__)

REGISTER_HICACHE_DRAFT = "sglang.srt.managers.scheduler.Scheduler._maybe_register_hicache_draft"


def register_hooks(registry) -> None:
    registry.register(REGISTER_HICACHE_DRAFT, register_draft_with_cp_hicache, HookType.AROUND)


def register_draft_with_cp_hicache(original, scheduler, *args, **kwargs):
    """AROUND ``Scheduler._maybe_register_hicache_draft``: the draft's KV and indexer host pools
    for a CP HiCache controller; stock's registration for any other cache."""
    controller = getattr(getattr(scheduler, "tree_cache", None), "cache_controller", None)
    if not scheduler.enable_hierarchical_cache or not isinstance(
        controller, CpHybridCacheController
    ):
        return original(scheduler, *args, **kwargs)
    draft_pool, _ = scheduler._get_draft_kv_pool()
    if draft_pool is None:
        return None
    attach_draft_to_cp_hicache(controller, draft_pool, scheduler.server_args.hicache_mem_layout)
    return None


def attach_draft_to_cp_hicache(
    controller: CpHybridCacheController, draft_pool: NSATokenToKVPool, host_layout: str
) -> HostPoolGroup:
    """Build the draft's host pools (``build_draft_host_pools``) and register them with ``controller``."""
    if not isinstance(draft_pool, NSATokenToKVPool):
        raise ValueError(
            f"{FLAG} with --enable-hierarchical-cache: the draft pool must be an NSATokenToKVPool "
            f"sharded like the target's, got {type(draft_pool).__name__}"
        )
    group = build_draft_host_pools(draft_pool, controller.mem_pool_host, host_layout)
    controller.set_draft_kv_pool(draft_pool, group)
    return group


def build_draft_host_pools(
    draft_pool: NSATokenToKVPool, target_host: HostPoolGroup, host_layout: str
) -> HostPoolGroup:
    """KV (anchor, device row width) + indexer host pools of the draft, with the target's slot count.

    Sized as stock sizes the draft's KV host pool (``host_to_device_ratio`` = target host slots over
    draft device rows), so every target host slot is a valid draft slot; both pools are per layer of
    the draft, i.e. one layer for the NextN draft. Host memory: ``1 / target layers`` of the target's
    host pools (GLM-5: 1/78)."""
    kv_host = MLATokenToKVPoolHost(
        draft_pool,
        host_to_device_ratio=target_host.size / draft_pool.size,
        host_size=0,
        page_size=target_host.page_size,
        layout=host_layout,
        override_kv_cache_dim=draft_pool.kv_cache_dim,
    )
    indexer_host = NSAIndexerPoolHost(draft_pool, kv_host, host_layout)
    layers = {layer: layer for layer in range(draft_pool.layer_num)}
    entries = [
        build_pool_entry(
            name=PoolName.KV,
            host_pool=kv_host,
            device_pool=draft_pool,
            layer_mapping=layers,
            transfer_layer_num=draft_pool.layer_num,
            is_anchor=True,
        ),
        build_pool_entry(
            name=PoolName.INDEXER,
            host_pool=indexer_host,
            device_pool=draft_pool,
            layer_mapping=layers,
            transfer_layer_num=draft_pool.layer_num,
            share_indices_with_anchor=True,
        ),
    ]
    return HostPoolGroup(entries)
