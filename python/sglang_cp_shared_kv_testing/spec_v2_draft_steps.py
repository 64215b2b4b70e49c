"""Spec v2's draft steps through sglang's own ``EagleDraftWorker.draft``, with a stand-in model.

What runs is sglang 0.5.11's: ``EagleDraftWorker.draft`` (``speculative/eagle_worker_v2.py``) with
``EagleDraftInputV2Mixin.prepare_for_v2_draft`` (the step locs copied from ``req_to_token`` after
the committed tokens by its Triton kernel), ``ForwardBatch.init_new``,
``NativeSparseAttnMultiStepBackend.init_forward_metadata`` (all steps' metadata at once),
``draft_forward`` (``select_top_k_tokens``, the step loop) and, per step, ``ModelRunner.forward``
-> ``_forward_raw`` -> ``forward_decode`` (``skip_attn_backend_init=True``) on a ``ModelRunner``
whose model is a stand-in. The plugin's hooks are applied as the plugin registers them:
``draft_decode_steps`` (AROUND the multi-step init, BEFORE ``ModelRunner.forward``) and the mirror's
``ForwardBatch.init_new`` hook (the batch's rows on the host).

Stand-ins: the step backends' metadata init (a real ``NSAMetadata`` of the committed tokens, then
the backend's metadata hook ``forward_dispatch`` as the registry runs it; sglang's own builds it on
CUDA), the model (records, when the step's forward reaches it, which step backend the forward
carries and which of the runtime's step plans is active, with the pages that plan gathers and fills
locally, the forward's locs and positions), and ``build_tree_kernel_efficient`` (sgl_kernel CUDA;
it runs after the steps). One process plays CP rank 1 of 2; the plans need no collective.

The Triton kernel runs on Triton's CPU interpreter, which must be on before Triton is imported:
``main`` runs in a subprocess with ``TRITON_INTERPRET=1`` and prints one JSON line.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch

PAGE = 64
CP_SIZE, RANK, PHYSICAL_PAGES = 2, 1, 8
NUM_STEPS = 4  # --speculative-num-steps: 3 step forwards (the last step only samples)
HIDDEN, VOCAB = 8, 32
# Committed lengths per req_to_token row: row 1's step tokens stay on the page of its last
# committed token; row 2's first draft token opens a page; row 3's third one does; row 4 is in the
# middle of its last page.
SEQ_LENS = {1: 129, 2: 128, 3: 62, 4: 200}
# Logical pages of each row (distinct, as the shared allocator hands them out; pages below CP_SIZE
# are the dummy page's and never handed out).
ROW_PAGES = {1: [4, 9, 6], 2: [3, 11, 8], 3: [5, 10], 4: [13, 7, 12, 15]}


def _pages(lookup) -> list:
    return sorted(np.flatnonzero(lookup.cpu().numpy()).tolist())


def _plan_pages(plan) -> dict:
    from sglang_cp_shared_kv_testing.peer_page_plan_fills import fill_lookup

    filled = _pages(fill_lookup(plan))
    return {"gathered": sorted(set(_pages(plan.lookup)) - set(filled)), "filled": filled}


class _StepBackend:
    """A ``NativeSparseAttnBackend`` of one draft step: its metadata init builds the committed
    tokens' tables, then runs the backend's metadata hook (``forward_dispatch``)."""

    def __init__(self, step: int):
        self.speculative_step_id = step
        self.forward_metadata = None

    def init_forward_metadata(self, forward_batch) -> None:
        from sglang_cp_shared_kv.model_executor import forward_dispatch
        from sglang_cp_shared_kv_testing.runtime_check import nsa_metadata_for

        seq_lens = forward_batch.seq_lens_cpu
        table = forward_batch.req_to_token_pool.req_to_token[
            forward_batch.req_pool_indices, : int(seq_lens.max())
        ].to(torch.int32)
        self.forward_metadata = nsa_metadata_for(table, seq_lens.to(torch.int32))
        forward_dispatch.dispatch_forward_metadata(None, self, forward_batch)


class _Model:
    """The draft model: what the runtime holds when a step's forward reaches it."""

    def __init__(self, runtime, multi_step):
        self.runtime, self.multi_step, self.steps = runtime, multi_step, []
        self.runner = None  # the ModelRunner whose forward_decode calls this

    def forward(self, input_ids, positions, forward_batch, **kwargs):
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        runtime = self.runtime
        plans = [plan for _, plan in runtime.draft_step_plans]
        active = next((i for i, plan in enumerate(plans) if plan is runtime.plan), None)
        backends = self.multi_step.attn_backends
        record = {
            "backend_step": next(
                (b.speculative_step_id for b in backends if b is forward_batch.attn_backend), None
            ),
            "forward_pass_id": self.runner.forward_pass_id,  # counted by ModelRunner.forward
            "active_plan": active,  # index into the runtime's step plans, None if no step plan
            "pipeline_on_active_plan": runtime.pipeline.plan is runtime.plan is not None,
            "locs": forward_batch.out_cache_loc.tolist(),
            "positions": positions.tolist(),
            "seq_lens_cpu": forward_batch.seq_lens_cpu.tolist(),
        }
        if runtime.plan is not None:
            record.update(_plan_pages(runtime.plan))
        self.steps.append(record)
        bs = input_ids.shape[0]
        return LogitsProcessorOutput(
            next_token_logits=torch.randn(bs, VOCAB), hidden_states=torch.randn(bs, HIDDEN)
        )


