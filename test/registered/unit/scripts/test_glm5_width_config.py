"""The GLM-5-width model: its config carries GLM-5's widths, its memory model adds up to GLM-5's size,
and the layer count it picks is the largest that fits beside the KV pool and the shared-KV scratch.

Planted bugs this caught (each reverted): routed experts not split over tp (each rank holding
every expert whole); ``layers_that_fit`` stopping early (a KV estimate a quarter too large).
"""

import contextlib
import io
import json
import os
import tempfile
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv.model_executor.gather_scratch import scratch_bytes
from sglang_cp_shared_kv_testing.e2e import glm5_width
from sglang_cp_shared_kv_testing.repo_scripts import load_script

register_cpu_ci(est_time=25, suite="stage-a-test-cpu")

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

# GLM-5: 744B parameters (its model card); bf16 bytes of the whole 78-layer model at tp 1.
GLM5_PARAMS = 744e9


class TestGlm5WidthMemory(CustomTestCase):
    def test_full_depth_weighs_what_glm5_weighs(self):
        config = glm5_width.glm5_width_config(glm5_width.GLM5_NUM_LAYERS, "bf16")
        w = glm5_width.weight_bytes_per_rank(config, tp=1, weight_dtype="bf16")
        params = w.total(glm5_width.GLM5_NUM_LAYERS, 3) / 2
        self.assertLess(abs(params - GLM5_PARAMS) / GLM5_PARAMS, 0.01, params)

    def test_experts_split_over_tp_and_attention_replicated(self):
        config = glm5_width.glm5_width_config(8, "bf16")
        w1, w8 = (glm5_width.weight_bytes_per_rank(config, tp, "bf16") for tp in (1, 8))
        self.assertEqual(w1.attention_per_layer, w8.attention_per_layer)
        self.assertEqual(w1.dense_mlp_per_layer, w8.dense_mlp_per_layer)
        router = 256 * 6144 * 4
        self.assertEqual(w1.moe_per_layer - router, 8 * (w8.moe_per_layer - router))
        fp8 = glm5_width.weight_bytes_per_rank(glm5_width.glm5_width_config(8, "fp8"), 8, "fp8")
        self.assertAlmostEqual((fp8.moe_per_layer - router) / (w8.moe_per_layer - router), 0.5, places=3)
        with self.assertRaisesRegex(ValueError, "--tp 3"):
            glm5_width.weight_bytes_per_rank(config, 3, "bf16")

    def test_layers_that_fit_is_the_largest_count_that_fits(self):
        for tp, weights, kv in ((2, "bf16", "bf16"), (2, "fp8", "fp8"), (4, "fp8", "bf16"), (8, "fp8", "fp8")):
            tokens = 262144
            plan = glm5_width.layers_that_fit(tp, weights, kv, tokens)
            cell = glm5_width.kv_bytes_per_token_per_layer(kv)
            scratch = scratch_bytes(tp * tokens, glm5_width.kv_row_bytes(kv), glm5_width.PAGE_SIZE)
            self.assertEqual(plan.kv_bytes_shared, tokens * plan.num_layers * cell + scratch)
            self.assertLessEqual(plan.weight_bytes + plan.kv_bytes_shared, plan.budget_bytes)
            more = plan.num_layers + 1
            w = glm5_width.weight_bytes_per_rank(glm5_width.glm5_width_config(more, weights), tp, weights)
            need = w.total(more, 3) + glm5_width.kv_pool_bytes_per_rank(tokens, more, kv, tp)
            self.assertGreater(need, plan.budget_bytes, (tp, weights, kv))
        with self.assertRaisesRegex(ValueError, "not even"):
            glm5_width.layers_that_fit(2, "bf16", "bf16", 262144, gpu_gib=15)


class TestGlm5WidthScript(CustomTestCase):
    def test_script_writes_glm5_widths_sglang_loads(self):
        from sglang.srt.configs.model_config import ModelConfig

        script = load_script("scripts/make_tiny_glm5_config.py")
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "glm5w"
            self.assertEqual(script.main([str(out), "--glm5-width", "--num-layers", "5", "--weights", "fp8"]), 0)
            config = json.loads((out / "config.json").read_text())
            for key, value in glm5_width.GLM5_WIDTHS.items():
                self.assertEqual(config[key], value, key)
            self.assertEqual(config["num_hidden_layers"], 5)
            self.assertEqual(config["mlp_layer_types"], ["dense"] * 3 + ["sparse"] * 2)
            model_config = ModelConfig(model_path=str(out))
            self.assertEqual(model_config.hf_config.hidden_size, 6144)
            self.assertEqual(model_config.quantization, "fp8")

    def test_print_memory_lists_every_tp(self):
        script = load_script("scripts/make_tiny_glm5_config.py")
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            self.assertEqual(script.main(["--print-memory"]), 0)
        text = buf.getvalue()
        for weights in ("bf16", "fp8"):
            for tp in (2, 4, 8):
                plan = glm5_width.layers_that_fit(tp, weights, "bf16", 262144)
                self.assertIn(f"weights {weights} tp {tp}:", text)
                self.assertIn(f"-> {plan.num_layers} layers", text)


if __name__ == "__main__":
    unittest.main()
