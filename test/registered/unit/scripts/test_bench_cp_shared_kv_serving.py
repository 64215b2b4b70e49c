"""benchmark/bench_cp_shared_kv_serving.py --dry-run, end to end against the fake sglang server.

The dry run starts the fake server (``sglang_cp_shared_kv_testing/e2e/fake_sglang_server.py``) with the exact command
lines the benchmark would give ``sglang serve``, runs every part (headline phases, single-request
costs, the PD pair) and writes results.json, the markdown page and the plot. The test replays the
headline workload through the fake's own cache model (``PrefixCacheModel``), sizing it from the
same flags, so it knows how many prompt tokens each server served from device and from host; the
table must report exactly those rates. Concurrency 1 keeps the request order, hence the cache's
decisions, deterministic.

Planted bugs this caught (each reverted): host hits read from ``cached_tokens_details["device"]``
(device and host rates swapped); the hit rate divided by prompt plus output tokens; the ``host``
TTFT rows not pushing the prefix off the device (their timed requests then hit device); runs of separate
parts merged server by server with dict.update (the second part replaced the first).
"""

import json
import tempfile
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv_testing.e2e.fake_sglang_server import PrefixCacheModel
from sglang_cp_shared_kv_testing.e2e.server_process import ServerError
from sglang_cp_shared_kv_testing.repo_scripts import load_script

register_cpu_ci(est_time=150, suite="stage-a-test-cpu")

PHYSICAL = 4096
TP = 2
RATIO = 2.0


