"""The gather scratch: one layer of KV and indexer K for every page a forward may reference.

It is a real ``NSATokenToKVPool`` with ``layer_num=1`` and ``cp_size x`` the physical pool's token
count (= the logical capacity), so sglang's own setters and getters read and write it with the
pool's exact row formats (bf16 576-wide rows, fp8 656-byte rows, 132-byte indexer rows per token).
Layers reuse it one after another (stream order), so it costs ``cp_size / num_layers`` of the
physical pool, not a replica. Sizing it from the logical capacity makes every forward fit: a batch
cannot reference more pages than exist (see ``build_peer_page_plan``).

Its memory is reserved before sglang sizes the pool (``reserve_scratch_bytes``): without that the
pool would take the whole profiled budget and the scratch would not fit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

logger = logging.getLogger(__name__)

SCRATCH_LAYER_ID = 0  # the scratch pool's only layer
# The indexer head dim of GLM-5 / DeepSeek-V3.2, and the only one NSATokenToKVPool accepts (it asserts).
NSA_INDEX_HEAD_DIM = 128


@dataclass(frozen=True)
class _ScratchLayer:
    """Stands in for the ``RadixAttention`` argument of the pool setters, which read only ``layer_id``."""

    layer_id: int = SCRATCH_LAYER_ID


SCRATCH_LAYER = _ScratchLayer()


def index_k_bytes_per_token(index_head_dim: int = NSA_INDEX_HEAD_DIM) -> int:
    """Indexer bytes per token as ``NSATokenToKVPool`` lays them out: one byte per fp8 K value and one
    fp32 scale per ``quant_block_size`` values, read from the pool class rather than restated here."""
    pool = NSATokenToKVPool
    values_and_scales = index_head_dim + index_head_dim // pool.quant_block_size * 4
    return values_and_scales * torch.empty(0, dtype=pool.index_k_with_scale_buffer_dtype).element_size()


def scratch_bytes(
    scratch_tokens: int,
    kv_row_bytes: int,
    page_size: int,
    index_head_dim: int = NSA_INDEX_HEAD_DIM,
) -> int:
    """Bytes of a scratch of ``scratch_tokens`` (logical) tokens, as ``NSATokenToKVPool`` allocates them."""
    kv_rows = scratch_tokens + page_size  # + dummy page 0
    index_pages = (scratch_tokens + page_size + 1) // page_size
    return kv_rows * kv_row_bytes + index_pages * page_size * index_k_bytes_per_token(index_head_dim)


def reserve_scratch_bytes(
    available_bytes: int,
    unreserved_physical_tokens: int,
    cp_size: int,
    kv_row_bytes: int,
    page_size: int,
    index_head_dim: int = NSA_INDEX_HEAD_DIM,
) -> int:
    """KV-budget bytes to hold back for the scratch.

    ``unreserved_physical_tokens`` is what the pool would get from the whole ``available_bytes``;
    the pool sized from what remains is no larger, so its scratch fits the reservation.
    """
    reserve = scratch_bytes(
        cp_size * unreserved_physical_tokens, kv_row_bytes, page_size, index_head_dim
    )
    if reserve >= available_bytes:
        raise ValueError(
            f"--enable-nsa-prefill-cp-shared-kv: the gather scratch needs {reserve} bytes but only "
            f"{available_bytes} bytes are available for the KV cache; raise --mem-fraction-static"
        )
    return reserve


def create_gather_scratch(pool: NSATokenToKVPool, cp_size: int) -> NSATokenToKVPool:
    """Allocate the scratch for ``pool`` (one layer, ``cp_size * pool.size`` tokens)."""
    scratch_tokens = cp_size * pool.size
    try:
        scratch = NSATokenToKVPool(
            size=scratch_tokens,
            page_size=pool.page_size,
            kv_lora_rank=pool.kv_lora_rank,
            dtype=pool.dtype,
            qk_rope_head_dim=pool.qk_rope_head_dim,
            layer_num=1,
            device=pool.device,
            index_head_dim=pool.index_head_dim,
            enable_memory_saver=False,
            kv_cache_dim=pool.kv_cache_dim,
        )
    except torch.OutOfMemoryError as error:
        raise RuntimeError(
            f"--enable-nsa-prefill-cp-shared-kv: cannot allocate the gather scratch "
            f"({scratch_tokens} tokens, one layer); lower --mem-fraction-static or "
            f"--max-total-tokens"
        ) from error
    logger.info(
        "CP shared KV gather scratch: %d logical tokens x 1 layer (%.2f GB); the 'KV Cache is "
        "allocated' line above is this scratch",
        scratch_tokens,
        scratch.get_kv_size_bytes() / (1 << 30),
    )
    return scratch
