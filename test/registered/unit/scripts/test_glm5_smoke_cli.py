"""scripts/glm5_cp_hicache_smoke.py up to the launch: --help, --dry-run, and sglang accepting its commands.

The printed ``sglang serve`` commands go through sglang's own argument parsing and ``ServerArgs``
post-processing with our server-args hooks, on the tiny GLM-5 directory. sglang's DSA branch asks
the GPU for its compute capability; the test answers as an H200 does (SM 9.0) and names
``--device cuda``, which is what a GPU machine resolves by itself.
"""

import json
import os
import shlex
import tempfile
import unittest
from pathlib import Path
from unittest import mock

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv_testing.repo_scripts import ScriptCliCase

register_cpu_ci(est_time=25, suite="stage-a-test-cpu")

REPO = Path(__file__).resolve().parents[4]
SHARED_KV_FLAG = "--enable-nsa-prefill-cp-shared-kv"


class TestSmokeCli(ScriptCliCase, CustomTestCase):
    SCRIPT = "scripts/glm5_cp_hicache_smoke.py"
    SCRIPT_MODULE = "glm5_smoke"

    def test_request_ids_name_files(self):
        # Found on the GPU: plan names hold '/', and the KV audit names its dump files by request id.
        rid = self.script.rid_of(3, "g0/warmup/p0a")
        self.assertNotIn("/", rid)
        self.assertNotEqual(rid, self.script.rid_of(3, "g0/warmup/p0b"))

    def test_the_smoke_plugin_reaches_the_servers_through_their_path_only(self):
        argv = ["--model-path", self.model_dir, "--load-format", "dummy", "--audit", "--plant", "read-wrong-owner"]
        args = self.script.parse_args(argv)
        off = self.script.server_env(args, False, Path("/tmp/out"))
        on = self.script.server_env(args, True, Path("/tmp/out"))
        self.assertEqual(on["PYTHONPATH"].split(os.pathsep)[0], str(REPO / "scripts" / "smoke_plugin"))
        self.assertEqual(on["SGLANG_CP_SHARED_KV_SMOKE_PLANT"], "read-wrong-owner")
        self.assertNotIn("SGLANG_CP_SHARED_KV_SMOKE_PLANT", off)  # bugs are planted in shared KV only
        self.assertNotEqual(on["SGLANG_CP_SHARED_KV_SMOKE_AUDIT_DIR"], off["SGLANG_CP_SHARED_KV_SMOKE_AUDIT_DIR"])
        self.assertNotIn("SGLANG_CP_SHARED_KV_SMOKE_PLANT", os.environ)

    def test_the_one_exchange_merge_is_asked_as_the_shared_server_reads_it(self):
        """The flag sets the setting on the shared-KV server only; what the value audit then expects
        follows the server's whole environment (flag, --server-env, inherited). Seen failing with
        the inherited environment left out of the judgement."""
        from sglang_cp_shared_kv.settings import MERGE_ONE_EXCHANGE_ENV

        base = ["--model-path", self.model_dir, "--load-format", "dummy", "--audit"]
        out = Path("/tmp/out")
        args = self.script.parse_args(base + ["--merge-one-exchange-max-extra-bytes", "3000000"])
        self.assertEqual(self.script.server_env(args, True, out)[MERGE_ONE_EXCHANGE_ENV], "3000000")
        self.assertNotIn(MERGE_ONE_EXCHANGE_ENV, self.script.server_env(args, False, out))
        self.assertTrue(self.script.one_exchange_asked(args, out))
        with mock.patch.dict(os.environ, {MERGE_ONE_EXCHANGE_ENV: "0"}):
            self.assertTrue(self.script.one_exchange_asked(self.script.parse_args(base), out))
            off = self.script.parse_args(base + ["--server-env", f"{MERGE_ONE_EXCHANGE_ENV}=off"])
            self.assertFalse(self.script.one_exchange_asked(off, out))
        with mock.patch.dict(os.environ, {}, clear=False):
            os.environ.pop(MERGE_ONE_EXCHANGE_ENV, None)
            self.assertFalse(self.script.one_exchange_asked(self.script.parse_args(base), out))
        for bad in (["--merge-one-exchange-max-extra-bytes", "-5"],
                    ["--merge-one-exchange-max-extra-bytes", "0", "--shared-kv", "off"]):  # fmt: skip
            rc, _ = self.run_main(*base, "--dry-run", *bad)
            self.assertEqual(rc, 2, bad)

    def dry_run_commands(self, *argv, model_dir=None):
        rc, out = self.run_main("--model-path", model_dir or self.model_dir, "--load-format", "dummy", "--dry-run", *argv)
        self.assertEqual(rc, 0, out)
        commands = {}
        for line in out.splitlines():
            if line.startswith("[shared-kv-"):
                mode, rest = line.split("] ", 1)
                words = shlex.split(rest)
                env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
                commands[mode[1:]] = (env, [w for w in words if w not in {f"{k}={v}" for k, v in env.items()}])
        return commands, out

    def test_help_lists_the_options(self):
        rc, out = self.run_main("--help")
        self.assertEqual(rc, 0)
        for option in ("--shared-kv", "--physical-tokens-per-rank", "--hicache-ratio", "--dry-run", "--load-format"):
            self.assertIn(option, out)

    def test_dry_run_prints_both_commands_and_the_plan_without_launching(self):
        commands, out = self.dry_run_commands("--shared-kv", "both", "--port", "31000")
        chosen, _ = self.dry_run_commands("--shared-kv", "on")
        port = int(chosen["shared-kv-on"][1][chosen["shared-kv-on"][1].index("--port") + 1])
        self.assertLessEqual(port, 55535)  # a port sglang accepts when none is given
        self.assertEqual(set(commands), {"shared-kv-off", "shared-kv-on"})
        env_off, off = commands["shared-kv-off"]
        env_on, on = commands["shared-kv-on"]
        self.assertNotIn(SHARED_KV_FLAG, off)
        self.assertEqual([w for w in on if w != SHARED_KV_FLAG], off)  # the flag is the only difference
        self.assertEqual(off[:2], ["sglang", "serve"])
        self.assertEqual(off[off.index("--host") + 1], "127.0.0.1")
        self.assertEqual(env_on["SGLANG_CP_SHARED_KV_SMOKE_DUMMY_INIT"], "1")
        self.assertEqual(env_on["HF_HUB_OFFLINE"], "1")
        self.assertIn("group 1: device D=131072 host H=262144", out)  # 8 x 16384 with shared KV
        self.assertIn("replays #", out)

    def test_sglang_accepts_each_command_and_resolves_nsa_prefill_cp(self):
        from sglang.srt.server_args import prepare_server_args

        from sglang_cp_shared_kv.server_args import register_server_args_hooks

        from sglang_cp_shared_kv.settings import CP_SHARED_KV_ENV
        from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks

        commands, _ = self.dry_run_commands("--shared-kv", "both")
        saved_env = dict(os.environ)
        try:
            for mode, (env, command) in commands.items():
                os.environ.pop(CP_SHARED_KV_ENV, None)
                with applied_hooks(register_server_args_hooks), mock.patch(
                    "torch.cuda.get_device_capability", return_value=(9, 0)
                ):
                    args = prepare_server_args(command[2:] + ["--device", "cuda"])
                shared = mode == "shared-kv-on"
                self.assertEqual(args.enable_nsa_prefill_cp_shared_kv, shared, mode)
                self.assertEqual(os.environ.get(CP_SHARED_KV_ENV) == "1", shared, mode)
                self.assertEqual((args.tp_size, args.attn_cp_size, args.page_size), (8, 8, 64), mode)
                self.assertEqual(args.max_total_tokens, 16384)
                self.assertTrue(args.enable_hierarchical_cache and args.enable_metrics)
                self.assertEqual((args.hicache_ratio, args.hicache_write_policy), (2.0, "write_through"))
                self.assertEqual((args.attention_backend, args.nsa_prefill_backend), ("nsa", "flashmla_sparse"))
        finally:
            os.environ.clear()
            os.environ.update(saved_env)

    def test_mtp_dry_run_gives_both_servers_the_recipe_and_the_opt_in(self):
        """--mtp: GLM-5's MTP recipe (EAGLE, 3 steps, top-k 1, 4 draft tokens) on both servers, which
        still differ by the shared-KV flag only; the opt-in variable on both; without --mtp neither.
        Planted and caught: the MTP arguments given to the shared-KV server only."""
        from sglang_cp_shared_kv_testing.e2e.server_process import MTP_OPT_IN_ENV, MTP_SERVER_ARGS

        commands, _ = self.dry_run_commands("--mtp", "--audit", "--plant", "draft-stale-load-back", model_dir=self.nextn_dir)
        (env_off, off), (env_on, on) = commands["shared-kv-off"], commands["shared-kv-on"]
        self.assertEqual([w for w in on if w != SHARED_KV_FLAG], off)
        recipe = list(MTP_SERVER_ARGS)
        self.assertEqual(off[off.index("--speculative-algorithm") : off.index("--speculative-algorithm") + 8], recipe)
        self.assertEqual(recipe[1::2], ["EAGLE", "3", "1", "4"])
        self.assertEqual((env_off[MTP_OPT_IN_ENV], env_on[MTP_OPT_IN_ENV]), ("1", "1"))
        self.assertEqual(env_on["SGLANG_CP_SHARED_KV_SMOKE_PLANT"], "draft-stale-load-back")
        plain, _ = self.dry_run_commands()
        for env, command in plain.values():
            self.assertNotIn(MTP_OPT_IN_ENV, env)
            self.assertNotIn("--speculative-algorithm", command)

    def test_sglang_resolves_the_mtp_command_to_the_nextn_draft(self):
        """The reference's MTP command through sglang's own ServerArgs: EAGLE, the draft from the model
        itself (its NextN layer), 4 draft tokens. The shared-KV command differs by the flag only; until
        the startup rules accept MTP under the opt-in, the only refusal it may meet is theirs."""
        from sglang.srt.server_args import prepare_server_args

        from sglang_cp_shared_kv.server_args import register_server_args_hooks

        from sglang_cp_shared_kv.settings import CP_SHARED_KV_ENV
        from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks

        commands, _ = self.dry_run_commands("--mtp", model_dir=self.nextn_dir)
        saved_env = dict(os.environ)
        try:
            for mode, (env, command) in commands.items():
                os.environ.pop(CP_SHARED_KV_ENV, None)
                os.environ.update({k: v for k, v in env.items() if k.startswith("SGLANG_CP_SHARED_KV_MTP")})
                with applied_hooks(register_server_args_hooks), mock.patch(
                    "torch.cuda.get_device_capability", return_value=(9, 0)
                ):
                    try:
                        args = prepare_server_args(command[2:] + ["--device", "cuda"])
                    except ValueError as e:
                        self.assertEqual(mode, "shared-kv-on", e)
                        self.assertIn("--speculative-algorithm", str(e))
                        continue
                self.assertEqual(args.speculative_algorithm, "EAGLE", mode)
                self.assertEqual(args.speculative_draft_model_path, self.nextn_dir, mode)
                self.assertEqual(
                    (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens), (3, 1, 4)
                )
                self.assertTrue(args.disable_cuda_graph)
        finally:
            os.environ.clear()
            os.environ.update(saved_env)

    def test_bad_arguments_exit_2(self):
        rc, _ = self.run_main("--model-path", self.model_dir, "--port", "60000", "--dry-run")
        self.assertEqual(rc, 2)  # sglang would refuse it: it also binds port + 10000
        rc, _ = self.run_main("--model-path", self.model_dir, "--physical-tokens-per-rank", "1000", "--dry-run")
        self.assertEqual(rc, 2)
        rc, _ = self.run_main("--model-path", self.model_dir, "--hicache-ratio", "1", "--dry-run")
        self.assertEqual(rc, 2)
        with tempfile.TemporaryDirectory() as short:
            config = json.loads((Path(self.model_dir) / "config.json").read_text())
            config["max_position_embeddings"] = 4096  # shorter than the planned 8 K-token prompts
            (Path(short) / "config.json").write_text(json.dumps(config))
            rc, _ = self.run_main("--model-path", short, "--dry-run")
            self.assertEqual(rc, 2)
        # MTP: a model without a NextN layer, and a draft plant without --mtp.
        rc, _ = self.run_main("--model-path", self.model_dir, "--mtp", "--dry-run")
        self.assertEqual(rc, 2)
        rc, _ = self.run_main("--model-path", self.nextn_dir, "--audit", "--plant", "draft-wrong-owner", "--dry-run")
        self.assertEqual(rc, 2)
        # MTP with the server's own decode default: it gathers under MTP, so graphs must go (named).
        import contextlib
        import io

        err = io.StringIO()
        with contextlib.redirect_stderr(err), self.assertRaises(SystemExit):
            self.script.parse_args(["--model-path", self.nextn_dir, "--mtp", "--decode", "server-default"])
        self.assertIn("default gathers, which needs --disable-cuda-graph", err.getvalue())


if __name__ == "__main__":
    unittest.main()