class TestServingBenchmarkDryRun(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        root = Path(cls.tmp.name)
        (root / "model").mkdir()
        (root / "model" / "config.json").write_text(json.dumps({"max_position_embeddings": 202752}))
        cls.out = root / "out"
        cls.argv = [
            "--model-path", str(root / "model"), "--dry-run", "--out-dir", str(cls.out), "--tp", str(TP),
            "--physical-tokens-per-rank", str(PHYSICAL), "--hicache-ratio", str(RATIO),
            "--document-tokens", "512", "--turns", "2", "--turn-tokens", "64", "--rounds", "2",
            "--concurrency", "1", "--max-new-tokens", "4", "--chunk-tokens", "256",
            "--cached-prefixes", "0,1024,4096", "--tpot-contexts", "256,2048", "--tpot-batches", "1,2",
            "--tpot-new-tokens", "4", "--repeats", "2", "--parts", "headline,single,pd",
            "--pd-prompts", "2", "--pd-prompt-tokens", "256", "--startup-timeout", "60", "--request-timeout", "60",
        ]  # fmt: skip
        cls.bench = load_script("benchmark/bench_cp_shared_kv_serving.py")
        cls.rc = cls.bench.main(cls.argv)
        cls.results = json.loads((cls.out / "results.json").read_text())
        cls.page = (cls.out / "serving.md").read_text()

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def expected_rates(self, shared_kv: bool):
        """Per phase: (device rate, host rate) the fake server must have served, replayed here."""
        device = PHYSICAL * (TP if shared_kv else 1)
        out = {}
        for w in self.bench.workloads_of(self.bench.parse_args(self.argv)):
            cache = PrefixCacheModel(device, int(RATIO * device))  # the phase starts with a flush
            dev = host = prompt = 0
            for turns in w.conversations():
                for turn in turns:
                    d, h = cache.serve(turn.input_ids)
                    dev, host, prompt = dev + d, host + h, prompt + len(turn.input_ids)
            out[w.name] = (dev / prompt, host / prompt)
        return out

    def test_run_completes(self):
        self.assertEqual(self.rc, 0, self.page)
        self.assertIn("DRY RUN", self.page)

    def test_headline_hit_rates_are_what_the_server_served(self):
        for mode, shared_kv in (("off", False), ("on", True)):
            headline = self.results["servers"][mode]["headline"]
            for phase, (dev, host) in self.expected_rates(shared_kv).items():
                s = headline[phase]["summary"]
                self.assertEqual(s["errors"], 0)
                self.assertAlmostEqual(s["device_hit_rate"], dev, places=12, msg=(mode, phase))
                self.assertAlmostEqual(s["host_hit_rate"], host, places=12, msg=(mode, phase))
                self.assertAlmostEqual(s["metrics_hit_rate"], dev + host, places=12, msg=(mode, phase))
                self.assertIn(f"| {phase} | device hit rate |", self.page)
        off, on = self.expected_rates(False), self.expected_rates(True)
        # The workload's point: the re-read documents fit the shared-KV device pool only.
        self.assertGreater(on["device"][0], off["device"][0])
        self.assertGreater(on["host"][0] + on["host"][1], off["host"][0] + off["host"][1])
        line = next(l for l in self.page.splitlines() if l.startswith("| device | device hit rate |"))
        self.assertEqual(line.split("|")[3].strip(), f"{off['device'][0]:.3f}")
        self.assertEqual(line.split("|")[4].strip(), f"{on['device'][0]:.3f}")

    def test_working_sets_sit_between_the_reported_pools(self):
        stock = self.results["servers"]["off"]["max_total_num_tokens"]
        shared = self.results["servers"]["on"]["max_total_num_tokens"]
        self.assertEqual((stock, shared), (PHYSICAL, TP * PHYSICAL))
        device = self.results["servers"]["on"]["headline"]["device"]["summary"]["working_set_tokens"]
        host = self.results["servers"]["on"]["headline"]["host"]["summary"]["working_set_tokens"]
        self.assertTrue(stock < device <= shared, device)
        self.assertTrue(shared < host <= RATIO * shared, host)
        self.assertIn(f"> {stock} and <=", self.page)

    def test_single_request_rows_come_from_where_they_say(self):
        for mode in ("off", "on"):
            device = self.results["servers"][mode]["max_total_num_tokens"]
            for row in self.results["servers"][mode]["ttft"]:
                if row["cached_prefix"] + 256 + 64 > 0.9 * device:
                    self.assertIn("skipped", row)
                    continue
                self.assertIsNotNone(row["ttft_ms"])
                expect = {"none": (0, 0), "device": (row["cached_prefix"], 0), "host": (0, row["cached_prefix"])}
                self.assertEqual((row["cached_device_tokens"], row["cached_host_tokens"]), expect[row["source"]],
                                 (mode, row))  # fmt: skip
            # 4096 cached tokens fit the shared-KV pool only
            rows = {(r["cached_prefix"], r["source"]): r for r in self.results["servers"][mode]["ttft"]}
            self.assertEqual("skipped" in rows[(4096, "host")], mode == "off")
            tpot = {(r["context"], r["batch"]): r for r in self.results["servers"][mode]["tpot"]}
            self.assertIsNotNone(tpot[(256, 2)]["tpot_ms"])
            self.assertEqual("skipped" in tpot[(2048, 2)], mode == "off")
        self.assertIn("not run: needs", self.page)

    def test_pd_pairs_report_latency_and_transfer_from_every_rank(self):
        for mode in ("off", "on"):
            pd = self.results["pd"][mode]
            self.assertEqual(pd["errors"], [])
            self.assertEqual(pd["ttft_requests"], 2)
            self.assertIsNotNone(pd["tpot_median_ms"])
            self.assertIn("--disaggregation-mode", pd["prefill_command"])
            self.assertEqual("--enable-nsa-prefill-cp-shared-kv" in pd["prefill_command"], mode == "on")
        self.assertIn("TTFT on / off", self.page)

    def test_plot_has_both_modes(self):
        plot = next(self.out.glob("serving-plot.*"))
        self.assertIn(plot.name, self.page)
        if plot.suffix == ".svg":
            self.assertEqual(plot.read_text().count("<polyline"), 4)  # 2 panels x (off, on)

    def test_report_from_merges_separate_runs(self):
        doc = self.out / "merged.md"
        self.assertEqual(self.bench.main(["--report-from", str(self.out / "results.json"), "--doc-out", str(doc)]), 0)
        self.assertEqual(doc.read_text(), self.page.replace("serving-plot", "merged-plot"))


class TestServingBenchmarkRunner(CustomTestCase):
    def test_gpu_runner_dry_run_with_the_stock_cuda_graph_baseline(self):
        """scripts/gpu/bench_serving_runs.sh, as a machine would run one part of one mode."""
        import os
        import subprocess

        from sglang_cp_shared_kv_testing.repo_scripts import REPO_ROOT

        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "python"), "BENCH_DRY_RUN": "1", "OUT": str(tmp / "out"),
                   "BENCH_RUNS_DIR": str(tmp / "runs"), "BENCH_MODEL_DIR": str(tmp / "model")}  # fmt: skip
            args = ["off", "tpot", "--stock-cuda-graphs", "--physical-tokens-per-rank", "4096",
                    "--tpot-contexts", "256", "--tpot-batches", "1", "--tpot-new-tokens", "4"]  # fmt: skip
            proc = subprocess.run(["bash", "scripts/gpu/bench_serving_runs.sh", *args], cwd=REPO_ROOT, env=env,
                                  capture_output=True, text=True, timeout=300)  # fmt: skip
            self.assertEqual(proc.returncode, 0, proc.stdout[-2000:] + proc.stderr[-2000:])
            results = json.loads((tmp / "out" / "off_tpot.json").read_text())
            config = json.loads((tmp / "model" / "config.json").read_text())
        self.assertEqual(config["hidden_size"], 6144)
        eager, graphs = results["servers"]["off"], results["servers"]["off-graphs"]
        self.assertIn("--disable-cuda-graph", eager["command"])
        self.assertNotIn("--disable-cuda-graph", graphs["command"])
        self.assertNotIn("--enable-nsa-prefill-cp-shared-kv", graphs["command"])
        for server in (eager, graphs):
            self.assertIsNotNone(server["tpot"][0]["tpot_ms"])
            self.assertNotIn("ttft", server)


