"""scripts/gpu/serve_smoke_runs.sh and pd_smoke_runs.sh at --tp 4 and 8, as dry runs on a CPU.

With ``SMOKE_DRY_RUN=1`` / mode ``dry-run`` the runners do everything but launch: they build the
model directory (tiny or GLM-5-width) and call each smoke with ``--dry-run``, which prints every
server's environment and command line and the request plan. The test reads those lines back and
checks what a four- or eight-GPU run depends on: every server at the requested ``--tp``, the
shared-KV flag on exactly the ``on_*`` runs, sglang's tp rule lifted for the stock reference, the
plan sized for ``cp x`` the per-rank pool, and in the PD pair the GPUs and memory fractions of the
prefill and the decode server.

With ``SMOKE_ONE_GPU=1`` (every rank on device 0) every server must carry the one-GPU settings: the
smoke plugin's switch and sglang's TP memory-imbalance check off in its environment, no custom
all-reduce and no flashinfer all-reduce fusion on its command line, pools capped; the decode modes
set per-owner decode (eager or under CUDA graphs, then without --disable-cuda-graph) and the
prefetch on the shared-KV servers only; the PD pair puts both servers on device 0.

Planted bugs this caught (each reverted): ``--tp 2`` left hard-coded in ``smoke()`` (every server
at tp 2); the PD runner giving the decode ``$PREFILL_GPUS`` whatever ``PD_DECODE_GPUS`` said;
``--one-gpu`` dropped from the serve runner's ``smoke()``; the PD runner keeping ``0,1,..`` for the
prefill in one-GPU mode.
"""

import json
import os
import re
import shlex
import subprocess
import tempfile
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv_testing.e2e import glm5_width
from sglang_cp_shared_kv_testing.repo_scripts import REPO_ROOT

register_cpu_ci(est_time=300, suite="stage-a-test-cpu")

SERVE_LINE = re.compile(r"^\[(?P<mode>[a-z-]+)\]\s+(?:(?P<side>prefill|decode):\s+)?(?P<rest>.*sglang serve .*)$")


