"""scripts/gpu/mooncake_tcp_probe.py without mooncake: the cases it parses, the block layout it writes
(every destination byte between the guards exactly once, in reverse block order), and what it calls a
failure. The probe itself runs where mooncake's engine imports (docs/gpu.md, "PD pair smoke")."""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv_testing.repo_scripts import load_script

register_cpu_ci(est_time=2, suite="stage-a-test-cpu")


def load_probe():
    return load_script("scripts/gpu/mooncake_tcp_probe.py")


class TestMooncakeTcpProbe(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.probe = load_probe()

    def test_cases(self):
        self.assertEqual(self.probe.parse_cases("cpu>cpu, cuda:0>cuda:1"), [("cpu", "cpu"), ("cuda:0", "cuda:1")])
        self.assertEqual(self.probe.parse_cases(None)[0], ("cpu", "cpu"))
        for bad in ("cpu", "cpu>gpu", "cuda:x>cpu"):
            with self.assertRaises(SystemExit):
                self.probe.parse_cases(bad)

    def test_layout_covers_the_destination_once_between_the_guards(self):
        nbytes, blocks = 1 << 20, 8
        layout = self.probe._block_layout(nbytes, blocks)
        guard = self.probe.GUARD_BYTES
        self.assertEqual(sorted(s for s, _, _ in layout), [k * (nbytes // blocks) for k in range(blocks)])
        covered = sorted((d, d + n) for _, d, n in layout)
        self.assertEqual(covered[0][0], guard)
        self.assertEqual(covered[-1][1], guard + nbytes)
        self.assertTrue(all(a[1] == b[0] for a, b in zip(covered, covered[1:])))
        self.assertGreater(layout[0][1], layout[-1][1])  # reverse order: a misplaced block is seen

    def test_failures(self):
        ok = {"force_tcp": True, "errors": [], "receiver_tcp_only": True, "sender_tcp_only": True,
              "results": [{"case": "cpu>cpu", "ret": 0, "bad_blocks": 0, "guards_ok": True}]}  # fmt: skip
        self.assertEqual(self.probe.failures(ok), [])
        self.assertEqual(len(self.probe.failures({**ok, "receiver_tcp_only": False})), 1)
        self.assertEqual(self.probe.failures({**ok, "force_tcp": False, "receiver_tcp_only": False}), [])
        bad = {**ok, "results": [{"case": "cuda:0>cuda:1", "ret": -1, "bad_blocks": 2, "guards_ok": False}]}
        self.assertIn("cuda:0>cuda:1", self.probe.failures(bad)[0])
        self.assertEqual(self.probe.failures({**ok, "results": []}), ["no case ran"])
        crashed = {**ok, "errors": ["receiver: ImportError: libibverbs.so.1"], "receiver_tcp_only": False}
        self.assertEqual(self.probe.failures(crashed), ["receiver: ImportError: libibverbs.so.1"])


if __name__ == "__main__":
    unittest.main()
