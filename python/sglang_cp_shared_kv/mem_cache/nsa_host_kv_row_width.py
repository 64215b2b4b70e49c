"""KV host rows as wide as the NSA device rows (fp8 KV: 656 bytes, not 576).

sglang 0.5.11's NSA HiCache assembler (``attach_hybrid_nsa_pool_to_hiradix_cache`` ->
``build_shared_anchor_stack`` -> ``build_kv_host_pool``) builds the KV host pool without
``override_kv_cache_dim``, so the host row is ``kv_lora_rank + qk_rope_head_dim`` elements. That
matches a bf16 device row, but an fp8 NSA device row also carries its scales (656 bytes of uint8),
and a backup -> load-back round trip then corrupts every KV row (seen on an H200: docs/cp-hicache.md, "Host row width").
Registered with the CP HiCache hooks, so it applies only with the flag on.
"""

from __future__ import annotations

from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
from sglang.srt.plugins.hook_registry import HookType

BUILD_KV_HOST_POOL = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler.build_kv_host_pool"


def register_hooks(registry) -> None:
    registry.register(BUILD_KV_HOST_POOL, build_kv_host_pool_with_device_row_width, HookType.AROUND)


def build_kv_host_pool_with_device_row_width(original, *, kv_pool, override_kv_cache_dim=None, **kwargs):
    """Size NSA KV host rows from the device pool's ``kv_cache_dim`` unless the caller chose one."""
    if override_kv_cache_dim is None and isinstance(kv_pool, NSATokenToKVPool):
        override_kv_cache_dim = kv_pool.kv_cache_dim
    return original(kv_pool=kv_pool, override_kv_cache_dim=override_kv_cache_dim, **kwargs)
