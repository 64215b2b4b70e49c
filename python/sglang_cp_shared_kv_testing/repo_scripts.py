"""The checkout's scripts (``scripts/``) as modules, for tests that call into them.

Scripts are not part of the package; test helpers live in the checkout (an editable install imports
them from there), so the repository root is this file's third parent above ``python/``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[2]


def load_script(relative_path: str, module_name: str | None = None) -> ModuleType:
    """Import ``REPO_ROOT / relative_path`` as a fresh module (named after the file by default)."""
    path = REPO_ROOT / relative_path
    spec = importlib.util.spec_from_file_location(module_name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ScriptCliCase:
    """Test-case mixin for a script's command line: ``cls.script`` (``SCRIPT``, a path under the
    repository, loaded once as ``SCRIPT_MODULE``), a tiny GLM-5 and one with a NextN layer
    (``cls.model_dir``, ``cls.nextn_dir``), and ``run_main`` (exit code and stdout of ``main``)."""

    SCRIPT: str = ""
    SCRIPT_MODULE: str | None = None

    @classmethod
    def setUpClass(cls):
        import tempfile

        from sglang_cp_shared_kv_testing.e2e.tiny_glm5 import write_tiny_glm5_model

        super().setUpClass()
        cls.script = load_script(cls.SCRIPT, cls.SCRIPT_MODULE)
        cls.tmp = tempfile.TemporaryDirectory()
        cls.model_dir = str(write_tiny_glm5_model(Path(cls.tmp.name) / "tiny-glm5"))
        cls.nextn_dir = str(write_tiny_glm5_model(Path(cls.tmp.name) / "tiny-glm5-nextn", nextn=True))

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()
        super().tearDownClass()

    def run_main(self, *argv):
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            try:
                rc = self.script.main(list(argv))
            except SystemExit as e:  # argparse: --help and usage errors
                rc = e.code
        return rc, out.getvalue()
