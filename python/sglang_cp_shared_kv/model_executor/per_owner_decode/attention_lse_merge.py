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
what sglang's NSA decode returns). Two forms, both moving the output in its dtype (bf16):

* ``merge_by_all_gather`` (ONE collective): each rank packs its partial and its LSE (fp32, its
  bytes as two more bf16 values per head) in one buffer ``[T, H, D + 2]``, one all-gather, and every
  rank merges the gathered partials itself: ``(cp - 1) * H * (2 D + 4)``.
* ``merge_by_scaled_sum`` (TWO collectives): all-gather ``lse_r`` (``(cp - 1) * 4 H``), every rank
  computes the global LSE and scales its own partial by ``exp(lse_r - lse)``, then one sum
  all-reduce of the scaled partials (ring: ``2 (cp - 1) / cp * 2 H D``).

GLM-5 (H 64, D 512), per token and layer: all-gather 65.8 KB at cp 2, 197.4 KB at cp 4, 460.5 KB at
cp 8; scaled sum 65.8 / 99.1 / 116.5 KB. At cp 2 both move the same bytes and the all-gather saves a
collective; above, it saves the collective's latency at the price of more bytes, which pays only for
small batches. ``choose_merge_exchange`` decides per decode batch by the bytes one exchange may add
(``SGLANG_CP_SHARED_KV_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES``; the default is modeled, not measured:
``settings``), a function of the batch's shape and the settings alone: every rank, running the same
batch (under CUDA graphs the same captured batch size), takes the same form.

Both results are identical on every rank, so replicated layers stay in lockstep: the all-gather form
merges the same gathered bytes with the same ops in the same rank order on every rank; NCCL's
all-reduce reduces each element once and broadcasts it. The two forms are not bitwise equal to each
other (the all-gather form sums in float32, the scaled sum in the output dtype), only within the
checks' tolerance. The scaled sum is linear per head, so its all-reduce could move past ``w_vc`` and
``o_proj`` (``hidden`` values per token instead of ``H * D``; not done).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

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


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """The merged output, float32 [T, H, D], of every rank's partial ``outs`` [n, T, H, D] and natural
    ``lses`` [n, T, H], summed in rank order."""
    lse = global_lse(lses)
    merged = scaled_partial(outs[0], lses[0], lse)
    for rank in range(1, outs.shape[0]):
        merged = merged + scaled_partial(outs[rank], lses[rank], lse)
    return merged


# ---- the exchanges (collectives are injected: torch.distributed, or an emulation) ----

AllGather = Callable[[torch.Tensor], torch.Tensor]  # [...] -> [cp_size, ...]
AllReduceSum = Callable[[torch.Tensor], torch.Tensor]  # [...] -> [...], summed over ranks

ONE_EXCHANGE = "all_gather"  # merge_by_all_gather: one collective
SCALED_SUM = "scaled_sum"  # merge_by_scaled_sum: two collectives
MERGE_COLLECTIVES = {ONE_EXCHANGE: 1, SCALED_SUM: 2}
LSE_BYTES = 4  # float32


def merge_received_bytes(
    form: str, tokens: int, heads: int, dim: int, out_bytes: int, cp_size: int
) -> float:
    """Bytes one rank receives in one layer's merge of ``tokens`` decode tokens (ring collectives:
    an all-gather of ``s`` bytes per rank delivers ``(cp - 1) s``, an all-reduce of ``s`` bytes
    ``2 (cp - 1) / cp * s``)."""
    if form == ONE_EXCHANGE:
        return (cp_size - 1) * tokens * heads * (dim * out_bytes + LSE_BYTES)
    if form == SCALED_SUM:
        lse_gather = (cp_size - 1) * tokens * heads * LSE_BYTES
        return lse_gather + 2 * (cp_size - 1) / cp_size * tokens * heads * dim * out_bytes
    raise ValueError(f"unknown merge form {form!r}; one of {tuple(MERGE_COLLECTIVES)}")


def choose_merge_exchange(
    tokens: int, heads: int, dim: int, out_bytes: int, cp_size: int, max_extra_bytes: Optional[int]
) -> str:
    """``ONE_EXCHANGE`` while it receives at most ``max_extra_bytes`` more than the scaled sum in
    this layer (None: never), else ``SCALED_SUM``. Host integers only (shapes, settings): the same
    on every rank of a batch, fixed for a captured batch size."""
    if max_extra_bytes is None:
        return SCALED_SUM
    shape = (tokens, heads, dim, out_bytes, cp_size)
    extra = merge_received_bytes(ONE_EXCHANGE, *shape) - merge_received_bytes(SCALED_SUM, *shape)
    return ONE_EXCHANGE if extra <= max_extra_bytes else SCALED_SUM


def merge_by_all_gather(out_r: torch.Tensor, lse_r: torch.Tensor, all_gather: AllGather) -> torch.Tensor:
    """Merged output in ``out_r``'s dtype from one all-gather of this rank's partial packed with its
    natural ``lse_r`` (``pack_partial``); every rank merges the same gathered bytes identically."""
    return merge_gathered(all_gather(pack_partial(out_r, lse_r)), out_r.shape[-1])


def pack_partial(out_r: torch.Tensor, lse_r: torch.Tensor) -> torch.Tensor:
    """``[T, H, D + w]`` in ``out_r``'s dtype: the partial's values, then the float32 LSE's bytes as
    ``w = 4 / itemsize`` values of that dtype (2 for bf16)."""
    tokens, heads, _ = out_r.shape
    lse_as_out = lse_r.float().contiguous().view(out_r.dtype).reshape(tokens, heads, -1)
    return torch.cat([out_r, lse_as_out], dim=-1)


def unpack_gathered(gathered: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's partial ``[n, T, H, D]`` (a view) and natural LSE ``[n, T, H]`` float32 from the
    all-gathered packed buffers ``[n, T, H, D + w]``."""
    n, tokens, heads, _ = gathered.shape
    lses = gathered[..., dim:].contiguous().view(torch.float32).reshape(n, tokens, heads)
    return gathered[..., :dim], lses


def merge_gathered(gathered: torch.Tensor, dim: int) -> torch.Tensor:
    """The merged output in the gathered dtype, ``[T, H, D]``: one fused kernel on CUDA
    (``fused_kernels``), the torch form elsewhere."""
    if gathered.is_cuda:
        from sglang_cp_shared_kv.model_executor.per_owner_decode import fused_kernels  # Triton: CUDA

        return fused_kernels.merge_gathered(gathered, dim)
    outs, lses = unpack_gathered(gathered, dim)
    return merge_partials(outs, lses).to(gathered.dtype)


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

