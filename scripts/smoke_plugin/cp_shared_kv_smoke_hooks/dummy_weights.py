"""Dummy weights under which the KV cache matters, for the tiny-model smoke (opt-in by env var).

sglang's ``--load-format dummy`` fills every float parameter, norm weights included, with
U(-1e-3, 1e-3) from one fixed seed. Behind RMSNorm weights of ~1e-3, each attention output is about
1e-3 of the residual stream and vanishes in bf16 rounding: greedy tokens then barely depend on the
KV cache, and a smoke comparing outputs would pass with corrupt KV.

With ``SMOKE_DUMMY_INIT_ENV=1`` in the server's environment the smoke plugin replaces that init: norm
weights 1, other vectors 0, matrices U(+-sqrt(3 / fan_in)) (unit gain, fan_in = last dim). Each
parameter is seeded from its name, so weights are identical across launches, and identical on
every rank for replicated parameters, which is what comparing two servers needs. Nothing here runs
unless the smoke sets the variable.
"""

from __future__ import annotations

import math
import zlib

import torch

DUMMY_INIT_TARGET = "sglang.srt.model_loader.weight_utils.initialize_dummy_weights"


def initialize_unit_gain_dummy_weights(model: torch.nn.Module, *args, seed: int = 1234, **kwargs) -> None:
    """Drop-in for sglang's ``initialize_dummy_weights`` (its low/high arguments are ignored)."""
    for name, param in model.state_dict().items():
        if not torch.is_floating_point(param):
            continue
        generator = torch.Generator(device=param.device)
        generator.manual_seed(seed ^ zlib.crc32(name.encode()))
        if param.dim() <= 1:
            param.fill_(1.0 if name.endswith("norm.weight") else 0.0)
            continue
        bound = math.sqrt(3.0 / param.shape[-1])
        # Sampled in fp32 so fp8/bf16 parameters get the same values as a reference would.
        values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
        values.uniform_(-bound, bound, generator=generator)
        param.copy_(values.to(param.dtype))


def register_hooks(registry) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    registry.register(DUMMY_INIT_TARGET, initialize_unit_gain_dummy_weights, HookType.REPLACE)
