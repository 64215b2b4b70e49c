"""The startup rule for PD with shared KV: prefill + mooncake + all-CP-ranks transfer only,
each refusal naming the flag or variable to change."""

import os
import unittest
from types import SimpleNamespace
from unittest import mock

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.settings import ALL_CP_RANKS_ENV, current_settings
from sglang_cp_shared_kv.startup_rules import disaggregation_problems

register_cpu_ci(est_time=2, suite="stage-a-test-cpu")


def args(mode="prefill", backend="mooncake"):
    return SimpleNamespace(disaggregation_mode=mode, disaggregation_transfer_backend=backend)


class TestDisaggregationRule(CustomTestCase):
    def check(self, server_args, env_value):
        env = {k: v for k, v in os.environ.items() if k != ALL_CP_RANKS_ENV}
        if env_value is not None:
            env[ALL_CP_RANKS_ENV] = env_value
        with mock.patch.dict(os.environ, env, clear=True):
            return disaggregation_problems(server_args, current_settings())

    def test_supported_prefill(self):
        for value in ("1", "true", "True", "yes"):
            self.assertEqual(self.check(args(), value), [], value)

    def test_pd_off_is_not_judged(self):
        self.assertEqual(self.check(args(mode="null"), None), [])

    def test_decode_mode_refused(self):
        problems = self.check(args(mode="decode"), "1")
        self.assertEqual(len(problems), 1)
        self.assertIn("--disaggregation-mode decode", problems[0])
        self.assertIn("--enable-nsa-prefill-cp-shared-kv", problems[0])

    def test_nixl_and_other_backends_refused(self):
        for backend in ("nixl", "mori", "ascend"):
            problems = self.check(args(backend=backend), "1")
            self.assertEqual(len(problems), 1, backend)
            self.assertIn(f"--disaggregation-transfer-backend {backend}", problems[0])
            self.assertIn("--disaggregation-transfer-backend mooncake", problems[0])

    def test_all_cp_ranks_transfer_required(self):
        for value in (None, "0", "false", ""):
            problems = self.check(args(), value)
            self.assertEqual(len(problems), 1, value)
            self.assertIn(ALL_CP_RANKS_ENV, problems[0])
            self.assertIn("decode server", problems[0])

    def test_every_problem_listed(self):
        self.assertEqual(len(self.check(args(backend="nixl"), None)), 2)


if __name__ == "__main__":
    unittest.main()
