"""Two shared-KV servers on one Mooncake Store, on CPU: the plan, the verdict, the store's expected
objects, the processes the driver would launch, a server B that does not start, the runner's dry run.

What a user depends on: the run is PASSED only if B's every prefix came whole from L3, with A up and
after A stopped; A's objects are all in the holder and nowhere else, before and after A stopped;
every restored row is the row A stored; a read the router sent to the other server came whole from
L3 there. The servers mount no segment of their own, the shared-KV ones serve the server's default
decode, and a server that does not start makes it FAILED quoting its error.

Planted and caught (each reverted): the hit check reading ``cached_tokens`` instead of the storage
figure (a prefix B held on device passed); the after-A round not judged (0 L3 tokens after A
stopped passed); ``served_by`` taking the first counter that moved (a read on the computing server
passed as another server's); the store check without the holder comparison (an object in a
server's own segment passed); the dry run's servers mounting 32 MB each (the client extra config's
default); B's start waited for without ``wait_started`` (the verdict: "server: ServerError: server
exited with code 1; see <log>" among other failures, not B's error).
"""

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from unittest import mock

import numpy as np

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO / "scripts" / "smoke_plugin"))
from cp_shared_kv_smoke_hooks import kv_audit_compare  # noqa: E402
from cp_shared_kv_smoke_hooks.kv_audit import write_pool_dump  # noqa: E402

from sglang_cp_shared_kv_testing.e2e import shared_store  # noqa: E402
from sglang_cp_shared_kv_testing.e2e.l3_restart import ServedRequest  # noqa: E402
from sglang_cp_shared_kv_testing.e2e.shared_store import A, B, REFERENCE, SharedStorePlan  # noqa: E402

register_cpu_ci(est_time=60, suite="stage-a-test-cpu")

PAGE = 64
SCRIPT = "scripts/glm5_cp_l3_shared_store_smoke.py"
HOLDER = "127.0.0.1:16001"


def plan(**kw):
    return SharedStorePlan(**{"prefixes": 3, "prefix_tokens": 4 * PAGE, "suffix_tokens": 10, "page_size": PAGE, **kw})


def clean_requests(p, ttft=lambda server, rid: 100.0):
    out = []
    for k in range(p.prefixes):
        out.append(ServedRequest(A, p.write_rid(k), p.prefix_tokens, 0, None, ttft(A, p.write_rid(k))))
        for rid in (p.live_rid(k), p.after_rid(k)):
            total = p.prefix_tokens + p.suffix_tokens
            out.append(ServedRequest(B, rid, total, p.prefix_tokens, p.prefix_tokens, ttft(B, rid)))
            out.append(ServedRequest(REFERENCE, rid, total, 0, None, ttft(REFERENCE, rid)))
    for j in range(p.router_prefixes):
        out.append(ServedRequest(A, p.router_write_rid(j), p.prefix_tokens, 0, None, 50.0))
        out.append(ServedRequest(B, p.router_read_rid(j), p.prefix_tokens + p.suffix_tokens, p.prefix_tokens,
                                 p.prefix_tokens, 50.0))  # fmt: skip
    return out


def find(requests, server, rid):
    return next(r for r in requests if r.server == server and r.rid == rid)


class TestPlan(CustomTestCase):
    def test_b_gets_each_prefix_with_two_suffixes_and_the_router_new_prefixes(self):
        p = plan(router_prefixes=2)
        for k in range(p.prefixes):
            live, after = p.live_prompt(k), p.after_prompt(k)
            self.assertEqual(live[: p.prefix_tokens], p.write_prompt(k))
            self.assertEqual(after[: p.prefix_tokens], p.write_prompt(k))
            self.assertNotEqual(live[p.prefix_tokens :], after[p.prefix_tokens :])
            self.assertEqual(len(after), p.prefix_tokens + p.suffix_tokens)
        for j in range(p.router_prefixes):
            self.assertEqual(p.router_read_prompt(j)[: p.prefix_tokens], p.router_write_prompt(j))
            self.assertNotIn(p.router_write_prompt(j), [p.write_prompt(k) for k in range(p.prefixes)])
        rids = [f(k) for k in range(p.prefixes) for f in (p.write_rid, p.live_rid, p.after_rid)]
        rids += [f(j) for j in range(p.router_prefixes) for f in (p.router_write_rid, p.router_read_rid)]
        self.assertEqual(len(set(rids)), len(rids))
        self.assertEqual(shared_store.restored_pairs(p)[:2], [(p.write_rid(0), p.live_rid(0), p.prefix_tokens),
                                                              (p.write_rid(0), p.after_rid(0), p.prefix_tokens)])  # fmt: skip

    def test_bad_settings_are_refused_by_name(self):
        for kw, setting in (({"prefixes": 1}, "--prefixes"), ({"prefix_tokens": 100}, "--prefix-tokens"),
                            ({"router_prefixes": -1}, "--router-prefixes")):  # fmt: skip
            with self.subTest(setting=setting), self.assertRaisesRegex(ValueError, setting):
                plan(**kw)


