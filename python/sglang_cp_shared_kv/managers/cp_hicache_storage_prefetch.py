"""The scheduler's entry into L3 prefetch under CP shared KV (AROUND ``Scheduler._prefetch_kvcache``).

Stock starts a prefetch only below a node whose ``host_value`` is set (``last_host_node.backuped``) or
at the root. CP nodes never set ``host_value`` (their host copy is per-rank metadata), so stock would
prefetch only for prompts with no host hit at all. Here every request that arrives goes to
``CpHiRadixCache.prefetch_from_storage_cp`` with its whole prompt: the cache matches it, and restores
from storage what lies beyond the match. The scheduler calls this on every rank for the same request
in the same order (requests are broadcast to the attention group), which the prefetch's agreement needs.
Any other cache, or a CP cache without storage, gets stock's method.
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookType

PREFETCH_KVCACHE = "sglang.srt.managers.scheduler.Scheduler._prefetch_kvcache"


def register_hooks(registry) -> None:
    registry.register(PREFETCH_KVCACHE, prefetch_kvcache_cp, HookType.AROUND)


def prefetch_kvcache_cp(original, scheduler, req, *args, **kwargs):
    """AROUND ``Scheduler._prefetch_kvcache``: the CP cache's synchronous L3 prefetch."""
    cache = getattr(scheduler, "tree_cache", None)
    if not scheduler.enable_hicache_storage or getattr(cache, "cp_storage", None) is None:
        return original(scheduler, req, *args, **kwargs)
    cache.prefetch_from_storage_cp(req.rid, req.origin_input_ids, extra_key=req.extra_key)
    return None
