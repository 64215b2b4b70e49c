"""scripts/make_tiny_glm5_config.py: the tiny GLM-5 directory loads offline and sglang sees an NSA model."""

import json
import os
import tempfile
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv_testing.repo_scripts import load_script

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


class TestMakeTinyGlm5Config(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.model_dir = Path(cls.tmp.name) / "tiny-glm5"
        cls.rc = load_script("scripts/make_tiny_glm5_config.py").main([str(cls.model_dir)])

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_script_writes_a_dir_sglang_treats_as_glm5_nsa(self):
        from sglang.srt.configs.model_config import AttentionArch, ModelConfig, is_deepseek_nsa

        self.assertEqual(self.rc, 0)
        config = json.loads((self.model_dir / "config.json").read_text())
        self.assertEqual(config["architectures"], ["GlmMoeDsaForCausalLM"])
        self.assertTrue(is_deepseek_nsa(config))
        model_config = ModelConfig(model_path=str(self.model_dir))
        self.assertTrue(is_deepseek_nsa(model_config.hf_config))
        self.assertEqual(model_config.attention_arch, AttentionArch.MLA)
        # Real GLM-5 row geometry, so pool row sizes match production.
        self.assertEqual(model_config.kv_lora_rank, 512)
        self.assertEqual(model_config.qk_rope_head_dim, 64)
        self.assertEqual(model_config.index_head_dim, 128)
        self.assertEqual(model_config.hf_config.index_topk, 2048)
        # Fields sglang's DeepseekV2 / GLM code reads as plain attributes survive AutoConfig.
        for field in ("topk_method", "first_k_dense_replace", "scoring_func", "n_routed_experts"):
            self.assertEqual(getattr(model_config.hf_config, field), config[field], field)

    def test_tokenizer_loads_offline_and_covers_the_vocab(self):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        config = json.loads((self.model_dir / "config.json").read_text())
        self.assertEqual(len(tokenizer), config["vocab_size"])
        self.assertEqual(tokenizer.eos_token_id, config["eos_token_id"])
        text = "GLM-5 on 8 x H200: prefix cache, wörld, 你好\n\t!"
        ids = tokenizer(text).input_ids
        self.assertTrue(all(0 <= i < 256 for i in ids))
        self.assertEqual(tokenizer.decode(ids), text)
        # Any id the model can emit decodes (greedy outputs of a dummy model are arbitrary ids).
        self.assertIsInstance(tokenizer.decode(list(range(config["vocab_size"]))), str)

    def test_nextn_option_gives_sglang_a_one_layer_nextn_draft_and_is_off_by_default(self):
        """--nextn adds GLM-5's MTP layer: sglang's draft config of the same directory is the NextN
        model with one layer (the draft worker's pool then has one layer). Without it the directory
        is unchanged (the smokes without MTP keep their model). Planted: the key written as
        ``num_nextn_layers`` (the key the draft needs is missing), caught."""
        from sglang.srt.configs.model_config import ModelConfig

        config = json.loads((self.model_dir / "config.json").read_text())
        self.assertNotIn("num_nextn_predict_layers", config)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "nextn"
            rc = load_script("scripts/make_tiny_glm5_config.py").main([str(out), "--nextn"])
            self.assertEqual(rc, 0)
            nextn_config = json.loads((out / "config.json").read_text())
            self.assertEqual(nextn_config["num_nextn_predict_layers"], 1)
            self.assertEqual({k: v for k, v in nextn_config.items() if k != "num_nextn_predict_layers"}, config)
            draft = ModelConfig(model_path=str(out), is_draft_model=True)
            self.assertEqual(draft.hf_config.architectures, ["DeepseekV3ForCausalLMNextN"])
            self.assertEqual(draft.num_nextn_predict_layers, 1)

    def test_check_rejects_a_config_sglang_would_not_run_as_nsa(self):
        from sglang_cp_shared_kv_testing.e2e.tiny_glm5 import check_model_dir, write_tiny_glm5_model

        broken = {
            "index_head_dim is 64": {"index_head_dim": 64},  # NSATokenToKVPool asserts 128
            "is_deepseek_nsa": {"architectures": ["Glm4MoeForCausalLM"]},  # not in sglang's DSA list
        }
        for message, change in broken.items():
            # A fresh directory each time: sglang caches loaded configs by path.
            with tempfile.TemporaryDirectory() as tmp:
                write_tiny_glm5_model(tmp)
                path = Path(tmp) / "config.json"
                path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
                with self.assertRaisesRegex(ValueError, message):
                    check_model_dir(tmp)


if __name__ == "__main__":
    unittest.main()
