"""The test run's own environment (``test/registered/unit/conftest.py``).

* Children run this interpreter: with a PATH whose first ``python3`` is another interpreter (a venv's
  Python started without the venv activated), ``put_this_interpreter_first_on_path`` makes the
  children's ``python3`` this one, venv and packages included. Seen failing with the helper leaving
  PATH alone (the other interpreter answered, as 20 runner dry-run tests failed before it), and with
  links to ``sys.executable`` instead of scripts (a link outside the venv starts the base
  interpreter, without sglang).
* ``--tier fast`` collects only files registered at ``est_time`` <= 20 s: a slow file (the runners'
  dry runs, 300 s) is left out, a fast one kept, and without the option both are collected. Seen
  failing with the option's hook returning None for every path.
"""

import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing.repo_scripts import REPO_ROOT

register_cpu_ci(est_time=40, suite="stage-a-test-cpu")

# What a child's python3 is: its installation (a venv's prefix) and whether it imports sglang.
WHICH_PYTHON3 = "import sys, importlib.util; print(sys.prefix, importlib.util.find_spec('sglang') is not None)"


class TestChildInterpreter(CustomTestCase):
    def test_children_run_this_interpreter_whatever_the_path_finds_first(self):
        with tempfile.TemporaryDirectory() as tmp:
            other = Path(tmp) / "python3"  # another interpreter, first on the PATH
            other.write_text("#!/bin/sh\necho other\n")
            other.chmod(0o755)
            env = {**os.environ, "PATH": f"{tmp}{os.pathsep}/usr/bin{os.pathsep}/bin",
                   "PYTHONPATH": str(REPO_ROOT / "python")}  # fmt: skip
            code = (
                "from sglang_cp_shared_kv_testing.child_interpreter import put_this_interpreter_first_on_path\n"
                "put_this_interpreter_first_on_path()\n"
                "import subprocess\n"
                f"print(subprocess.run(['python3', '-c', {WHICH_PYTHON3!r}], capture_output=True, text=True).stdout)"
            )
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        self.assertEqual(out.stdout.strip(), f"{sys.prefix} True", out.stderr[-2000:])

    def test_this_test_process_already_has_it(self):
        out = subprocess.run(["python3", "-c", WHICH_PYTHON3], capture_output=True, text=True, timeout=60)
        self.assertEqual(out.stdout.strip(), f"{sys.prefix} True", out.stderr[-2000:])


class TestFastTier(CustomTestCase):
    def _collected(self, *options):
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", *options, "test/registered/unit/scripts"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        return out.stdout

    def test_fast_tier_leaves_slow_files_out(self):
        fast = self._collected("--tier", "fast")
        self.assertNotIn("test_gpu_smoke_runners_dry_run.py", fast)
        self.assertIn("test_glm5_smoke_value_audit.py", fast)
        full = self._collected()
        self.assertIn("test_gpu_smoke_runners_dry_run.py", full)
        self.assertIn("test_glm5_smoke_value_audit.py", full)


if __name__ == "__main__":
    unittest.main()
