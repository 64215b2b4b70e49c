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

Every checked row records the merge form that ran (the audit's hooks on the two merge functions of
``decode_forward``, through ``HookRegistry``): the one exchange at the modeled setting (every batch
at CP 2), the scaled sum with the setting off. Seen failing with the two functions' forms swapped
in the audit's table.
"""

import json
import tempfile
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.model_executor.per_owner_decode.attention_lse_merge import ONE_EXCHANGE, SCALED_SUM
from sglang_cp_shared_kv.settings import MODELED_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES as MODELED
from sglang_cp_shared_kv_testing import per_owner_decode_hooked as hooked

register_cpu_ci(est_time=55, suite="stage-a-test-cpu")

CLEAN_MAX = 2e-2  # bf16 outputs against an fp32 recomputation
CAUGHT_MIN = 0.2


def _errors(audit_dir: str) -> tuple:
    """(decode rows' errors, rows by merge form) over both ranks."""
    errors, forms = [], {}
    for path in sorted(Path(audit_dir).glob("value_audit.rank*.json")):
        data = json.loads(path.read_text())
        assert not any(data["problems"].values()), data["problems"]
        errors += data["errors"].get("decode", [])
        for form, rows in data.get("rows_by_merge_form", {}).get("decode", {}).items():
            forms[form] = forms.get(form, 0) + rows
    return errors, forms


class TestValueAuditThroughSglangDecode(CustomTestCase):
    def test_clean_passes_and_the_merge_skew_is_caught_for_fa3_and_flashmla_kv(self):
        with tempfile.TemporaryDirectory() as tmp:
            scenarios, dirs = [], []
            cases = [(impl, kv_dtype, plant, MODELED) for impl, kv_dtype in (("fa3", "bf16"), ("flashmla_kv", "fp8"))
                     for plant in (None, "value-merge-skew")] + [("fa3", "bf16", None, None)]  # fmt: skip
            for impl, kv_dtype, plant, one_exchange in cases:
                audit_dir = Path(tmp) / f"{impl}-{plant}-{one_exchange}"
                audit_dir.mkdir()
                dirs.append((impl, plant, one_exchange, str(audit_dir)))
                scenarios.append(hooked.Scenario(
                    seq_lens=(900, 128, 70, 400), topk=128, kv_dtype=kv_dtype, decode_impl=impl, padded=1,
                    layers=("topk", "skip"), steps=4, value_audit_dir=str(audit_dir), smoke_plant=plant,
                    merge_one_exchange_max_extra_bytes=one_exchange,
                ))  # fmt: skip
            outcomes = hooked.run_scenarios(2, scenarios, "cpu", rel_tol=2e-2)
            for (impl, plant, one_exchange, audit_dir), (_, comparison) in zip(dirs, outcomes):
                with self.subTest(impl=impl, plant=plant, one_exchange=one_exchange):
                    errors, forms = _errors(audit_dir)
                    # 4 steps x 2 layers, one request each, both ranks
                    self.assertEqual(len(errors), 16)
                    self.assertEqual(forms, {ONE_EXCHANGE if one_exchange is not None else SCALED_SUM: 16})
                    self.assertTrue(comparison["indices_cover_selection"])  # the rows stay right
                    if plant is None:
                        self.assertLess(max(errors), CLEAN_MAX)
                        self.assertTrue(comparison["passed_tolerance"])
                    else:
                        self.assertGreater(max(errors), CAUGHT_MIN)


if __name__ == "__main__":
    unittest.main()
