"""``check_launch``: a launch line judged on a machine without a GPU, through sglang's own parser and
every startup rule of ours, with the effective settings printed.

Planted once: ``check_launch`` without its ``--device cuda`` default (stock's device probe raises
``RuntimeError: No accelerator`` on CPU) failed every test here; the environment settings left out
of the startup validation failed ``test_refused_launches_name_every_problem`` (the prefetch case).
"""

import io
import os
import json
import tempfile
import unittest
from unittest import mock

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv.check_launch import ACCEPTED, REFUSED, check_launch
from sglang_cp_shared_kv.settings import (
    ALL_CP_RANKS_ENV,
    CP_SHARED_KV_ENV,
    DECODE_PATH_ENV,
    GRAPH_DECODE_ENV,
    PREFETCH_SLOT_TOKENS_ENV,
)
from sglang_cp_shared_kv_testing.server_args_cases import Glm5LikeModelDir, ServerArgsHooksApplied

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")

# README's GLM-5 CP 8 launch line (the model path is a directory holding GLM-5's config only).
README_LINE = (
    "sglang serve --model-path {model} --tp 8 --enable-nsa-prefill-context-parallel "
    "--enable-nsa-prefill-cp-shared-kv --disable-piecewise-cuda-graph "
    "--enable-hierarchical-cache --hicache-ratio 2"
)
FP8_KV = " --kv-cache-dtype fp8_e4m3"


