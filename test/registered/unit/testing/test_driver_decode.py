"""The decode the soak and the L3 restart smoke serve and judge (``server_process.decode_setup``,
``served_decode_failures``; ``server_log.ServedDecode.unaudited``).

By default what a user launches: the server's own decode, CUDA graphs where it decodes per owner.
A verdict names what the server logged and fails where that is not what was asked, or where the
decode read audit never judged per-owner decode. Planted and caught (each reverted):
``served_decode_failures`` without its graph comparison (a server asked for graphs that captured
none passed); ``unaudited`` returning nothing when no rank reported (a per-owner server with the
audit silent passed); ``decode_setup`` keeping graphs on for the default with fp8 KV (the server
would refuse to start).
"""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing.e2e.server_log import ServedDecode
from sglang_cp_shared_kv_testing.e2e.server_process import (
    SERVER_DEFAULT_DECODE,
    ServeConfig,
    decode_asked,
    decode_setup,
    served_decode_failures,
)

register_cpu_ci(est_time=2, suite="stage-a-test-cpu")

FP8 = ["--kv-cache-dtype", "fp8_e4m3"]
MTP = ["--speculative-algorithm", "EAGLE"]
PER_OWNER_GRAPHS = ServedDecode(per_owner_impls=("fa3",), graphs=True)
GATHER_EAGER = ServedDecode(gather_reasons=("SGLANG_CP_SHARED_KV_DECODE=gather",))


def config(decode_path, cuda_graphs):
    return ServeConfig(model_path="/m", tp_size=2, shared_kv=True, port=30000, physical_tokens_per_rank=4096,
                       hicache_ratio=2.0, decode_path=decode_path, cuda_graphs=cuda_graphs)  # fmt: skip


class TestDecodeSetup(CustomTestCase):
    def test_auto_graphs_follow_the_path(self):
        self.assertEqual(decode_setup(SERVER_DEFAULT_DECODE, "auto", []), (SERVER_DEFAULT_DECODE, True))
        self.assertEqual(decode_setup(SERVER_DEFAULT_DECODE, "auto", FP8), (SERVER_DEFAULT_DECODE, False))
        self.assertEqual(decode_setup(SERVER_DEFAULT_DECODE, "auto", MTP), (SERVER_DEFAULT_DECODE, False))
        self.assertEqual(decode_setup(SERVER_DEFAULT_DECODE, "off", []), (SERVER_DEFAULT_DECODE, False))
        self.assertEqual(decode_setup("per_owner", "auto", FP8), ("per_owner", True))
        self.assertEqual(decode_setup("per_owner", "off", []), ("per_owner", False))
        self.assertEqual(decode_setup("gather", "auto", []), ("gather", False))

    def test_combinations_the_server_refuses_are_refused_naming_the_rule(self):
        for decode, graphs, args, rule in (("gather", "on", [], "--disable-cuda-graph"),
                                           (SERVER_DEFAULT_DECODE, "on", FP8, "--disable-cuda-graph"),
                                           ("per_owner", "auto", MTP, "MTP")):  # fmt: skip
            with self.subTest(decode=decode, graphs=graphs, args=args), self.assertRaisesRegex(ValueError, rule):
                decode_setup(decode, graphs, args)

    def test_the_command_and_environment_of_the_default(self):
        default = config(*decode_setup(SERVER_DEFAULT_DECODE, "auto", []))
        self.assertEqual(default.env(), {})
        self.assertNotIn("--disable-cuda-graph", default.command())
        self.assertEqual(decode_asked(default), SERVER_DEFAULT_DECODE)
        self.assertEqual(decode_asked(config("per_owner", False)), "per_owner, graphs off")
        self.assertEqual(decode_asked(config("gather", False)), "gather")


class TestServedDecodeJudgement(CustomTestCase):
    def test_what_was_asked_passes(self):
        self.assertEqual(served_decode_failures(config(SERVER_DEFAULT_DECODE, True), PER_OWNER_GRAPHS), [])
        self.assertEqual(served_decode_failures(config("per_owner", True), PER_OWNER_GRAPHS), [])
        self.assertEqual(served_decode_failures(config("gather", False), GATHER_EAGER), [])

    def test_another_path_graphs_not_captured_or_nothing_logged_fail(self):
        (failure,) = served_decode_failures(config("per_owner", False), GATHER_EAGER)
        self.assertIn("asked per_owner, the server logged gather, graphs off", failure)
        (failure,) = served_decode_failures(config(SERVER_DEFAULT_DECODE, True), ServedDecode(("fa3",)))
        self.assertIn("CUDA graphs asked on, the server captured none", failure)
        (failure,) = served_decode_failures(config("gather", False), ServedDecode())
        self.assertIn("logged no decode path", failure)
        mixed = ServedDecode(("fa3",), GATHER_EAGER.gather_reasons, True)
        self.assertIn("the ranks disagree", served_decode_failures(config(SERVER_DEFAULT_DECODE, True), mixed)[0])

    def test_per_owner_decode_needs_its_audit_to_have_judged(self):
        audited = {"ranks": 2, "layers": 40, "graph_forwards": 30, "graph_replays": 30}
        self.assertEqual(PER_OWNER_GRAPHS.unaudited(audited), [])
        self.assertIn("no rank reported", PER_OWNER_GRAPHS.unaudited({"ranks": 0})[0])
        self.assertIn("no graph replay", PER_OWNER_GRAPHS.unaudited({**audited, "graph_replays": 0})[0])
        self.assertEqual(ServedDecode(("fa3",)).unaudited({**audited, "graph_replays": 0}), [])  # eager
        self.assertEqual(GATHER_EAGER.unaudited({"ranks": 0}), [])  # the scratch read audit's forwards


if __name__ == "__main__":
    unittest.main()
