"""The gather scratch: two slots, each one layer of KV and indexer K for the pages a forward reads.

Each slot is a real ``NSATokenToKVPool`` with ``layer_num=1``, so sglang's own setters and getters
read and write it with the pool's exact row formats (bf16 576-wide rows, fp8 656-byte rows,
132-byte indexer rows per token).

* Slot 0 is used for all layers by every forward that does not prefetch. Its size comes from
  ``startup_rules.ScratchSizing``: when a decode forward may gather, ``cp_size x`` the physical
  pool's token count (= the logical capacity), so every forward fits (a batch cannot reference
  more pages than exist, see ``build_peer_page_plan``); when decode runs per owner, what one
  prefill batch may reference (admission caps batches to it).
* Slot 1 (``prefetch_slot_tokens``, requested in ``startup_rules``) lets a prefill forward
  gather layer ``l+1`` while layer ``l`` reads slot 0 (``peer_page_prefetch``). It only has to
  hold what one prefill forward references, so by default it is sized from the context length
  plus the chunked-prefill budget (+25% for owner padding), capped at the logical capacity; a
  forward that does not fit runs the serial path.

Layers reuse the slots one after another, so the scratch costs at most ``cp_size / num_layers`` of
the physical pool for slot 0 (a fixed, prefill-sized amount when decode runs per owner) plus slot
1's share, not a replica. Its memory is reserved before
sglang sizes the pool (``reserve_scratch_bytes``): without that the pool would take the whole
profiled budget and the scratch would not fit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
from sglang_cp_shared_kv.settings import PREFETCH_SLOT_TOKENS_ENV

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


def prefetch_slot_tokens(requested_tokens: int, logical_tokens: int, page_size: int) -> int:
    """Tokens of slot 1: the request rounded up to pages, at most the logical capacity (slot 0)."""
    pages = -(-max(requested_tokens, 0) // page_size)
    return min(pages * page_size, logical_tokens)


def reserve_scratch_bytes(
    available_bytes: int,
    unreserved_physical_tokens: int,
    cp_size: int,
    kv_row_bytes: int,
    page_size: int,
    index_head_dim: int = NSA_INDEX_HEAD_DIM,
    requested_prefetch_slot_tokens: int = 0,
    prefill_slot0_tokens: Optional[int] = None,
) -> int:
    """KV-budget bytes to hold back for both scratch slots.

    ``unreserved_physical_tokens`` is what the pool would get from the whole ``available_bytes``;
    the pool sized from what remains is no larger, so both of its slots fit the reservation (both
    are capped at the logical capacity, which can only shrink). ``prefill_slot0_tokens``: slot 0's
    prefill-only size (``ScratchSizing.prefill_tokens``); None: the logical capacity.
    """
    logical_tokens = cp_size * unreserved_physical_tokens
    slot1_tokens = prefetch_slot_tokens(requested_prefetch_slot_tokens, logical_tokens, page_size)
    slot0_tokens = slot0_scratch_tokens(prefill_slot0_tokens, logical_tokens, page_size)
    reserve = scratch_bytes(slot0_tokens, kv_row_bytes, page_size, index_head_dim)
    if slot1_tokens > 0:
        reserve += scratch_bytes(slot1_tokens, kv_row_bytes, page_size, index_head_dim)
    if reserve >= available_bytes:
        raise ValueError(
            f"--enable-nsa-prefill-cp-shared-kv: the gather scratch needs {reserve} bytes but only "
            f"{available_bytes} bytes are available for the KV cache; raise --mem-fraction-static"
            f" (or lower {PREFETCH_SLOT_TOKENS_ENV})"
        )
    return reserve


def slot0_scratch_tokens(prefill_tokens: Optional[int], logical_tokens: int, page_size: int) -> int:
    """Slot 0's tokens: the logical capacity, or ``prefill_tokens`` rounded up to pages and capped
    at it (see ``startup_rules.scratch_sizing``)."""
    if prefill_tokens is None:
        return logical_tokens
    return min(-(-prefill_tokens // page_size) * page_size, logical_tokens)


def create_gather_scratch(
    pool: NSATokenToKVPool, cp_size: int, prefill_tokens: Optional[int] = None
) -> NSATokenToKVPool:
    """Allocate slot 0 for ``pool``: one layer of ``cp_size * pool.size`` tokens, or of
    ``slot0_scratch_tokens(prefill_tokens, ...)`` when decode does not gather."""
    tokens = slot0_scratch_tokens(prefill_tokens, cp_size * pool.size, pool.page_size)
    return _scratch_pool(pool, tokens, "slot 0")


def create_prefetch_slot(
    pool: NSATokenToKVPool, cp_size: int, requested_tokens: int
) -> Optional[NSATokenToKVPool]:
    """Allocate slot 1 (``prefetch_slot_tokens``); None when that is 0 tokens (prefetch off)."""
    tokens = prefetch_slot_tokens(requested_tokens, cp_size * pool.size, pool.page_size)
    return _scratch_pool(pool, tokens, "slot 1") if tokens > 0 else None


def _scratch_pool(pool: NSATokenToKVPool, scratch_tokens: int, name: str) -> NSATokenToKVPool:
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
            f"--enable-nsa-prefill-cp-shared-kv: cannot allocate the gather scratch {name} "
            f"({scratch_tokens} tokens, one layer); lower --mem-fraction-static or "
            f"--max-total-tokens"
        ) from error
    logger.info(
        "CP shared KV gather scratch %s: %d logical tokens x 1 layer (%.2f GB); the 'KV Cache is "
        "allocated' line above is this scratch",
        name,
        scratch_tokens,
        scratch.get_kv_size_bytes() / (1 << 30),
    )
    return scratch