class TestCheckLaunch(Glm5LikeModelDir, ServerArgsHooksApplied, CustomTestCase):
    def run_check(self, line, env=None):
        out = io.StringIO()
        variables = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_CP_SHARED_KV")}
        variables.pop(ALL_CP_RANKS_ENV, None)
        variables.update(env or {})
        with mock.patch.dict(os.environ, variables, clear=True):
            # The hooks are applied by the test case (the sandbox), not by sglang's plugin loader.
            code = check_launch(line.format(model=self.model_path).split(), out, load_plugins=lambda: None)
        return code, out.getvalue()

    def test_readme_glm5_cp8_line_is_accepted(self):
        code, report = self.run_check(README_LINE)
        self.assertEqual(code, ACCEPTED, report)
        self.assertIn("CP size: 8", report)
        self.assertIn("page size: 64", report)
        # the defaults (bf16 KV, fa3): decode per owner under CUDA graphs
        self.assertIn("decode: per owner", report)
        self.assertIn("decode CUDA graphs: on", report)
        self.assertIn("HiCache: on (--hicache-ratio 2.0", report)
        self.assertIn("L3 storage: off", report)

    def test_fp8_kv_line_with_graphs_disabled_gathers(self):
        code, report = self.run_check(README_LINE + FP8_KV + " --disable-cuda-graph")
        self.assertEqual(code, ACCEPTED, report)
        self.assertIn("decode: page gather", report)
        self.assertIn("flashmla_kv", report)

    def test_l3_storage_is_reported(self):
        with tempfile.TemporaryDirectory() as storage:
            line = README_LINE + " --hicache-storage-backend file --hicache-storage-backend-extra-config"
            config = json.dumps({"file_path": storage}).replace(" ", "")
            code, report = self.run_check(line + " " + config.replace("{", "{{").replace("}", "}}"))
        self.assertEqual(code, ACCEPTED, report)
        self.assertIn("L3 storage: file (owner-free page keys", report)

    def test_readme_pd_prefill_line_is_accepted(self):
        line = README_LINE + " --disaggregation-mode prefill --disaggregation-transfer-backend mooncake"
        code, report = self.run_check(line, {ALL_CP_RANKS_ENV: "1", PREFETCH_SLOT_TOKENS_ENV: "auto"})
        self.assertEqual(code, ACCEPTED, report)
        self.assertIn("decode: none (PD prefill server", report)
        self.assertIn("layer-ahead prefetch: on (auto", report)

    def test_refused_launches_name_every_problem(self):
        cases = {
            "cuda graphs with fp8 KV (decode gathers by default)": (
                README_LINE + FP8_KV,
                {},
                ["requires --disable-cuda-graph while decode gathers pages", "flashmla_kv", DECODE_PATH_ENV],
            ),
            "cuda graphs with the gather asked for": (
                README_LINE,
                {DECODE_PATH_ENV: "gather"},
                ["requires --disable-cuda-graph while decode gathers pages", f"{DECODE_PATH_ENV}=gather"],
            ),
            "cuda graphs turned off": (README_LINE, {GRAPH_DECODE_ENV: "0"}, [f"{GRAPH_DECODE_ENV}=0"]),
            "tp 3": (README_LINE.replace("--tp 8", "--tp 3"), {}, ["--tp 3"]),
            "storage and prefetch": (
                README_LINE + " --hicache-storage-backend nixl",
                {PREFETCH_SLOT_TOKENS_ENV: "lots"},
                ["--hicache-storage-backend nixl", f"{PREFETCH_SLOT_TOKENS_ENV} must be", "'lots'"],
            ),
            "pd without all ranks": (
                README_LINE + " --disaggregation-mode prefill --disaggregation-transfer-backend nixl",
                {ALL_CP_RANKS_ENV: "on"},
                ["nixl", f"{ALL_CP_RANKS_ENV} must be one of"],
            ),
            "flag missing": (README_LINE.replace(" --enable-nsa-prefill-cp-shared-kv", ""), {}, ["not in the arguments"]),
        }
        for name, (line, env, expected) in cases.items():
            with self.subTest(name):
                code, report = self.run_check(line, env)
                self.assertEqual(code, REFUSED, report)
                self.assertTrue(report.startswith("REFUSED: "), report)
                for text in expected:
                    self.assertIn(text, report)
                self.assertNotEqual(os.environ.get(CP_SHARED_KV_ENV), "1")

    def test_sglangs_own_refusals_are_reported_not_raised(self):
        """sglang's ``ServerArgs`` asserts some combinations itself (before any rule of ours runs):
        those are refusals too, printed as such with exit 1. Seen failing before: each raised its
        AssertionError out of check_launch (a traceback)."""
        cases = {
            "dp attention": (README_LINE.replace("--tp 8", "--tp 4") + " --dp 2 --enable-dp-attention",
                             "dp attention is not supported"),
            "decode server with prefill CP": (README_LINE + " --disaggregation-mode decode",
                                              "CP is only supported for prefill"),
            "fp4 KV": (README_LINE + " --kv-cache-dtype fp4_e2m1", "only supports bf16/bfloat16 or fp8_e4m3"),
        }  # fmt: skip
        for name, (line, text) in cases.items():
            with self.subTest(name):
                code, report = self.run_check(line)
                self.assertEqual(code, REFUSED, report)
                self.assertTrue(report.startswith("REFUSED: sglang refused the arguments"), report)
                self.assertIn(text, report)

    def test_sizes_chunked_prefill_as_an_h200_does(self):
        """sglang picks the chunked prefill size from the GPU's memory; check_launch assumes an
        H200's (143,771 MiB: 8,192 tokens) unless told. Seen failing before: 4,096 (sglang's
        size for a GPU whose memory it cannot read)."""
        code, report = self.run_check(README_LINE)
        self.assertEqual(code, ACCEPTED, report)
        self.assertIn("context length 4096 + chunked prefill 8192", report)
        code, report = self.run_check(README_LINE + " --assume-gpu-memory-mib 40960")  # an A100 40GB
        self.assertIn("context length 4096 + chunked prefill 4096", report)

    def test_a_malformed_argument_is_argparses_usage_error(self):
        with self.assertRaises(SystemExit) as raised, mock.patch("sys.stderr", io.StringIO()):
            self.run_check(README_LINE.replace("--tp 8", "--tp eight"))
        self.assertEqual(raised.exception.code, 2)


if __name__ == "__main__":
    unittest.main()
