"""The checkout's scripts (``scripts/``) as modules, for tests that call into them.

Scripts are not part of the package; test helpers live in the checkout (an editable install imports
them from there), so the repository root is this file's third parent above ``python/``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[3]


def load_script(relative_path: str, module_name: str | None = None) -> ModuleType:
    """Import ``REPO_ROOT / relative_path`` as a fresh module (named after the file by default)."""
    path = REPO_ROOT / relative_path
    spec = importlib.util.spec_from_file_location(module_name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
