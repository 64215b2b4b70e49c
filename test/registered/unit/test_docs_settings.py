"""README and docs/configuration.md against the code: an operator reads the settings, the files and
the commands there, so each one named must exist and each default must be the code's.

Planted once each: ``SGLANG_CP_SHARED_KV_PREFILL_SCRATCH_TOKENS``'s row removed from
docs/configuration.md failed ``test_every_variable_has_a_row_in_the_configuration_page``; its
README row removed failed ``test_every_variable_is_in_the_readme``; the configuration page's
default of ``SGLANG_CP_SHARED_KV_DECODE`` written as `per_owner` failed
``test_defaults_in_the_configuration_page_are_the_codes``; ``bench_stock_decode_layer.py`` in
README renamed to ``benchmark/bench_missing.py`` failed
``test_every_repository_path_the_readme_names_exists`` and ``test_every_benchmark_is_listed``;
``observability/`` dropped from README failed ``test_every_package_directory_is_listed``.
"""

import os
import re
import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv import settings as s

register_cpu_ci(est_time=1, suite="stage-a-test-cpu")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
PACKAGE_DIR = os.path.join(REPO, "python", "sglang_cp_shared_kv")
# What the configuration page's "Default" column says for each kind of default.
OFF = "off"


def _read(relative_path: str) -> str:
    with open(os.path.join(REPO, relative_path), encoding="utf-8") as f:
        return f.read()


def _doc_pages():
    docs = os.path.join(REPO, "docs")
    return ["README.md"] + sorted(
        os.path.join("docs", name) for name in os.listdir(docs) if name.endswith(".md")
    )


def _table_row(text: str, name: str):
    """Cells of the first table row whose first cell is `name` (None: no such row)."""
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and cells and cells[0] == f"`{name}`":
            return cells
    return None


def _expected_default_text(name: str, default) -> str:
    if isinstance(default, bool):
        return "on" if default else OFF
    if default is None and name == s.PREFILL_SCRATCH_TOKENS_ENV:
        return "context length"  # the prefill scratch rule (startup_rules.scratch_sizing)
    if default is None:
        return f"`{s.MERGE_ONE_EXCHANGE_OFF}`"  # the one-exchange merge's budget, unset: off
    return f"`{default}`"


DEFAULTS = {
    s.DECODE_PATH_ENV: s.DEFAULT_DECODE_PATH,
    s.GRAPH_DECODE_ENV: s.DEFAULT_DECODE_CUDA_GRAPH,
    s.MTP_ENV: s.DEFAULT_MTP,
    s.PREFETCH_SLOT_TOKENS_ENV: s.DEFAULT_PREFETCH_SLOT_TOKENS,
    s.PREFILL_SCRATCH_TOKENS_ENV: s.DEFAULT_PREFILL_SCRATCH_TOKENS,
    s.REQ_TO_PAGE_MIRROR_CHECK_ENV: s.DEFAULT_CHECK_PAGE_MIRROR,
    s.MERGE_ONE_EXCHANGE_ENV: s.DEFAULT_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES,
    s.ALL_CP_RANKS_ENV: s.DEFAULT_ALL_CP_RANKS_TRANSFER,
    s.CPP_RADIX_TREE_ENV: s.DEFAULT_CPP_RADIX_TREE,
    s.UNIFIED_RADIX_TREE_ENV: s.DEFAULT_UNIFIED_RADIX_TREE,
}


class TestSettingsDocumented(CustomTestCase):
    def test_defaults_cover_every_variable(self):
        """This test's own table must follow settings.py, or the checks below miss a variable."""
        self.assertEqual(set(DEFAULTS), set(s.SETTINGS_ENVS))

    def test_every_variable_has_a_row_in_the_configuration_page(self):
        page = _read("docs/configuration.md")
        missing = [name for name in s.SETTINGS_ENVS if _table_row(page, name) is None]
        self.assertEqual(missing, [], "variables of settings.py without a row in docs/configuration.md")

    def test_defaults_in_the_configuration_page_are_the_codes(self):
        page = _read("docs/configuration.md")
        wrong = {}
        for name, default in DEFAULTS.items():
            row = _table_row(page, name)
            if row is None:
                continue  # reported by the test above
            expected = _expected_default_text(name, default)
            if not row[1].startswith(expected):
                wrong[name] = (row[1], expected)
        self.assertEqual(wrong, {}, "docs/configuration.md default -> what settings.py defaults to")

    def test_every_variable_is_in_the_readme(self):
        readme = _read("README.md")
        missing = [name for name in s.SETTINGS_ENVS if _table_row(readme, name) is None]
        self.assertEqual(missing, [], "variables of settings.py without a row in README's table")
        self.assertIsNotNone(_table_row(readme, s.CP_SHARED_KV_FLAG))

    def test_every_documented_variable_exists(self):
        """A page naming SGLANG_CP_SHARED_KV_X that settings.py does not declare sends users to a
        setting nothing reads (the smoke plugin's own variables are test-only and allowed)."""
        known = set(s.SETTINGS_ENVS) | {s.CP_SHARED_KV_ENV}
        unknown = {}
        for page in _doc_pages():
            for name in set(re.findall(r"SGLANG_CP_SHARED_KV(?:_[A-Z0-9]+)*", _read(page))):
                if name not in known and not name.startswith("SGLANG_CP_SHARED_KV_SMOKE_"):
                    unknown.setdefault(page, []).append(name)
        self.assertEqual(unknown, {})


class TestReadmeNamesWhatExists(CustomTestCase):
    def test_every_repository_path_the_readme_names_exists(self):
        readme = _read("README.md")
        paths = set(re.findall(r"(?<![\w/.])((?:scripts|benchmark|docs|test|python)/[\w./-]+)", readme))
        paths = {p.rstrip(".") for p in paths}
        missing = sorted(p for p in paths if not os.path.exists(os.path.join(REPO, p)))
        self.assertEqual(missing, [])

    def test_every_module_run_with_python_m_exists(self):
        missing = []
        for page in _doc_pages():
            for module in re.findall(r"python3? -m (sglang_cp_shared_kv[\w.]*)", _read(page)):
                # the product package or the tests' package beside it, both under python/
                base = os.path.join(os.path.dirname(PACKAGE_DIR), *module.split("."))
                if not (os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__main__.py"))):
                    missing.append((page, module))
        self.assertEqual(missing, [])

    def test_every_benchmark_is_listed(self):
        """'Where things are' lists every benchmark script, so none is found only by browsing."""
        readme = _read("README.md")
        unlisted = sorted(
            name
            for name in os.listdir(os.path.join(REPO, "benchmark"))
            if name.endswith(".py") and name not in readme
        )
        self.assertEqual(unlisted, [])

    def test_every_package_directory_is_listed(self):
        readme = _read("README.md")
        unlisted = sorted(
            name
            for name in os.listdir(PACKAGE_DIR)
            if os.path.isdir(os.path.join(PACKAGE_DIR, name))
            and not name.startswith("__")
            and f"`{name}/`" not in readme
        )
        self.assertEqual(unlisted, [])


if __name__ == "__main__":
    unittest.main()
