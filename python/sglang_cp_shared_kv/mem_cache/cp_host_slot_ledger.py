"""Free physical host slots of every CP rank, known on every rank without a collective.

Each rank's host pool holds only the pages it owns, so a node's backup may fit on one rank and not on
another, and the ranks must still take one decision (the tree is identical everywhere). Asking the group
costs a blocking all-reduce per written node. It does not have to be asked: host slots are taken only
by the write of a tree node and given back only by the host eviction of one (and all at once by a
reset), both in the same order on every rank, and how many slots a node takes on rank ``r`` is the
number of its positions on pages ``r`` owns, which follows from its logical locs (identical on every
rank). So every rank keeps every rank's free count and reaches, alone, the answer every other rank
reaches: does this write fit everywhere, and how far must host eviction go.

The ledger is only as right as that premise, so each rank checks its own entry against its host pool
after every change: slots taken or freed behind the tree's back fail loudly here instead of letting the
ranks' trees drift apart.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class CpHostSlotLedger:
    """Free host slots per CP rank (``free[r]``), identical on every rank."""

    def __init__(self, capacity_by_rank: Sequence[int], cp_rank: int, page_size: int, host_pool):
        self.capacity = np.asarray(capacity_by_rank, dtype=np.int64)
        self.free = self.capacity.copy()
        self.cp_rank = cp_rank
        self.page_size = page_size
        self._host_pool = host_pool  # only read, for the check of this rank's own entry
        self.check_own_entry("at start")

    @property
    def cp_size(self) -> int:
        return len(self.capacity)

    def slots_of_pages(self, page_owners: np.ndarray) -> np.ndarray:
        """Host slots each rank needs for pages owned by ``page_owners`` (one entry per page)."""
        counts = np.bincount(page_owners, minlength=self.cp_size).astype(np.int64, copy=False)
        return counts * self.page_size

    def shortfall(self, slots_by_rank: np.ndarray) -> np.ndarray:
        """Slots each rank must free before ``slots_by_rank`` fits (0 where it fits already)."""
        return np.maximum(slots_by_rank - self.free, 0)

    def fits(self, slots_by_rank: np.ndarray) -> bool:
        # count_nonzero, not .all(): a C call without NumPy's Python wrapper (a few ranks per call).
        return not np.count_nonzero(slots_by_rank > self.free)

    def take(self, slots_by_rank: np.ndarray) -> None:
        """Slots of a node just written (this rank's already taken from its host pool)."""
        if not self.fits(slots_by_rank):
            raise RuntimeError(
                f"CP HiCache host ledger: taking {slots_by_rank.tolist()} slots, only "
                f"{self.free.tolist()} free"
            )
        self.free -= slots_by_rank
        self.check_own_entry("after a host write")

    def give_back(self, slots_by_rank: np.ndarray) -> None:
        """Slots of a node just evicted from host (this rank's already freed in its host pool)."""
        self.free += slots_by_rank
        if np.count_nonzero(self.free > self.capacity):
            raise RuntimeError(
                f"CP HiCache host ledger: {self.free.tolist()} slots free, more than the "
                f"{self.capacity.tolist()} that exist"
            )
        self.check_own_entry("after a host eviction")

    def reset(self) -> None:
        """Every slot free again (the host pools were cleared with the tree)."""
        self.free[:] = self.capacity
        self.check_own_entry("after a reset")

    def check_own_entry(self, when: str) -> None:
        actual = self._host_pool.available_size()
        if actual != self.free[self.cp_rank]:
            raise RuntimeError(
                f"CP HiCache host ledger of cp rank {self.cp_rank} counts {int(self.free[self.cp_rank])} "
                f"free host slots {when}, but its host pool has {actual}: host slots were taken or "
                "freed outside CpHiRadixCache, and the CP ranks' trees would no longer agree"
            )
