"""One store per layer: this forward's rows go into the scratch slot, owned ones are copied to the pool.

sglang's setters quantize while they store (fp8 KV rows, the indexer's act-quant), so storing the
batch twice (pool, then scratch) quantizes twice. Instead the hooks run sglang's setter once, on
the scratch slot at the rows' scratch locs (``PeerPagePlan.remap_token_locs``), and copy the stored
bytes of every row to its physical row (``CpSharedKVLayout.physical_locs_or_dummy``: owned rows to
their physical row, the others into the dummy page 0, as the owner-filtered store did).

The maps are the same for every layer of a forward, so ``BatchRowMaps`` is built once per forward
(per locs tensor) and reused by every layer's KV and indexer store.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.model_executor.peer_page_plan import PeerPagePlan


@dataclass(frozen=True)
class BatchRowMaps:
    """Where the rows of one forward's stores go (one entry per token of ``out_cache_loc``)."""

    scratch_locs: torch.Tensor  # scratch-slot rows, the locs' dtype (what sglang's setters take)
    scratch_rows: torch.Tensor  # the same, int64 (for index_select / index_put)
    physical_rows: torch.Tensor  # this rank's physical rows, non-owned -> dummy page 0; int64
    # (page, slot) of both, for the paged indexer buffer.
    scratch_page_slot: tuple
    physical_page_slot: tuple


def batch_row_maps(
    plan: PeerPagePlan, layout: CpSharedKVLayout, logical_locs: torch.Tensor
) -> BatchRowMaps:
    page_size = layout.page_size
    scratch_locs = plan.remap_token_locs(logical_locs)
    scratch_rows = scratch_locs.long()
    physical_rows = layout.physical_locs_or_dummy(logical_locs).long()
    return BatchRowMaps(
        scratch_locs=scratch_locs,
        scratch_rows=scratch_rows,
        physical_rows=physical_rows,
        scratch_page_slot=(scratch_rows // page_size, scratch_rows % page_size),
        physical_page_slot=(physical_rows // page_size, physical_rows % page_size),
    )


def copy_kv_rows(slot_kv: torch.Tensor, pool_kv: torch.Tensor, maps: BatchRowMaps) -> None:
    """Raw bytes of the stored KV rows, slot ``[rows, 1, dim]`` -> pool (same dtype and width)."""
    pool_kv.index_copy_(0, maps.physical_rows, slot_kv.index_select(0, maps.scratch_rows))


def copy_index_k_rows(
    slot_pages: torch.Tensor,
    pool_pages: torch.Tensor,
    maps: BatchRowMaps,
    page_size: int,
    index_head_dim: int,
) -> None:
    """Raw bytes of the stored indexer rows between paged buffers.

    A page of ``NSATokenToKVPool.index_k_with_scale_buffer`` is ``page_size * index_head_dim`` fp8
    K bytes (token-major) followed by the tokens' scale bytes, so a token's row is two pieces;
    both are copied.
    """
    k_bytes = page_size * index_head_dim
    scale_bytes = pool_pages.shape[1] // page_size - index_head_dim

    def parts(pages: torch.Tensor):
        return (
            pages[:, :k_bytes].view(pages.shape[0], page_size, index_head_dim),
            pages[:, k_bytes:].view(pages.shape[0], page_size, scale_bytes),
        )

    for src, dst in zip(parts(slot_pages), parts(pool_pages)):
        dst.index_put_(maps.physical_page_slot, src[maps.scratch_page_slot])
