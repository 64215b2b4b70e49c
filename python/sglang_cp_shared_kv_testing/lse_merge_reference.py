"""The LSE merge of every rank's partial attention output in one place, and the exchange built on it
that per-owner decode did not choose (``attention_lse_merge``'s docstring says why).

``merge_partials`` is what the tests and GPU checks hold the scaled sum to; ``merge_by_all_gather``
(every rank's partial and LSE gathered, merged locally) is timed beside it by
``benchmark/bench_per_owner_decode_exchange.py`` and counted by ``decode_step_bytes``.
"""

from __future__ import annotations

import torch

from sglang_cp_shared_kv.model_executor.per_owner_decode.attention_lse_merge import (
    AllGather,
    global_lse,
    scaled_partial,
)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """n-way merge of ``outs`` [n, T, H, D] with natural ``lses`` [n, T, H]: (out float32, lse)."""
    lse = global_lse(lses)
    out = sum(scaled_partial(outs[r], lses[r], lse) for r in range(outs.shape[0]))
    return out, lse


def merge_by_all_gather(
    out_r: torch.Tensor, lse_r: torch.Tensor, all_gather: AllGather
) -> torch.Tensor:
    """Merged output in ``out_r``'s dtype from this rank's partial (natural ``lse_r``)."""
    tokens, heads, dim = out_r.shape
    # One buffer: the partial's bytes, then the LSE's bytes (float32 viewed in out's dtype).
    lse_as_out = lse_r.float().contiguous().view(out_r.dtype).reshape(tokens, heads, -1)
    gathered = all_gather(torch.cat([out_r, lse_as_out], dim=-1))
    outs = gathered[..., :dim]
    lses = gathered[..., dim:].contiguous().view(torch.float32).reshape(-1, tokens, heads)
    return merge_partials(outs, lses)[0].to(out_r.dtype)
