"""The multi-rank launcher: values come back in rank order, and a failing rank fails the run quickly.

Every multi-rank test, the simulation and the GPU checks rely on it to report what each rank did, and
on a dead rank not leaving its peers blocked in a collective until gloo's timeout.
"""

import time
import unittest

from multi_rank_probes import rank_one_raises, sum_of_ranks

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing.multi_rank import RanksFailed, launch, run_ranks

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")


class TestMultiRank(CustomTestCase):
    def test_values_in_rank_order_over_a_real_group(self):
        values = run_ranks(sum_of_ranks, 2, (10,))
        self.assertEqual(values, [(r, 2, 0 + 1 + 2 * 10, 1) for r in range(2)])

    def test_a_raising_rank_fails_the_run_before_the_collective_timeout(self):
        start = time.monotonic()
        outcomes = launch(rank_one_raises, 2, timeout_s=300)
        self.assertLess(time.monotonic() - start, 120)
        self.assertIsInstance(outcomes[1].error, ValueError)
        self.assertIn("planted failure", outcomes[1].traceback)
        self.assertFalse(outcomes[0].ok)  # its all-reduce failed as rank 1 left
        self.assertRegex(str(RanksFailed(outcomes)), "rank 1 raised ValueError")


if __name__ == "__main__":
    unittest.main()
