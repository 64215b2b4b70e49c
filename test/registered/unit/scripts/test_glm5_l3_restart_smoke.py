"""The served L3 restart smoke on CPU: its plan, its verdict and its audit of restored rows, the
servers it would launch, and the GPU runner's dry run.

What a user depends on: a served restart is PASSED only if every restart prompt's whole prefix came
from L3, nothing came from L3 where nothing can be (a fresh directory, a server without storage),
every page's two objects were stored, and the restored rows are the stored rows byte for byte. The
servers serve the server's default decode unless told otherwise, the verdict names the decode they
logged, and a server that does not start is a FAILED quoting its error.

Planted and caught (each reverted): the hit check reading ``cached_tokens`` instead of the storage
figure (a prefix recomputed, or loaded from host, then passed); ``storage_tokens`` returning the
details' ``host`` count (0 L3 tokens read as a hit); ``restored_row_check`` comparing layer 0 only
(a restored page wrong in layer 1 passed); the timed TTFT including the warm-up prefix.
"""

import io
import json
import os
import shutil
import sys
import tempfile
import unittest
from contextlib import redirect_stdout
from pathlib import Path
from unittest import mock

import numpy as np

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO / "scripts" / "smoke_plugin"))
from cp_shared_kv_smoke_hooks import kv_audit_compare  # noqa: E402
from cp_shared_kv_smoke_hooks.kv_audit import write_pool_dump  # noqa: E402

from sglang_cp_shared_kv_testing.e2e import l3_restart  # noqa: E402
from sglang_cp_shared_kv_testing.e2e.l3_restart import RECOMPUTE, RESTART, WRITE, L3RestartPlan, ServedRequest  # noqa: E402

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")

PAGE = 64


def plan(**kw):
    return L3RestartPlan(**{"prefixes": 3, "prefix_tokens": 4 * PAGE, "suffix_tokens": 10, "page_size": PAGE, **kw})


def clean_requests(p, ttft=lambda server, k: 100.0 + k):
    out = []
    for k in range(p.prefixes):
        out.append(ServedRequest(WRITE, p.write_rid(k), p.prefix_tokens, 0, 0, ttft(WRITE, k)))
        out.append(ServedRequest(RESTART, p.read_rid(k), p.prefix_tokens + p.suffix_tokens, p.prefix_tokens,
                                 p.prefix_tokens, ttft(RESTART, k)))  # fmt: skip
        out.append(ServedRequest(RECOMPUTE, p.read_rid(k), p.prefix_tokens + p.suffix_tokens, 0, None, ttft(RECOMPUTE, k)))
    return out


