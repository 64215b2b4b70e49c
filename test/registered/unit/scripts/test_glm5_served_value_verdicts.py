"""The value audit in the verdicts of the PD pair smoke, the soak and the L3 restart, on CPU, from
value audit files written as the smoke plugin's ``value_audit.py`` writes them.

What a user depends on: every audited shared-KV server of these served runs has its attention
outputs judged. PD: the shared-KV pair's prefill within the tolerance of the stock pair's prefill,
its decode (a stock server in both pairs) within the stock pair's decode's; without a stock pair in
the call, the recorded stock figures. The soak and the L3 restart run no stock server: the recorded
stock figures (``value_audit_compare.recorded_tolerance``). In each driver a shared-KV server with
rows beyond the tolerance fails, so does one that checked no row (or, under graphs, no replay), and
clean servers pass with their figures in the verdict.

Seen failing before the drivers judged the value audit: every case that must fail passed (the PD's
``audit_checks``, the soak's ``audit_failures`` and the L3 restart's ``judge`` gave no value-audit
failure), and the figures were missing. Planted and caught: the PD's shared decode judged by the
stock prefill's tolerance (``test_the_shared_decode_is_judged_by_the_stock_decode``).
"""

import json
import sys
import tempfile
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv_testing.e2e.server_log import ServedDecode
from sglang_cp_shared_kv_testing.e2e.smoke_report import RunReport
from sglang_cp_shared_kv_testing.repo_scripts import REPO_ROOT, load_script

sys.path.insert(0, str(REPO_ROOT / "scripts" / "smoke_plugin"))
from cp_shared_kv_smoke_hooks import value_audit_compare  # noqa: E402

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

# Within the recorded stock tolerance (3 x 0.0117 max, 2 x 0.0081 p99) and within 3 x of each other.
CLEAN_PREFILL = {"extend": [0.002, 0.004, 0.006, 0.008]}
CLEAN_DECODE = {"decode_graph": [0.003, 0.005, 0.007]}
REPLAYS = {"1": 3}
OFF = 0.3  # a value-only bug's row (a merge weight off: 0.25 to 1.0 served)


def write_values(audit_dir: Path, errors_by_kind, replays=None, ranks=2):
    """One ``value_audit.rank<r>.json`` per rank, the rows spread over the ranks."""
    audit_dir.mkdir(parents=True, exist_ok=True)
    for rank in range(ranks):
        data = {"errors": {k: v[rank::ranks] for k, v in errors_by_kind.items()},
                "layers_checked": {k: 1 for k in errors_by_kind}, "problems": {},
                "graph_replays_by_bs": replays or {}}  # fmt: skip
        (audit_dir / f"value_audit.rank{rank}.json").write_text(json.dumps(data))


def with_row(errors_by_kind, kind, error):
    return {**errors_by_kind, kind: errors_by_kind.get(kind, []) + [error]}


def value_failures(failures):
    return [f for f in failures if "value audit" in f]


