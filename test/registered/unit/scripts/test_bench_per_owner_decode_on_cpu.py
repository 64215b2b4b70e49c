"""benchmark/bench_per_owner_decode.py's CPU dry run: both paths of one decode layer run end to end
through the package's per-owner code (tables, candidates, selection, attention, merge arithmetic)
and the gather's copy + indexer + top-k + attention, and the table has one row per case.

The benchmark only runs on a lent GPU, so this is what notices when a change breaks its plumbing."""

import contextlib
import io
import re
import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv_testing.repo_scripts import load_script

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")


class TestBenchPerOwnerDecodeOnCpu(CustomTestCase):
    def test_dry_run_prints_a_row_per_case(self):
        bench = load_script("benchmark/bench_per_owner_decode.py")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = bench.main(["--device", "cpu", "--cp-sizes", "2,4", "--batches", "1,3", "--contexts-k", "1"])
        self.assertEqual(code, 0)
        rows = [line for line in printed.getvalue().splitlines() if re.match(r"^\| \d", line)]
        self.assertEqual(len(rows), 4, printed.getvalue())
        # about k / cp of the selected rows are this rank's (the emulated peers hold the rest)
        self.assertIn("(64 rows)", rows[0])
        self.assertIn("(32 rows)", rows[2])


if __name__ == "__main__":
    unittest.main()
