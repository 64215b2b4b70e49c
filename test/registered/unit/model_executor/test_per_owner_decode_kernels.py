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

The interpreter runs a kernel's Python, not its compilation, so the kernels are also compiled for an
H200 (``sm_90``) through their wrappers at GLM-5's decode shapes
(``sglang_cp_shared_kv_testing/triton_gpu_compile.py``: Triton's binder and compiler, the wheel's
ptxas, no GPU). Planted: ``carry`` summed as int64 in the selection kernel (a loop-carried variable
changing type) -> the interpreter test still passed, this one failed with the compiler's error.
"""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing.triton_gpu_compile import PER_OWNER_DECODE_KERNELS, compile_in_fresh_process
from sglang_cp_shared_kv_testing.triton_interpreted import run_interpreted

register_cpu_ci(est_time=35, suite="stage-a-test-cpu")


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



class TestFusedKernelsCompileForH200(CustomTestCase):
    def test_every_kernel_compiles_for_sm90_at_glm5_decode_shapes(self):
        result = compile_in_fresh_process(300)
        self.assertEqual(result["target"], ["cuda", 90, 32], result)
        self.assertEqual(result["errors"], [], result)
        compiled = {entry["kernel"] for entry in result["compiled"]}
        self.assertEqual(compiled, set(PER_OWNER_DECODE_KERNELS), result)
        for entry in result["compiled"]:
            self.assertGreater(entry["cubin_bytes"], 0, entry)
        # The partials reach the merge kernels as bf16, the batch both as 1 and as a runtime integer.
        merge = [e for e in result["compiled"] if e["kernel"] == "_merge_gathered_kernel"]
        self.assertTrue(all(e["signature"]["values_ptr"] == "*bf16" for e in merge), merge)
        batch_types = {e["signature"]["batch"] for e in result["compiled"] if e["kernel"] == "_owned_selection_kernel"}
        self.assertEqual(batch_types, {"constexpr", "i32"}, result)
        self.assertTrue(result["passed"], result)


if __name__ == "__main__":
    unittest.main()
