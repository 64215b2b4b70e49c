"""scripts/glm5_cp_hicache_smoke.py end to end against a stand-in ``sglang`` server on loopback.

The stand-in speaks the parts of sglang's HTTP API the smoke uses (``/health``, ``/server_info``,
``/metrics`` in Prometheus text, streamed ``/generate`` in sglang's ``data: ...`` event format),
prints sglang's capacity log lines, and spawns a child like sglang's scheduler processes. It
proves the driver's wiring: verdicts, exit codes, report, and that no server process survives.
"""

import json
import os
import signal
import tempfile
import time
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv_testing.repo_scripts import load_script

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")


FAKE_SGLANG = r'''#!/usr/bin/env python3
import json, os, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[2:]  # after "serve"
def arg(name):
    return argv[argv.index(name) + 1]
port, tp, physical = int(arg("--port")), int(arg("--tp")), int(arg("--max-total-tokens"))
shared = "--enable-nsa-prefill-cp-shared-kv" in argv
logical = physical * (tp if shared else 1)
stamp = time.strftime("%Y-%m-%d %H:%M:%S")
if os.environ.get("FAKE_CRASH_AT_START"):
    print(f"[{stamp} TP0] Scheduler hit an exception: Traceback (most recent call last):", flush=True)
    print("AssertionError: boom", flush=True)
    sys.exit(1)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a "scheduler"
with open(os.environ["FAKE_CHILD_PID_FILE"], "a") as f:
    f.write(f"{child.pid}\n")
for rank in range(tp):
    print(f"[{stamp} ATTN_CP{rank} TP{rank}] KV Cache is allocated. #tokens: {physical}, KV size: 0.10 GB")
print(f"[{stamp} ATTN_CP0 TP0] max_total_num_tokens={logical}, chunked_prefill_size=8192", flush=True)
state = {"evicted": 0, "loaded": 0, "host": 0}
seen = set()

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, body, ctype):
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            self.reply(b"", "text/plain")
        elif self.path == "/server_info":
            self.reply(json.dumps({"max_total_num_tokens": logical}).encode(), "application/json")
        elif self.path == "/metrics":
            text = (
                "# TYPE sglang:evicted_tokens_total counter\n"
                f'sglang:evicted_tokens_total{{cache_type="HiRadixCache"}} {state["evicted"]}\n'
                "# TYPE sglang:load_back_tokens_total counter\n"
                f'sglang:load_back_tokens_total{{cache_type="HiRadixCache"}} {state["loaded"]}\n'
                "# TYPE sglang:cached_tokens_total counter\n"
                f'sglang:cached_tokens_total{{cache_source="host",model_name="m"}} {state["host"]}\n'
                "# TYPE sglang:hicache_host_total_tokens gauge\n"
                + "".join(f'sglang:hicache_host_total_tokens{{tp_rank="{r}"}} {2 * physical}\n' for r in range(tp))
            )
            self.reply(text.encode(), "text/plain; version=0.0.4")
        else:
            self.send_error(404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids, n = body["input_ids"], body["sampling_params"]["max_new_tokens"]
        if body.get("return_logprob"):  # teacher-forced scoring: input logprobs, one JSON body
            start = body["logprob_start_len"]
            logprobs = [[-((7 * t + i) % 13) / 10, t, None] for i, t in enumerate(ids) if i >= start]
            data = json.dumps({"meta_info": {"input_token_logprobs": logprobs, "cached_tokens": 0}}).encode()
            self.reply(data, "application/json")
            return
        host = len(ids) - 64 if tuple(ids[:64]) in seen else 0
        seen.add(tuple(ids[:64]))
        state["evicted"] += tp * len(ids)
        state["loaded"] += tp * host
        state["host"] += host
        out = [(sum(ids) + 7 * i) % 256 for i in range(n)]
        if shared and host and os.environ.get("FAKE_CORRUPT_SHARED"):
            out[-1] ^= 1  # what a wrong page after load-back would do to a greedy token
        meta = {"cached_tokens": host, "cached_tokens_details": {"device": 0, "host": host}}
        if "--speculative-algorithm" in argv:  # sglang's meta_info with MTP: verify forwards, tokens
            meta.update(spec_verify_ct=(n + 1) // 2, completion_tokens=n)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for k in (1, n):
            chunk = {"text": None, "output_ids": out[:k], "meta_info": meta}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")

ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def load_smoke():
    return load_script("scripts/glm5_cp_hicache_smoke.py", "glm5_smoke")


def process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # reaped soon by its new parent
    except FileNotFoundError:
        return True


class TestSmokeRunner(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.script = load_smoke()

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        tmp = Path(self.tmp.name)
        (tmp / "bin").mkdir()
        fake = tmp / "bin" / "sglang"
        fake.write_text(FAKE_SGLANG)
        fake.chmod(0o755)
        self.pid_file = tmp / "children"
        self.saved_env = dict(os.environ)
        os.environ["PATH"] = f"{tmp / 'bin'}:{os.environ['PATH']}"
        os.environ["FAKE_CHILD_PID_FILE"] = str(self.pid_file)
        self.saved_sigterm = signal.getsignal(signal.SIGTERM)
        self.out_dir = tmp / "out"

    def tearDown(self):
        os.environ.clear()
        os.environ.update(self.saved_env)
        signal.signal(signal.SIGTERM, self.saved_sigterm)
        self.tmp.cleanup()

    def run_smoke(self, *extra):
        argv = ["--model-path", "/nonexistent/glm5", "--physical-tokens-per-rank", "1024", "--max-new-tokens", "4",
                "--startup-timeout", "60", "--request-timeout", "30", "--out-dir", str(self.out_dir), *extra]  # fmt: skip
        rc = self.script.main(argv)
        report_path = self.out_dir / "report.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else None
        return rc, report

    def assert_no_server_process_left(self):
        pids = [int(p) for p in self.pid_file.read_text().split()] if self.pid_file.exists() else []
        deadline = time.monotonic() + 10
        while not all(process_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.assertTrue(all(process_gone(p) for p in pids), pids)

    def test_both_modes_pass_and_leave_no_process(self):
        rc, report = self.run_smoke("--shared-kv", "both")
        self.assertEqual(rc, 0, report and [r["failures"] for r in report["runs"]])
        off, on = report["runs"]
        self.assertEqual((off["mode"], on["mode"]), ("shared-kv-off", "shared-kv-on"))
        self.assertEqual(off["figures"]["logical_over_physical"], 1)
        self.assertEqual(on["figures"]["logical_over_physical"], 8)
        self.assertGreater(on["figures"]["hicache_activity"]["load_back_tokens"], 0)
        self.assertEqual(len(on["records"]), len(off["records"]))
        self.assertTrue(on["figures"]["ttft"])
        self.assertEqual(report["greedy_differences"], [])
        self.assert_no_server_process_left()

    def test_greedy_differences_are_reported_not_judged(self):
        # Stock NSA kernels are not run-to-run deterministic: greedy tokens are no oracle (the KV
        # audits are), so a difference is listed in the report and does not fail the run.
        os.environ["FAKE_CORRUPT_SHARED"] = "1"
        rc, report = self.run_smoke("--shared-kv", "both")
        self.assertEqual(rc, 0, [r["failures"] for r in report["runs"]])
        self.assertTrue(report["greedy_differences"])
        self.assertIn("shared-kv-on differs from shared-kv-off", report["greedy_differences"][0])
        self.assert_no_server_process_left()

    def test_mtp_reports_accept_lengths_of_both_servers(self):
        """--mtp: both servers get the recipe, and the report carries each run's mean accept length
        (tokens per verify forward from meta_info), reported and not judged."""
        rc, report = self.run_smoke("--shared-kv", "both", "--mtp")
        self.assertEqual(rc, 0, report and [r["failures"] for r in report["runs"]])
        for run in report["runs"]:
            self.assertIn("--speculative-algorithm", run["command"])
            accept = run["figures"]["mtp_accept_length"]
            self.assertEqual(accept["requests"], len(run["records"]))
            self.assertEqual(accept["tokens_per_verify"], 2.0)  # 4 tokens over 2 verifies each
        rc, report = self.run_smoke("--shared-kv", "on")
        self.assertNotIn("mtp_accept_length", report["runs"][0]["figures"])
        self.assert_no_server_process_left()

    def test_audited_runs_score_teacher_forced_and_judge_missing_audits(self):
        """--audit: both servers score the texts twice and the shared-KV run is judged against the
        stock run's spread (equal here: passes); the stand-in writes no audit files, so each run
        fails with the audits' own reasons (no value audit file, no pool dumps), not with a crash
        of the driver. Seen failing with the stand-in answering the scoring as a stream."""
        rc, report = self.run_smoke("--shared-kv", "off", "--audit", "--teacher-forced-texts", "2")
        self.assertEqual(rc, 1)
        (stock,) = report["runs"]
        self.assertEqual(len(stock["figures"]["teacher_forced"]["passes"]), 2)
        self.assertIn("value audit: no value audit file (the audit did not run)", stock["failures"])
        reference = self.out_dir
        self.out_dir = Path(self.tmp.name) / "out_on"
        rc, report = self.run_smoke("--shared-kv", "on", "--audit", "--teacher-forced-texts", "2",
                                    "--reference-dir", str(reference))  # fmt: skip
        self.assertEqual(rc, 1)
        (on,) = report["runs"]
        forced = on["figures"]["teacher_forced_verdict"]
        self.assertEqual(forced["shared_vs_stock"]["tokens"], 2 * 64)
        self.assertEqual(forced["shared_vs_stock"]["mean"], 0.0)
        self.assertFalse([f for f in on["failures"] if f.startswith("teacher-forced")])
        self.assertTrue([f for f in on["failures"] if f.startswith("value audit")])
        self.assert_no_server_process_left()

    def test_a_server_that_dies_at_startup_fails_with_its_log_error(self):
        os.environ["FAKE_CRASH_AT_START"] = "1"
        rc, report = self.run_smoke("--shared-kv", "on")
        self.assertEqual(rc, 1)
        failures = "\n".join(report["runs"][0]["failures"])
        self.assertIn("server exited with code 1", failures)
        self.assertIn("Scheduler hit an exception", failures)


if __name__ == "__main__":
    unittest.main()
