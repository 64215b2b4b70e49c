"""The EAGLE draft's decode steps: what each step plans, which plan each step runs on, no host sync.

One process plays CP rank 1 of 2 on CPU (the plans need no collective) and, for the sync check, the
``meta`` device stands in for the GPU. The steps' reads and rows across real ranks are checked in
``test_cp_shared_kv_runtime_gloo.py`` (``TestDraftDecodeStepsAcrossRanks``).

Planted, each caught, then reverted: ``draft_step_lengths`` returning the committed lengths with
one new token (the decode rule: the page the last committed token opened planned as a local fill,
``test_committed_pages_are_gathered_and_draft_pages_filled`` failed); ``begin_draft_step_planning``
not emptying the previous draft's plans (a stale step selected after a new planning,
``test_each_step_selects_its_own_plan`` failed); ``end_draft_step_planning`` leaving the previous
forward's plan active (``test_no_plan_is_active_between_planning_and_the_first_step`` failed).
"""

import unittest
from unittest import mock
from types import SimpleNamespace

import numpy as np
import torch

from sglang.srt.layers.attention.nsa_backend import NativeSparseAttnMultiStepBackend
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror import ReqToPageMirror
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror_writers import ROWS_ATTR
from sglang_cp_shared_kv.model_executor import draft_decode_steps, forward_dispatch, peer_page_reads
from sglang_cp_shared_kv.model_executor.per_owner_decode import decode_forward as per_owner_decode
from sglang_cp_shared_kv.model_executor.cp_shared_kv_draft_pool import attach_draft_runtime
from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import draft_step_lengths
from sglang_cp_shared_kv.model_executor.gather_scratch import create_gather_scratch
from sglang_cp_shared_kv.model_executor.per_owner_decode.decode_forward import (
    PerOwnerDecode,
)
from sglang_cp_shared_kv_testing.device_sync_recorder import DeviceSyncRecorder
from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks
from sglang_cp_shared_kv_testing.peer_page_plan_fills import fill_lookup
from sglang_cp_shared_kv_testing.runtime_check import PAGE_SIZE, make_nsa_pool, nsa_metadata_for
from sglang_cp_shared_kv_testing.shared_kv_state import attach_runtime

register_cpu_ci(est_time=25, suite="stage-a-test-cpu")

CP_SIZE, RANK, PHYSICAL_PAGES = 2, 1, 8
# Committed lengths: the last token of request 1 alone on its page 2; request 2's first draft
# token opens its page 2; request 3's third one opens its page 1.
SEQ_LENS = [129, 128, 62]
# Logical pages of each request's rows (distinct, as the shared allocator hands them out).
ROW_PAGES = {1: [4, 9, 6], 2: [3, 11, 8], 3: [5, 10]}
NUM_STEPS = 4  # --speculative-num-steps: 3 step forwards