def run_tpot_dry_run(*extra):
    """One short TPOT row per server against the stand-in servers: (rc, servers, page)."""
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"max_position_embeddings": 202752}))
        bench = load_script("benchmark/bench_cp_shared_kv_serving.py")
        rc = bench.main([
            "--model-path", str(model), "--dry-run", "--out-dir", str(Path(tmp) / "out"), "--tp", "2",
            "--physical-tokens-per-rank", "4096", "--parts", "tpot", "--tpot-contexts", "256",
            "--tpot-batches", "1", "--tpot-new-tokens", "4", "--repeats", "1", "--startup-timeout", "30",
            "--request-timeout", "30", *extra,
        ])  # fmt: skip
        results = json.loads((Path(tmp) / "out" / "results.json").read_text())
        page = (Path(tmp) / "out" / "serving.md").read_text()
    return rc, results["servers"], page


class TestServingBenchmarkPerOwnerDecode(CustomTestCase):
    """``--per-owner-decode``: two more shared-KV servers, decode per owner eagerly and under CUDA
    graphs, each launched with its decode path named (none relies on the server's default, auto);
    the fake server refuses a shared-KV server with CUDA graphs where they are off, as the real
    startup validation does. Planted: graphs turned off in every launch environment -> the graph
    server fails to start and the run fails."""

    def run_bench(self):
        return run_tpot_dry_run("--stock-cuda-graphs", "--per-owner-decode")

    def test_per_owner_servers_run_with_their_opt_ins(self):
        rc, servers, page = self.run_bench()
        self.assertEqual(rc, 0, page)
        eager, graphs = servers["on-per-owner"], servers["on-per-owner-graphs"]
        self.assertIn("--disable-cuda-graph", eager["command"])
        self.assertNotIn("--disable-cuda-graph", graphs["command"])
        self.assertEqual(eager["env"], {"SGLANG_CP_SHARED_KV_DECODE": "per_owner",
                                        "SGLANG_CP_SHARED_KV_DECODE_CUDA_GRAPH": "0"})
        self.assertEqual(graphs["env"], {"SGLANG_CP_SHARED_KV_DECODE": "per_owner",
                                         "SGLANG_CP_SHARED_KV_DECODE_CUDA_GRAPH": "1"})
        self.assertEqual(servers["on"]["env"], {"SGLANG_CP_SHARED_KV_DECODE": "gather"})
        for server in (eager, graphs, servers["on"]):
            self.assertIn("--enable-nsa-prefill-cp-shared-kv", server["command"])
        for server in (eager, graphs, servers["on"], servers["off-graphs"]):
            self.assertIsNotNone(server["tpot"][0]["tpot_ms"], server)
        self.assertIn("on-per-owner-graphs / off-graphs", page)

    def test_a_graph_server_with_graphs_off_fails(self):
        from unittest import mock

        from sglang_cp_shared_kv_testing.e2e.server_process import ServeConfig

        graphs_off = {"SGLANG_CP_SHARED_KV_DECODE": "per_owner", "SGLANG_CP_SHARED_KV_DECODE_CUDA_GRAPH": "0"}
        with mock.patch.object(ServeConfig, "env", lambda self: dict(graphs_off) if self.shared_kv else {}):
            rc, servers, _ = self.run_bench()
        self.assertEqual(rc, 1)
        self.assertTrue(servers["on-per-owner-graphs"]["failures"], servers["on-per-owner-graphs"])
        self.assertFalse(servers["on-per-owner"]["failures"])  # eager (--disable-cuda-graph) starts


