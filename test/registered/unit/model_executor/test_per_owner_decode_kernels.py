"""The fused per-owner decode kernels (Triton; what CUDA decode runs) equal their torch references.

On CPU the kernels run in Triton's interpreter, in a fresh process (``TRITON_INTERPRET`` is read
when triton is first imported): ``sglang_cp_shared_kv_testing/per_owner_decode_kernel_cases.py`` compares the candidate
gather, this rank's share of the global selection (many exact ties at the k-th score across ranks,
requests shorter than k and empty, k = 2048 above the kernel's block), the scaled partial and the
one-exchange merge of the packed, gathered partials (empty LSEs of +inf, -inf and NaN, an all-empty
token, NaN in an empty partial's output).

Planted in the kernels, each made this test fail (then reverted): ties of every rank counted before
this rank's (the ``rank < cp_rank`` factor dropped); ``tie_rank < wanted_ties`` for ``<=``; a
padding column's row read as row 0; this rank's NaN LSE not treated as empty; the merge kernel
reading the LSE one word early (``lse_word - 1``: the packed buffer misread) and adding an empty
partial's values (no ``tl.where``: NaN from its garbage).
"""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing.triton_interpreted import run_interpreted

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")


class TestFusedKernelsMatchTheTorchReference(CustomTestCase):
    def test_in_the_triton_interpreter(self):
        result = run_interpreted(["-m", "sglang_cp_shared_kv_testing.per_owner_decode_kernel_cases"], 600)
        self.assertTrue(result["gather_equal"], result)
        for selection in result["selections"]:
            self.assertTrue(selection["equal"], selection)
        self.assertLessEqual(result["scaled_partial_worst_in_bf16_roundings"], 2.0, result)
        self.assertFalse(result["scaled_partial_nan"], result)
        self.assertLessEqual(result["merge_gathered_worst_in_bf16_roundings"], 2.0, result)
        self.assertFalse(result["merge_gathered_nan"], result)
        self.assertTrue(result["merge_gathered_padded_zero"], result)
        self.assertTrue(result["passed"], result)


if __name__ == "__main__":
    unittest.main()
