"""Which path a forward's attention takes under shared KV, decided once per forward.

The decision is made in one place, AFTER ``NativeSparseAttnBackend.init_forward_metadata`` (the
backend has built this forward's index tables), in this order:

1. One of the EAGLE draft's steps, while the multi-step backend plans them
   (``CpSharedKVRuntime.planning_draft_steps``, set by ``draft_decode_steps``): the step's own plan
   (``plan_draft_step``); draft steps always gather, never per owner.
2. A decode forward that per-owner decode takes (``CpSharedKVState.begin_per_owner_forward``, only
   where it was attached at startup): no plan, the index tables stay physical, and the pool
   getters serve the physical pool.
3. Everything else gathers: the forward's plan (``CpSharedKVRuntime.begin_forward``), then its
   index tables are rewritten to scratch locs (``peer_page_reads.remap_index_tables``).

Every CP rank runs the same batch and holds the same startup state, so every rank takes the same
branch and enters the same collectives. This module is the only caller of the three entries above
(the pool's state hands the second to per-owner decode); ``test_module_structure`` pins that.
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookType
from sglang_cp_shared_kv.model_executor.cp_shared_kv_state import serving_state
from sglang_cp_shared_kv.model_executor.peer_page_reads import remap_index_tables

_BACKEND = "sglang.srt.layers.attention.nsa_backend.NativeSparseAttnBackend"


def dispatch_forward_metadata(result, backend, forward_batch, *args, **kwargs):
    """AFTER ``NativeSparseAttnBackend.init_forward_metadata``: draft step, per owner or gather."""
    state = serving_state(forward_batch.token_to_kv_pool)
    if state is None:
        return None
    runtime = state.runtime
    if runtime.planning_draft_steps:
        plan = runtime.plan_draft_step(backend, forward_batch)
    elif state.begin_per_owner_forward(backend, forward_batch):
        return None
    else:
        plan = runtime.begin_forward(forward_batch)
    remap_index_tables(backend, plan)
    return None


def register_hooks(registry) -> None:
    registry.register(f"{_BACKEND}.init_forward_metadata", dispatch_forward_metadata, HookType.AFTER)
