"""Torch stand-ins for the Triton kernels inside sglang's NSA pool stores and indexer-K reads.

On a machine without a GPU, sglang's own ``NSATokenToKVPool.set_mla_kv_buffer``,
``set_index_k_scale_buffer``, ``get_index_k_scale_buffer`` and ``Indexer._store_index_k_cache``
(whose non-CUDA branch is ``act_quant`` + ``set_index_k_scale_buffer``) stop at a Triton kernel.
``cpu_kernels()`` swaps just those kernels for torch code with the same byte layouts, so the real
sglang methods (and our hooks around them) run on CPU:

* ``memory_pool.quantize_k_cache_separate`` -> ``quantize_k_cache_separate_torch``
  (fp8 rows: 512 fp8 nope | 4 fp32 tile scales | 64 bf16 rope = 656 bytes);
* ``memory_pool.set_mla_kv_buffer_triton`` -> ``set_mla_kv_rows_torch``;
* ``index_buf_accessor.SetKAndS.execute`` / ``GetKAndS.execute`` -> ``set_k_and_s_torch`` /
  ``get_k_and_s_torch`` (page = loc // 64: 64 x 128 fp8 K then 64 fp32 scales);
* ``act_quant_torch`` for the ``act_quant`` argument of ``_store_index_k_cache``.

The quantizers are plain torch, so two pools written through them agree bit for bit, but their
bytes are not claimed equal to the CUDA kernels' bytes.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

from sglang.srt.layers.attention.nsa import index_buf_accessor
from sglang.srt.mem_cache import memory_pool

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INDEX_HEAD_DIM = 128


def _quantize_tiles(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tile absmax fp8: returns (fp8 values shaped like ``x``, fp32 scales [rows, tiles])."""
    tiles = x.float().reshape(x.shape[0], -1, tile)
    scale = (tiles.abs().amax(dim=-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    values = (tiles / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values.reshape(x.shape), scale


def quantize_k_cache_separate_torch(k_nope: torch.Tensor, k_rope: torch.Tensor, tile_size=128):
    nope = k_nope.reshape(k_nope.shape[0], -1)
    rope = k_rope.reshape(k_rope.shape[0], -1)
    values, scale = _quantize_tiles(nope, tile_size)
    nope_part = torch.cat([values.view(torch.uint8), scale.view(torch.uint8)], dim=-1)
    rope_part = rope.to(torch.bfloat16).contiguous().view(torch.uint8)
    return nope_part.unsqueeze(1), rope_part.unsqueeze(1)


def set_mla_kv_rows_torch(kv_buffer, loc, cache_k_nope, cache_k_rope):
    rows = torch.cat([cache_k_nope, cache_k_rope], dim=-1)
    kv_buffer[loc.long()] = rows.reshape(-1, *kv_buffer.shape[1:])


def act_quant_torch(x: torch.Tensor, block_size: int = 128, scale_fmt=None):
    values, scale = _quantize_tiles(x.reshape(-1, x.shape[-1]), block_size)
    return values.reshape(x.shape), scale.reshape(*x.shape[:-1], -1)


def _index_byte_offsets(pool, buf, locs: torch.Tensor):
    """Flat byte offsets of each loc's K bytes [n, 128] and scale bytes [n, 4] in ``buf``."""
    page = torch.div(locs, pool.page_size, rounding_mode="floor")
    slot = locs % pool.page_size
    base = page * buf.shape[1]
    k = (base + slot * INDEX_HEAD_DIM)[:, None] + torch.arange(INDEX_HEAD_DIM, device=buf.device)
    s_base = base + pool.page_size * INDEX_HEAD_DIM + slot * 4
    s = s_base[:, None] + torch.arange(4, device=buf.device)
    return k, s


def set_k_and_s_torch(*, pool, buf, loc, index_k, index_k_scale):
    k_offsets, s_offsets = _index_byte_offsets(pool, buf, loc.long())
    flat = buf.view(-1)
    flat[k_offsets] = index_k.contiguous().view(torch.uint8).reshape(k_offsets.shape)
    flat[s_offsets] = index_k_scale.contiguous().view(torch.uint8).reshape(s_offsets.shape)


def get_k_and_s_torch(pool, buf, page_indices, seq_len_tensor, seq_len_sum, max_seq_len):
    locs = []
    for request, seq_len in enumerate(seq_len_tensor.tolist()):
        positions = torch.arange(seq_len, device=buf.device)
        pages = page_indices[request, positions // pool.page_size].long()
        locs.append(pages * pool.page_size + positions % pool.page_size)
    locs = torch.cat(locs) if locs else torch.empty(0, dtype=torch.int64, device=buf.device)
    k_offsets, s_offsets = _index_byte_offsets(pool, buf, locs)
    flat = buf.view(-1)
    return flat[k_offsets], flat[s_offsets]


class IndexerStub:
    """The attributes ``Indexer._store_index_k_cache`` reads from ``self`` on its non-CUDA branch."""

    block_size = 128
    scale_fmt = None


@contextlib.contextmanager
def cpu_kernels():
    """Run sglang's NSA pool stores and indexer-K reads on CPU (see module docstring)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            mock.patch.object(memory_pool, "quantize_k_cache_separate", quantize_k_cache_separate_torch)
        )
        stack.enter_context(
            mock.patch.object(memory_pool, "set_mla_kv_buffer_triton", set_mla_kv_rows_torch)
        )
        stack.enter_context(
            mock.patch.object(index_buf_accessor.SetKAndS, "execute", staticmethod(set_k_and_s_torch))
        )
        stack.enter_context(
            mock.patch.object(index_buf_accessor.GetKAndS, "execute", staticmethod(get_k_and_s_torch))
        )
        yield
