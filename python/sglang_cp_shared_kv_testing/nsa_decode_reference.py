"""Torch references of the NSA decode kernels per-owner decode runs, for CPU tests and checks.

* ``paged_mqa_logits_reference``: ``deep_gemm.fp8_paged_mqa_logits`` (indexer scores over a block
  table of 64-token pages; indexer pages as ``NSATokenToKVPool`` stores them: 64 x 128 fp8 K,
  then 64 fp32 scales): ``logit[b, t] = sum_h weights[b, h] * relu(q[b, h] . k[t] * scale[t])``,
  -inf past a request's length (the real kernel leaves those columns unspecified).
* ``sparse_mla_decode_reference``: ``flash_mla_with_kvcache`` with ``indices`` (FlashMLA's
  sparse decode): softmax attention of every head over the indexed rows, -1 skipped; returns the
  natural-log LSE, and for a query with no valid index out = 0 and LSE = +inf, as FlashMLA does.
* ``flash_mla_sparse_fwd_reference``: ``flash_mla_sparse_fwd`` (bf16 KV, ``flashmla_sparse``
  decode): the same attention over bf16 rows, returning (out, max_logits, base-2 LSE [T, H]); a
  query with no valid index gets out = 0, LSE = +inf.
* ``fa3_paged_decode_reference``: ``flash_attn_with_kvcache`` as sglang's ``_forward_fa3`` calls it
  (page size 1, ``q`` the rope part, ``qv`` the latent part, one query per request): reads the
  first ``cache_seqlens[b]`` entries of the page table and, like the kernel, does NOT skip -1
  (a -1 entry reads the last row); returns out [T, H, 512] and, with ``return_softmax_lse``, the
  natural-log LSE [H, T] (varlen layout); a request with ``cache_seqlens`` 0 gets out = 0,
  LSE = -inf.
* ``fp8_kv_rows`` / ``kv_rows_as_float``: 656-byte fp8 KV rows (512 fp8 | 4 fp32 scales |
  64 bf16 rope), the format FlashMLA reads and ``NSATokenToKVPool`` stores.
"""

from __future__ import annotations

import math

import torch

from sglang_cp_shared_kv_testing.nsa_cpu_kernels import FP8, quantize_k_cache_separate_torch

KV_LORA_RANK = 512
ROPE_DIM = 64
FP8_ROW_BYTES = 656
INDEX_HEAD_DIM = 128
INDEX_ROW_BYTES = INDEX_HEAD_DIM + 4


def fp8_kv_rows(kv: torch.Tensor) -> torch.Tensor:
    """[N, 576] latent + rope -> [N, 656] uint8 fp8 rows."""
    nope, rope = quantize_k_cache_separate_torch(kv[:, None, :KV_LORA_RANK], kv[:, None, KV_LORA_RANK:])
    return torch.cat([nope, rope], dim=-1).reshape(kv.shape[0], FP8_ROW_BYTES)


def kv_rows_as_float(rows: torch.Tensor) -> torch.Tensor:
    """[N, 656] uint8 fp8 rows -> [N, 576] float32 (what the kernel dequantizes)."""
    values = rows[:, :KV_LORA_RANK].contiguous().view(FP8).float()
    scales = rows[:, KV_LORA_RANK : KV_LORA_RANK + 16].contiguous().view(torch.float32)
    nope = (values.reshape(rows.shape[0], 4, 128) * scales[:, :, None]).reshape(rows.shape[0], -1)
    rope = rows[:, KV_LORA_RANK + 16 :].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=-1)


def index_pages(keys_fp8: torch.Tensor, scales: torch.Tensor, page_size: int = 64) -> torch.Tensor:
    """Indexer K rows [N, 128] fp8 and scales [N] fp32 (N a multiple of the page size) as pool pages
    [N / page_size, page_size * 132] uint8."""
    pages = keys_fp8.shape[0] // page_size
    k_bytes = keys_fp8.contiguous().view(torch.uint8).reshape(pages, page_size * INDEX_HEAD_DIM)
    s_bytes = scales.float().contiguous().view(torch.uint8).reshape(pages, page_size * 4)
    return torch.cat([k_bytes, s_bytes], dim=1)


