"""Owner-filtered persistent writes into the sharded ``NSATokenToKVPool``.

Every KV store in an NSA forward receives the whole batch's *logical* locs (``out_cache_loc``;
under NSA prefill CP the chunk is all-gathered before it is stored). A rank keeps only the locs it
owns, as physical rows; the other rows are written to their slot of physical page 0, the dummy page
no allocated logical page maps to, so they never land on real data. The map keeps shapes static
(no boolean masking, no host sync), and padded tokens (loc 0) sink the same way as in stock sglang.

Hooks (only the pool a ``CpSharedKVRuntime`` serves is affected; the scratch and any other pool
pass through):

* ``NSATokenToKVPool.set_mla_kv_buffer``: MLA latent rows of every dtype the pool stores (bf16,
  fp8 656-byte rows); covers prefill, decode and the trtllm path (write sites W1-W3).
* ``Indexer._store_index_k_cache``: indexer K on all its branches (fused JIT store, AITER,
  ``act_quant`` + ``set_index_k_scale_buffer``), which read the locs from the forward batch.
* ``NSATokenToKVPool.set_kv_buffer``: unused by NSA; refused, since it would bypass the filter.

The same hooks then assemble the gather scratch for the layer (see ``cp_shared_kv_runtime``).
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookType
from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import runtime_of
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG

_POOL = "sglang.srt.mem_cache.memory_pool.NSATokenToKVPool"
_INDEXER = "sglang.srt.layers.attention.nsa.nsa_indexer.Indexer"


def set_mla_kv_buffer(original, pool, layer, loc, cache_k_nope, cache_k_rope):
    runtime = runtime_of(pool)
    if runtime is None:
        return original(pool, layer, loc, cache_k_nope, cache_k_rope)
    runtime.store_mla_kv(original, layer, loc, cache_k_nope, cache_k_rope)


def store_index_k_cache(original, indexer, forward_batch, layer_id, key, *, act_quant=None):
    runtime = runtime_of(forward_batch.token_to_kv_pool)
    if runtime is None:
        return original(indexer, forward_batch, layer_id, key, act_quant=act_quant)
    runtime.store_index_k(original, indexer, forward_batch, layer_id, key, act_quant)


def set_kv_buffer(original, pool, *args, **kwargs):
    if runtime_of(pool) is not None:
        raise ValueError(
            f"{FLAG}: NSATokenToKVPool.set_kv_buffer would bypass the owner filter; "
            f"NSA stores go through set_mla_kv_buffer"
        )
    return original(pool, *args, **kwargs)


def register_hooks(registry) -> None:
    registry.register(f"{_POOL}.set_mla_kv_buffer", set_mla_kv_buffer, HookType.AROUND)
    registry.register(f"{_INDEXER}._store_index_k_cache", store_index_k_cache, HookType.AROUND)
    registry.register(f"{_POOL}.set_kv_buffer", set_kv_buffer, HookType.AROUND)