class TestPlanAndVerdict(CustomTestCase):
    def test_prompts_share_the_prefix_and_differ_after_it(self):
        p = plan()
        for k in range(p.prefixes):
            read, write = p.read_prompt(k), p.write_prompt(k)
            self.assertEqual(read[: p.prefix_tokens], write)
            self.assertEqual(len(read), p.prefix_tokens + p.suffix_tokens)
        self.assertNotEqual(p.write_prompt(0), p.write_prompt(1))
        self.assertEqual(p.stored_pages(), 12)

    def test_bad_settings_are_refused_by_name(self):
        for kw, setting in (({"prefixes": 1}, "--prefixes"), ({"prefix_tokens": 100}, "--prefix-tokens"),
                            ({"suffix_tokens": 0}, "--suffix-tokens")):  # fmt: skip
            with self.subTest(setting=setting), self.assertRaisesRegex(ValueError, setting):
                plan(**kw)

    def test_storage_tokens_read_from_the_response(self):
        meta = {"cached_tokens": 300, "cached_tokens_details": {"device": 0, "host": 44, "storage": 256}}
        self.assertEqual(l3_restart.storage_tokens(meta), 256)
        self.assertIsNone(l3_restart.storage_tokens({"cached_tokens": 300}))
        self.assertIsNone(l3_restart.storage_tokens({"cached_tokens_details": None}))
        samples = [({"cache_source": "storage_HiCacheFile"}, 512.0), ({"cache_source": "host"}, 64.0)]
        self.assertEqual(l3_restart.storage_counter_total(samples), 512.0)

    def test_a_clean_restart_passes(self):
        p = plan()
        self.assertEqual(l3_restart.hit_failures(p, clean_requests(p)), [])
        self.assertEqual(l3_restart.stored_object_failures(p, 2 * p.stored_pages()), [])

    def test_a_prefix_not_from_l3_fails(self):
        """The plant of the brief: a verdict with 0 L3 hit tokens must FAIL, also when the prefix
        came from the cache some other way (cached_tokens full) or the response has no figure."""
        p = plan()
        for storage in (0, None, p.prefix_tokens - PAGE):
            requests = clean_requests(p)
            requests[1].storage_tokens = storage  # restart, prefix 0
            with self.subTest(storage=storage):
                failures = l3_restart.hit_failures(p, requests)
                self.assertEqual(len(failures), 1, failures)
                self.assertIn("served from L3", failures[0])
                line = l3_restart.verdict_line(2, failures, {})
                self.assertTrue(line.startswith("FAILED l3_restart_cp2"), line)

    def test_hits_where_none_can_be_fail(self):
        p = plan()
        requests = clean_requests(p)
        requests[0].storage_tokens = PAGE  # the write server on a fresh directory
        requests[2].cached_tokens = PAGE  # the recompute server is fresh and has no storage
        failures = l3_restart.hit_failures(p, requests)
        self.assertEqual(len(failures), 2, failures)

    def test_missing_responses_and_errors_fail(self):
        p = plan()
        requests = [r for r in clean_requests(p) if r.server != RECOMPUTE]
        requests[0].error = "HTTP 500"
        failures = l3_restart.hit_failures(p, requests)
        self.assertTrue(any("HTTP 500" in f for f in failures))
        self.assertEqual(sum("no response" in f for f in failures), p.prefixes)

    def test_too_few_stored_objects_fail(self):
        p = plan()
        self.assertEqual(len(l3_restart.stored_object_failures(p, p.stored_pages())), 1)  # KV without indexer

    def test_the_verdict_names_the_decode_the_servers_logged(self):
        """Seen failing before the verdict named the decode path."""
        decode = {"asked": "server-default", "served": {WRITE: "per owner (fa3), graphs on",
                                                        RECOMPUTE: "per owner (fa3), graphs on",
                                                        RESTART: "per owner (fa3), graphs on"}}  # fmt: skip
        line = l3_restart.verdict_line(4, [], {"decode": decode})
        self.assertTrue(line.startswith("PASSED l3_restart_cp4, decode per owner (fa3), graphs on (asked: "
                                        "server-default): L3 tokens"), line)  # fmt: skip
        decode["served"][RESTART] = "gather, graphs off"
        line = l3_restart.verdict_line(4, ["restart: decode: asked per_owner ..."], {"decode": decode})
        self.assertIn("FAILED l3_restart_cp4, decode write: per owner (fa3), graphs on, recompute: per owner "
                      "(fa3), graphs on, restart: gather, graphs off (asked: server-default): 1 failures", line)  # fmt: skip
        self.assertIn("decode not logged (asked: gather)", l3_restart.verdict_line(2, ["x"], {"decode": {"asked": "gather"}}))

    def test_ttft_median_over_the_timed_prefixes_only(self):
        p = plan(prefixes=4)
        warm = {RESTART: 5000.0, RECOMPUTE: 9000.0}
        requests = clean_requests(p, ttft=lambda s, k: warm.get(s, 1) if k == 0 else {RESTART: 10.0 * k, RECOMPUTE: 40.0}.get(s, 1))
        row = l3_restart.ttft_comparison(p, requests)
        self.assertEqual((row["from_l3_ttft_ms"], row["recomputed_ttft_ms"]), (20.0, 40.0))
        self.assertEqual(row["from_l3_over_recomputed"], 0.5)
        self.assertEqual(row["label"], "one GPU, time-sliced")
        self.assertEqual(row["timed_prefixes"], 3)


def write_dump(run_dir, rid, rank, positions, token_ids, kv, index):
    write_pool_dump(run_dir, rid, rank, positions, token_ids, kv[positions], index[positions])


