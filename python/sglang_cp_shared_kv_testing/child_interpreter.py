"""The interpreter running the tests is the ``python3`` of every child process they start.

Runner scripts, smoke drivers and multi-rank workers call ``python3`` by name. A venv's interpreter
run without the venv activated (``/path/venv/bin/python -m pytest ...``) would leave them to
whatever ``python3`` the PATH finds first, often one without sglang: the test conftest calls
``put_this_interpreter_first_on_path`` once per test process.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path


def put_this_interpreter_first_on_path() -> Path:
    """A private folder with ``python3`` and ``python`` links to ``sys.executable``, first on PATH
    for this process and everything it starts; returns the folder."""
    folder = Path(tempfile.mkdtemp(prefix="cp-shared-kv-tests-python-"))
    for name in ("python3", "python"):
        (folder / name).symlink_to(sys.executable)
    os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"
    return folder
