"""Page-granular ownership of the shared KV cache across a context-parallel group.

Everything above the device pool (radix tree, ``req_to_token``, allocator, scheduler) sees *logical*
token locs; each rank's pool buffers are indexed by *physical* rows. The boundary is this bijection:

    logical page q  ->  owner rank  q % cp_size,  physical page  q // cp_size   (slot offset kept)
    logical loc  l  =  q * page_size + s           physical loc  p = (q // cp_size) * page_size + s

so a rank's physical pool holds every ``cp_size``-th logical page. Logical pages ``0 .. cp_size-1``
map to physical page 0 on every rank, which sglang keeps as the dummy page that padded tokens write
into; the allocator never hands them out.

The class is stateless arithmetic: no pools, trees or process groups, and the only home of the formula
above. Ownership is a property of pages, so the formula is written once, on pages: ``owner_of_page``,
``physical_page_of``, ``logical_page_of`` take an int, a NumPy array or a tensor (element-wise, type
kept), and ``rows_of_pages`` expands page heads to rows. Host-side planners (allocator, HiCache
controller, peer-page plan) decide on page numbers and expand once; the per-loc torch methods at the end
serve the owner-filtered writes, which see one loc per token inside a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class CpSharedKVLayout:
    cp_size: int
    cp_rank: int
    page_size: int

    def __post_init__(self):
        for name in ("cp_size", "cp_rank", "page_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if self.cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {self.cp_size}")
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"cp_rank must be in [0, {self.cp_size}), got {self.cp_rank}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")

    # ---- pages (an int, a NumPy array or a tensor, element-wise) ----

    def owner_of_page(self, logical_page):
        """Rank that stores ``logical_page``."""
        return logical_page % self.cp_size

    def physical_page_of(self, logical_page):
        """Physical page of a logical page on its owner (ownership not checked: see
        ``owner_of_page``). Physical page 0 is the dummy page."""
        return logical_page // self.cp_size

    def logical_page_of(self, physical_page, rank: int | None = None):
        """Logical page stored at ``physical_page`` on ``rank`` (this rank by default)."""
        rank = self.cp_rank if rank is None else rank
        return physical_page * self.cp_size + rank

    def rows_of_pages(self, page_heads):
        """Every row of the pages starting at ``page_heads``, page by page (a NumPy array or a tensor;
        dtype and device kept).

        Unit-free (logical locs, physical rows, host slots, node-local positions alike): ownership is
        a per-page property, so callers decide on page heads and expand here.
        """
        if isinstance(page_heads, np.ndarray):
            slots = np.arange(self.page_size, dtype=page_heads.dtype)
        else:
            slots = _slot_offsets(self.page_size, page_heads.dtype, page_heads.device)
        return (page_heads[:, None] + slots).reshape(-1)

    # ---- logical locs, one per token (torch: any device, int32 or int64, dtype kept) ----

    def owned_by_this_rank(self, logical_locs: torch.Tensor) -> torch.Tensor:
        """Bool mask of the logical locs this rank stores."""
        return self.owner_of_page(_page_of(logical_locs, self.page_size)) == self.cp_rank

    def physical_locs_or_dummy(self, logical_locs: torch.Tensor) -> torch.Tensor:
        """Physical rows for owned locs; every other loc goes to its slot of physical page 0.

        Physical page 0 is the dummy page on every rank, so writing a whole batch through this
        map stores owned rows and sinks the rest. Same shape, no host sync (CUDA-graph safe).
        """
        slot = logical_locs % self.page_size
        physical = self.physical_page_of(_page_of(logical_locs, self.page_size)) * self.page_size
        return torch.where(self.owned_by_this_rank(logical_locs), physical + slot, slot)


def _page_of(logical_locs: torch.Tensor, page_size: int) -> torch.Tensor:
    return torch.div(logical_locs, page_size, rounding_mode="floor")


@functools.lru_cache(maxsize=None)
def _slot_offsets(page_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``0 .. page_size-1`` on ``device``, made once: ``rows_of_pages`` runs on every allocation."""
    return torch.arange(page_size, dtype=dtype, device=device)
