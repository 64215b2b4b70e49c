"""The fused per-owner decode kernels (Triton; what CUDA decode runs) equal their torch references.

On CPU the kernels run in Triton's interpreter, in a fresh process (``TRITON_INTERPRET`` is read
when triton is first imported): ``testing/per_owner_decode_kernel_cases.py`` compares the candidate
gather, this rank's share of the global selection (many exact ties at the k-th score across ranks,
requests shorter than k and empty, k = 2048 above the kernel's block) and the scaled partial (empty
LSEs of +inf, -inf and NaN, an all-empty token, NaN in an empty partial's output).

Planted in the kernels, each made this test fail (then reverted): ties of every rank counted before
this rank's (the ``rank < cp_rank`` factor dropped); ``tie_rank < wanted_ties`` for ``<=``; a
padding column's row read as row 0; this rank's NaN LSE not treated as empty.
"""

import json
import os
import subprocess
import sys
import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")


class TestFusedKernelsMatchTheTorchReference(CustomTestCase):
    def test_in_the_triton_interpreter(self):
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        run = subprocess.run(
            [sys.executable, "-m", "sglang_cp_shared_kv.testing.per_owner_decode_kernel_cases"],
            env=env, capture_output=True, text=True, timeout=600,
        )
        lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
        self.assertTrue(lines, run.stdout[-2000:] + run.stderr[-4000:])
        result = json.loads(lines[-1])
        self.assertTrue(result["gather_equal"], result)
        for selection in result["selections"]:
            self.assertTrue(selection["equal"], selection)
        self.assertLessEqual(result["scaled_partial_worst_in_bf16_roundings"], 2.0, result)
        self.assertFalse(result["scaled_partial_nan"], result)
        self.assertTrue(result["passed"], result)
        self.assertEqual(run.returncode, 0, run.stderr[-4000:])


if __name__ == "__main__":
    unittest.main()
