"""Merge per-owner partial attention outputs by log-sum-exp, identically on every CP rank.

Each rank attends (all heads) over the selected tokens it owns and keeps ``out_r`` [T, H, D] and
``lse_r`` [T, H]. Softmax attention over the union is

    lse = log(sum_r exp(lse_r))          out = sum_r exp(lse_r - lse) * out_r

LSE base: natural log throughout here. Kernels differ: FlashMLA's sparse decode
(``flash_mla_with_kvcache`` with ``indices``) returns a natural-log LSE shaped [B, H, 1];
``flash_mla_sparse_fwd`` documents a base-2 LSE [T, H]. ``natural_lse`` converts; pass the
kernel's base explicitly.

Empty partials: a rank may own none of a token's selected tokens. Kernels then return out = 0 and
an LSE of +inf (FlashMLA's convention) or -inf; any non-finite LSE counts as empty here, and its
``out_r`` is never read (may be garbage or NaN). A token with no tokens anywhere (a padded request)
gets out = 0, lse = -inf, no NaN.

Exchange (bytes received per rank, per token and layer; H heads, D = kv_lora_rank = 512 values
per head: the absorbed-MLA attention output before the per-head up-projection ``w_vc``, which is
what sglang's NSA decode returns):

* all-gather ``out_r`` (bf16) and ``lse_r`` (fp32), merge locally:
  ``(cp - 1) * H * (2 D + 4)``; one collective per layer (out and lse in one buffer). Not chosen
  (below); the tests' ``lse_merge_reference`` keeps it for the exchange benchmark.
* ``merge_by_scaled_sum``: all-gather ``lse_r`` (``(cp - 1) * 4 H``), every rank computes the global
  LSE and scales its own partial by ``exp(lse_r - lse)``, then one sum all-reduce of the scaled
  partials in the output dtype (ring: ``2 (cp - 1) / cp * 2 H D``); two collectives per layer.
  The scaled sum is linear per head, so the same all-reduce can move past ``w_vc`` and ``o_proj``
  (every rank runs them for the whole batch anyway under NSA CP, attention TP 1) and then reduces
  ``hidden`` values per token instead of ``H * D``.

GLM-5 (H 64, D 512, hidden 6144), per token and layer: all-gather 65.8 KB (cp 2) / 460.5 KB
(cp 8); scaled sum 65.8 KB / 116.5 KB; scaled sum after ``o_proj`` 12.5 KB / 23.3 KB.
``decode_step_bytes`` holds these formulas. Choice: the scaled sum. At cp 2 it moves the same bytes
as the all-gather, at cp 8 four times fewer, and it is the form that moves past ``o_proj`` without
changing its math; its price is a second (small) collective per layer, which matters only when
latency, not bytes, bounds the step (batch 1). Both results are identical on every rank (NCCL
reduces each element once and broadcasts it; the all-gather form merges identical bytes with the
same ops), so replicated layers stay in lockstep.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
import torch.distributed as dist

from sglang_cp_shared_kv.model_executor.sync_debug import sync_debug_exempt

LN2 = math.log(2.0)
_NEG_INF = float("-inf")
_LOWEST = torch.finfo(torch.float32).min


def natural_lse(lse: torch.Tensor, base: float) -> torch.Tensor:
    """An LSE in ``base`` (``math.e`` or 2) as a natural-log LSE, float32."""
    lse = lse.float()
    if base == math.e:
        return lse
    if base == 2:
        return lse * LN2
    raise ValueError(f"unsupported LSE base {base}")


def global_lse(lses: torch.Tensor) -> torch.Tensor:
    """Natural LSE of the union from per-rank natural LSEs ``[n, T, H]``; -inf where all are empty."""
    return torch.logsumexp(_as_empty_or_finite(lses), dim=0)


def partial_weight(lse_r: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(lse_r - lse)`` [T, H] float32: 0 for an empty partial or an empty union."""
    # An empty union has every partial empty: exp(-inf - finite) = 0, never -inf - -inf.
    return torch.exp(_as_empty_or_finite(lse_r) - lse.clamp(min=_LOWEST))


def scaled_partial(out_r: torch.Tensor, lse_r: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """This rank's term of the merged output, float32 [T, H, D]; exactly 0 for an empty partial
    (whose ``out_r`` may be garbage or NaN, so it is selected away, not multiplied by 0)."""
    weight = partial_weight(lse_r, lse).unsqueeze(-1)
    return torch.where(weight > 0, out_r * weight, 0.0)


def _as_empty_or_finite(lses: torch.Tensor) -> torch.Tensor:
    """float32 LSEs with every non-finite value (empty: +inf, -inf or NaN) as -inf."""
    return torch.nan_to_num(lses.float(), nan=_NEG_INF, posinf=_NEG_INF, neginf=_NEG_INF)


# ---- the exchanges (collectives are injected: torch.distributed, or an emulation) ----

AllGather = Callable[[torch.Tensor], torch.Tensor]  # [...] -> [cp_size, ...]
AllReduceSum = Callable[[torch.Tensor], torch.Tensor]  # [...] -> [...], summed over ranks


def merge_by_scaled_sum(
    out_r: torch.Tensor, lse_r: torch.Tensor, all_gather: AllGather, all_reduce_sum: AllReduceSum
) -> torch.Tensor:
    """Merged output in ``out_r``'s dtype: global LSE from gathered LSEs, then a sum of scaled partials."""
    return all_reduce_sum(scaled_partial_of_gathered(out_r, lse_r, all_gather(lse_r.float().contiguous())))


def scaled_partial_of_gathered(out_r: torch.Tensor, lse_r: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """This rank's term in ``out_r``'s dtype, from every rank's natural LSEs ``lses`` [n, T, H]:
    one fused kernel on CUDA (``fused_kernels``), the torch form elsewhere."""
    if out_r.is_cuda:
        from sglang_cp_shared_kv.model_executor.per_owner_decode import fused_kernels  # Triton: CUDA

        return fused_kernels.scaled_partial(out_r, lse_r, lses)
    return scaled_partial(out_r, lse_r, global_lse(lses)).to(out_r.dtype)


def process_group_collectives(group: dist.ProcessGroup) -> tuple[AllGather, AllReduceSum]:
    """The two collectives over ``group`` (every rank calls them in the same order)."""
    cp_size = dist.get_world_size(group)
    staged = dist.get_backend(group) == dist.Backend.GLOO  # gloo moves host memory

    def all_gather(tensor: torch.Tensor) -> torch.Tensor:
        with _host_staging(staged and tensor.is_cuda):
            source = (tensor.cpu() if staged else tensor).contiguous()
            # Ranks concatenated along dim 0 (the shape gloo requires), then viewed rank-major.
            out = source.new_empty((cp_size * source.shape[0], *source.shape[1:]))
            dist.all_gather_into_tensor(out, source, group=group)
            return out.view(cp_size, *source.shape).to(tensor.device)

    def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
        with _host_staging(staged and tensor.is_cuda):
            work = tensor.cpu() if staged else tensor.contiguous().clone()
            dist.all_reduce(work, op=dist.ReduceOp.SUM, group=group)
            return work.to(tensor.device)

    return all_gather, all_reduce_sum


def _host_staging(staged: bool):
    """gloo moves host memory: CP ranks sharing a GPU in the checks bounce device tensors through
    the host, a deliberate wait that sync debugging must not count (NCCL groups never stage)."""
    return sync_debug_exempt() if staged else contextlib.nullcontext()

