"""The MTP draft pool's runtime: attached with the target's layout, group and scratch; refused when
the draft pool cannot be a shard of the same layout.

The draft's rows on their owners and its reads in EXTEND and DECODE are checked across gloo ranks
(``test_cp_shared_kv_runtime_gloo.TestDraftPoolAcrossRanks``); its size against sglang's own pool
construction in ``test_cp_shared_kv_capacity``.

Planted bugs, each seen failing then reverted: ``draft_pool_problems`` not comparing ``size`` (the
smaller draft pool accepted); the draft runtime built with its own scratch instead of the target's;
attaching twice allowed; the draft's state built with a spec of its own (equal, not the target's
object: ``test_draft_runtime_shares_layout_group_and_scratch`` failed).
"""

import unittest
from types import SimpleNamespace

import torch

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing import sgl_kernel_cpu_shim

sgl_kernel_cpu_shim.install()

from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout  # noqa: E402
from sglang_cp_shared_kv.model_executor.cp_shared_kv_draft_pool import (  # noqa: E402
    attach_draft_runtime,
    draft_pool_problems,
)
from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import runtime_of  # noqa: E402
from sglang_cp_shared_kv.model_executor.gather_scratch import create_gather_scratch  # noqa: E402
from sglang_cp_shared_kv_testing.runtime_check import PAGE_SIZE, make_nsa_pool  # noqa: E402
from sglang_cp_shared_kv_testing.shared_kv_state import attach_runtime  # noqa: E402

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

CP_SIZE = 2
PHYSICAL_TOKENS = 4 * PAGE_SIZE


def _target(dtype_name="fp8", layers=3):
    pool = make_nsa_pool(PHYSICAL_TOKENS, dtype_name, layers, "cpu")
    layout = CpSharedKVLayout(CP_SIZE, 1, PAGE_SIZE)
    runtime = attach_runtime(pool, layout, create_gather_scratch(pool, CP_SIZE), "cp-group")
    return pool, runtime


class TestAttachDraftRuntime(CustomTestCase):
    def test_draft_runtime_shares_layout_group_and_scratch(self):
        target_pool, target = _target()
        draft_pool = make_nsa_pool(PHYSICAL_TOKENS, "fp8", 1, "cpu")
        draft = attach_draft_runtime(draft_pool, target_pool)
        self.assertIs(runtime_of(draft_pool), draft)
        self.assertIs(runtime_of(target_pool), target)  # the target keeps its own
        self.assertIs(draft.pool, draft_pool)
        # The draft reuses the target's spec and mirror: one birth of every decision.
        self.assertIs(draft.state.spec, target.state.spec)
        self.assertIs(draft.state.mirror, target.state.mirror)
        self.assertIs(draft.layout, target.layout)
        self.assertIs(draft.cp_group, target.cp_group)
        self.assertIs(draft.scratch, target.scratch)  # no second scratch to reserve memory for
        self.assertEqual(draft.num_logical_pages, target.num_logical_pages)
        self.assertFalse(draft.pipeline.can_prefetch)  # one layer: serial path

    def test_a_draft_pool_unlike_the_targets_is_refused(self):
        target_pool, _ = _target()
        cases = {
            "size": make_nsa_pool(PHYSICAL_TOKENS - PAGE_SIZE, "fp8", 1, "cpu"),
            "dtype": make_nsa_pool(PHYSICAL_TOKENS, "bf16", 1, "cpu"),
        }
        for name, draft_pool in cases.items():
            with self.subTest(name=name):
                problems = draft_pool_problems(target_pool, draft_pool)
                self.assertEqual(len(problems), 1 if name == "size" else 2, problems)  # bf16: wider rows too
                self.assertIn(f"draft pool's {name}", problems[0])
                with self.assertRaisesRegex(ValueError, f"draft pool's {name}"):
                    attach_draft_runtime(draft_pool, target_pool)
                self.assertIsNone(runtime_of(draft_pool))
        not_nsa = SimpleNamespace(size=PHYSICAL_TOKENS)
        self.assertIn("NSATokenToKVPool", draft_pool_problems(target_pool, not_nsa)[0])

    def test_draft_before_target_or_twice_is_refused(self):
        lone_target = make_nsa_pool(PHYSICAL_TOKENS, "fp8", 3, "cpu")
        draft_pool = make_nsa_pool(PHYSICAL_TOKENS, "fp8", 1, "cpu")
        with self.assertRaisesRegex(ValueError, "target pool has no runtime"):
            attach_draft_runtime(draft_pool, lone_target)
        target_pool, _ = _target()
        attach_draft_runtime(draft_pool, target_pool)
        with self.assertRaisesRegex(ValueError, "already has a runtime"):
            attach_draft_runtime(draft_pool, target_pool)


if __name__ == "__main__":
    unittest.main()