class TestVerdict(CustomTestCase):
    def test_a_clean_run_passes(self):
        p = plan(router_prefixes=2)
        requests = clean_requests(p)
        self.assertEqual(shared_store.hit_failures(p, requests), [])
        self.assertEqual(shared_store.router_failures(p, requests), [])
        rates = shared_store.l3_hit_rate(p, requests)
        self.assertEqual((rates["with_a_up"]["rate"], rates["after_a_stopped"]["rate"]), (1.0, 1.0))

    def test_a_prefix_of_b_not_whole_from_l3_fails_in_either_round(self):
        """Also when B had it otherwise (cached_tokens full: device or host) or the response says nothing."""
        p = plan()
        for rid, when in ((p.live_rid(1), "with A up"), (p.after_rid(2), "after A stopped")):
            for storage in (0, None, p.prefix_tokens - PAGE):
                requests = clean_requests(p)
                find(requests, B, rid).storage_tokens = storage
                with self.subTest(rid=rid, storage=storage):
                    failures = shared_store.hit_failures(p, requests)
                    self.assertEqual(len(failures), 1, failures)
                    self.assertIn(f"b {rid} ({when}): {storage or 0} tokens served from L3", failures[0])

    def test_hits_where_none_can_be_and_missing_responses_fail(self):
        p = plan()
        requests = clean_requests(p)
        find(requests, A, p.write_rid(0)).storage_tokens = PAGE  # a fresh store
        find(requests, REFERENCE, p.after_rid(1)).cached_tokens = PAGE  # flushed, no storage
        requests = [r for r in requests if (r.server, r.rid) != (B, p.after_rid(2))]
        failures = shared_store.hit_failures(p, requests)
        self.assertEqual(len(failures), 3, failures)
        self.assertIn(f"b {p.after_rid(2)}: no response", failures)

    def test_router_reads_must_land_on_the_other_server_and_come_from_l3(self):
        p = plan(router_prefixes=2)
        for change, expected in (
            (lambda read: setattr(read, "server", A), "both requests went to a"),
            (lambda read: setattr(read, "storage_tokens", 0), "0 tokens from L3, expected the prefix a computed"),
            (lambda read: setattr(read, "server", "unknown"), "not both known"),
            (lambda read: setattr(read, "error", "HTTP 500"), "HTTP 500"),
        ):  # fmt: skip
            requests = clean_requests(p)
            change(next(r for r in requests if r.rid == p.router_read_rid(1)))
            with self.subTest(expected=expected):
                failures = shared_store.router_failures(p, requests)
                self.assertEqual(len(failures), 1, failures)
                self.assertIn(expected, failures[0])
        self.assertEqual(shared_store.router_failures(plan(), []), [])  # no router phase, nothing judged

    def test_the_server_of_a_routed_request_is_the_one_whose_counter_grew_by_its_prompt(self):
        self.assertEqual(shared_store.served_by(300, {A: 1000, B: 40}, {A: 1000, B: 340}), B)
        self.assertEqual(shared_store.served_by(300, {A: 1000, B: 40}, {A: 1008, B: 340}), B)  # a nudge on a
        self.assertIsNone(shared_store.served_by(300, {A: 0, B: 0}, {A: 300, B: 300}))
        self.assertIsNone(shared_store.served_by(300, {A: 0, B: 0}, {A: 0, B: 0}))

    def test_the_store_holds_every_object_in_the_holder_alone(self):
        keys = ["k0__k", "k0__indexer", "k1__k", "k1__indexer"]
        held = {key: [HOLDER] for key in keys}
        self.assertEqual(shared_store.store_failures("after a stopped", keys, held, HOLDER, [HOLDER]), [])
        cases = (
            ({**held, "k1__k": []}, [HOLDER], "1 of 4 objects missing (first k1__k)"),
            ({**held, "k0__indexer": ["127.0.0.1:17000"]}, [HOLDER, "127.0.0.1:17000"], "segments mounted besides"),
            ({**held, "k0__indexer": [HOLDER, "127.0.0.1:17000"]}, [HOLDER], "1 of 4 objects have a replica outside"),
        )  # fmt: skip
        for endpoints, segments, expected in cases:
            with self.subTest(expected=expected):
                failures = shared_store.store_failures("after a stopped", keys, endpoints, HOLDER, segments)
                self.assertTrue(any(expected in f for f in failures), failures)

    def test_object_keys_and_the_namespace_tag_as_the_servers_log_it(self):
        from sglang_cp_shared_kv.mem_cache.cp_hicache_storage_keys import page_hash_chain

        tokens = list(range(2 * PAGE + 5))  # two whole pages and a partial one
        keys = shared_store.page_object_keys("cpkv0123456789abcdef", tokens, PAGE)
        first, second = page_hash_chain(tokens, PAGE)
        self.assertEqual(keys, [f"cpkv0123456789abcdef_{first}__k", f"cpkv0123456789abcdef_{first}__indexer",
                                f"cpkv0123456789abcdef_{second}__k", f"cpkv0123456789abcdef_{second}__indexer"])  # fmt: skip
        line = ("[2026-12-04 10:00:00 TP1] CP HiCache L3 storage mooncake on cp rank 1 of 2 (writer): keys "
                "cpkv0123456789abcdef_<page hash> (model=/m kv=torch.bfloat16x1152B ...)")  # fmt: skip
        self.assertEqual(shared_store.namespace_tags(["noise", line]), ["cpkv0123456789abcdef"])

    def test_ttft_over_the_timed_prefixes_and_the_verdict_line(self):
        p = plan(prefixes=4)
        times = {A: 1.0, B: 20.0, REFERENCE: 80.0}
        requests = clean_requests(p, ttft=lambda s, rid: 9000.0 if rid.endswith("-0") else times[s])
        ttft = shared_store.ttft_comparison(p, requests)
        self.assertEqual((ttft["from_l3_a_stopped_ms"], ttft["recomputed_ms"], ttft["label"]), (20.0, 80.0, "one GPU, time-sliced"))
        decode = {"asked": "server-default", "served": {A: "per owner (fa3), graphs on", B: "per owner (fa3), graphs on"}}
        line = shared_store.verdict_line(2, 4, [], {"decode": decode, "ttft": ttft, "l3_hit_rate": shared_store.l3_hit_rate(p, requests)})
        self.assertTrue(line.startswith("PASSED l3_shared_store_a2_b4, decode per owner (fa3), graphs on (asked: "
                                        "server-default): B's prefixes from L3 1.0 with A up, 1.0 after A stopped"), line)  # fmt: skip
        line = shared_store.verdict_line(2, 4, ["b store-b-after-1 (after A stopped): 0 tokens"], {"decode": decode})
        self.assertTrue(line.startswith("FAILED l3_shared_store_a2_b4, decode per owner (fa3), graphs on (asked: "
                                        "server-default): 1 failures, first: b store-b-after-1"), line)  # fmt: skip