class TestServingBenchmarkAsLaunched(CustomTestCase):
    """``--servers as-launched``: the off and on servers as users launch them, so the ratios are
    against stock with CUDA graphs. Seen failing with the on server given graphs whatever its KV
    dtype (the fake, like the real startup check, then refuses the fp8 server: rc 1)."""

    def run_bench(self, *extra):
        return run_tpot_dry_run("--servers", "as-launched", *extra)

    def test_stock_with_graphs_against_the_shared_kv_default(self):
        rc, servers, page = self.run_bench()
        self.assertEqual(rc, 0, page)
        off, on = servers["off"], servers["on"]
        self.assertNotIn("--disable-cuda-graph", off["command"])
        self.assertNotIn("--disable-cuda-graph", on["command"])  # bf16 KV: per owner under graphs
        self.assertIn("--enable-nsa-prefill-cp-shared-kv", on["command"])
        self.assertEqual(on["env"], {})  # no decode setting: the server's default decides
        self.assertEqual((off["mode"], on["mode"]), ("off-graphs", "on-default-graphs"))
        self.assertIn("Servers: off: stock, CUDA graphs; on: shared KV, decode as the server defaults, CUDA graphs.",
                      page)  # fmt: skip

    def test_where_the_default_gathers_the_shared_kv_server_runs_eager(self):
        rc, servers, page = self.run_bench("--extra-server-args", "--kv-cache-dtype fp8_e4m3")
        self.assertEqual(rc, 0, page)
        self.assertIn("--disable-cuda-graph", servers["on"]["command"])  # flashmla_kv: the default gathers
        self.assertNotIn("--disable-cuda-graph", servers["off"]["command"])

    def test_the_eager_setups_extra_servers_are_refused(self):
        bench = load_script("benchmark/bench_cp_shared_kv_serving.py")
        for flag in ("--stock-cuda-graphs", "--per-owner-decode"):
            with self.subTest(flag=flag), self.assertRaises(SystemExit):
                bench.parse_args(["--model-path", "m", "--servers", "as-launched", flag])


class TestServeConfigDecodePath(CustomTestCase):
    """The launch line and environment of each decode path; combinations the startup rules refuse
    are refused here before anything starts."""

    def config(self, **kwargs):
        from sglang_cp_shared_kv_testing.e2e.server_process import ServeConfig

        base = dict(model_path="/m", tp_size=2, shared_kv=True, port=30000, physical_tokens_per_rank=4096,
                    hicache_ratio=None)  # fmt: skip
        return ServeConfig(**{**base, **kwargs})

    def test_gather_decode_needs_eager_decode(self):
        self.assertIn("--disable-cuda-graph", self.config().command())
        self.assertEqual(self.config().env(), {"SGLANG_CP_SHARED_KV_DECODE": "gather"})  # named, not the default
        self.assertEqual(self.config(shared_kv=False).env(), {})
        with self.assertRaises(ValueError):
            self.config(cuda_graphs=True).command()

    def test_per_owner_decode_eager_and_under_graphs(self):
        eager = self.config(decode_path="per_owner")
        self.assertIn("--disable-cuda-graph", eager.command())
        self.assertEqual(eager.env(), {"SGLANG_CP_SHARED_KV_DECODE": "per_owner",
                                       "SGLANG_CP_SHARED_KV_DECODE_CUDA_GRAPH": "0"})
        graphs = self.config(decode_path="per_owner", cuda_graphs=True)
        self.assertNotIn("--disable-cuda-graph", graphs.command())
        self.assertEqual(graphs.env()["SGLANG_CP_SHARED_KV_DECODE_CUDA_GRAPH"], "1")

    def test_per_owner_needs_shared_kv_and_a_known_path(self):
        with self.assertRaises(ValueError):
            self.config(shared_kv=False, decode_path="per_owner").command()
        with self.assertRaises(ValueError):
            self.config(decode_path="per-owner").command()


