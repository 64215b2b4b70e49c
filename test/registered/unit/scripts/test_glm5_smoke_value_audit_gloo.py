"""The smoke's value audit on per-owner decode forwards run through sglang's own decode methods.

Two CP ranks (gloo, CPU references of the kernels) run decode steps through
``NativeSparseAttnBackend.forward_decode`` and ``Indexer._get_topk_paged`` with the plugin's hooks
and the smoke plugin's value audit (``per_owner_decode_hooked``, ``Scenario.value_audit_dir``): the
audit gathers each checked request's rows from both ranks' physical pools, recomputes the selection
and attention, and compares the merged output. Layers include a ``skip_topk`` layer (its selection
comes from the layer before). Clean, every row is within rounding of the reference; with the smoke's
value-only plant ``value-merge-skew`` (rank 1's LSE raised: indices right, merge weights wrong) the
checked rows are far off, and the row-level comparison of the harness still finds every index right.
Seen failing (the plant not caught) while the audit checked one request per forward by the sum of
sequence lengths, which a decode step moves by the batch size: the same single-owner request every
step.
"""

import json
import tempfile
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing import per_owner_decode_hooked as hooked

register_cpu_ci(est_time=45, suite="stage-a-test-cpu")

CLEAN_MAX = 2e-2  # bf16 outputs against an fp32 recomputation
CAUGHT_MIN = 0.2


def _errors(audit_dir: str) -> list:
    errors = []
    for path in sorted(Path(audit_dir).glob("value_audit.rank*.json")):
        data = json.loads(path.read_text())
        assert not any(data["problems"].values()), data["problems"]
        errors += data["errors"].get("decode", [])
    return errors


class TestValueAuditThroughSglangDecode(CustomTestCase):
    def test_clean_passes_and_the_merge_skew_is_caught_for_fa3_and_flashmla_kv(self):
        with tempfile.TemporaryDirectory() as tmp:
            scenarios, dirs = [], []
            for impl, kv_dtype in (("fa3", "bf16"), ("flashmla_kv", "fp8")):
                for plant in (None, "value-merge-skew"):
                    audit_dir = Path(tmp) / f"{impl}-{plant}"
                    audit_dir.mkdir()
                    dirs.append((impl, plant, str(audit_dir)))
                    scenarios.append(hooked.Scenario(
                        seq_lens=(900, 128, 70, 400), topk=128, kv_dtype=kv_dtype, decode_impl=impl, padded=1,
                        layers=("topk", "skip"), steps=4, value_audit_dir=str(audit_dir), smoke_plant=plant,
                    ))  # fmt: skip
            outcomes = hooked.run_scenarios(2, scenarios, "cpu", rel_tol=2e-2)
            for (impl, plant, audit_dir), (_, comparison) in zip(dirs, outcomes):
                with self.subTest(impl=impl, plant=plant):
                    errors = _errors(audit_dir)
                    # 4 steps x 2 layers, one request each, both ranks
                    self.assertEqual(len(errors), 16)
                    self.assertTrue(comparison["indices_cover_selection"])  # the rows stay right
                    if plant is None:
                        self.assertLess(max(errors), CLEAN_MAX)
                        self.assertTrue(comparison["passed_tolerance"])
                    else:
                        self.assertGreater(max(errors), CAUGHT_MIN)


if __name__ == "__main__":
    unittest.main()