class TestRestoredRows(CustomTestCase):
    """Two ranks, page p on rank p % 2 (write) and on rank (p + 1) % 2 after the restart."""

    def setUp(self):
        self.tmp = Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, self.tmp)
        rng = np.random.default_rng(0)
        self.prefix = rng.integers(0, 256, 4 * PAGE)
        self.read_tokens = np.concatenate([self.prefix, rng.integers(0, 256, 10)])
        n = len(self.read_tokens)
        self.kv = rng.integers(0, 256, (n, 2, 16), dtype=np.uint8)
        self.index = rng.integers(0, 256, (n, 2, 8), dtype=np.uint8)

    def dumps(self, name, rid, tokens, kv, owner_shift):
        run = self.tmp / name
        positions = np.arange(len(tokens))
        for rank in (0, 1):
            mine = positions[((positions // PAGE) + owner_shift) % 2 == rank]
            write_dump(run, rid, rank, mine, tokens, kv, self.index)
        return run

    def check(self, restored_kv):
        written = self.dumps("write", "l3-write-0", self.prefix, self.kv, 0)
        restored = self.dumps("restart", "l3-read-0", self.read_tokens, restored_kv, 1)
        return kv_audit_compare.restored_row_check(written, restored, [("l3-write-0", "l3-read-0", len(self.prefix))])

    def test_a_byte_exact_restore_passes_at_other_owners(self):
        out = self.check(self.kv)
        self.assertEqual(out["failures"], [])
        self.assertEqual((out["positions_checked"], out["positions_differing"]), (4 * PAGE, 0))

    def test_one_byte_of_a_deep_layer_fails(self):
        kv = self.kv.copy()
        kv[PAGE + 3, 1, 5] ^= 1  # layer 1: a forward comparison would call this rounding
        out = self.check(kv)
        self.assertEqual(out["positions_differing"], 1)
        self.assertIn("first at position 67", out["failures"][0])

    def test_rows_after_the_prefix_are_not_judged_and_a_missing_dump_fails(self):
        kv = self.kv.copy()
        kv[len(self.prefix) + 2] ^= 0xFF  # the suffix: computed by the restart server itself
        self.assertEqual(self.check(kv)["failures"], [])
        out = kv_audit_compare.restored_row_check(self.tmp / "write", self.tmp / "restart", [("l3-write-9", "l3-read-0", 8)])
        self.assertIn("no pool dump of l3-write-9", out["failures"][0])


class TestServersAndRunner(CustomTestCase):
    def test_sglang_accepts_the_storage_servers_in_one_gpu_mode(self):
        from sglang.srt.server_args import prepare_server_args

        from sglang_cp_shared_kv.server_args import register_server_args_hooks
        from sglang_cp_shared_kv_testing.e2e.tiny_glm5 import write_tiny_glm5_model
        from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks
        from sglang_cp_shared_kv_testing.repo_scripts import load_script

        smoke = load_script("scripts/glm5_cp_l3_restart_smoke.py", "l3_smoke")
        with tempfile.TemporaryDirectory() as tmp, mock.patch.dict(os.environ):
            model = str(write_tiny_glm5_model(Path(tmp) / "tiny"))
            args = smoke.parse_args(["--model-path", model, "--tp", "4", "--load-format", "dummy", "--one-gpu"])
            for name, storage in ((WRITE, "file"), (RESTART, "file"), (RECOMPUTE, None)):
                config = smoke.serve_config(args, name, 30000, Path(tmp))
                os.environ.update(smoke.server_env(args, name, Path(tmp)))
                with self.subTest(server=name), applied_hooks(register_server_args_hooks), mock.patch(
                    "torch.cuda.get_device_capability", return_value=(9, 0)
                ):
                    server = prepare_server_args(config.command()[2:] + ["--device", "cuda"])
                    self.assertEqual(server.hicache_storage_backend, storage)
                    self.assertTrue(server.enable_hierarchical_cache and server.disable_custom_all_reduce)
                    self.assertEqual(server.attn_cp_size, 4)

    def test_the_dry_run_prints_three_servers_on_one_directory(self):
        from sglang_cp_shared_kv_testing.repo_scripts import load_script

        smoke = load_script("scripts/glm5_cp_l3_restart_smoke.py", "l3_smoke")
        with tempfile.TemporaryDirectory() as tmp:
            out = io.StringIO()
            with redirect_stdout(out):
                rc = smoke.main(["--model-path", f"{tmp}/m", "--tp", "4", "--one-gpu", "--dry-run", "--out-dir", tmp])
        self.assertEqual(rc, 0)
        servers = [line for line in out.getvalue().splitlines() if line.startswith("[")]
        self.assertEqual([s.split("]")[0][1:] for s in servers], [WRITE, RECOMPUTE, RESTART])
        self.assertTrue(all("SGLANG_CP_SHARED_KV_SMOKE_ONE_GPU=1" in s and "--tp 4 " in s for s in servers))
        self.assertEqual(sum("--hicache-storage-backend file" in s for s in servers), 2)
        self.assertEqual(len({s.split("file_path")[1] for s in servers if "file_path" in s}), 1)  # one directory

    def dry_run_servers(self, *options):
        from sglang_cp_shared_kv_testing.repo_scripts import load_script

        smoke = load_script("scripts/glm5_cp_l3_restart_smoke.py", "l3_smoke")
        with tempfile.TemporaryDirectory() as tmp:
            out = io.StringIO()
            with redirect_stdout(out):
                rc = smoke.main(["--model-path", f"{tmp}/m", "--tp", "2", "--dry-run", "--out-dir", tmp, *options])
        self.assertEqual(rc, 0)
        servers = [line for line in out.getvalue().splitlines() if line.startswith("[")]
        self.assertEqual(len(servers), 3)
        return servers

    def test_every_server_serves_the_servers_own_decode_by_default(self):
        """No decode setting, no ``--disable-cuda-graph``: what a user launches. Seen failing while the
        smoke served the gather (named, eager)."""
        for server in self.dry_run_servers():
            self.assertNotIn("SGLANG_CP_SHARED_KV_DECODE", server)
            self.assertNotIn("--disable-cuda-graph ", server)

    def test_decode_gather_is_named_and_eager_and_never_under_graphs(self):
        """Seen failing before ``--decode`` existed (argparse refused it)."""
        for server in self.dry_run_servers("--decode", "gather"):
            self.assertIn("SGLANG_CP_SHARED_KV_DECODE=gather", server)
            self.assertIn("--disable-cuda-graph ", server)
        for server in self.dry_run_servers("--decode", "per_owner", "--cuda-graphs", "off"):
            self.assertIn("SGLANG_CP_SHARED_KV_DECODE_CUDA_GRAPH=0", server)
            self.assertIn("--disable-cuda-graph ", server)
        from contextlib import redirect_stderr

        with redirect_stderr(io.StringIO()) as err, self.assertRaises(SystemExit):
            self.dry_run_servers("--decode", "gather", "--cuda-graphs", "on")
        self.assertIn("requires --disable-cuda-graph", err.getvalue())

    def test_a_server_that_does_not_start_fails_quoting_its_error(self):
        """With decode CUDA graphs turned off in the inherited environment, the server's default (per
        owner, graphs kept) is refused at startup, as the real server refuses it: the verdict is FAILED
        with that error and nothing else. Seen failing before: the failure said only "server exited
        with code 1; see <log>", first of 21 failures (requests never sent, audits never run)."""
        from sglang_cp_shared_kv.settings import GRAPH_DECODE_ENV
        from sglang_cp_shared_kv_testing.repo_scripts import load_script

        smoke = load_script("scripts/glm5_cp_l3_restart_smoke.py", "l3_smoke")
        with tempfile.TemporaryDirectory() as tmp, mock.patch.dict(os.environ, {GRAPH_DECODE_ENV: "0"}):
            out = io.StringIO()
            with redirect_stdout(out):
                rc = smoke.main(["--model-path", f"{tmp}/m", "--tp", "2", "--fake-server", "--out-dir", f"{tmp}/out",
                                 "--startup-timeout", "60"])  # fmt: skip
            report = json.loads(Path(tmp, "out", "report.json").read_text())
        self.assertEqual(rc, 1)
        verdict = [line for line in out.getvalue().splitlines() if line.startswith(("PASSED", "FAILED"))]
        self.assertEqual(len(verdict), 1, out.getvalue()[-2000:])
        self.assertTrue(verdict[0].startswith("FAILED l3_restart_cp2, decode not logged (asked: server-default): "
                                              "1 failures, first: write server did not start: ValueError: "
                                              "--disable-cuda-graph is required"), verdict[0])  # fmt: skip
        self.assertEqual(len(report["failures"]), 1, report["failures"])

    def runner_dry_run(self, **settings):
        """The server lines of ``scripts/gpu/l3_restart_runs.sh`` with ``L3_DRY_RUN=1`` at CP 2."""
        import subprocess

        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "PYTHONPATH": str(REPO / "python"), "OUT": f"{tmp}/out", "L3_RUNS_DIR": f"{tmp}/runs",
                   "SMOKE_MODEL_DIR": f"{tmp}/tiny", "L3_DRY_RUN": "1", "L3_TPS": "2", **settings}  # fmt: skip
            proc = subprocess.run(["bash", "scripts/gpu/l3_restart_runs.sh"], cwd=REPO, env=env, capture_output=True,
                                  text=True, timeout=300)  # fmt: skip
            self.assertFalse(list(Path(tmp, "runs").glob("*/server_*.log")), "a dry run started a server")
        self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
        servers = [line for line in proc.stdout.splitlines() if line.startswith("[")]
        self.assertEqual(len(servers), 3, proc.stdout[-2000:])
        return servers

    def test_the_runner_serves_the_default_unless_l3_decode_says_otherwise(self):
        """Seen failing (``L3_DECODE=gather`` served the default) before the runner passed it on."""
        for server in self.runner_dry_run():
            self.assertNotIn("SGLANG_CP_SHARED_KV_DECODE", server)
            self.assertNotIn("--disable-cuda-graph ", server)
            self.assertIn("--load-format dummy", server)
        for server in self.runner_dry_run(L3_DECODE="gather"):
            self.assertIn("SGLANG_CP_SHARED_KV_DECODE=gather", server)
            self.assertIn("--disable-cuda-graph ", server)

if __name__ == "__main__":
    unittest.main()
