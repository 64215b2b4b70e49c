"""The interpreter running the tests is the ``python3`` of every child process they start.

Runner scripts, smoke drivers and multi-rank workers call ``python3`` by name. A venv's interpreter
run without the venv activated (``/path/venv/bin/python -m pytest ...``) would leave them to
whatever ``python3`` the PATH finds first, often one without sglang: the test conftest calls
``put_this_interpreter_first_on_path`` once per test process.
"""

from __future__ import annotations

import atexit
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path


def put_this_interpreter_first_on_path() -> Path:
    """A private folder with ``python3`` and ``python`` scripts that exec ``sys.executable``, first
    on PATH for this process and everything it starts; returns the folder. Scripts, not symlinks: a
    venv's interpreter finds its venv from the path it is started by, and a link in another folder
    would start the base interpreter without the venv's packages."""
    folder = Path(tempfile.mkdtemp(prefix="cp-shared-kv-tests-python-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # gone with the test process
    for name in ("python3", "python"):
        script = folder / name
        script.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n")
        script.chmod(0o755)
    os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"
    return folder
