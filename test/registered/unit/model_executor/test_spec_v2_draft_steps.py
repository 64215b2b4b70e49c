"""Spec v2's draft steps, run by sglang's own ``EagleDraftWorker.draft``, each run on its own plan.

sglang 0.5.11's spec v2 draft (``eagle_worker_v2.py``) builds every step's metadata with
``self.draft_attn_backend.init_forward_metadata`` (the ``NativeSparseAttnMultiStepBackend``, hooked
AROUND by ``draft_decode_steps.plan_draft_steps``) and runs each step through
``self.draft_runner.forward(forward_batch, skip_attn_backend_init=True)``, i.e.
``ModelRunner.forward`` (hooked BEFORE by ``select_draft_step_plan``) -> ``forward_decode`` ->
``model.forward``; its ``ForwardBatch`` comes from ``prepare_for_v2_draft`` (forward mode DECODE,
the committed ``seq_lens_cpu`` of ``prepare_for_decode``, the step locs copied from
``req_to_token`` at ``seq_len + step``). The story (``sglang_cp_shared_kv_testing/spec_v2_draft_steps.py``) runs all of
that, with a stand-in model, step backends and tree kernel, in a subprocess (Triton's CPU
interpreter for the loc kernel). Every expectation below is computed here from the story's rows
and lengths, not read from the plugin.

Planted, each caught, then reverted: ``begin_draft_step`` selecting the previous step's plan
(``test_each_step_runs_on_its_own_plan`` and ``test_the_step_s_token_is_a_local_fill_on_a_draft_page``
failed); the BEFORE hook on ``ModelRunner.forward`` left out of ``register_hooks`` (no step plan
active when the model runs: ``test_each_step_runs_on_its_own_plan`` failed); ``draft_step_lengths``
planning the committed tokens only (the draft-only pages not in the plan:
``test_the_step_s_token_is_a_local_fill_on_a_draft_page`` failed).
"""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing import spec_v2_draft_steps as story
from sglang_cp_shared_kv_testing.triton_interpreted import run_interpreted

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")

TIMEOUT_S = 300
PAGE = story.PAGE
ROWS = list(story.SEQ_LENS)
STEP_FORWARDS = story.NUM_STEPS - 1


def _run_story() -> dict:
    return run_interpreted(["-m", story.__name__], TIMEOUT_S)


def _loc(row: int, position: int) -> int:
    return story.ROW_PAGES[row][position // PAGE] * PAGE + position % PAGE


def _committed_pages() -> list:
    """Every logical page holding a committed token (the last one's page too)."""
    return sorted(
        page
        for row, seq_len in story.SEQ_LENS.items()
        for page in story.ROW_PAGES[row][: -(-seq_len // PAGE)]
    )


def _draft_only_pages(step: int) -> list:
    """Pages a draft token of steps 0 .. ``step`` opened (no committed token on them)."""
    pages = set()
    for row, seq_len in story.SEQ_LENS.items():
        for position in range(seq_len, seq_len + step + 1):
            if position % PAGE == 0:
                pages.add(story.ROW_PAGES[row][position // PAGE])
    return sorted(pages)


class TestSpecV2DraftSteps(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.report = _run_story()
        cls.steps = cls.report["steps"]

    def test_every_step_forward_goes_through_model_runner_forward(self):
        self.assertEqual(len(self.steps), STEP_FORWARDS)
        self.assertEqual([s["forward_pass_id"] for s in self.steps], [1, 2, 3])
        self.assertEqual([s["backend_step"] for s in self.steps], list(range(STEP_FORWARDS)))
        self.assertEqual(self.report["trees_built"], 1)  # the draft ran to its end

    def test_the_steps_read_the_committed_lengths_and_write_after_them(self):
        committed = [story.SEQ_LENS[row] for row in ROWS]
        for step, record in enumerate(self.steps):
            with self.subTest(step=step):
                self.assertEqual(record["seq_lens_cpu"], committed)
                self.assertEqual(record["locs"], [_loc(row, story.SEQ_LENS[row] + step) for row in ROWS])

    def test_each_step_runs_on_its_own_plan(self):
        # One plan per step backend, in step order, and each step's forward runs on its own.
        self.assertEqual(
            [p["backend_step"] for p in self.report["planned"]], list(range(STEP_FORWARDS))
        )
        for step, record in enumerate(self.steps):
            with self.subTest(step=step):
                self.assertEqual(record["active_plan"], step)
                self.assertTrue(record["pipeline_on_active_plan"])
                planned = self.report["planned"][step]
                self.assertEqual(
                    (record["gathered"], record["filled"]), (planned["gathered"], planned["filled"])
                )

    def test_committed_pages_are_gathered(self):
        for step, record in enumerate(self.steps):
            with self.subTest(step=step):
                self.assertEqual(record["gathered"], _committed_pages())

    def test_the_step_s_token_is_a_local_fill_on_a_draft_page(self):
        committed = set(_committed_pages())
        for step, record in enumerate(self.steps):
            with self.subTest(step=step):
                self.assertEqual(record["filled"], _draft_only_pages(step))
                for loc in record["locs"]:
                    page = loc // PAGE
                    expected = "gathered" if page in committed else "filled"
                    self.assertIn(page, record[expected])
        # The story opens draft pages at step 0 (row 2) and step 2 (row 3).
        self.assertEqual([len(_draft_only_pages(s)) for s in range(STEP_FORWARDS)], [1, 1, 2])


if __name__ == "__main__":
    unittest.main()