class TestServingBenchmarkCapacity(CustomTestCase):
    """Part ``capacity`` against the fake server, which sizes pools from a fixed KV budget less the
    scratch reservation the runtime makes; ``FAKE_SGLANG_NO_SCRATCH=1`` is a planted capacity bug
    (a shared-KV pool as large as stock's, no room for the scratch) the verdict must catch."""

    def run_capacity(self, no_scratch: bool):
        import os
        from unittest import mock

        from sglang_cp_shared_kv_testing.e2e.fake_sglang_server import NO_SCRATCH_ENV

        bench = load_script("benchmark/bench_cp_shared_kv_serving.py")
        with tempfile.TemporaryDirectory() as tmp:
            model = Path(tmp) / "model"
            model.mkdir()
            (model / "config.json").write_text(json.dumps({"num_hidden_layers": 78}))
            env = {NO_SCRATCH_ENV: "1"} if no_scratch else {}
            with mock.patch.dict(os.environ, env):
                rc = bench.main(["--model-path", str(model), "--tp", "8", "--dry-run", "--parts", "capacity",
                                 "--out-dir", str(Path(tmp) / "out"), "--startup-timeout", "60"])  # fmt: skip
            results = json.loads((Path(tmp) / "out" / "results.json").read_text())
            page = (Path(tmp) / "out" / "serving.md").read_text()
        return rc, results["capacity"], page

    def test_capacity_is_cp_times_physical_less_the_scratch_share(self):
        rc, capacity, page = self.run_capacity(no_scratch=False)
        self.assertEqual(rc, 0, capacity["failures"])
        off, on = capacity["off"], capacity["on"]
        self.assertEqual(on["logical_device_tokens_per_cp_group"], 8 * on["physical_device_tokens_per_rank"][0])
        self.assertEqual(off["logical_device_tokens_per_cp_group"], off["physical_device_tokens_per_rank"][0])
        ratio = on["logical_device_tokens_per_cp_group"] / off["logical_device_tokens_per_cp_group"]
        self.assertAlmostEqual(ratio, 8 * 78 / (78 + 8), delta=0.15)  # about cp * L / (L + cp)
        self.assertIn("both hold", page)

    def test_a_pool_without_room_for_the_scratch_fails(self):
        rc, capacity, page = self.run_capacity(no_scratch=True)
        self.assertEqual(rc, 1)
        self.assertTrue(any("less the scratch's share" in f for f in capacity["failures"]), capacity)
        self.assertIn("## Failures", page)


class TestServingBenchmarkMerge(CustomTestCase):
    def test_parts_of_one_server_from_separate_runs_meet(self):
        """One call per part and mode (what fits a call) must still give one table per server."""
        bench = load_script("benchmark/bench_cp_shared_kv_serving.py")
        run = lambda servers, pd=None: {"commit": "c", "command": "x", "dry_run": False,  # noqa: E731
                                        "servers": servers, "pd": pd or {}}  # fmt: skip
        merged = bench.merge_results([
            run({"off": {"mode": "off", "headline": {"device": 1}, "failures": ["a"]}}),
            run({"off": {"mode": "off", "ttft": [], "tpot": [], "failures": ["b"]},
                 "on": {"mode": "on", "ttft": [], "failures": []}}),
            run({}, {"on": {"ttft_median_ms": 1.0}}),
        ])  # fmt: skip
        self.assertEqual(set(merged["servers"]["off"]), {"mode", "headline", "ttft", "tpot", "failures"})
        self.assertEqual(merged["servers"]["off"]["failures"], ["a", "b"])
        self.assertEqual(merged["pd"], {"on": {"ttft_median_ms": 1.0}})
        self.assertEqual(len(merged["runs"]), 3)


class TestServingBenchmarkRefusals(CustomTestCase):
    def test_pools_that_cannot_separate_a_working_set_are_refused(self):
        bench = load_script("benchmark/bench_cp_shared_kv_serving.py")
        with tempfile.TemporaryDirectory() as tmp:
            rc = bench.main(["--model-path", tmp, "--dry-run", "--tp", "1", "--out-dir", tmp])
        self.assertEqual(rc, 2)

    def test_a_pool_other_than_planned_stops_the_run(self):
        bench = load_script("benchmark/bench_cp_shared_kv_serving.py")
        with self.assertRaisesRegex(ServerError, "expected 8192"):
            bench.check_reported_pool({"max_total_num_tokens": 8128}, 8192, "on")


if __name__ == "__main__":
    unittest.main()
