"""The smoke's unit-gain dummy init: why it exists, what it writes, and that only the smoke turns it on."""

import os
import sys
import unittest
from pathlib import Path

import torch

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

# The smoke's test-only plugin is not installed; the smoke puts this folder on its servers' path.
sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "scripts" / "smoke_plugin"))
import cp_shared_kv_smoke_hooks  # noqa: E402
from cp_shared_kv_smoke_hooks import SMOKE_DUMMY_INIT_ENV  # noqa: E402
from cp_shared_kv_smoke_hooks.dummy_weights import initialize_unit_gain_dummy_weights  # noqa: E402

register_cpu_ci(est_time=15, suite="stage-a-test-cpu")


class ContextBlock(torch.nn.Module):
    """One residual read of the context, shaped like an MLA layer: embed, norm, latent, output."""

    def __init__(self, vocab=320, hidden=1024, latent=512):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, hidden)
        self.input_layernorm = torch.nn.RMSNorm(hidden)
        self.kv_a_proj_with_mqa = torch.nn.Linear(hidden, latent, bias=False)
        self.o_proj = torch.nn.Linear(latent, hidden, bias=False)

    def forward(self, token, context):
        latent = self.kv_a_proj_with_mqa(self.input_layernorm(self.embed_tokens(context)))
        return self.embed_tokens(token) + self.o_proj(latent.mean(0))


def context_sensitivity(init) -> float:
    """Fraction of output elements that change when the whole context changes (bf16, as served)."""
    block = ContextBlock().to(torch.bfloat16)
    with torch.no_grad():
        init(block)
        token = torch.tensor([5])
        a = block(token, torch.arange(0, 64))
        b = block(token, torch.arange(64, 128))
    return (a != b).float().mean().item()


class TestSmokeDummyWeights(CustomTestCase):
    def test_stock_dummy_weights_hide_the_context_and_unit_gain_does_not(self):
        from sglang.srt.model_loader.weight_utils import initialize_dummy_weights

        # sglang's U(+-1e-3) norms shrink every context read below bf16 resolution of the residual.
        self.assertLess(context_sensitivity(initialize_dummy_weights), 0.05)
        self.assertGreater(context_sensitivity(initialize_unit_gain_dummy_weights), 0.9)

    def test_values_follow_the_parameter_kind_and_are_reproducible(self):
        def build():
            block = ContextBlock().to(torch.bfloat16)
            block.register_parameter("e_score_correction_bias", torch.nn.Parameter(torch.ones(16)))
            block.register_parameter("w13_weight", torch.nn.Parameter(torch.empty(4, 64, 256, dtype=torch.bfloat16)))
            with torch.no_grad():
                initialize_unit_gain_dummy_weights(block)
            return block

        a, b = build(), build()
        for name, value in a.state_dict().items():
            self.assertTrue(torch.equal(value, b.state_dict()[name]), name)  # same on every launch
        self.assertTrue(torch.all(a.input_layernorm.weight == 1))
        self.assertTrue(torch.all(a.e_score_correction_bias == 0))
        for name, fan_in in (("kv_a_proj_with_mqa.weight", 1024), ("o_proj.weight", 512), ("w13_weight", 256)):
            value = a.state_dict()[name].float()
            bound = (3.0 / fan_in) ** 0.5
            self.assertLessEqual(value.abs().max().item(), bound * 1.01, name)
            self.assertAlmostEqual(value.std().item(), bound / 3**0.5, delta=0.1 * bound, msg=name)
        # Seeded by name: two same-shaped matrices do not repeat each other.
        self.assertFalse(torch.equal(a.kv_a_proj_with_mqa.weight[:, :512], a.o_proj.weight[:512, :]))

    def test_only_the_smoke_plugin_swaps_the_init_and_only_when_the_smoke_asks(self):
        from sglang.srt.model_loader import loader, weight_utils

        from sglang_cp_shared_kv import plugin
        from sglang_cp_shared_kv.settings import CP_SHARED_KV_ENV
        from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks

        def norm_weight_after_dummy_load() -> float:
            block = ContextBlock(hidden=64, latent=32)
            with torch.no_grad():
                loader.initialize_dummy_weights(block)  # the name DummyModelLoader.load_model calls
            return block.input_layernorm.weight.abs().max().item()

        stock = weight_utils.initialize_dummy_weights
        saved = dict(os.environ)
        try:
            os.environ.pop(CP_SHARED_KV_ENV, None)
            os.environ.pop(SMOKE_DUMMY_INIT_ENV, None)
            with applied_hooks(lambda registry: cp_shared_kv_smoke_hooks.register()):
                self.assertLessEqual(norm_weight_after_dummy_load(), 1e-3)  # stock U(+-1e-3)
            os.environ[SMOKE_DUMMY_INIT_ENV] = "1"
            with applied_hooks(lambda registry: plugin.register()):  # the product never swaps it
                self.assertLessEqual(norm_weight_after_dummy_load(), 1e-3)
            with applied_hooks(lambda registry: cp_shared_kv_smoke_hooks.register()):
                self.assertEqual(norm_weight_after_dummy_load(), 1.0)
            self.assertIs(loader.initialize_dummy_weights, stock)  # undone after the block
        finally:
            os.environ.clear()
            os.environ.update(saved)


if __name__ == "__main__":
    unittest.main()