class _Case(CustomTestCase):
    device = "cpu"

    def _runtime(self, scratch_tokens=None):
        shard = make_nsa_pool(PHYSICAL_PAGES * PAGE_SIZE, "bf16", 1, self.device)
        layout = CpSharedKVLayout(CP_SIZE, RANK, PAGE_SIZE)
        scratch = create_gather_scratch(shard, CP_SIZE, scratch_tokens)
        self.req_to_token_pool = ReqToTokenPool(4, 8 * PAGE_SIZE, self.device, False)
        mirror = ReqToPageMirror.attach(self.req_to_token_pool, PAGE_SIZE)
        runtime = attach_runtime(
            shard, layout, scratch, None, req_to_token_pool=self.req_to_token_pool,
            scratch_serves_decode=scratch_tokens is None,
        )  # fmt: skip
        for row, pages in ROW_PAGES.items():
            mirror.write(row, 0, np.array(pages))
        return runtime

    def _batch(self, runtime, mode=ForwardMode.DECODE, seq_lens=SEQ_LENS):
        bs = len(seq_lens)
        return SimpleNamespace(
            forward_mode=mode,
            seq_lens_cpu=torch.tensor(seq_lens),
            extend_seq_lens_cpu=[1] * bs,
            req_pool_indices=torch.arange(1, bs + 1, device=self.device),
            req_to_token_pool=self.req_to_token_pool,
            out_cache_loc=torch.zeros(bs * (NUM_STEPS - 1), dtype=torch.int64, device=self.device),
            token_to_kv_pool=runtime.pool,
            attn_backend=None,
            **{ROWS_ATTR: np.arange(1, bs + 1, dtype=np.int64)},
        )

    def _multi_step_backend(self, batch):
        """sglang's multi-step backend over step backends whose metadata init stands in for
        sglang's and runs the backend's metadata hook (``forward_dispatch``)."""
        shape = (len(batch.seq_lens_cpu), 3 * PAGE_SIZE)
        table = torch.zeros(shape, dtype=torch.int32, device=self.device)

        class StepBackend:
            def __init__(self, step):
                self.speculative_step_id = step

            def init_forward_metadata(self, forward_batch):
                self.forward_metadata = nsa_metadata_for(table)
                forward_dispatch.dispatch_forward_metadata(None, self, forward_batch)

        multi_step = NativeSparseAttnMultiStepBackend.__new__(NativeSparseAttnMultiStepBackend)
        multi_step.speculative_num_steps, multi_step.topk = NUM_STEPS, 1
        multi_step.attn_backends = [StepBackend(step) for step in range(NUM_STEPS - 1)]
        return multi_step

    def _plan_steps(self, runtime, batch):
        multi_step = self._multi_step_backend(batch)
        with applied_hooks(draft_decode_steps.register_hooks):
            multi_step.init_forward_metadata(batch)  # sglang's loop, through the AROUND hook
        return multi_step.attn_backends


def _pages(plan, lookup):
    """Logical pages ``lookup`` maps to a scratch page (sorted)."""
    return sorted(np.flatnonzero(lookup.cpu().numpy()).tolist())


class TestDraftStepLengths(_Case):
    def test_lengths_cover_the_committed_tokens_and_the_steps_token(self):
        batch = SimpleNamespace(seq_lens_cpu=torch.tensor(SEQ_LENS))
        for step in range(NUM_STEPS - 1):
            with self.subTest(step=step):
                reads, written = draft_step_lengths(batch, step)
                self.assertEqual(reads.tolist(), [n + step + 1 for n in SEQ_LENS])
                self.assertEqual(written.tolist(), [step + 1] * len(SEQ_LENS))

    def test_committed_pages_are_gathered_and_draft_pages_filled(self):
        runtime = self._runtime()
        batch = self._batch(runtime)
        backends = self._plan_steps(runtime, batch)
        plans = [plan for _, plan in runtime.draft_step_plans]
        self.assertEqual([b for b, _ in runtime.draft_step_plans], backends)
        committed = [4, 9, 6, 3, 11, 5]  # every page with a committed token, request 1's page 2 too
        for step, plan in enumerate(plans):
            with self.subTest(step=step):
                filled = _pages(plan, fill_lookup(plan))
                gathered = sorted(set(_pages(plan, plan.lookup)) - set(filled))
                self.assertEqual(gathered, sorted(committed))
                # Draft tokens only: request 2's page 2 from step 0, request 3's page 1 from step 2.
                self.assertEqual(filled, [8] if step < 2 else [8, 10])


