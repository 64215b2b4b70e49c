"""benchmark/bench_per_owner_decode.py's CPU dry run: both paths of one decode layer run end to end
through the package's per-owner code (tables, candidates, selection, attention, merge arithmetic in
the form the rule picks) and the gather's copy + indexer + top-k + attention, and the table has one
row per case; its ``--merge-kernels`` mode times both merge forms per cp size and batch.
benchmark/bench_per_owner_decode_exchange.py on two gloo ranks: every exchange of both merge forms
runs, and its crossover line reads the measured rows.

The benchmarks only run on a lent GPU, so this is what notices when a change breaks their plumbing.
Seen failing: the merge-kernel mode calling ``merge_gathered`` with the packed width for ``dim``;
the exchange benchmark importing ``merge_by_all_gather`` from the tests' package it left."""

import contextlib
import io
import os
import re
import subprocess
import sys
import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv_testing.repo_scripts import REPO_ROOT, load_script

register_cpu_ci(est_time=60, suite="stage-a-test-cpu")


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
        self.assertTrue(all(row.endswith("| all_gather |") for row in rows))  # the rule at batches 1, 3

    def test_merge_kernels_dry_run_times_both_forms(self):
        bench = load_script("benchmark/bench_per_owner_decode.py")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = bench.main(["--device", "cpu", "--merge-kernels", "--cp-sizes", "2,8", "--batches", "1,32"])
        self.assertEqual(code, 0)
        rows = [line for line in printed.getvalue().splitlines() if re.match(r"^\| \d", line)]
        self.assertEqual([row.split("|")[-2].strip() for row in rows],
                         ["all_gather", "all_gather", "all_gather", "scaled_sum"])  # fmt: skip

    def test_exchange_benchmark_on_two_gloo_ranks(self):
        """Run as a script (its ranks are spawned processes, which import it by name)."""
        script = REPO_ROOT / "benchmark" / "bench_per_owner_decode_exchange.py"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "python"), os.environ.get("PYTHONPATH", "")])}
        run = subprocess.run(
            [sys.executable, str(script), "--device", "cpu", "--world", "2", "--batches", "1,4", "--iters", "2",
             "--warmup", "0"], capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        self.assertEqual(run.returncode, 0, run.stderr[-3000:])
        bench = load_script("benchmark/bench_per_owner_decode_exchange.py")
        printed = io.StringIO(run.stdout)
        rows = [line.split() for line in printed.getvalue().splitlines() if re.match(r"^\s+\d+ ", line)]
        self.assertEqual([(row[0], row[1]) for row in rows],
                         [(b, form) for b in ("1", "4") for form in bench.FORMS])  # fmt: skip
        self.assertIn("the default setting (modeled) picks it up to batch 4", printed.getvalue())
        synthetic = [(1, "all_gather", 10.0, 100.0), (1, "scaled_sum", 20.0, 100.0),
                     (8, "all_gather", 30.0, 900.0), (8, "scaled_sum", 20.0, 500.0)]  # fmt: skip
        self.assertIn("measured faster up to batch 1 (0 extra bytes", bench.crossover(synthetic, 2))


if __name__ == "__main__":
    unittest.main()
