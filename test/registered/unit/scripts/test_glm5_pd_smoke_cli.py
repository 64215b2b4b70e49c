"""scripts/glm5_pd_smoke.py up to the launch: --help, --dry-run (both servers' commands and environments
per mode, the request plan), argument errors, and sglang's parser accepting the commands.

What each side must set is the point of the PD smoke: the prefill command is the single-server
smoke's plus the disaggregation flags, the decode command is stock sglang (no plugin flag, CUDA graphs
on), SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER is set on both servers exactly when shared KV is on,
both servers get the smoke's test plugin on their PYTHONPATH (and the unit-gain dummy init), mooncake
over TCP on loopback (MC_FORCE_TCP, SGLANG_HOST_IP) and NVLink multicast off, and only the stock
reference prefill gets the plugin's tp-rule lift.
"""

import argparse
import os
import shlex
import unittest
from pathlib import Path
from unittest import mock

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv_testing.repo_scripts import ScriptCliCase

register_cpu_ci(est_time=25, suite="stage-a-test-cpu")

REPO = Path(__file__).resolve().parents[4]
SHARED_KV_FLAG = "--enable-nsa-prefill-cp-shared-kv"
ALL_CP_RANKS_ENV = "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"
LIFT_TP_RULE_ENV = "SGLANG_CP_SHARED_KV_SMOKE_LIFT_TP_RULE"
DUMMY_INIT_ENV = "SGLANG_CP_SHARED_KV_SMOKE_DUMMY_INIT"
SMOKE_PLUGIN_DIR = str(REPO / "scripts" / "smoke_plugin")
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class TestPDSmokeCli(ScriptCliCase, CustomTestCase):
    SCRIPT = "scripts/glm5_pd_smoke.py"

    def dry_run(self, *argv, model_dir=None):
        """{(mode, side): (env, command)} from the dry-run output, and the whole output."""
        rc, out = self.run_main("--model-path", model_dir or self.model_dir, "--load-format", "dummy", "--dry-run", *argv)
        self.assertEqual(rc, 0, out)
        commands = {}
        for line in out.splitlines():
            if line.startswith("[pd-shared-kv-"):
                mode, rest = line.split("] ", 1)
                side, rest = rest.split(":", 1)
                words = shlex.split(rest)
                start = words.index("sglang")
                env = dict(w.split("=", 1) for w in words[:start])
                commands[(mode[1:], side.strip())] = (env, words[start:])
        return commands, out

    def test_help_lists_the_options(self):
        rc, out = self.run_main("--help")
        self.assertEqual(rc, 0)
        for option in ("--prefill-tp", "--decode-tp", "--prefill-gpus", "--decode-gpu", "--shared-kv",
                       "--dummy-init", "--decode-mem-fraction-static", "--dry-run"):  # fmt: skip
            self.assertIn(option, out)
        self.assertNotIn("--stock-cp-tp-route", out)  # the placeholder gave way to the smoke plugin

    def test_dry_run_commands_and_environments(self):
        commands, out = self.dry_run("--bootstrap-port", "31111")
        self.assertEqual(
            set(commands),
            {(m, s) for m in ("pd-shared-kv-off", "pd-shared-kv-on") for s in ("prefill", "decode")},
        )
        env_on, prefill_on = commands[("pd-shared-kv-on", "prefill")]
        env_off, prefill_off = commands[("pd-shared-kv-off", "prefill")]
        # The two prefill servers differ by the flag only; both are disaggregated prefill servers.
        self.assertEqual([w for w in prefill_on if w != SHARED_KV_FLAG], prefill_off)
        self.assertIn(SHARED_KV_FLAG, prefill_on)
        for cmd in (prefill_on, prefill_off):
            self.assertEqual(cmd[cmd.index("--tp") + 1], "2")
            self.assertEqual(cmd[cmd.index("--disaggregation-mode") + 1], "prefill")
            self.assertEqual(cmd[cmd.index("--disaggregation-transfer-backend") + 1], "mooncake")
            self.assertEqual(cmd[cmd.index("--disaggregation-bootstrap-port") + 1], "31111")
            self.assertIn("--enable-hierarchical-cache", cmd)
            self.assertIn("--enable-nsa-prefill-context-parallel", cmd)
        for mode in ("pd-shared-kv-off", "pd-shared-kv-on"):
            env, decode = commands[(mode, "decode")]
            self.assertEqual(decode[decode.index("--tp") + 1], "1")
            self.assertEqual(decode[decode.index("--disaggregation-mode") + 1], "decode")
            self.assertEqual(decode[decode.index("--disaggregation-transfer-backend") + 1], "mooncake")
            for stock_only in (SHARED_KV_FLAG, "--enable-nsa-prefill-context-parallel", "--disable-cuda-graph"):
                self.assertNotIn(stock_only, decode)  # a stock decode server with CUDA graphs
            self.assertEqual(env["CUDA_VISIBLE_DEVICES"], "1")
            for side_env in (env, commands[(mode, "prefill")][0]):
                self.assertEqual(side_env["MC_FORCE_TCP"], "true")
                self.assertEqual(side_env["SGLANG_HOST_IP"], "127.0.0.1")  # mooncake sessions, zmq, bootstrap
                for name, value in MULTICAST_OFF_ENV.items():
                    self.assertEqual(side_env[name], value, (mode, name))
            self.assertEqual(env[DUMMY_INIT_ENV], "1")
            # the smoke's test plugin reaches both servers of both pairs, first on their path
            for side_env in (env, commands[(mode, "prefill")][0]):
                self.assertEqual(side_env["PYTHONPATH"].split(os.pathsep)[0], SMOKE_PLUGIN_DIR)
            # all-CP-ranks transfer on both servers exactly when shared KV is on
            self.assertEqual(env.get(ALL_CP_RANKS_ENV), "1" if mode.endswith("on") else None, mode)
            self.assertEqual(commands[(mode, "prefill")][0].get(ALL_CP_RANKS_ENV), env.get(ALL_CP_RANKS_ENV))
        self.assertEqual(env_on["CUDA_VISIBLE_DEVICES"], "0,1")
        # the smoke plugin's tp-rule lift reaches the stock reference prefill only
        self.assertEqual(env_off.get(LIFT_TP_RULE_ENV), "1")
        self.assertNotIn(LIFT_TP_RULE_ENV, env_on)
        for mode in ("pd-shared-kv-off", "pd-shared-kv-on"):
            self.assertNotIn(LIFT_TP_RULE_ENV, commands[(mode, "decode")][0])
        self.assertIn("group 1: device D=32768 host H=65536", out)  # 2 x 16384 with shared KV

    def test_decode_pool_fits_twice_the_longest_request(self):
        commands, out = self.dry_run("--shared-kv", "on")
        _, decode = commands[("pd-shared-kv-on", "decode")]
        tokens = int(decode[decode.index("--max-total-tokens") + 1])
        self.assertEqual(tokens % 64, 0)
        self.assertGreaterEqual(tokens, 2 * (8128 + 16))

    def test_tp_rule_lift_only_where_stock_sglang_refuses(self):
        commands, _ = self.dry_run("--shared-kv", "off", "--prefill-tp", "8", "--prefill-gpus", "0,1,2,3,4,5,6,7")
        env_off, prefill_off = commands[("pd-shared-kv-off", "prefill")]
        self.assertEqual(prefill_off[prefill_off.index("--tp") + 1], "8")
        self.assertNotIn(LIFT_TP_RULE_ENV, env_off)  # stock NSA prefill CP runs at tp 8 by itself
        self.assertEqual(env_off["PYTHONPATH"].split(os.pathsep)[0], SMOKE_PLUGIN_DIR)

    def test_dummy_init_only_with_dummy_weights_and_unit_gain(self):
        commands, _ = self.dry_run("--dummy-init", "stock")
        for key, (env, _) in commands.items():
            self.assertNotIn(DUMMY_INIT_ENV, env, key)
        rc, out = self.run_main("--model-path", self.model_dir, "--dry-run")  # real weights
        self.assertEqual(rc, 0, out)
        self.assertNotIn(DUMMY_INIT_ENV, out)
        self.assertIn(LIFT_TP_RULE_ENV, out)  # the reference still needs the lift

    def test_bad_arguments_exit_2(self):
        for argv in (
            ("--prefill-tp", "1", "--dry-run"),
            ("--decode-port", "60000", "--dry-run"),
            ("--physical-tokens-per-rank", "1000", "--dry-run"),
            ("--hicache-ratio", "1", "--dry-run"),
        ):
            rc, _ = self.run_main("--model-path", self.model_dir, *argv)
            self.assertEqual(rc, 2, argv)

    def test_mtp_on_both_servers_of_both_pairs(self):
        """--mtp: the MTP recipe and the opt-in on the prefill and on the stock decode server of each
        pair (the decode receives the draft pool and runs the draft); the plants go to the shared-KV
        prefill only; a draft plant needs --mtp, --mtp a NextN layer. Planted and caught: the recipe
        left off the decode command (a decode without a draft pool receives no draft rows)."""
        from sglang_cp_shared_kv_testing.e2e.server_process import MTP_OPT_IN_ENV, MTP_SERVER_ARGS

        commands, _ = self.dry_run("--mtp", "--audit", "--plant", "draft-wrong-owner", model_dir=self.nextn_dir)
        self.assertEqual(len(commands), 4)
        for (mode, side), (env, argv) in commands.items():
            start = argv.index("--speculative-algorithm")
            self.assertEqual(argv[start : start + len(MTP_SERVER_ARGS)], list(MTP_SERVER_ARGS), (mode, side))
            self.assertEqual(env.get(MTP_OPT_IN_ENV), "1", (mode, side))
            planted = env.get("SGLANG_CP_SHARED_KV_SMOKE_PLANT")
            self.assertEqual(planted, "draft-wrong-owner" if (mode, side) == ("pd-shared-kv-on", "prefill") else None)
        for argv in (("--mtp", "--dry-run"), ("--audit", "--plant", "draft-stale-load-back", "--dry-run")):
            model = self.model_dir if argv[0] == "--mtp" else self.nextn_dir
            rc, _ = self.run_main("--model-path", model, *argv)
            self.assertEqual(rc, 2, argv)

    def test_sglang_parses_both_commands(self):
        """Every flag exists in sglang 0.5.11 (plus ours); the decode command builds a stock decode
        ServerArgs on the tiny GLM-5 (page 64, chunk cache, no shared KV)."""
        from sglang.srt.server_args import ServerArgs, prepare_server_args

        from sglang_cp_shared_kv.server_args import register_server_args_hooks

        from sglang_cp_shared_kv.settings import CP_SHARED_KV_ENV
        from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks

        commands, _ = self.dry_run("--shared-kv", "on")
        saved_env = dict(os.environ)
        try:
            with applied_hooks(register_server_args_hooks), mock.patch(
                "torch.cuda.get_device_capability", return_value=(9, 0)
            ):
                parser = argparse.ArgumentParser()
                ServerArgs.add_cli_args(parser)
                prefill = parser.parse_args(commands[("pd-shared-kv-on", "prefill")][1][2:])
                self.assertTrue(prefill.enable_nsa_prefill_cp_shared_kv)
                self.assertEqual(prefill.disaggregation_mode, "prefill")
                decode = prepare_server_args(commands[("pd-shared-kv-on", "decode")][1][2:] + ["--device", "cuda"])
            self.assertEqual(decode.disaggregation_mode, "decode")
            self.assertFalse(decode.enable_nsa_prefill_cp_shared_kv)
            self.assertEqual((decode.tp_size, decode.page_size), (1, 64))
            self.assertTrue(decode.disable_radix_cache)  # sglang's decode: chunk cache, no decode prefix
            self.assertNotEqual(os.environ.get(CP_SHARED_KV_ENV), "1")
        finally:
            os.environ.clear()
            os.environ.update(saved_env)


if __name__ == "__main__":
    unittest.main()