def _model_runner(model, req_to_token_pool, pool):
    """A ``ModelRunner`` with the attributes its ``forward`` path reads for an eager decode."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)
    runner.__dict__.update(
        model=model,
        device="cpu",
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool=pool,
        attn_backend=None,
        graph_runner=None,  # the draft worker's runner captures no graph of its own
        forward_pass_id=0,
        msprobe_debugger=None,
        enable_elastic_ep=False,
        eplb_manager=None,
        hisparse_coordinator=None,
        support_pp=False,
        device_timer=None,
        use_ngram_embedding=False,
        model_is_mrope=False,
        is_hybrid_swa=False,
        server_args=SimpleNamespace(
            disable_overlap_schedule=False,
            enable_pdmux=False,
            elastic_ep_backend=None,
            enable_lora=False,
            attention_backend="nsa",
        ),
    )
    return runner


def run() -> dict:
    """One draft of four requests; the steps' records and the plans the runtime built."""
    from sglang.srt.layers.attention.nsa_backend import NativeSparseAttnMultiStepBackend
    from sglang.srt.managers.schedule_batch import ModelWorkerBatch
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative import eagle_worker_v2
    from sglang.srt.speculative.eagle_info import EagleDraftInput
    from sglang.srt.speculative.eagle_utils import TreeMaskMode

    from sglang_cp_shared_kv.mem_cache import req_to_page_mirror_writers
    from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
    from sglang_cp_shared_kv.mem_cache.req_to_page_mirror import ReqToPageMirror
    from sglang_cp_shared_kv.model_executor import draft_decode_steps
    from sglang_cp_shared_kv.model_executor.gather_scratch import create_gather_scratch
    from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks
    from sglang_cp_shared_kv_testing.runtime_check import make_nsa_pool
    from sglang_cp_shared_kv_testing.shared_kv_state import attach_runtime

    torch.manual_seed(0)
    shard = make_nsa_pool(PHYSICAL_PAGES * PAGE, "bf16", 1, "cpu")
    scratch = create_gather_scratch(shard, CP_SIZE, None)
    req_to_token_pool = ReqToTokenPool(len(SEQ_LENS) + 1, 8 * PAGE, "cpu", False)
    mirror = ReqToPageMirror.attach(req_to_token_pool, PAGE)
    runtime = attach_runtime(
        shard, CpSharedKVLayout(CP_SIZE, RANK, PAGE), scratch, None, req_to_token_pool=req_to_token_pool
    )
    for row, pages in ROW_PAGES.items():
        locs = (torch.tensor(pages).repeat_interleave(PAGE) * PAGE) + torch.arange(PAGE).repeat(len(pages))
        req_to_token_pool.req_to_token[row, : len(locs)] = locs.to(torch.int32)
        mirror.write(row, 0, np.array(pages))

    rows = list(SEQ_LENS)
    bs = len(rows)
    seq_lens = torch.tensor([SEQ_LENS[r] for r in rows], dtype=torch.int64)
    spec_info = EagleDraftInput(
        topk_p=torch.rand(bs, 1),
        topk_index=torch.randint(0, VOCAB, (bs, 1)),
        hidden_states=torch.randn(bs, HIDDEN),
        verified_id=torch.randint(0, VOCAB, (bs,)),
    )
    batch = ModelWorkerBatch(
        forward_mode=ForwardMode.DECODE,
        input_ids=torch.zeros(bs, dtype=torch.int64),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64),
        seq_lens=seq_lens,
        out_cache_loc=None,
        seq_lens_cpu=seq_lens.clone(),  # spec v2's prepare_for_decode copies seq_lens to the host
        seq_lens_sum=int(seq_lens.sum()),
        return_logprob=False,
        top_logprobs_nums=None,
        token_ids_logprobs=None,
        global_num_tokens=None,
        global_num_tokens_for_logprob=None,
        is_extend_in_batch=False,
        all_extend_in_batch=False,
        can_run_dp_cuda_graph=False,
        tbo_split_seq_index=None,
        global_forward_mode=None,
        extend_num_tokens=None,
        extend_seq_lens=None,
        extend_prefix_lens=None,
        extend_logprob_start_lens=None,
        extend_input_logprob_token_ids=None,
        multimodal_inputs=None,
        encoder_cached=None,
        encoder_lens=None,
        encoder_lens_cpu=None,
        encoder_out_cache_loc=None,
        lora_ids=None,
        sampling_info=None,
        spec_info=spec_info,
        reqs=[SimpleNamespace(rid=f"r{row}", req_pool_idx=row) for row in rows],
    )

    multi_step = NativeSparseAttnMultiStepBackend.__new__(NativeSparseAttnMultiStepBackend)
    multi_step.speculative_num_steps, multi_step.topk = NUM_STEPS, 1
    multi_step.attn_backends = [_StepBackend(step) for step in range(NUM_STEPS - 1)]
    model = _Model(runtime, multi_step)
    model.runner = _model_runner(model, req_to_token_pool, shard)

    worker = eagle_worker_v2.EagleDraftWorker.__new__(eagle_worker_v2.EagleDraftWorker)
    worker.__dict__.update(
        topk=1,
        speculative_num_steps=NUM_STEPS,
        speculative_num_draft_tokens=NUM_STEPS,
        hot_token_id=None,
        req_to_token_pool=req_to_token_pool,
        cuda_graph_runner=None,  # eager: the plugin refuses the draft's graphs
        draft_runner=model.runner,
        draft_attn_backend=multi_step,
        tree_mask_mode=TreeMaskMode.FULL_MASK,
        target_worker=SimpleNamespace(
            model_runner=SimpleNamespace(
                attn_backend=SimpleNamespace(get_verify_buffers_to_fill_after_draft=lambda: (None, None))
            )
        ),
    )

    def register(registry):
        req_to_page_mirror_writers.register_hooks(registry)
        draft_decode_steps.register_hooks(registry)

    tree = []

    def build_tree(verified_id, parent_list, top_scores_index, draft_tokens, *args):
        tree.append(draft_tokens.shape)
        return (None, None, None, None, None, draft_tokens)

    with applied_hooks(register), mock.patch.object(
        eagle_worker_v2, "build_tree_kernel_efficient", side_effect=build_tree
    ), mock.patch(
        "sglang.srt.model_executor.forward_batch_info.get_moe_expert_parallel_world_size",
        return_value=1,
    ):
        worker.draft(batch)

    return {
        "steps": model.steps,
        "planned": [
            {"backend_step": backend.speculative_step_id, **_plan_pages(plan)}
            for backend, plan in runtime.draft_step_plans
        ],
        "trees_built": len(tree),
    }


def main() -> None:
    from sglang_cp_shared_kv_testing import sgl_kernel_cpu_shim

    sgl_kernel_cpu_shim.install()
    print(json.dumps(run()))


if __name__ == "__main__":
    main()
