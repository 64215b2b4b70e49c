"""benchmark/bench_peer_page_gather.py runs its whole flow on CPU (``--quick``): plan, store, copy,
pack and gather for every CP size, dtype and prefix it lists. Its numbers mean nothing here; what is
checked is that the benchmark still runs against the plan's current interface (seen failing: it
called ``build_peer_page_plan`` with the arguments the plan took before its host-side rewrite)."""

import subprocess
import sys
import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing.repo_scripts import REPO_ROOT

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")


class TestBenchPeerPageGatherOnCpu(CustomTestCase):
    def test_quick_run_covers_every_case(self):
        out = subprocess.run(
            [sys.executable, "benchmark/bench_peer_page_gather.py", "--device", "cpu", "--quick"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        rows = [line for line in out.stdout.splitlines() if line.startswith(("fp8 |", "bf16 |"))]
        cases = {tuple(cell.strip() for cell in row.split("|")[:2]) for row in rows}
        self.assertEqual(cases, {(d, cp) for d in ("fp8", "bf16") for cp in ("2", "4", "8")})


if __name__ == "__main__":
    unittest.main()
