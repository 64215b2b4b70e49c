"""Fused Triton kernels for per-owner decode: one launch where the torch form takes ten or more.

Per-owner decode's arithmetic around the indexer and attention kernels is small (a few ``[B, k]``
and ``[T, H]`` tensors per layer), so as a chain of torch ops it is bound by launches: eagerly each
op costs a host launch, and even as a CUDA graph each is a separate kernel. These kernels do the
same arithmetic in one launch each, on CUDA tensors; their torch forms (``decode_topk_merge``,
``attention_lse_merge``) stay the reference and serve CPU. Every rank runs the same kernel on the
same gathered bytes, so the results stay identical across ranks.

* ``gather_candidates``: this rank's candidates (score, pool row, position) at the columns its
  local top-k picked; -inf / -1 / -1 for padding columns (-1).
* ``owned_selection``: from every rank's gathered candidate scores and the columns of any top-k
  over them, the k-th score, then this rank's attention indices by the tie rule of
  ``decode_topk_merge`` (above the k-th score, then ties in candidate order: ranks before this one
  first, then this rank's own in its order), -1 elsewhere. One program per request; no host sync.
* ``scaled_partial``: the global natural LSE from the gathered per-rank LSEs and this rank's
  partial scaled by ``exp(lse_r - lse)`` in the output dtype, exactly 0 for an empty partial
  (non-finite LSE), as ``attention_lse_merge.scaled_partial`` (the scaled sum's term);
* ``merge_gathered``: the merged output from every rank's all-gathered packed partial and LSE (the
  one-exchange merge), summed in rank order in float32, as ``attention_lse_merge.merge_partials``.

The torch reference checks them: on CPU through Triton's interpreter (``TRITON_INTERPRET=1``, a
unit test) and on the GPU in ``scripts/gpu/check_cp_per_owner_decode.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _gather_candidates_kernel(
    columns_ptr, logits_ptr, positions_ptr, rows_ptr,
    scores_out, rows_out, positions_out,
    logits_stride, table_stride, K: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < K
    column = tl.load(columns_ptr + b * K + offs, mask=inside, other=-1)
    valid = inside & (column >= 0)
    column = tl.where(valid, column, 0).to(tl.int64)
    score = tl.load(logits_ptr + b * logits_stride + column, mask=valid, other=float("-inf"))
    row = tl.load(rows_ptr + b * table_stride + column, mask=valid, other=-1)
    position = tl.load(positions_ptr + b * table_stride + column, mask=valid, other=-1)
    tl.store(scores_out + b * K + offs, score, mask=inside)
    tl.store(rows_out + b * K + offs, row, mask=inside)
    tl.store(positions_out + b * K + offs, position, mask=inside)


def gather_candidates(columns, logits, positions, physical_rows):
    """(scores float32, rows int32, positions int32) [B, k] at ``columns`` [B, k] int32 (-1 padding)
    of ``logits`` [B, L] float32 and the tables ``positions`` / ``physical_rows`` [B, >= L] int32."""
    batch, k = columns.shape
    columns, logits = columns.contiguous(), logits.float()
    positions, physical_rows = positions.contiguous(), physical_rows.contiguous()
    assert logits.stride(1) == 1 and positions.stride() == physical_rows.stride()
    scores = torch.empty((batch, k), dtype=torch.float32, device=logits.device)
    rows = torch.empty((batch, k), dtype=torch.int32, device=logits.device)
    out_positions = torch.empty((batch, k), dtype=torch.int32, device=logits.device)
    if batch:
        grid = (batch, triton.cdiv(k, _BLOCK))
        _gather_candidates_kernel[grid](
            columns, logits, positions, physical_rows, scores, rows, out_positions,
            logits.stride(0), positions.stride(0), K=k, BLOCK=_BLOCK,
        )
    return scores, rows, out_positions


@triton.jit
def _owned_selection_kernel(
    gathered_ptr, kth_columns_ptr, rows_ptr, indices_out,
    batch, cp_size, cp_rank, K: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    # The k-th score: the smallest score at the columns of a top-k (candidate order: rank r's
    # column j is r * K + j; gathered is [cp_size, batch, K]).
    kth = float("inf")
    for start in range(0, K, BLOCK):
        offs = start + lanes
        column = tl.load(kth_columns_ptr + b * K + offs, mask=offs < K, other=0).to(tl.int64)
        rank = column // K
        score = tl.load(gathered_ptr + (rank * batch + b) * K + column % K, mask=offs < K, other=float("inf"))
        kth = tl.minimum(kth, tl.min(score, axis=0))
    # Candidates above the k-th score (every rank), and ties of the ranks before this one.
    above = 0
    ties_before = 0
    for rank in range(0, cp_size):
        for start in range(0, K, BLOCK):
            offs = start + lanes
            score = tl.load(gathered_ptr + (rank * batch + b) * K + offs, mask=offs < K, other=float("-inf"))
            above += tl.sum((score > kth).to(tl.int32), axis=0)
            ties_before += tl.sum(((score == kth) & (score > float("-inf"))).to(tl.int32), axis=0) * (rank < cp_rank).to(tl.int32)
    wanted_ties = K - above
    carry = ties_before
    for start in range(0, K, BLOCK):
        offs = start + lanes
        inside = offs < K
        score = tl.load(gathered_ptr + (cp_rank * batch + b) * K + offs, mask=inside, other=float("-inf"))
        real = score > float("-inf")
        tied = (score == kth) & real
        tie_rank = carry + tl.cumsum(tied.to(tl.int32), axis=0)
        chosen = real & ((score > kth) | (tied & (tie_rank <= wanted_ties)))
        row = tl.load(rows_ptr + b * K + offs, mask=inside, other=-1)
        tl.store(indices_out + b * K + offs, tl.where(chosen, row, -1), mask=inside)
        carry += tl.sum(tied.to(tl.int32), axis=0)


def owned_selection(gathered_scores, kth_columns, physical_rows, cp_rank: int):
    """[B, k] int32 attention indices of ``cp_rank``: its ``physical_rows`` [B, k] of the selected
    candidates, -1 elsewhere; ``gathered_scores`` [cp_size, B, k] float32 as all-gathered,
    ``kth_columns`` [B, k] int32 the candidate-order columns of any top-k over them."""
    cp_size, batch, k = gathered_scores.shape
    indices = torch.empty((batch, k), dtype=torch.int32, device=gathered_scores.device)
    if batch:
        _owned_selection_kernel[(batch,)](
            gathered_scores.contiguous(), kth_columns.contiguous(), physical_rows.contiguous(),
            indices, batch, cp_size, cp_rank, K=k, BLOCK=min(_BLOCK, triton.next_power_of_2(k)),
        )
    return indices


@triton.jit
def _scaled_partial_kernel(
    out_ptr, lse_r_ptr, lses_ptr, result_ptr, tokens_heads, cp_size, out_stride, result_stride,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    th = tl.program_id(0)  # token * heads + head
    neg_inf = float("-inf")
    peak = neg_inf
    for rank in range(0, cp_size):
        x = tl.load(lses_ptr + rank * tokens_heads + th)
        x = tl.where((x == x) & (x < float("inf")), x, neg_inf)  # empty (NaN, +-inf) -> -inf
        peak = tl.maximum(peak, x)
    safe_peak = tl.where(peak > neg_inf, peak, 0.0)
    total = 0.0
    for rank in range(0, cp_size):
        x = tl.load(lses_ptr + rank * tokens_heads + th)
        x = tl.where((x == x) & (x < float("inf")), x, neg_inf)
        total += tl.exp(x - safe_peak)
    lse = tl.where(total > 0, safe_peak + tl.log(total), neg_inf)
    own = tl.load(lse_r_ptr + th)
    own = tl.where((own == own) & (own < float("inf")), own, neg_inf)
    weight = tl.exp(own - tl.maximum(lse, -3.4028234663852886e38))
    d = tl.arange(0, BLOCK_D)
    values = tl.load(out_ptr + th * out_stride + d, mask=d < D, other=0.0).to(tl.float32)
    scaled = tl.where(weight > 0, values * weight, 0.0)
    tl.store(result_ptr + th * result_stride + d, scaled.to(result_ptr.dtype.element_ty), mask=d < D)


def scaled_partial(out_r, lse_r, lses):
    """This rank's term of the merged output in ``out_r``'s dtype: ``out_r`` [T, H, D] scaled by
    ``exp(lse_r - lse)``, ``lse`` the natural LSE of ``lses`` [cp_size, T, H] (natural, float32,
    every rank's, this one's included); exactly 0 where ``lse_r`` [T, H] is not finite."""
    tokens, heads, dim = out_r.shape
    out_r = out_r.reshape(tokens * heads, dim)
    if out_r.stride(1) != 1:
        out_r = out_r.contiguous()
    result = torch.empty((tokens * heads, dim), dtype=out_r.dtype, device=out_r.device)
    if tokens * heads:
        _scaled_partial_kernel[(tokens * heads,)](
            out_r, lse_r.float().contiguous(), lses.float().contiguous(), result, tokens * heads,
            lses.shape[0], out_r.stride(0), result.stride(0), D=dim, BLOCK_D=triton.next_power_of_2(dim),
        )
    return result.view(tokens, heads, dim)


@triton.jit
def _merge_gathered_kernel(
    values_ptr, lse_words_ptr, result_ptr, tokens_heads, cp_size, row_values, row_words, lse_word,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    th = tl.program_id(0)  # token * heads + head
    neg_inf = float("-inf")
    peak = neg_inf
    for rank in range(0, cp_size):
        x = tl.load(lse_words_ptr + (rank * tokens_heads + th) * row_words + lse_word)
        x = tl.where((x == x) & (x < float("inf")), x, neg_inf)  # empty (NaN, +-inf) -> -inf
        peak = tl.maximum(peak, x)
    safe_peak = tl.where(peak > neg_inf, peak, 0.0)
    total = 0.0
    for rank in range(0, cp_size):
        x = tl.load(lse_words_ptr + (rank * tokens_heads + th) * row_words + lse_word)
        x = tl.where((x == x) & (x < float("inf")), x, neg_inf)
        total += tl.exp(x - safe_peak)
    lse = tl.maximum(tl.where(total > 0, safe_peak + tl.log(total), neg_inf), -3.4028234663852886e38)
    d = tl.arange(0, BLOCK_D)
    merged = tl.zeros([BLOCK_D], dtype=tl.float32)
    for rank in range(0, cp_size):
        row = rank * tokens_heads + th
        x = tl.load(lse_words_ptr + row * row_words + lse_word)
        x = tl.where((x == x) & (x < float("inf")), x, neg_inf)
        weight = tl.exp(x - lse)
        values = tl.load(values_ptr + row * row_values + d, mask=d < D, other=0.0).to(tl.float32)
        merged += tl.where(weight > 0, values * weight, 0.0)  # an empty partial is never read
    tl.store(result_ptr + th * D + d, merged.to(result_ptr.dtype.element_ty), mask=d < D)


def merge_gathered(gathered, dim: int):
    """The merged output ``[T, H, dim]`` in ``gathered``'s dtype from every rank's packed partial
    ``gathered`` [cp_size, T, H, dim + w] (``attention_lse_merge.pack_partial``: the values, then
    the float32 LSE's bytes). The LSEs are read in place, through a float32 view of the buffer."""
    cp_size, tokens, heads, width = gathered.shape
    gathered = gathered.contiguous()
    if (dim * gathered.element_size()) % 4:
        raise ValueError(f"merge_gathered: the LSE after {dim} values of {gathered.dtype} is not 4-byte aligned")
    words = gathered.view(torch.float32)  # [cp_size, T, H, width * itemsize / 4]
    result = torch.empty((tokens, heads, dim), dtype=gathered.dtype, device=gathered.device)
    if tokens * heads:
        _merge_gathered_kernel[(tokens * heads,)](
            gathered, words, result, tokens * heads, cp_size, width, words.shape[-1],
            dim * gathered.element_size() // 4, D=dim, BLOCK_D=triton.next_power_of_2(dim),
        )
    return result
