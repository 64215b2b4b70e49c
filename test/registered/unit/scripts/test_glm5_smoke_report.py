"""The smoke's verdicts: output equality between runs, replays, HiCache activity, capacity, TTFT pairs."""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing.e2e.request_plan import REPLAY, ROUND2, build_plan
from sglang_cp_shared_kv_testing.e2e.server_log import CapacityLines, LogFinding
from sglang_cp_shared_kv_testing.e2e.server_process import GenerateResult
from sglang_cp_shared_kv_testing.e2e.smoke_report import (
    RequestRecord,
    RunReport,
    accept_length_summary,
    capacity_failures,
    capacity_figures,
    compare_runs,
    first_difference,
    hicache_activity,
    hicache_failures,
    log_failures,
    request_failures,
    ttft_summary,
)

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

PLAN = build_plan([4096], 2.0, 64, 8192, 8, (0, 256))


def outputs_of(request):
    """A stand-in greedy output that depends on the prompt, as a model's does."""
    ids = PLAN.input_ids(request)
    return [(sum(ids) + 7 * i) % 256 for i in range(PLAN.max_new_tokens)]


def healthy_run(mode="shared-kv-off"):
    report = RunReport(mode=mode, command=[], log_path="", tp_size=8)
    for r in PLAN.requests:
        host = r.prefix_tokens if r.phase in (ROUND2, REPLAY) else 0
        meta = {"cached_tokens": host, "cached_tokens_details": {"device": 0, "host": host}}
        result = GenerateResult(outputs_of(r), meta, ttft_s=0.05 if host else 0.4, e2e_s=0.6)
        deltas = {"evicted_tokens": 8 * r.prefix_tokens, "load_back_tokens": 8 * host}
        report.records.append(RequestRecord.from_response(r.index, r.name, r.prompt_tokens, result, deltas))
    return report


class TestSmokeReport(CustomTestCase):
    def test_healthy_runs_pass_every_check(self):
        off, on = healthy_run(), healthy_run("shared-kv-on")
        self.assertEqual(request_failures(PLAN, off.records), [])
        self.assertEqual(hicache_failures(hicache_activity(off.records)), [])
        self.assertEqual(compare_runs(PLAN, off, on), [])

    def test_a_changed_token_fails_the_comparison_and_names_the_request(self):
        off, on = healthy_run(), healthy_run("shared-kv-on")
        victim = next(r for r in on.records if r.cached_host_tokens > 0)
        victim.output_ids[5] ^= 1
        failures = compare_runs(PLAN, off, on)
        self.assertEqual(len(failures), 1)
        self.assertIn(f"#{victim.index} {victim.name}", failures[0])
        self.assertIn("output token 5", failures[0])

    def test_replay_mismatch_errors_and_short_outputs_fail_the_run(self):
        run = healthy_run()
        replay = next(r for r in PLAN.requests if r.phase == REPLAY)
        run.records[replay.index].output_ids[0] += 1
        run.records[1].error = "HTTP 500: boom"
        run.records[2].output_ids = run.records[2].output_ids[:3]
        failures = "\n".join(request_failures(PLAN, run.records))
        self.assertIn(f"replay of #{replay.replay_of} differs at output token 0", failures)
        self.assertIn("HTTP 500: boom", failures)
        self.assertIn("3 output tokens, expected 8", failures)
        run.records.pop()
        self.assertIn("not run", request_failures(PLAN, run.records)[-1])

    def test_no_load_back_or_no_host_hit_fails(self):
        run = healthy_run()
        for r in run.records:
            r.metric_deltas["load_back_tokens"] = 0
            r.cached_host_tokens = 0
        failures = "\n".join(hicache_failures(hicache_activity(run.records)))
        self.assertIn("no host load-back", failures)
        self.assertIn("no request was served from host", failures)
        self.assertNotIn("no device eviction", failures)

    def test_mtp_accept_length_from_sglangs_meta_info(self):
        """sglang's meta_info with MTP carries spec_verify_ct and completion_tokens: accept length is
        tokens per verify (bonus token included), pooled and per request, and for the requests whose
        prompt came partly from host. Reported only; without MTP there is nothing."""
        records = []
        for i, (verify, host) in enumerate(((4, 0), (8, 0), (16, 128))):
            meta = {"cached_tokens": host, "cached_tokens_details": {"host": host}, "spec_verify_ct": verify,
                    "completion_tokens": 16}  # fmt: skip
            records.append(RequestRecord.from_response(i, f"r{i}", 100, GenerateResult([1] * 16, meta, 0.1, 0.2), {}))
        summary = accept_length_summary(records)
        self.assertEqual(summary["requests"], 3)
        self.assertAlmostEqual(summary["tokens_per_verify"], 48 / 28, places=4)
        self.assertAlmostEqual(summary["mean_per_request"], (4 + 2 + 1) / 3, places=4)
        self.assertEqual(summary["mean_prefix_from_host"], 1.0)
        self.assertEqual(accept_length_summary(healthy_run().records), {"requests": 0})
        self.assertIsNone(healthy_run().records[0].spec_verify_ct)

    def test_first_difference(self):
        self.assertIsNone(first_difference([1, 2, 3], [1, 2, 3]))
        self.assertEqual(first_difference([1, 2, 3], [1, 9, 3]), 1)
        self.assertEqual(first_difference([1, 2], [1, 2, 3]), 2)

    def test_capacity_must_scale_by_cp_size_only_with_shared_kv(self):
        lines = CapacityLines(device_pool_tokens={r: 16384 for r in range(8)}, host_kv_gb={0: 2.5}, host_indexer_gb={0: 0.3})
        on = capacity_figures({"max_total_num_tokens": 8 * 16384}, lines, {"0": 32832.0})
        self.assertEqual(on["logical_over_physical"], 8)
        self.assertEqual(on["host_memory_gb_per_rank"], {"0": 2.8})
        self.assertEqual(capacity_failures(True, 8, on), [])
        self.assertIn("expected 1", capacity_failures(False, 8, on)[0])
        off = capacity_figures({"max_total_num_tokens": 16384}, lines, {})
        self.assertIn("expected 8", capacity_failures(True, 8, off)[0])
        self.assertEqual(capacity_failures(False, 8, off), [])

    def test_only_fatal_log_findings_fail(self):
        findings = [LogFinding(3, "load-back failed", False, 0, "x"), LogFinding(9, "assertion", True, 2, "AssertionError")]
        self.assertEqual(log_failures(findings), ["server log line 9 (assertion): AssertionError"])

    def test_ttft_rows_pair_recomputed_and_host_served_prefixes(self):
        rows = ttft_summary(PLAN, healthy_run().records)
        self.assertEqual(len(rows), PLAN.groups[0].num_prefixes)
        for row in rows:
            self.assertIn("round1", row["recomputed_request"])
            self.assertIn("round2", row["from_host_request"])
            self.assertEqual(row["host_tokens"], row["prefix_tokens"])
            self.assertEqual((row["recomputed_ttft_ms"], row["from_host_ttft_ms"]), (400.0, 50.0))


if __name__ == "__main__":
    unittest.main()
