"""Each NSA decode impl's attention call as sglang's NSA backend makes it, with the LSE kept, for checks.

The kernel is an argument (the real one, or its torch reference from ``nsa_decode_reference``), so
the eager check (``scripts/gpu/check_cp_per_owner_decode.py``) and the graph check
(``scripts/gpu/check_per_owner_decode_graphs.py``) call real kernels and references the same way,
and that way is the runtime's (``model_executor/per_owner_decode/decode_forward.py``). ``rows`` are the KV rows
as the impl's pool stores them; ``indices`` [B, k] rows of ``rows``, -1 elsewhere. Each call returns
(out [B, H, 512], LSE [B, H] in the kernel's base, ``per_owner_decode.SERVED_DECODE_IMPLS``). Every
call has fixed shapes and no host sync, so it can be captured in a CUDA graph.

* ``flashmla_kv`` (``_forward_flashmla_kv``): ``flash_mla_with_kvcache`` over fp8 656-byte rows
  viewed as 64-row pages, ``indices`` [B, 1, k] int32, an empty block table, the tile metadata of
  ``get_mla_metadata``; natural LSE [B, H, 1].
* ``flashmla_sparse`` (``_forward_flashmla_sparse``): ``flash_mla_sparse_fwd(q [T, H, 576],
  kv [N, 1, 576], indices [T, 1, k] int32, sm_scale, d_v=512)`` over bf16 rows; base-2 LSE [T, H].
* ``fa3`` (``_forward_fa3``, page size 1): ``flash_attn_with_kvcache`` with ``q`` the rope part,
  ``qv`` the latent part, ``k_cache`` / ``v_cache`` views of the bf16 rows, sglang's varlen
  ``cu_seqlens``; the page table and ``cache_seqlens`` replaced as ``forward_fa3_per_owner``
  replaces them (owned indices compacted to the front, their count), since fa3 reads
  ``cache_seqlens`` entries and does not skip -1; natural LSE [H, T].
"""

from __future__ import annotations

import torch

from sglang_cp_shared_kv.model_executor.per_owner_decode.decode_topk_merge import (
    compact_owned_indices,
)

DECODE_IMPLS = ("flashmla_kv", "flashmla_sparse", "fa3")
KV_DTYPE_OF_IMPL = {"flashmla_kv": "fp8", "flashmla_sparse": "bf16", "fa3": "bf16"}
PAGE = 64
KV_LORA_RANK = 512


def flashmla_kv_call(kernel, q, rows, indices, sm_scale, cache_seqlens, tile_metadata, num_splits):
    """``kernel``: ``flash_mla_with_kvcache``; ``cache_seqlens`` [B] int32 (sglang's
    ``nsa_cache_seqlens_int32``) and the tile metadata ``get_mla_metadata`` made from them."""
    batch, heads = q.shape[0], q.shape[1]
    out, lse = kernel(
        q=q.view(batch, 1, heads, -1),
        k_cache=rows.view(torch.float8_e4m3fn).view(-1, PAGE, 1, rows.shape[-1]),
        block_table=torch.empty((batch, 0), dtype=torch.int32, device=q.device),
        cache_seqlens=cache_seqlens,
        head_dim_v=KV_LORA_RANK,
        tile_scheduler_metadata=tile_metadata,
        num_splits=num_splits,
        softmax_scale=sm_scale,
        indices=indices.view(batch, 1, -1).to(torch.int32),
        is_fp8_kvcache=True,
    )
    return out[:, 0], lse[:, :, 0]


def flashmla_sparse_call(kernel, q, rows, indices, sm_scale):
    """``kernel``: ``flash_mla_sparse_fwd``; returns its base-2 LSE."""
    out, _, lse = kernel(
        q=q.contiguous(),
        kv=rows[:, None].contiguous(),
        indices=indices[:, None].to(torch.int32).contiguous(),
        sm_scale=sm_scale,
        d_v=KV_LORA_RANK,
    )
    return out, lse


def fa3_call(kernel, q, rows, indices, sm_scale, seq_lens):
    """``kernel``: ``flash_attn_with_kvcache``; ``seq_lens`` [B] the requests' lengths (sglang's
    ``cu_seqlens_k`` is the cumsum of them capped at k; the kernel reads ``cache_seqlens``)."""
    table, owned_counts = compact_owned_indices(indices.to(torch.int32))
    batch = q.shape[0]
    nsa_seq_lens = seq_lens.clamp(max=indices.shape[1]).to(torch.int32)
    out, lse, *_ = kernel(
        q=q[:, :, KV_LORA_RANK:],
        k_cache=rows[:, KV_LORA_RANK:].view(-1, 1, 1, rows.shape[-1] - KV_LORA_RANK),
        v_cache=rows[:, :KV_LORA_RANK].view(-1, 1, 1, KV_LORA_RANK),
        qv=q[:, :, :KV_LORA_RANK],
        page_table=table,
        cache_seqlens=owned_counts,
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=q.device),
        cu_seqlens_k_new=torch.nn.functional.pad(nsa_seq_lens.cumsum(0, dtype=torch.int32), (1, 0)),
        max_seqlen_q=1,
        softmax_scale=sm_scale,
        causal=True,
        return_softmax_lse=True,
    )
    return out, lse.t()
