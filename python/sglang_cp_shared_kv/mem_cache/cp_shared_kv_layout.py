"""Page-granular ownership of the shared KV cache across a context-parallel group.

Everything above the device pool (radix tree, ``req_to_token``, allocator, scheduler) sees *logical*
token locs; each rank's pool buffers are indexed by *physical* rows. The boundary is this bijection:

    logical page q  ->  owner rank  q % cp_size,  physical page  q // cp_size   (slot offset kept)
    logical loc  l  =  q * page_size + s           physical loc  p = (q // cp_size) * page_size + s

so a rank's physical pool holds every ``cp_size``-th logical page. Logical pages ``0 .. cp_size-1``
map to physical page 0 on every rank, which sglang keeps as the dummy page that padded tokens write
into; the allocator never hands them out.

The class is stateless arithmetic: no pools, trees or process groups. Every per-loc method has a torch
form (any device, int32 or int64, dtype preserved) and a NumPy twin with the ``_np`` suffix; the page
helpers at the end take page numbers (ints or NumPy arrays) or page heads.
"""

from __future__ import annotations

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

    # ---- logical -> owner / physical (torch) ----

    def owner_of(self, logical_locs: torch.Tensor) -> torch.Tensor:
        """Rank that stores each logical loc."""
        return torch.div(logical_locs, self.page_size, rounding_mode="floor") % self.cp_size

    def owned_by_this_rank(self, logical_locs: torch.Tensor) -> torch.Tensor:
        """Bool mask of the logical locs this rank stores."""
        return self.owner_of(logical_locs) == self.cp_rank

    def logical_locs_to_physical(self, logical_locs: torch.Tensor) -> torch.Tensor:
        """Physical rows of owned logical locs; raises if any loc belongs to another rank."""
        if logical_locs.numel() and not bool(self.owned_by_this_rank(logical_locs).all()):
            raise ValueError(
                f"logical_locs_to_physical: locs not owned by cp_rank {self.cp_rank} "
                f"(cp_size {self.cp_size}, page_size {self.page_size})"
            )
        return self._to_physical(logical_locs)

    def physical_locs_to_logical(self, physical_locs: torch.Tensor) -> torch.Tensor:
        """Logical locs of this rank's physical rows (inverse of ``logical_locs_to_physical``)."""
        if physical_locs.numel() and bool((physical_locs < 0).any()):
            raise ValueError("physical_locs_to_logical: negative physical loc")
        page = torch.div(physical_locs, self.page_size, rounding_mode="floor")
        return (page * self.cp_size + self.cp_rank) * self.page_size + physical_locs % self.page_size

    def physical_locs_or_dummy(self, logical_locs: torch.Tensor) -> torch.Tensor:
        """Physical rows for owned locs; every other loc goes to its slot of physical page 0.

        Physical page 0 is the dummy page on every rank, so writing a whole batch through this
        map stores owned rows and sinks the rest. Same shape, no host sync (CUDA-graph safe).
        """
        return torch.where(
            self.owned_by_this_rank(logical_locs),
            self._to_physical(logical_locs),
            logical_locs % self.page_size,
        )

    def _to_physical(self, logical_locs: torch.Tensor) -> torch.Tensor:
        """The bijection without the ownership check (valid only for owned locs)."""
        page = torch.div(logical_locs, self.page_size, rounding_mode="floor")
        return torch.div(page, self.cp_size, rounding_mode="floor") * self.page_size + (
            logical_locs % self.page_size
        )

    # ---- NumPy twins ----

    def owner_of_np(self, logical_locs: np.ndarray) -> np.ndarray:
        return (np.asarray(logical_locs) // self.page_size) % self.cp_size

    def owned_by_this_rank_np(self, logical_locs: np.ndarray) -> np.ndarray:
        return self.owner_of_np(logical_locs) == self.cp_rank

    def logical_locs_to_physical_np(self, logical_locs: np.ndarray) -> np.ndarray:
        locs = np.asarray(logical_locs)
        if locs.size and not self.owned_by_this_rank_np(locs).all():
            raise ValueError(
                f"logical_locs_to_physical_np: locs not owned by cp_rank {self.cp_rank} "
                f"(cp_size {self.cp_size}, page_size {self.page_size})"
            )
        return (locs // self.page_size // self.cp_size) * self.page_size + locs % self.page_size

    def physical_locs_to_logical_np(self, physical_locs: np.ndarray) -> np.ndarray:
        locs = np.asarray(physical_locs)
        if locs.size and (locs < 0).any():
            raise ValueError("physical_locs_to_logical_np: negative physical loc")
        page = locs // self.page_size
        return (page * self.cp_size + self.cp_rank) * self.page_size + locs % self.page_size

    # ---- pages (an int, or a NumPy array of page numbers element-wise) ----

    def owner_of_page(self, logical_page):
        return logical_page % self.cp_size

    def physical_page_of(self, logical_page):
        """Physical page of an owned logical page (ownership not checked: see ``owner_of_page``)."""
        return logical_page // self.cp_size

    def logical_page_of(self, physical_page: int, rank: int | None = None) -> int:
        """Logical page stored at ``physical_page`` on ``rank`` (this rank by default)."""
        rank = self.cp_rank if rank is None else rank
        return physical_page * self.cp_size + rank

    def rows_of_pages(self, page_first_rows: torch.Tensor) -> torch.Tensor:
        """Every row of the pages starting at ``page_first_rows``, page by page (same device, dtype).

        Unit-free (logical locs, physical rows, host slots, node-local positions alike): ownership is
        a per-page property, so callers decide on page heads and expand here.
        """
        slots = torch.arange(
            self.page_size, dtype=page_first_rows.dtype, device=page_first_rows.device
        )
        return (page_first_rows[:, None] + slots).reshape(-1)

    def for_rank(self, cp_rank: int) -> "CpSharedKVLayout":
        """The same layout seen from another rank of the group."""
        return CpSharedKVLayout(self.cp_size, cp_rank, self.page_size)
