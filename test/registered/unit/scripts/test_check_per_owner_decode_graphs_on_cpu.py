"""scripts/gpu/check_per_owner_decode_graphs.py on the CPU (torch references, no graph: a "replay"
re-runs the layer over the static buffers): it passes on both batches, and its stale-buffer plant
(rank 1's owner tables not refreshed before the second batch) fails the second batch only.

The script is only run on a lent GPU, so this is what notices when a change breaks it, or when it
stops catching the bug it exists to catch."""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv.testing.per_owner_decode_graph_emulation import reference_kernels
from sglang_cp_shared_kv.testing.repo_scripts import load_script

register_cpu_ci(est_time=60, suite="stage-a-test-cpu")


class TestCheckPerOwnerDecodeGraphsOnCpu(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.check = load_script("scripts/gpu/check_per_owner_decode_graphs.py")

    def _run(self, plant="none"):
        args = self.check.parse_args(["--device", "cpu", "--cp-sizes", "2", "--plant", plant])
        return self.check.run_cp(args, 2, reference_kernels())

    def test_both_batches_pass(self):
        self.assertEqual(self._run(), [True, True])

    def test_stale_tables_fail_the_second_batch(self):
        self.assertEqual(self._run("stale-tables"), [True, False])


if __name__ == "__main__":
    unittest.main()
