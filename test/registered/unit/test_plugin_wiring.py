"""The installed plugin as sglang's own entry points load it, in a fresh launcher and a spawned child.

The launcher does what ``python -m sglang.launch_server`` and ``sglang serve`` do: load plugins,
then parse. In it: ``--help`` lists the flag; ``sglang serve``'s ``serve()`` parses the flag and
fails fast on an invalid combination before spawning anything; a valid command line is parsed and
handed, pickled, to a process spawned the way sglang spawns schedulers. Checked: the launcher holds
only the server-args hooks; the child receives the flag in ``ServerArgs`` and ``SGLANG_CP_SHARED_KV``
in its environment, registers the runtime hooks, and every registered target exists in sglang
0.5.11 (``HookRegistry`` only logs a target it cannot resolve, so a typo would go unnoticed until
serving).
"""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest
from importlib.metadata import entry_points

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv.settings import CP_SHARED_KV_ENV, CP_SHARED_KV_FLAG

register_cpu_ci(est_time=40, suite="stage-a-test-cpu")

SERVER_ARGS_TARGETS = {
    "sglang.srt.server_args.ServerArgs.add_cli_args",
    "sglang.srt.server_args.ServerArgs.__init__",
    "sglang.srt.server_args.ServerArgs.from_cli_args",
    "sglang.srt.server_args.ServerArgs.check_server_args",
    "sglang.srt.server_args.ServerArgs._handle_model_specific_adjustments",
}
LOAD_BACK_QUOTA_TARGETS = {
    "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
    "sglang.srt.mem_cache.hiradix_cache.HiRadixCache.init_load_back",
}
PD_TRANSFER_TARGETS = {"sglang.srt.disaggregation.utils.get_kv_class"}

# Runs as a file so that the spawned child can import it (multiprocessing "spawn", as sglang uses).
LAUNCHER = textwrap.dedent(
    """
    import contextlib
    import io
    import json
    import multiprocessing
    import os

    from sglang_cp_shared_kv_testing import sgl_kernel_cpu_shim

    FLAG = "--enable-nsa-prefill-cp-shared-kv"


    def registry_state():
        from sglang.srt.plugins.hook_registry import HookRegistry

        return {"registered": sorted(HookRegistry._hooks), "applied": sorted(HookRegistry._patched)}


    def scheduler_like(server_args):
        # Like run_scheduler_process: ServerArgs arrives pickled, then plugins load.
        sgl_kernel_cpu_shim.install()
        from sglang.srt.plugins import load_plugins

        load_plugins()
        return {
            "flag": server_args.enable_nsa_prefill_cp_shared_kv,
            "env": os.environ.get("SGLANG_CP_SHARED_KV"),
            **registry_state(),
        }


    if __name__ == "__main__":
        sgl_kernel_cpu_shim.install()
        from sglang.cli.serve import serve
        from sglang.srt.plugins import load_plugins
        from sglang.srt.server_args import prepare_server_args

        load_plugins()  # what launch_server and serve() do before parsing
        result = {"launcher": registry_state()}

        help_text = io.StringIO()
        with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
            prepare_server_args(["--help"])
        result["help"] = help_text.getvalue()

        try:
            serve(None, ["--model-type", "llm", "--model-path", "dummy", FLAG])
            result["serve_error"] = None
        except ValueError as e:
            result["serve_error"] = str(e)

        args = prepare_server_args(
            ["--model-path", "dummy", "--enable-nsa-prefill-context-parallel", "--disable-cuda-graph",
             "--disable-piecewise-cuda-graph", FLAG]
        )
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            result["child"] = pool.apply(scheduler_like, (args,))
        print("RESULT " + json.dumps(result))
    """
)


class TestPluginWiring(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        with tempfile.TemporaryDirectory() as tmp:
            launcher_path = os.path.join(tmp, "launcher.py")
            with open(launcher_path, "w") as f:
                f.write(LAUNCHER)
            env = dict(os.environ, HF_HUB_OFFLINE="1")
            env.pop(CP_SHARED_KV_ENV, None)
            proc = subprocess.run(
                [sys.executable, launcher_path],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=300,
            )
        cls.output = proc.stdout
        cls.returncode = proc.returncode
        cls.result = None
        if "RESULT " in proc.stdout:
            cls.result = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])

    def setUp(self):
        self.assertEqual(self.returncode, 0, self.output[-3000:])
        self.assertIsNotNone(self.result, self.output[-3000:])

    def test_entry_point_is_registered(self):
        values = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
        self.assertEqual(values.get("cp_shared_kv"), "sglang_cp_shared_kv.plugin:register")

    def test_help_lists_the_flag(self):
        self.assertIn(CP_SHARED_KV_FLAG, self.result["help"])

    def test_sglang_serve_parses_the_flag_and_fails_fast(self):
        self.assertIn(
            f"{CP_SHARED_KV_FLAG} requires --enable-nsa-prefill-context-parallel",
            self.result["serve_error"] or "",
        )

    def test_flag_reaches_spawned_process_which_registers_runtime_hooks(self):
        launcher, child = self.result["launcher"], self.result["child"]
        # Before the flag is validated only the server-args hooks exist.
        self.assertEqual(set(launcher["registered"]), SERVER_ARGS_TARGETS)
        self.assertIs(child["flag"], True)
        self.assertEqual(child["env"], "1")
        registered = set(child["registered"])
        self.assertTrue(
            SERVER_ARGS_TARGETS | LOAD_BACK_QUOTA_TARGETS | PD_TRANSFER_TARGETS <= registered, registered
        )
        self.assertEqual(set(child["applied"]), registered)


if __name__ == "__main__":
    unittest.main()