class TestRestoredRows(CustomTestCase):
    """A at CP 2 (page p on rank p % 2), B at CP 4 (page p on rank p % 4): B's rows of every prefix,
    in both rounds, against A's dumps."""

    def setUp(self):
        self.tmp = Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, self.tmp)
        self.plan = plan(prefixes=2)
        self.rng = np.random.default_rng(0)

    def dump(self, server, cp_size, rid, tokens, kv, index):
        positions = np.arange(len(tokens))
        for rank in range(cp_size):
            mine = positions[(positions // PAGE) % cp_size == rank]
            write_pool_dump(self.tmp / server, rid, rank, mine, np.array(tokens), kv[mine], index[mine])

    def run_check(self, corrupt=None):
        p = self.plan
        for k in range(p.prefixes):
            n = p.prefix_tokens + p.suffix_tokens
            kv = self.rng.integers(0, 256, (n, 2, 16), dtype=np.uint8)
            index = self.rng.integers(0, 256, (n, 2, 8), dtype=np.uint8)
            self.dump(A, 2, p.write_rid(k), p.write_prompt(k), kv, index)
            for rid, prompt in ((p.live_rid(k), p.live_prompt(k)), (p.after_rid(k), p.after_prompt(k))):
                restored = kv.copy()
                if corrupt == rid:
                    restored[PAGE + 1, 1, 3] ^= 1  # one byte of layer 1
                self.dump(B, 4, rid, prompt, restored, index)
        return kv_audit_compare.restored_row_check(self.tmp / A, self.tmp / B, shared_store.restored_pairs(p))

    def test_every_row_restored_in_both_rounds_is_checked(self):
        out = self.run_check()
        self.assertEqual(out["failures"], [])
        self.assertEqual((out["requests"], out["positions_checked"]), (4, 4 * self.plan.prefix_tokens))

    def test_one_differing_byte_after_a_stopped_fails(self):
        out = self.run_check(corrupt=self.plan.after_rid(1))
        self.assertEqual(out["positions_differing"], 1)
        self.assertIn(f"of {self.plan.after_rid(1)} differ from the rows {self.plan.write_rid(1)} stored", out["failures"][0])


class TestProcessesAndRunner(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        from sglang_cp_shared_kv_testing.repo_scripts import load_script

        cls.smoke = load_script(SCRIPT, "l3_shared_store_smoke")

    def dry_run_lines(self, *options):
        with tempfile.TemporaryDirectory() as tmp:
            out = io.StringIO()
            with redirect_stdout(out):
                rc = self.smoke.main(["--model-path", f"{tmp}/m", "--dry-run", "--out-dir", tmp, *options])
        self.assertEqual(rc, 0)
        return {line.split("]")[0][1:]: line for line in out.getvalue().splitlines() if line.startswith("[")}

    def test_the_dry_run_prints_the_store_three_servers_and_the_router(self):
        lines = self.dry_run_lines("--tp-b", "4", "--one-gpu", "--router")
        self.assertEqual(list(lines), ["master", "holder", A, REFERENCE, B, "router"])
        rpc = lines["master"].split("--rpc_port=")[1].split()[0]
        self.assertIn(f"--master_server_address=127.0.0.1:{rpc}", lines["holder"])
        self.assertIn("--global_segment_size=4294967296", lines["holder"])
        for name, tp in ((A, 2), (B, 4), (REFERENCE, 4)):
            with self.subTest(server=name):
                self.assertIn(f"--tp {tp} ", lines[name])
                self.assertIn("SGLANG_CP_SHARED_KV_SMOKE_ONE_GPU=1", lines[name])
        for name in (A, B):  # the same store, no segment of their own, page_first
            config = json.loads(lines[name].split("--hicache-storage-backend-extra-config ")[1].split("'")[1])
            self.assertEqual((config["master_server_address"], config["global_segment_size"]), (f"127.0.0.1:{rpc}", 0))
            self.assertIn("--hicache-mem-layout page_first --hicache-storage-backend mooncake", lines[name])
            self.assertIn("--enable-nsa-prefill-cp-shared-kv", lines[name])
        self.assertNotIn("--hicache-storage-backend", lines[REFERENCE])
        self.assertNotIn("--enable-nsa-prefill-cp-shared-kv", lines[REFERENCE])
        self.assertIn("SGLANG_CP_SHARED_KV_SMOKE_LIFT_TP_RULE=1", lines[REFERENCE])
        self.assertIn("--policy round_robin", lines["router"])
        self.assertNotIn("router", self.dry_run_lines())

    def test_a_and_b_serve_the_servers_own_decode_by_default(self):
        lines = self.dry_run_lines()
        for name in (A, B):
            self.assertNotIn("SGLANG_CP_SHARED_KV_DECODE", lines[name])
            self.assertNotIn("--disable-cuda-graph ", lines[name])
        lines = self.dry_run_lines("--decode", "gather")
        for name in (A, B):
            self.assertIn("SGLANG_CP_SHARED_KV_DECODE=gather", lines[name])
            self.assertIn("--disable-cuda-graph ", lines[name])

    def test_sglang_accepts_a_and_b_on_mooncake_in_one_gpu_mode(self):
        """(The reference is the serve smoke's stock server, lifted to CP 4 by the smoke plugin.)"""
        from sglang.srt.server_args import prepare_server_args

        from sglang_cp_shared_kv.server_args import register_server_args_hooks
        from sglang_cp_shared_kv_testing.e2e.tiny_glm5 import write_tiny_glm5_model
        from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks

        with tempfile.TemporaryDirectory() as tmp, mock.patch.dict(os.environ):
            model = str(write_tiny_glm5_model(Path(tmp) / "tiny"))
            args = self.smoke.parse_args(["--model-path", model, "--tp-b", "4", "--load-format", "dummy", "--one-gpu"])
            for name, cp in ((A, 2), (B, 4)):
                config = self.smoke.serve_config(args, name, 50051)
                os.environ.update(self.smoke.server_env(args, name, Path(tmp)))
                with self.subTest(server=name), applied_hooks(register_server_args_hooks), mock.patch(
                    "torch.cuda.get_device_capability", return_value=(9, 0)
                ):
                    server = prepare_server_args(config.command()[2:] + ["--port", "30000", "--device", "cuda"])
                    self.assertEqual(server.hicache_storage_backend, "mooncake")
                    self.assertEqual(server.hicache_mem_layout, "page_first")
                    self.assertEqual(server.attn_cp_size, cp)

    def test_b_that_does_not_start_fails_quoting_its_error(self):
        """B refused at startup (decode graphs off in its environment alone, as the real server refuses
        the default then) while A started and served: FAILED with B's error and nothing else."""
        from sglang_cp_shared_kv.settings import GRAPH_DECODE_ENV

        real_start = self.smoke.l3_servers.start

        def start(args, name, config, env, log_path):
            return real_start(args, name, config, {**env, GRAPH_DECODE_ENV: "0"} if name == B else env, log_path)

        with tempfile.TemporaryDirectory() as tmp, mock.patch.object(self.smoke.l3_servers, "start", start):
            out = io.StringIO()
            with redirect_stdout(out):
                rc = self.smoke.main(["--model-path", f"{tmp}/m", "--fake-server", "--out-dir", f"{tmp}/out",
                                      "--prefix-tokens", "128", "--storage-wait-s", "0", "--startup-timeout", "60"])  # fmt: skip
            report = json.loads(Path(tmp, "out", "report.json").read_text())
        self.assertEqual(rc, 1)
        self.assertEqual([r["rid"] for r in report["requests"]], [f"store-a-write-{k}" for k in range(3)])
        verdict = [line for line in out.getvalue().splitlines() if line.startswith(("PASSED", "FAILED"))]
        self.assertEqual(len(verdict), 1, out.getvalue()[-2000:])
        self.assertTrue(verdict[0].startswith("FAILED l3_shared_store_a2_b2"), verdict[0])
        self.assertIn("1 failures, first: b server did not start: ValueError: --disable-cuda-graph is required", verdict[0])
        self.assertEqual(len(report["failures"]), 1, report["failures"])

    def test_the_runner_dry_run_prints_both_cp_sizes_of_b_in_one_gpu_mode(self):
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "PYTHONPATH": str(REPO / "python"), "OUT": f"{tmp}/out", "STORE_RUNS_DIR": f"{tmp}/runs",
                   "SMOKE_MODEL_DIR": f"{tmp}/tiny", "STORE_DRY_RUN": "1", "SMOKE_ONE_GPU": "1", "STORE_TPS_B": "2 4"}  # fmt: skip
            proc = subprocess.run(["bash", "scripts/gpu/l3_shared_store_runs.sh"], cwd=REPO, env=env,
                                  capture_output=True, text=True, timeout=300)  # fmt: skip
            self.assertFalse(list(Path(tmp, "runs").glob("*/server_*.log")), "a dry run started a server")
        self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
        servers = [line for line in proc.stdout.splitlines() if line.startswith(("[b]", "[a]"))]
        self.assertEqual(sorted(s.split("--tp ")[1].split()[0] for s in servers), ["2", "2", "2", "4"])
        self.assertTrue(all("SGLANG_CP_SHARED_KV_SMOKE_ONE_GPU=1" in s and "--load-format dummy" in s for s in servers))
        self.assertEqual(sum(line.startswith("[router]") for line in proc.stdout.splitlines()), 2)
        self.assertEqual(sum(line.startswith("[holder]") for line in proc.stdout.splitlines()), 2)


if __name__ == "__main__":
    unittest.main()
