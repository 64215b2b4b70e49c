"""The EAGLE draft's multi-step decode under shared KV: one plan per step, picked when the step runs.

sglang 0.5.11's ``EAGLEWorker.draft`` (top-k 1) initializes the metadata of every draft step at
once, from the same batch, before the first step runs
(``NativeSparseAttnMultiStepBackend.init_forward_metadata``: one ``NativeSparseAttnBackend`` per
step, ``speculative_step_id`` 0 .. steps-2), then ``draft_forward`` runs the steps one after the
other, each through ``ModelRunner.forward`` with ``forward_batch.attn_backend`` set to its step's
backend and ``out_cache_loc`` to its step's locs. Every step stores the NextN layer's KV and
indexer K once, and reads the committed tokens only, while it writes at ``seq_len + step``.
Spec v2's ``EagleDraftWorker.draft`` (``eagle_worker_v2.py``) runs its steps the same way, through
the same two hooks: ``prepare_for_v2_draft`` builds a DECODE batch of the committed ``seq_lens``
(``seq_lens_cpu`` copied by its ``prepare_for_decode``) with the step locs copied from
``req_to_token`` at ``seq_len + step``; ``self.draft_attn_backend.init_forward_metadata`` is the
multi-step backend's; each step runs ``self.draft_runner.forward(..., skip_attn_backend_init=True)``,
i.e. ``ModelRunner.forward`` (the draft runner has no graph runner of its own, so ``_forward_raw``
goes to ``forward_decode``). Only its draft CUDA graph (``cuda_graph_runner.replay``) bypasses
both, and that graph's capture is refused (below). ``test_spec_v2_draft_steps.py`` runs sglang's
own ``EagleDraftWorker.draft`` through these hooks.

The runtime holds one plan per forward, so here:

1. ``plan_draft_steps`` (AROUND the multi-step backend's ``init_forward_metadata``): while the step
   backends' metadata are built, the backend's metadata hook (``peer_page_reads``) plans each step
   with ``CpSharedKVRuntime.plan_draft_step`` (``draft_step_lengths``: every committed page
   gathered, a page only draft tokens fill planned as a local fill) and remaps that step's tables
   with it. Draft steps never run per owner: per-owner decode serves the target's decode only, and
   its state is cleared so the pool getters serve the scratch. Afterwards no plan is active: a step
   that did not select its own reads nothing (the reads raise).
2. ``select_draft_step_plan`` (BEFORE ``ModelRunner.forward``): when the forward's
   ``attn_backend`` is a step planned in 1, its plan becomes the runtime's and the layer pipeline
   starts afresh (one store per layer and step, serial path).

Host data only (``seq_lens_cpu``, the rows of ``ForwardBatch.init_new``, the ``req_to_token``
mirror), the same on every rank, so every rank plans the same steps and enters the same gathers.
Under CUDA graphs the step backends' capture and replay are refused by ``peer_page_reads``.
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookType
from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import runtime_of

_MULTI_STEP_BACKEND = "sglang.srt.layers.attention.nsa_backend.NativeSparseAttnMultiStepBackend"
_MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"


def plan_draft_steps(original, multi_step_backend, forward_batch, *args, **kwargs):
    """AROUND ``NativeSparseAttnMultiStepBackend.init_forward_metadata``: plan every step."""
    runtime = runtime_of(forward_batch.token_to_kv_pool)
    if runtime is None:
        return original(multi_step_backend, forward_batch, *args, **kwargs)
    runtime.state.end_per_owner_forward()
    runtime.begin_draft_step_planning()
    try:
        return original(multi_step_backend, forward_batch, *args, **kwargs)
    finally:
        runtime.end_draft_step_planning()


def select_draft_step_plan(model_runner, forward_batch, *args, **kwargs):
    """BEFORE ``ModelRunner.forward``: a draft step runs on its own plan (draft steps are DECODE
    forwards; an idle draft, which plans nothing, selects nothing)."""
    runtime = runtime_of(forward_batch.token_to_kv_pool)
    if runtime is None or not runtime.draft_step_plans or not forward_batch.forward_mode.is_decode():
        return None
    if runtime.begin_draft_step(getattr(forward_batch, "attn_backend", None)):
        runtime.state.end_per_owner_forward()
    return None


def register_hooks(registry) -> None:
    registry.register(
        f"{_MULTI_STEP_BACKEND}.init_forward_metadata", plan_draft_steps, HookType.AROUND
    )
    registry.register(f"{_MODEL_RUNNER}.forward", select_draft_step_plan, HookType.BEFORE)
