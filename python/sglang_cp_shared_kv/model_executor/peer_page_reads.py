"""Reads of peer pages: attention and the NSA indexer read the gather scratch, not the shard.

* ``remap_index_tables``: once ``forward_dispatch`` has planned a gathering forward's pages
  (``CpSharedKVRuntime.begin_forward``), rewrite the index tables in the frozen ``NSAMetadata``
  (``dataclasses.replace``): ``page_table_1`` and ``page_table_1_flattened`` hold token locs,
  ``real_page_table`` page ids; all become scratch locs / pages. Under round-robin CP the tables are
  already filtered to this rank's requests; the remap is elementwise, and the plan covers the whole
  unfiltered batch, so that is fine.
* Pool getters (AROUND), called by the kernels after the layer's store assembled its scratch slot
  (``CpSharedKVRuntime.kv_slot_for_read``: slot ``l % 2`` under the layer-ahead prefetch, else 0):
  ``get_key_buffer`` (attention, all impls), ``get_index_k_with_scale_buffer`` (paged indexer in
  decode; the fused indexer store also calls it, see ``CpSharedKVRuntime.writing_physical``) and
  ``get_index_k_scale_buffer`` (ragged indexer in prefill) return the scratch's buffers, after the
  original's HiCache per-layer wait.
* A decode forward that per-owner decode takes over (``forward_dispatch``) is not planned or
  remapped, and the getters then serve the physical buffers (the pool's state says so:
  ``CpSharedKVState.reads_physical_pool``).
* Readers this runtime does not serve raise: ``get_index_k_continuous`` /
  ``get_index_k_scale_continuous`` (in-seq-split CP and the non-CUDA indexer), ``get_mla_kv_buffer``
  (the dense MHA path, off under NSA prefill CP), and CUDA-graph capture / replay of the backend
  unless decode graphs run per owner (``per_owner_decode.cuda_graphs`` made the backend's static
  owner tables).
"""

from __future__ import annotations

import dataclasses

from sglang.srt.plugins.hook_registry import HookType
from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import runtime_of
from sglang_cp_shared_kv.model_executor.cp_shared_kv_state import serving_state
from sglang_cp_shared_kv.model_executor.gather_scratch import SCRATCH_LAYER_ID
from sglang_cp_shared_kv.model_executor.per_owner_decode import (
    cuda_graphs as per_owner_decode_graphs,
)
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG

_POOL = "sglang.srt.mem_cache.memory_pool.NSATokenToKVPool"
_BACKEND = "sglang.srt.layers.attention.nsa_backend.NativeSparseAttnBackend"


def remap_index_tables(backend, plan) -> None:
    """Rewrite the frozen ``NSAMetadata`` of a gathering forward to scratch locs / pages (the
    decision to gather is ``forward_dispatch``'s)."""
    metadata = backend.forward_metadata
    flattened = metadata.page_table_1_flattened
    backend.forward_metadata = dataclasses.replace(
        metadata,
        page_table_1=plan.remap_token_locs(metadata.page_table_1),
        real_page_table=plan.remap_pages(metadata.real_page_table),
        page_table_1_flattened=None if flattened is None else plan.remap_token_locs(flattened),
    )


def get_key_buffer(original, pool, layer_id):
    buffer = original(pool, layer_id)
    state = serving_state(pool)
    if state is None or state.reads_physical_pool():
        return buffer
    return original(state.runtime.kv_slot_for_read(layer_id), SCRATCH_LAYER_ID)


def get_index_k_with_scale_buffer(original, pool, layer_id):
    buffer = original(pool, layer_id)
    state = serving_state(pool)
    if state is None or state.runtime.writing_physical or state.reads_physical_pool():
        return buffer
    return original(state.runtime.index_slot_for_read(layer_id), SCRATCH_LAYER_ID)


def get_index_k_scale_buffer(
    original, pool, layer_id, seq_len_tensor, page_indices, seq_len_sum, max_seq_len
):
    runtime = runtime_of(pool)
    if runtime is None:
        return original(pool, layer_id, seq_len_tensor, page_indices, seq_len_sum, max_seq_len)
    runtime.wait_for_layer(layer_id)
    slot = runtime.index_slot_for_read(layer_id)
    # ``page_indices`` is the remapped ``real_page_table``: scratch pages.
    return original(slot, SCRATCH_LAYER_ID, seq_len_tensor, page_indices, seq_len_sum, max_seq_len)


def refuse_when_served(name: str):
    def refuse(original, pool, *args, **kwargs):
        if runtime_of(pool) is not None:
            raise ValueError(
                f"{FLAG} does not serve NSATokenToKVPool.{name} (in-seq-split CP, the non-CUDA "
                f"indexer and the dense MHA path are unsupported)"
            )
        return original(pool, *args, **kwargs)

    return refuse


def refuse_cuda_graph(backend, *args, **kwargs):
    if per_owner_decode_graphs.buffers_of(backend) is not None:
        return None  # decode graphs per owner (per_owner_decode.cuda_graphs): no gather
    raise ValueError(
        f"{FLAG} requires --disable-cuda-graph: decode graphs cannot replay the per-forward, "
        f"variable-size page gather"
    )


def register_hooks(registry) -> None:
    for method in (
        "init_forward_metadata_capture_cuda_graph",
        "init_forward_metadata_replay_cuda_graph",
        "init_forward_metadata_replay_cuda_graph_from_precomputed",
    ):
        registry.register(f"{_BACKEND}.{method}", refuse_cuda_graph, HookType.BEFORE)
    registry.register(f"{_POOL}.get_key_buffer", get_key_buffer, HookType.AROUND)
    registry.register(
        f"{_POOL}.get_index_k_with_scale_buffer", get_index_k_with_scale_buffer, HookType.AROUND
    )
    registry.register(f"{_POOL}.get_index_k_scale_buffer", get_index_k_scale_buffer, HookType.AROUND)
    for name in ("get_index_k_continuous", "get_index_k_scale_continuous", "get_mla_kv_buffer"):
        registry.register(f"{_POOL}.{name}", refuse_when_served(name), HookType.AROUND)