def run_runner(script: str, args, env_extra, tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "python"), "OUT": str(tmp / "out"), **env_extra}
    return subprocess.run(["bash", script, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def servers_in(text: str):
    """(mode, side, env dict, argv) of every server line a smoke's dry run printed."""
    out = []
    for line in text.splitlines():
        m = SERVE_LINE.match(line)
        if not m:
            continue
        words = shlex.split(m["rest"])
        start = words.index("sglang")
        env = dict(w.split("=", 1) for w in words[:start])
        out.append((m["mode"], m["side"], env, words[start:]))
    return out


def flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


class TestServeRunnerDryRun(CustomTestCase):
    def check_serve(self, tp: int, only: str, model_env):
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            env = {"SMOKE_DRY_RUN": "1", "SMOKE_TP": str(tp), "SMOKE_RUNS_DIR": str(tmp / "runs"),
                   "SMOKE_MODEL_DIR": str(tmp / "model"), "SMOKE_ONLY": only, **model_env}  # fmt: skip
            proc = run_runner("scripts/gpu/serve_smoke_runs.sh", ["correctness"], env, tmp)
            names = only.split()
            for name in names:  # the runner's own status is its last grep's; each smoke's is printed
                self.assertIn(f"{name}: exit 0", proc.stdout, proc.stderr[-2000:])
                text = (tmp / "out" / f"{name}.log").read_text()
                (server,) = servers_in(text)
                mode, _, env_vars, argv = server
                shared = name.startswith("on_")
                self.assertEqual(mode, "shared-kv-on" if shared else "shared-kv-off")
                self.assertEqual(flag(argv, "--tp"), str(tp))
                self.assertEqual("--enable-nsa-prefill-cp-shared-kv" in argv, shared)
                self.assertEqual(flag(argv, "--model-path"), str(tmp / "model"))
                self.assertEqual("--kv-cache-dtype" in argv, "fp8" in name)
                self.assertEqual(env_vars.get("SGLANG_CP_SHARED_KV_SMOKE_LIFT_TP_RULE"), "1")
                # two GPUs or more: the audits cover every layer (one-GPU runs: the first two)
                self.assertNotIn("SGLANG_CP_SHARED_KV_SMOKE_AUDIT_LAYERS", env_vars)
                # the plan is sized for both capacities: per-rank pool and cp x it
                physical = int(flag(argv, "--max-total-tokens"))
                self.assertIn(f"device D={physical} ", text)
                self.assertIn(f"device D={tp * physical} ", text)
            return json.loads((tmp / "model" / "config.json").read_text())

    def test_tiny_model_at_tp4_and_tp8(self):
        self.check_serve(4, "ref_bf16 on_fp8", {})
        config = self.check_serve(8, "ref_fp8_radix on_bf16_wt_chunked", {})
        self.assertEqual(config["hidden_size"], 1024)

    def test_mtp_modes_serve_the_nextn_model_with_mtp_and_the_opt_in(self):
        """Modes mtp / mtp-plants: every server gets GLM-5's MTP recipe and the opt-in, the model
        directory has its NextN layer, a spec v1 run turns the overlap scheduler off, the plants are
        set on the shared-KV servers only and all judged against the stock MTP reference."""
        from sglang_cp_shared_kv_testing.e2e.server_process import MTP_OPT_IN_ENV, MTP_SERVER_ARGS

        cases = (("mtp", "ref_mtp_bf16 on_mtp_bf16_spec_v1 on_mtp_fp8"),
                 ("mtp-plants", "plant_draft-wrong-owner plant_draft-stale-load-back"))  # fmt: skip
        for mode, only in cases:
            with tempfile.TemporaryDirectory() as tmp:
                tmp = Path(tmp)
                env = {"SMOKE_DRY_RUN": "1", "SMOKE_RUNS_DIR": str(tmp / "runs"), "SMOKE_NEXTN_MODEL_DIR": str(tmp / "nextn"),
                       "SMOKE_MODEL_DIR": str(tmp / "plain"), "SMOKE_ONLY": only}  # fmt: skip
                proc = run_runner("scripts/gpu/serve_smoke_runs.sh", [mode], env, tmp)
                config = json.loads((tmp / "nextn" / "config.json").read_text())
                self.assertEqual(config["num_nextn_predict_layers"], 1)
                self.assertFalse((tmp / "plain").exists())
                for name in only.split():
                    self.assertIn(f"{name}: exit 0", proc.stdout, proc.stderr[-2000:])
                    (server,) = servers_in((tmp / "out" / f"{name}.log").read_text())
                    _, _, env_vars, argv = server
                    start = argv.index("--speculative-algorithm")
                    self.assertEqual(argv[start : start + len(MTP_SERVER_ARGS)], list(MTP_SERVER_ARGS), name)
                    self.assertEqual(env_vars.get(MTP_OPT_IN_ENV), "1", name)
                    self.assertEqual(flag(argv, "--model-path"), str(tmp / "nextn"))
                    self.assertEqual("--enable-nsa-prefill-cp-shared-kv" in argv, not name.startswith("ref_"))
                    self.assertEqual("--disable-overlap-schedule" in argv, "spec_v1" in name)
                    self.assertEqual("--kv-cache-dtype" in argv, "fp8" in name)
                    plant = env_vars.get("SGLANG_CP_SHARED_KV_SMOKE_PLANT")
                    self.assertEqual(plant, name[len("plant_") :] if name.startswith("plant_") else None)
                    if name.startswith("plant_"):
                        self.assertEqual(flag(argv, "--hicache-write-policy"), "write_through")

    def test_glm5_width_model_at_tp8(self):
        config = self.check_serve(8, "on_bf16_wt_chunked", {"SMOKE_MODEL": "glm5-width"})
        self.assertEqual(config["hidden_size"], 6144)
        plan = glm5_width.layers_that_fit(8, "fp8", "bf16", 262144)
        self.assertEqual(config["num_hidden_layers"], plan.num_layers)
        self.assertEqual(config["quantization_config"]["quant_method"], "fp8")


ONE_GPU_ENV = {"SGLANG_CP_SHARED_KV_SMOKE_ONE_GPU": "1", "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "0",
               "NCCL_SOCKET_IFNAME": "lo", "NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": "1"}  # fmt: skip
ONE_GPU_ARGS = ("--disable-custom-all-reduce", "--enforce-disable-flashinfer-allreduce-fusion")


class TestOneGpuRunnersDryRun(CustomTestCase):
    def assert_one_gpu(self, env_vars, argv, what):
        for key, value in ONE_GPU_ENV.items():
            self.assertEqual(env_vars.get(key), value, (what, key))
        for arg in ONE_GPU_ARGS:
            self.assertIn(arg, argv, what)
        self.assertIsNotNone(flag(argv, "--max-total-tokens"), what)  # pools capped: the GPU is shared

    def test_serve_decode_runs_at_tp_2_4_8(self):
        # name -> (per-owner decode, graphs, prefetch); one check per decode mode, spread over the sizes
        expected = {"on_bf16_owner_graphs": (True, True, False), "plant_decode-wrong-page": (True, False, False),
                    "on_fp8_owner_graphs_prefetch": (True, True, True), "ref_bf16": (False, False, False),
                    "on_bf16_owner_prefetch": (True, False, True), "on_bf16_gather": (False, False, False),
                    "plant_decode-wrong-page_graphs": (True, True, False)}  # fmt: skip
        for tp, only in ((2, "on_bf16_owner_graphs plant_decode-wrong-page on_fp8_owner_graphs_prefetch"),
                         (4, "ref_bf16 on_bf16_gather"),
                         (8, "on_bf16_owner_prefetch on_bf16_owner_graphs plant_decode-wrong-page_graphs")):  # fmt: skip
            with tempfile.TemporaryDirectory() as tmp, self.subTest(tp=tp):
                tmp = Path(tmp)
                env = {"SMOKE_DRY_RUN": "1", "SMOKE_ONE_GPU": "1", "SMOKE_TP": str(tp), "SMOKE_ONLY": only,
                       "SMOKE_RUNS_DIR": str(tmp / "runs"), "SMOKE_MODEL_DIR": str(tmp / "model")}  # fmt: skip
                proc = run_runner("scripts/gpu/serve_smoke_runs.sh", ["onegpu-core"], env, tmp)
                for name in only.split():
                    self.assertIn(f"{name}: exit 0", proc.stdout, proc.stderr[-2000:])
                    (server,) = servers_in((tmp / "out" / f"{name}.log").read_text())
                    _, _, env_vars, argv = server
                    self.assert_one_gpu(env_vars, argv, name)
                    self.assertEqual(flag(argv, "--tp"), str(tp))
                    # the read audit's per-forward pool all-gathers go through sockets: two layers
                    self.assertEqual(env_vars.get("SGLANG_CP_SHARED_KV_SMOKE_AUDIT_LAYERS"), "2", name)
                    per_owner, graphs, prefetch = expected[name]
                    # every shared-KV run names its path: none depends on the server's default (auto)
                    shared = "--enable-nsa-prefill-cp-shared-kv" in argv
                    path = env_vars.get("SGLANG_CP_SHARED_KV_DECODE")
                    self.assertEqual(path, ("per_owner" if per_owner else "gather") if shared else None, name)
                    self.assertEqual(env_vars.get("SGLANG_CP_SHARED_KV_DECODE_CUDA_GRAPH") == "1", graphs, name)
                    self.assertEqual("--disable-cuda-graph" not in argv, graphs, name)
                    self.assertEqual(env_vars.get("SGLANG_CP_SHARED_KV_PREFETCH_SLOT_TOKENS") == "auto", prefetch, name)
                    self.assertEqual("--kv-cache-dtype" in argv, "fp8" in name or name == "plant_decode-wrong-page")
                    if name.startswith("plant_"):
                        self.assertEqual(env_vars.get("SGLANG_CP_SHARED_KV_SMOKE_PLANT"), "decode-wrong-page")

    def test_defaults_mode_launches_the_shared_kv_server_as_a_user_does(self):
        """Mode defaults serves the shared-KV server's own decode default: no decode setting in its
        environment, no --disable-cuda-graph and no capture list (sglang's own), against the stock
        reference (eager, as in every judged pair), both with a burst of 48 (batches above 16 replay).
        Seen failing with the decode env still named for the server-default run."""
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            env = {"SMOKE_DRY_RUN": "1", "SMOKE_ONE_GPU": "1", "SMOKE_TP": "4",
                   "SMOKE_RUNS_DIR": str(tmp / "runs"), "SMOKE_MODEL_DIR": str(tmp / "model")}  # fmt: skip
            proc = run_runner("scripts/gpu/serve_smoke_runs.sh", ["defaults"], env, tmp)
            for name in ("ref_bf16_burst48", "on_bf16_server_default"):
                self.assertIn(f"{name}: exit 0", proc.stdout, proc.stderr[-2000:])
            (ref,) = servers_in((tmp / "out" / "ref_bf16_burst48.log").read_text())
            (server,) = servers_in((tmp / "out" / "on_bf16_server_default.log").read_text())
            _, _, env_vars, argv = server
            self.assert_one_gpu(env_vars, argv, "defaults")
            self.assertIn("--enable-nsa-prefill-cp-shared-kv", argv)
            self.assertEqual(flag(argv, "--tp"), "4")
            self.assertEqual([k for k in env_vars if k.startswith("SGLANG_CP_SHARED_KV_DECODE")], [])
            self.assertNotIn("--disable-cuda-graph", argv)
            self.assertNotIn("--cuda-graph-bs", argv)
            self.assertIn("--disable-cuda-graph", ref[3])
            for name in ("ref_bf16_burst48", "on_bf16_server_default"):
                self.assertIn("then a burst of 48 concurrent", (tmp / "out" / f"{name}.log").read_text(), name)

    def test_values_mode_serves_the_default_and_each_value_plant_on_its_decode_path(self):
        """Mode values: the shared-KV server as launched by a user, and the value-only plants, each
        on the decode path it breaks (per owner under graphs and eagerly, the gather), all audited
        against ref_bf16. Seen failing with the gathered-scale plant on a per-owner server (its
        prefill reads peer pages through the gather, but its decode would not)."""
        plants = {
            "plant_value-merge-skew_graphs": ("value-merge-skew", "per_owner", "1"),
            "plant_value-graph-stale-lse_graphs": ("value-graph-stale-lse", "per_owner", "1"),
            "plant_value-merge-skew": ("value-merge-skew", "per_owner", "0"),
            "plant_value-gathered-scale": ("value-gathered-scale", "gather", "0"),
        }
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            env = {"SMOKE_DRY_RUN": "1", "SMOKE_ONE_GPU": "1",
                   "SMOKE_RUNS_DIR": str(tmp / "runs"), "SMOKE_MODEL_DIR": str(tmp / "model")}  # fmt: skip
            proc = run_runner("scripts/gpu/serve_smoke_runs.sh", ["values"], env, tmp)
            for name in ["ref_bf16", "on_bf16_server_default", *plants]:
                self.assertIn(f"{name}: exit 0", proc.stdout, proc.stderr[-2000:])
            (_, _, env_vars, argv), = servers_in((tmp / "out" / "on_bf16_server_default.log").read_text())
            self.assertEqual([k for k in env_vars if k.startswith("SGLANG_CP_SHARED_KV_DECODE")], [])
            self.assertNotIn("--disable-cuda-graph", argv)
            self.assertIn("SGLANG_CP_SHARED_KV_SMOKE_AUDIT_DIR", env_vars)
            for name, (plant, path, graphs) in plants.items():
                (_, _, env_vars, argv), = servers_in((tmp / "out" / f"{name}.log").read_text())
                self.assert_one_gpu(env_vars, argv, name)
                self.assertEqual(env_vars.get("SGLANG_CP_SHARED_KV_SMOKE_PLANT"), plant, name)
                self.assertEqual(env_vars.get("SGLANG_CP_SHARED_KV_DECODE"), path, name)
                self.assertEqual(env_vars.get("SGLANG_CP_SHARED_KV_DECODE_CUDA_GRAPH"), graphs, name)
                self.assertEqual("--disable-cuda-graph" in argv, graphs == "0", name)
                self.assertIn("SGLANG_CP_SHARED_KV_SMOKE_AUDIT_DIR", env_vars, name)

    def test_one_exchange_mode_asks_every_shared_server_for_the_merge_and_the_reference_for_none(self):
        """Mode one-exchange: the one-exchange merge setting (the modeled value from settings.py, or
        SMOKE_ONE_EXCHANGE_BYTES) on the user's launch (sglang's graphs), per owner eagerly and the
        merge-skew plant under graphs; never on the stock reference. Seen failing with the driver
        writing the setting under another variable name (the servers' environment lacked it)."""
        from sglang_cp_shared_kv.settings import MERGE_ONE_EXCHANGE_ENV, MODELED_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES

        runs = {
            "on_bf16_one_exchange_default": (None, None, True),
            "on_bf16_one_exchange_eager": (None, "per_owner", False),
            "plant_value-merge-skew_one_exchange_graphs": ("value-merge-skew", "per_owner", True),
        }
        for asked, want in ((None, str(MODELED_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES)), ("123", "123")):
            with self.subTest(asked=asked), tempfile.TemporaryDirectory() as tmp:
                tmp = Path(tmp)
                env = {"SMOKE_DRY_RUN": "1", "SMOKE_ONE_GPU": "1",
                       "SMOKE_RUNS_DIR": str(tmp / "runs"), "SMOKE_MODEL_DIR": str(tmp / "model")}  # fmt: skip
                if asked:
                    env["SMOKE_ONE_EXCHANGE_BYTES"] = asked
                proc = run_runner("scripts/gpu/serve_smoke_runs.sh", ["one-exchange"], env, tmp)
                for name in ["ref_bf16", *runs]:
                    self.assertIn(f"{name}: exit 0", proc.stdout, proc.stderr[-2000:])
                (_, _, ref_env, _), = servers_in((tmp / "out" / "ref_bf16.log").read_text())
                self.assertNotIn(MERGE_ONE_EXCHANGE_ENV, ref_env)
                for name, (plant, path, graphs) in runs.items():
                    (_, _, env_vars, argv), = servers_in((tmp / "out" / f"{name}.log").read_text())
                    self.assert_one_gpu(env_vars, argv, name)
                    self.assertEqual(env_vars.get(MERGE_ONE_EXCHANGE_ENV), want, name)
                    self.assertEqual(env_vars.get("SGLANG_CP_SHARED_KV_SMOKE_PLANT"), plant, name)
                    self.assertEqual(env_vars.get("SGLANG_CP_SHARED_KV_DECODE"), path, name)
                    self.assertEqual("--disable-cuda-graph" in argv, not graphs, name)
                    self.assertIn("SGLANG_CP_SHARED_KV_SMOKE_AUDIT_DIR", env_vars, name)

    def test_ttft_chunks_mode_pairs_stock_and_shared_kv_at_two_chunk_sizes_without_audits(self):
        """Mode ttft-chunks: stock and shared KV at chunked prefill 2048 and 8192, no audit on any
        server (the read audit's per-forward collectives are not the product's path).
        Seen failing with --audit left on the shared-KV runs."""
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            env = {"SMOKE_DRY_RUN": "1", "SMOKE_ONE_GPU": "1",
                   "SMOKE_RUNS_DIR": str(tmp / "runs"), "SMOKE_MODEL_DIR": str(tmp / "model")}  # fmt: skip
            proc = run_runner("scripts/gpu/serve_smoke_runs.sh", ["ttft-chunks"], env, tmp)
            for chunk in ("2048", "8192"):
                for kv in ("off", "on"):
                    name = f"ttft_{kv}_c{chunk}"
                    self.assertIn(f"{name}: exit 0", proc.stdout, proc.stderr[-2000:])
                    (server,) = servers_in((tmp / "out" / f"{name}.log").read_text())
                    _, _, env_vars, argv = server
                    self.assert_one_gpu(env_vars, argv, name)
                    self.assertEqual(flag(argv, "--chunked-prefill-size"), chunk, name)
                    self.assertEqual("--enable-nsa-prefill-cp-shared-kv" in argv, kv == "on", name)
                    self.assertNotIn("SGLANG_CP_SHARED_KV_SMOKE_AUDIT_DIR", env_vars, name)

    def test_stock_graphs_mode_runs_stock_graphs_with_padded_batches(self):
        """Mode stock-graphs: the stock server runs decode CUDA graphs (no --disable-cuda-graph)
        captured at batch 2 and 16 only (a burst batch replays padded by several rows), shared KV
        off; SMOKE_MAX_NEW_TOKENS and SMOKE_PHYSICAL_TOKENS_PER_RANK (how CP 8 fits a call) reach the
        plan and the pool cap.
        Seen failing with --stock-cuda-graphs dropped from the runner (the server ran eagerly), and
        with the pool knob not passed on (--max-total-tokens stayed 16384)."""
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            env = {"SMOKE_DRY_RUN": "1", "SMOKE_ONE_GPU": "1", "SMOKE_MAX_NEW_TOKENS": "4",
                   "SMOKE_PHYSICAL_TOKENS_PER_RANK": "8192",
                   "SMOKE_RUNS_DIR": str(tmp / "runs"), "SMOKE_MODEL_DIR": str(tmp / "model")}  # fmt: skip
            proc = run_runner("scripts/gpu/serve_smoke_runs.sh", ["stock-graphs"], env, tmp)
            self.assertIn("ref_bf16_stock_graphs: exit 0", proc.stdout, proc.stderr[-2000:])
            text = (tmp / "out" / "ref_bf16_stock_graphs.log").read_text()
            (server,) = servers_in(text)
            mode, _, env_vars, argv = server
            self.assertEqual(mode, "shared-kv-off")
            self.assert_one_gpu(env_vars, argv, "stock-graphs")
            self.assertNotIn("--disable-cuda-graph", argv)
            start = argv.index("--cuda-graph-bs")
            self.assertEqual(argv[start + 1 : start + 3], ["2", "16"])
            self.assertNotIn("--enable-nsa-prefill-cp-shared-kv", argv)
            self.assertIn("max_new_tokens=4", text)
            self.assertEqual(flag(argv, "--max-total-tokens"), "8192")
            self.assertIn("device D=8192 ", text)

    def test_padded_graphs_mode(self):
        """Mode padded-graphs: two shared-KV runs with per-owner graphs captured at SMOKE_TP and 16
        only (burst batches replay padded), launches blocking: one judged, one (a diagnosis) with
        sglang's --debug-cuda-graph (replays run eagerly); the reference without any of it. Started
        at every CP size (the server accepts per-owner graphs at 2, 4 and 8)."""
        judged, diagnosis = "on_bf16_owner_graphs_padded", "diag_padded_eager_replay"
        # (SMOKE_TP, SMOKE_ONLY): the whole mode at CP 2, one graph run each elsewhere.
        for tp, only in (("2", None), ("4", judged), ("8", diagnosis)):
            with self.subTest(tp=tp), tempfile.TemporaryDirectory() as tmp:
                tmp = Path(tmp)
                env = {"SMOKE_DRY_RUN": "1", "SMOKE_ONE_GPU": "1", "SMOKE_RUNS_DIR": str(tmp / "runs"),
                       "SMOKE_MODEL_DIR": str(tmp / "model"), "SMOKE_TP": tp}  # fmt: skip
                if only:
                    env["SMOKE_ONLY"] = only
                proc = run_runner("scripts/gpu/serve_smoke_runs.sh", ["padded-graphs"], env, tmp)
                self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
                for name in (only or f"{judged} {diagnosis}").split():
                    self.assertIn(f"{name}: exit 0", proc.stdout, proc.stderr[-2000:])
                    servers = {mode: (env_vars, argv) for mode, _, env_vars, argv in
                               servers_in((tmp / "out" / f"{name}.log").read_text())}  # fmt: skip
                    env_vars, argv = servers["shared-kv-on"]
                    self.assertEqual(env_vars.get("CUDA_LAUNCH_BLOCKING"), "1", name)
                    self.assertEqual(env_vars.get("SGLANG_CP_SHARED_KV_DECODE_CUDA_GRAPH"), "1", name)
                    self.assertNotIn("--disable-cuda-graph", argv)
                    start = argv.index("--cuda-graph-bs")
                    self.assertEqual(argv[start + 1 : start + 3], [tp, "16"], name)
                    self.assertEqual("--debug-cuda-graph" in argv, name == diagnosis, name)
                if only is None:
                    ((_, _, ref_env, ref_argv),) = servers_in((tmp / "out" / "ref_bf16.log").read_text())
                    self.assertNotIn("--debug-cuda-graph", ref_argv)

    def test_stock_cuda_graphs_needs_shared_kv_off(self):
        proc = subprocess.run(
            ["python3", "scripts/glm5_cp_hicache_smoke.py", "--model-path", "/nonexistent", "--tp", "2",
             "--shared-kv", "both", "--stock-cuda-graphs", "--dry-run"],
            cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "python")},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        self.assertEqual(proc.returncode, 2, proc.stderr[-2000:])
        self.assertIn("--stock-cuda-graphs needs --shared-kv off", proc.stderr)

    def test_pd_pairs_share_device_0_at_tp8(self):
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            env = {"PD_MODEL_DIR": str(tmp / "model"), "PD_TP": "8", "SMOKE_ONE_GPU": "1"}
            proc = run_runner("scripts/gpu/pd_smoke_runs.sh", ["dry-run"], env, tmp)
            self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
            servers = servers_in(proc.stdout)
        self.assertEqual(len(servers), 4)
        for mode, side, env_vars, argv in servers:
            self.assertEqual(env_vars["CUDA_VISIBLE_DEVICES"], "0", (mode, side))
            self.assertEqual(env_vars.get("MC_FORCE_TCP"), "true")  # the KV crosses mooncake over TCP
            self.assert_one_gpu(env_vars, argv, (mode, side))
            self.assertEqual(flag(argv, "--tp"), "8" if side == "prefill" else "1")


class TestPdRunnerDryRun(CustomTestCase):
    def pairs(self, env_extra):
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            env = {"PD_MODEL_DIR": str(tmp / "model"), **env_extra}
            proc = run_runner("scripts/gpu/pd_smoke_runs.sh", ["dry-run"], env, tmp)
            self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
            servers = servers_in(proc.stdout)
            self.assertEqual(len(servers), 4, proc.stdout[-3000:])  # two pairs, off then on
            config = json.loads((tmp / "model" / "config.json").read_text())
        return {(mode, side): (env, argv) for mode, side, env, argv in servers}, config

    def check_pair(self, servers, tp, prefill_gpus, decode_gpus, decode_tp, fractions):
        for shared in (False, True):
            mode = "pd-shared-kv-on" if shared else "pd-shared-kv-off"
            p_env, p_argv = servers[(mode, "prefill")]
            d_env, d_argv = servers[(mode, "decode")]
            self.assertEqual(flag(p_argv, "--tp"), str(tp))
            self.assertEqual(p_env["CUDA_VISIBLE_DEVICES"], prefill_gpus)
            self.assertEqual(d_env["CUDA_VISIBLE_DEVICES"], decode_gpus)
            self.assertEqual(flag(d_argv, "--tp"), str(decode_tp))
            self.assertEqual("--enable-nsa-prefill-cp-shared-kv" in p_argv, shared)
            self.assertNotIn("--enable-nsa-prefill-cp-shared-kv", d_argv)
            self.assertEqual(flag(p_argv, "--disaggregation-mode"), "prefill")
            self.assertEqual(flag(d_argv, "--disaggregation-mode"), "decode")
            self.assertEqual((float(flag(p_argv, "--mem-fraction-static")), float(flag(d_argv, "--mem-fraction-static"))),
                             fractions)  # fmt: skip
            # sglang's tp == 8 rule: lifted for the stock prefill below tp 8 only
            lifted = p_env.get("SGLANG_CP_SHARED_KV_SMOKE_LIFT_TP_RULE") == "1"
            self.assertEqual(lifted, not shared and tp != 8)
            for env in (p_env, d_env):
                self.assertEqual(env.get("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER") == "1", shared)
            shared_gpus = set(prefill_gpus.split(",")) & set(decode_gpus.split(","))
            if shared_gpus:  # the decode, launched second, must be given more than the prefill holds
                self.assertGreater(fractions[1], fractions[0])

    def test_tiny_pairs_at_tp4(self):
        servers, _ = self.pairs({"PD_TP": "4"})  # four GPUs: the decode shares the prefill's last
        self.check_pair(servers, 4, "0,1,2,3", "3", 1, (0.35, 0.75))
        servers, _ = self.pairs({"PD_TP": "4", "PD_DECODE_GPUS": "4,5,6,7", "PD_DECODE_TP": "4"})
        self.check_pair(servers, 4, "0,1,2,3", "4,5,6,7", 4, (0.35, 0.75))

    def test_mtp_dry_run_pairs_serve_the_nextn_model_with_mtp(self):
        from sglang_cp_shared_kv_testing.e2e.server_process import MTP_OPT_IN_ENV, MTP_SERVER_ARGS

        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            env = {"PD_NEXTN_MODEL_DIR": str(tmp / "nextn"), "PD_MODEL_DIR": str(tmp / "plain")}
            proc = run_runner("scripts/gpu/pd_smoke_runs.sh", ["mtp-dry-run"], env, tmp)
            self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
            servers = servers_in(proc.stdout)
            self.assertEqual(json.loads((tmp / "nextn" / "config.json").read_text())["num_nextn_predict_layers"], 1)
        self.assertEqual(len(servers), 4)
        for mode, side, env_vars, argv in servers:
            self.assertEqual(flag(argv, "--model-path"), str(tmp / "nextn"))
            start = argv.index("--speculative-algorithm")
            self.assertEqual(argv[start : start + len(MTP_SERVER_ARGS)], list(MTP_SERVER_ARGS), (mode, side))
            self.assertEqual(env_vars.get(MTP_OPT_IN_ENV), "1")

    def test_glm5_width_pair_at_tp8_shares_every_gpu(self):
        servers, config = self.pairs({"PD_TP": "8", "PD_MODEL": "glm5-width"})
        every = "0,1,2,3,4,5,6,7"
        self.check_pair(servers, 8, every, every, 8, (0.4, 0.85))
        self.assertEqual(config["hidden_size"], 6144)
        plan = glm5_width.layers_that_fit(8, "fp8", "bf16", 65536, mem_fraction_static=0.4)
        self.assertEqual(config["num_hidden_layers"], plan.num_layers)


if __name__ == "__main__":
    unittest.main()
