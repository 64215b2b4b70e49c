"""Two things every test run here needs, whatever interpreter and options it was started with.

* The interpreter running the tests is the ``python3`` of every child process they start (runner
  scripts, smoke drivers, multi-rank workers call ``python3`` by name): a venv's interpreter run
  without the venv activated would otherwise leave the children to whatever ``python3`` the PATH
  finds first, one without sglang.
* ``--tier fast``: only the test files whose ``register_cpu_ci(est_time=...)`` is at most
  ``FAST_TIER_MAX_EST_S`` seconds, for the inner loop; the README's command (no option) runs all.
"""

from __future__ import annotations

import re
from pathlib import Path

from sglang_cp_shared_kv_testing.child_interpreter import put_this_interpreter_first_on_path

FAST_TIER_MAX_EST_S = 20
_EST_TIME = re.compile(r"register_cpu_ci\(\s*est_time\s*=\s*(\d+)")

put_this_interpreter_first_on_path()


def pytest_addoption(parser):
    parser.addoption(
        "--tier",
        choices=("fast", "full"),
        default="full",
        help=f"fast: only test files registered with est_time <= {FAST_TIER_MAX_EST_S} s (the inner loop); "
        "full: every test (the README's command, CI)",
    )


def estimated_seconds(path: Path):
    """The file's ``register_cpu_ci`` estimate, or None when it has none."""
    match = _EST_TIME.search(path.read_text(errors="replace"))
    return int(match.group(1)) if match else None


def pytest_ignore_collect(collection_path, config):
    if config.getoption("--tier") != "fast" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    estimate = estimated_seconds(collection_path)
    return True if estimate is None or estimate > FAST_TIER_MAX_EST_S else None
