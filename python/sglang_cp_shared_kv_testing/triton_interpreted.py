"""Run a check in a fresh Python process under Triton's interpreter, and read its JSON verdict.

Triton reads ``TRITON_INTERPRET`` when it is first imported, so CPU tests of code that launches
Triton kernels (ours, or sglang's) run it in a subprocess with the variable set (and TorchDynamo
off, which the interpreter's kernels do not need). The check prints its result as one JSON object
on its last line starting with ``{``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Sequence


def run_interpreted(args: Sequence[str], timeout_s: float) -> dict:
    """``python *args`` under the interpreter -> its last JSON line; AssertionError (with the
    process's output) if it exits non-zero or prints none."""
    return run_json_check(args, timeout_s, dict(os.environ, TRITON_INTERPRET="1", TORCHDYNAMO_DISABLE="1"))


def run_json_check(args: Sequence[str], timeout_s: float, env: dict) -> dict:
    """``python *args`` in ``env`` -> its last JSON line, as ``run_interpreted``."""
    proc = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1])