class TestStepPlanSelection(_Case):
    def test_each_step_selects_its_own_plan(self):
        runtime = self._runtime()
        batch = self._batch(runtime)
        backends = self._plan_steps(runtime, batch)
        plans = dict(runtime.draft_step_plans)
        for backend in backends:
            batch.attn_backend = backend
            draft_decode_steps.select_draft_step_plan(None, batch)
            self.assertIs(runtime.plan, plans[backend])
            self.assertIs(runtime.pipeline.plan, plans[backend])
        # A new draft: its own plans only (the previous draft's step backends select nothing).
        stale = backends[0]
        backends = self._plan_steps(runtime, batch)
        batch.attn_backend = stale
        draft_decode_steps.select_draft_step_plan(None, batch)
        self.assertIsNone(runtime.plan)

    def test_no_plan_is_active_between_planning_and_the_first_step(self):
        runtime = self._runtime()
        runtime.begin_forward(self._batch(runtime, ForwardMode.EXTEND))  # e.g. the draft extend
        self._plan_steps(runtime, self._batch(runtime))
        self.assertIsNone(runtime.plan)
        self.assertIsNone(runtime.pipeline.plan)
        with self.assertRaisesRegex(RuntimeError, "read before its store"):
            runtime.kv_slot_for_read(0)

    def test_a_forward_of_its_own_ends_the_steps_plans(self):
        runtime = self._runtime()
        batch = self._batch(runtime)
        backends = self._plan_steps(runtime, batch)
        plan = runtime.begin_forward(self._batch(runtime, ForwardMode.EXTEND))  # e.g. draft extend
        batch.attn_backend = backends[1]
        draft_decode_steps.select_draft_step_plan(None, batch)
        self.assertIs(runtime.plan, plan)
        self.assertEqual(runtime.draft_step_plans, [])

    def test_other_backends_and_pools_are_left_alone(self):
        runtime = self._runtime()
        batch = self._batch(runtime)
        self._plan_steps(runtime, batch)
        batch.attn_backend = SimpleNamespace()  # the draft runner's own backend (draft extend)
        draft_decode_steps.select_draft_step_plan(None, batch)
        self.assertIsNone(runtime.plan)
        idle = self._batch(runtime, ForwardMode.IDLE)
        idle.attn_backend = runtime.draft_step_plans[0][0]  # an idle draft runs the step backends
        draft_decode_steps.select_draft_step_plan(None, idle)
        self.assertIsNone(runtime.plan)
        calls = []
        unserved = SimpleNamespace(token_to_kv_pool=SimpleNamespace(), attn_backend=None)
        draft_decode_steps.plan_draft_steps(lambda *args: calls.append(args), "multi", unserved)
        self.assertEqual(calls, [("multi", unserved)])

    def test_steps_gather_although_per_owner_decode_is_attached(self):
        runtime = self._runtime()
        # No collective runs here (the steps never reach per-owner decode's exchanges).
        no_collectives = (None, None)
        with mock.patch.object(per_owner_decode, "process_group_collectives", return_value=no_collectives):
            state = PerOwnerDecode(runtime.state)
        state.forward = object()  # as a per-owner decode forward of this pool left it
        batch = self._batch(runtime)
        backends = self._plan_steps(runtime, batch)
        self.assertFalse(runtime.state.reads_physical_pool())
        self.assertEqual(len(runtime.draft_step_plans), NUM_STEPS - 1)
        batch.attn_backend = backends[0]
        draft_decode_steps.select_draft_step_plan(None, batch)
        self.assertIsNotNone(runtime.plan)


class TestDraftStepRefusals(_Case):
    def test_a_prefill_sized_scratch_refuses_draft_steps_and_the_draft_pool(self):
        runtime = self._runtime(scratch_tokens=2 * PAGE_SIZE)
        with self.assertRaisesRegex(ValueError, "SGLANG_CP_SHARED_KV_DECODE=gather"):
            self._plan_steps(runtime, self._batch(runtime))
        draft_pool = make_nsa_pool(PHYSICAL_PAGES * PAGE_SIZE, "bf16", 1, "cpu")
        with self.assertRaisesRegex(ValueError, "SGLANG_CP_SHARED_KV_DECODE=gather"):
            attach_draft_runtime(draft_pool, runtime.pool)

    def test_a_draft_step_is_a_decode_forward(self):
        runtime = self._runtime()
        with self.assertRaisesRegex(ValueError, "draft step in forward mode EXTEND"):
            self._plan_steps(runtime, self._batch(runtime, ForwardMode.EXTEND))
        self.assertFalse(runtime.planning_draft_steps)


class TestDraftStepPlansHaveNoDeviceSync(_Case):
    device = "meta"

    def test_planning_and_selecting_every_step(self):
        runtime = self._runtime()
        batch = self._batch(runtime)
        multi_step = self._multi_step_backend(batch)
        recorder = DeviceSyncRecorder(self.device, raise_at_first=True)
        with applied_hooks(draft_decode_steps.register_hooks):
            with recorder:
                multi_step.init_forward_metadata(batch)
                for backend in multi_step.attn_backends:
                    batch.attn_backend = backend
                    draft_decode_steps.select_draft_step_plan(None, batch)
        self.assertEqual(recorder.recorded, [])
        self.assertEqual(recorder.host_to_device_copies, NUM_STEPS - 1)  # one per step's plan


if __name__ == "__main__":
    unittest.main()
