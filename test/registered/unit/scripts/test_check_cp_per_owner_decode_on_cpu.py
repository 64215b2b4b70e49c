"""scripts/gpu/check_cp_per_owner_decode.py on the CPU (torch references of the kernels): it passes on
the per-owner decode code it checks, for every decode impl it serves (flashmla_kv over fp8 KV,
flashmla_sparse and fa3 over bf16 KV), and FAILS on each planted bug (a rank's partial dropped from
the merge, the LSE taken in the wrong base, a selected token attributed to the wrong owner); its
section through sglang's decode methods passes on two gloo ranks for each impl.

The script is only run on a lent GPU, so this is what notices when a change breaks it, or when it
stops catching a bug it exists to catch."""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv_testing.repo_scripts import load_script

register_cpu_ci(est_time=240, suite="stage-a-test-cpu")

SEQ_LENS = "3000,2048,700,2200"


class TestCheckCpPerOwnerDecodeOnCpu(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.check = load_script("scripts/gpu/check_cp_per_owner_decode.py")
        cls.kernels = cls.check.pick_kernels("cpu")

    def _case(self, cp_size, plant="none", impl="flashmla_kv"):
        args = self.check.parse_args(["--device", "cpu", "--seq-lens", SEQ_LENS, "--plant", plant])
        return self.check.run_case(args, cp_size, self.kernels, impl)

    def test_passes_at_cp_2_4_8_with_exact_selection(self):
        # the empty partial's LSE as each kernel (reference) reports it: FlashMLA +inf, fa3 -inf
        for impl, empty_lse in (("flashmla_kv", "inf"), ("flashmla_sparse", "inf"), ("fa3", "-inf")):
            for cp_size in (2, 4, 8):
                result = self._case(cp_size, impl=impl)
                with self.subTest(impl=impl, cp_size=cp_size):
                    self.assertTrue(result["passed"], result)
                    self.assertEqual(result["exact"], result["requests"])  # same scores: bit-exact set
                    self.assertLess(result["rel_err"], 1e-2)
                    self.assertLess(result["lse_err"], 1e-3)
                    self.assertEqual(result["empty_lse"], empty_lse)  # a rank owned none of a padded row

    def test_each_plant_fails(self):
        for impl in ("flashmla_kv", "flashmla_sparse", "fa3"):
            for plant, broken in (
                ("drop-partial", "rel_err"),
                ("lse-base", "lse_err"),
                ("wrong-owner", "union_ok"),
            ):
                result = self._case(2, plant, impl)
                with self.subTest(impl=impl, plant=plant):
                    self.assertFalse(result["passed"], result)
                    if broken == "rel_err":
                        self.assertGreater(result["rel_err"], self.check.REL_TOL)
                    elif broken == "lse_err":  # the merged output moves as well
                        self.assertGreater(result["lse_err"], self.check.LSE_TOL[self.check.KV_DTYPE_OF_IMPL[impl]])
                        self.assertGreater(result["rel_err"], self.check.REL_TOL)
                    else:  # the output moves too, but one token of 2048 may stay within tolerance
                        self.assertLess(result["union_ok"], result["requests"])

    def test_main_reports_kernels_and_exits_non_zero_on_a_plant(self):
        argv = ["--device", "cpu", "--cp-sizes", "2", "--seq-lens", "900,300", "--hooked-cp-sizes", ""]
        self.assertEqual(self.check.main(argv), 0)
        self.assertEqual(self.check.main(argv + ["--plant", "drop-partial"]), 1)

    def test_the_hooked_decode_steps_pass_on_two_ranks_for_every_impl(self):
        args = self.check.parse_args(["--device", "cpu", "--seq-lens", "2500,300"])
        verdicts = self.check.run_hooked_case(args, 2, self.kernels)
        self.assertEqual(verdicts, {"flashmla_kv": True, "flashmla_sparse": True, "fa3": True})


if __name__ == "__main__":
    unittest.main()