class TestPDPairValues(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.driver = load_script("scripts/glm5_pd_smoke.py", "glm5_pd_smoke_values_under_test")

    def judge(self, shared_prefill, shared_decode, stock_prefill=CLEAN_PREFILL, stock_decode=CLEAN_DECODE,
              shared_kv="both"):  # fmt: skip
        """(value failures, figures) of each pair's audit checks: {shared_kv: (failures, figures)}."""
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            args = self.driver.parse_args(["--model-path", tmp, "--audit", "--shared-kv", shared_kv,
                                           "--decode-max-total-tokens", "4096"])  # fmt: skip
            ports = {"prefill": 30001, "decode": 30002, "bootstrap": 30003}
            written = {(False, "prefill"): stock_prefill, (False, "decode"): stock_decode,
                       (True, "prefill"): shared_prefill, (True, "decode"): shared_decode}  # fmt: skip
            for (shared, side), errors in written.items():
                write_values(self.driver.audit_dir(out, shared, side), errors, REPLAYS if side == "decode" else None)
            judged = {}
            for config in self.driver.pair_configs(args, None, ports, out):
                report = RunReport(mode=self.driver.mode_name(config.shared_kv), command=[], log_path="", tp_size=2)
                self.driver.audit_checks(args, config, out, report)
                judged[config.shared_kv] = (value_failures(report.failures), report.figures)
            return judged

    def test_clean_pairs_pass_with_their_figures(self):
        judged = self.judge(CLEAN_PREFILL, CLEAN_DECODE)
        self.assertEqual([judged[s][0] for s in (False, True)], [[], []])
        figures = judged[True][1]
        self.assertEqual(figures["value_audit_prefill"]["all"]["rows"], 4)
        self.assertEqual(figures["value_tolerance_decode"]["reference_max"], 0.007)  # the stock decode's
        self.assertIn("values 3 rows, max rel err 0.007, p99 0.007 (tolerance 0.021, stock)", figures["values_decode"])

    def test_a_shared_prefill_row_beyond_the_stock_prefill_fails(self):
        failures, _ = self.judge(with_row(CLEAN_PREFILL, "extend", OFF), CLEAN_DECODE)[True]
        self.assertEqual(len(failures), 1, failures)
        self.assertTrue(failures[0].startswith("prefill value audit (extend): 1 of 5 rows off by more than 0.024"),
                        failures[0])  # fmt: skip

    def test_the_shared_decode_is_judged_by_the_stock_decode(self):
        """The stock decode's errors (max 0.007) set the decode's limit (0.021), not the stock
        prefill's (max 0.02 here: 0.06); transferred pages giving other values fail."""
        stock_prefill = with_row(CLEAN_PREFILL, "extend", 0.02)
        failures, _ = self.judge(CLEAN_PREFILL, with_row(CLEAN_DECODE, "decode_graph", 0.04), stock_prefill)[True]
        self.assertEqual(len(failures), 1, failures)
        self.assertIn("decode value audit (decode_graph): 1 of 4 rows off by more than 0.021", failures[0])

    def test_nothing_checked_fails(self):
        judged = self.judge({}, {"decode": [0.003]})
        failures = judged[True][0]
        self.assertIn("prefill value audit: no output row was checked", failures)
        self.assertIn("decode value audit: CUDA-graph replays ran but none of their outputs was checked", failures)
        # The stock pair is the tolerance's source: it must have checked rows itself.
        self.assertIn("prefill value audit: no output row was checked", self.judge(CLEAN_PREFILL, CLEAN_DECODE, {})[False][0])

    def test_without_a_stock_pair_the_recorded_figures_judge(self):
        prefill, decode = with_row(CLEAN_PREFILL, "extend", 0.015), with_row(CLEAN_DECODE, "decode_graph", 0.05)
        judged = self.judge(prefill, decode, shared_kv="on")
        failures, figures = judged[True]
        self.assertEqual(figures["value_tolerance_prefill"]["source"], value_audit_compare.RECORDED_SOURCE)
        self.assertEqual(len(failures), 1, failures)  # 0.015 within 3 x 0.0117 (and 2 x 0.0081), 0.05 beyond
        self.assertIn("decode value audit (decode_graph): 1 of 4 rows off by more than 0.0351", failures[0])


class TestSoakValues(CustomTestCase):
    SERVED = ServedDecode(per_owner_impls=("fa3",), graphs=True)

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.driver = load_script("scripts/glm5_cp_hicache_soak.py", "glm5_cp_hicache_soak_values_under_test")

    def audits(self, errors_by_kind, replays=REPLAYS):
        with tempfile.TemporaryDirectory() as tmp:
            write_values(self.driver.audit_dir(Path(tmp)), errors_by_kind, replays)
            figures, failures = self.driver.audit_failures(Path(tmp), self.SERVED)
        return figures, value_failures(failures)

    def test_rows_beyond_the_recorded_stock_tolerance_fail_and_clean_ones_pass(self):
        clean = {**CLEAN_PREFILL, **CLEAN_DECODE}
        figures, failures = self.audits(clean)
        self.assertEqual(failures, [])
        self.assertEqual(figures["value_tolerance"]["max"], 3 * value_audit_compare.STOCK_MAX_SEEN)
        self.assertEqual(figures["value_audit"]["all"]["rows"], 7)
        _, failures = self.audits(with_row(clean, "decode_graph", 0.05))
        self.assertEqual(len(failures), 1, failures)
        self.assertIn("value audit (decode_graph): 1 of 4 rows off by more than 0.0351 (max 0.05; recorded stock",
                      failures[0])  # fmt: skip

    def test_nothing_checked_or_no_replay_checked_fails(self):
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp)
            write_values(run_dir, {})
            self.assertEqual(self.driver.value_failures(run_dir, self.SERVED)[1],
                             ["value audit: no output row was checked"])  # fmt: skip
            write_values(run_dir, CLEAN_PREFILL)  # eager rows only, under graphs
            self.assertEqual(self.driver.value_failures(run_dir, self.SERVED)[1],
                             ["value audit: CUDA-graph replays ran but none of their outputs was checked"])  # fmt: skip
            eager = ServedDecode(gather_reasons=("fp8 KV",))
            self.assertEqual(self.driver.value_failures(run_dir, eager)[1], [])


class TestL3RestartValues(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.driver = load_script("scripts/glm5_cp_l3_restart_smoke.py", "glm5_cp_l3_restart_values_under_test")

    def judge(self, errors_by_server):
        from sglang_cp_shared_kv_testing.e2e import l3_restart

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            args = self.driver.parse_args(["--model-path", tmp, "--tp", "2"])
            for name, errors in errors_by_server.items():
                write_values(self.driver.audit_dir(out, name), errors, REPLAYS)
            figures = {}
            failures = self.driver.judge(args, out, [], {}, figures)
        self.assertTrue(failures)  # no requests, dumps or logs here: only the value verdict is read
        return value_failures(failures), l3_restart.verdict_line(2, [], figures)

    def test_every_server_is_judged_by_the_recorded_stock_figures(self):
        clean = {**CLEAN_PREFILL, **CLEAN_DECODE}
        failures, line = self.judge({name: clean for name in self.driver.SERVERS})
        self.assertEqual(failures, [])
        self.assertIn("values 21 rows, max rel err 0.008, p99 0.008 (tolerance 0.035, recorded stock", line)
        failures, _ = self.judge({"write": clean, "recompute": clean, "restart": with_row(clean, "extend", OFF)})
        self.assertEqual(len(failures), 1, failures)
        self.assertTrue(failures[0].startswith("restart: value audit (extend): 1 of 5 rows off by more than 0.0351"),
                        failures[0])  # fmt: skip

    def test_a_server_that_checked_nothing_fails(self):
        clean = {**CLEAN_PREFILL, **CLEAN_DECODE}
        failures, _ = self.judge({"write": {}, "recompute": clean})
        self.assertEqual(failures, ["write: value audit: no output row was checked",
                                    "restart: value audit: no value audit file (the audit did not run)"])  # fmt: skip


if __name__ == "__main__":
    unittest.main()