def _index_rows(pages: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool pages -> (K [pages * page_size, 128] float32, scales [pages * page_size])."""
    k = pages[:, : page_size * INDEX_HEAD_DIM].contiguous().view(FP8).float()
    s = pages[:, page_size * INDEX_HEAD_DIM :].contiguous().view(torch.float32)
    return k.reshape(-1, INDEX_HEAD_DIM), s.reshape(-1)


def paged_mqa_logits_reference(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int = 64,
) -> torch.Tensor:
    """[B, W * page_size] float32 logits; ``q_fp8`` [B, heads, 128], ``weights`` [B, heads]."""
    k, s = _index_rows(pages, page_size)
    batch, width = block_table.shape
    slot = torch.arange(page_size, device=pages.device)
    rows = (block_table.long()[:, :, None] * page_size + slot).reshape(batch, width * page_size)
    scores = torch.einsum("bhd,btd->bht", q_fp8.float(), k[rows]) * s[rows][:, None, :]
    logits = (scores.relu() * weights.float()[:, :, None]).sum(dim=1)
    column = torch.arange(width * page_size, device=pages.device)
    return torch.where(column[None, :] < seq_lens[:, None], logits, float("-inf"))


def sparse_mla_decode_reference(
    q: torch.Tensor, kv_rows: torch.Tensor, indices: torch.Tensor, sm_scale: float, dv: int = KV_LORA_RANK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, dv] float32, natural LSE [B, H]); ``q`` [B, H, 576], ``kv_rows`` [N, 576] float,
    ``indices`` [B, k] rows of ``kv_rows`` (-1 skipped)."""
    valid = indices >= 0
    gathered = kv_rows.float()[indices.clamp(min=0).long()]  # [B, k, 576]
    scores = torch.einsum("bhd,bkd->bhk", q.float(), gathered) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    empty = ~torch.isfinite(lse)
    probs = torch.where(empty[..., None], 0.0, torch.exp(scores - lse.masked_fill(empty, 0.0)[..., None]))
    out = torch.einsum("bhk,bkd->bhd", probs, gathered[..., :dv])
    return out, lse.masked_fill(empty, float("inf"))


def flash_mla_sparse_fwd_reference(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = KV_LORA_RANK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q`` [T, H, 576] bf16, ``kv`` [N, 1, 576] bf16, ``indices`` [T, 1, k] (-1 skipped) ->
    (out [T, H, d_v] bf16, max_logits [T, H] (base 2), LSE [T, H] base 2)."""
    out, lse = sparse_mla_decode_reference(q.float(), kv[:, 0].float(), indices[:, 0], sm_scale, d_v)
    log2e = 1.0 / math.log(2.0)
    rows = kv[:, 0].float()[indices[:, 0].clamp(min=0).long()]
    scores = torch.einsum("thd,tkd->thk", q.float(), rows) * sm_scale * log2e
    scores = scores.masked_fill((indices[:, 0] < 0)[:, None, :], float("-inf"))
    return out.to(torch.bfloat16), scores.amax(dim=-1), lse * log2e


def fa3_paged_decode_reference(
    q, k_cache, v_cache, qv=None, page_table=None, cache_seqlens=None, cu_seqlens_q=None,
    max_seqlen_q=None, softmax_scale=None, causal=True, return_softmax_lse=False, **_,
):
    """``q`` [T, H, 64] (rope), ``qv`` [T, H, 512], ``k_cache`` [N, 1, 1, 64], ``v_cache``
    [N, 1, 1, 512], ``page_table`` [B, k] rows, ``cache_seqlens`` [B]; T == B (decode)."""
    if max_seqlen_q != 1 or q.shape[0] != page_table.shape[0]:
        raise NotImplementedError("the fa3 reference serves decode: one query per request")
    k_rope = k_cache.reshape(k_cache.shape[0], -1).float()
    latent = v_cache.reshape(v_cache.shape[0], -1).float()
    rows = page_table.long()  # -1 reads the last row, as an unskipped -1 reads some row
    read = torch.arange(rows.shape[1], device=rows.device)[None, :] < cache_seqlens[:, None]
    scores = (
        torch.einsum("thd,tkd->thk", q.float(), k_rope[rows])
        + torch.einsum("thd,tkd->thk", qv.float(), latent[rows])
    ) * softmax_scale
    scores = scores.masked_fill(~read[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [T, H]
    empty = ~torch.isfinite(lse)
    probs = torch.where(empty[..., None], 0.0, torch.exp(scores - lse.masked_fill(empty, 0.0)[..., None]))
    out = torch.einsum("thk,tkd->thd", probs, latent[rows]).to(qv.dtype)
    if not return_softmax_lse:
        return out
    return out, lse.masked_fill(empty, float("-inf")).t().contiguous()
