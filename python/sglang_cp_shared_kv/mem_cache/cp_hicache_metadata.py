"""Host-backup state of one radix node under CP shared KV.

A radix node's ``value`` stays the full *logical* loc tensor (identical on every rank). Its host copy is
sharded: each rank backs up only the positions whose logical page it owns, into its own *physical* host
slots. ``CpHiCacheNodeMetadata`` records that per rank, in units that survive eviction of the device locs:

* ``logical_len``: tokens the node represents (the same on every rank).
* ``owned_positions``: node-local token positions (``0 .. logical_len-1``) this rank holds on host, sorted.
  Positions, not logical locs: the locs are freed when the node leaves the device, and the load-back
  allocates new ones.
* ``host_indices``: this rank's host slots, ``host_indices[i]`` holding position ``owned_positions[i]``.
* ``owner_ranks``: for every position, the rank that holds it on host (the same on every rank). Load-back
  must place position ``p`` on a logical page owned by ``owner_ranks[p]`` again, because only that rank
  has its bytes; the owners are recorded here so that every rank can ask the (rank-independent) allocator
  for the same placement.

* ``slots_by_rank`` (optional, NumPy int64, one entry per CP rank): the host slots each rank holds for the
  node, i.e. its positions per owner in ``owner_ranks`` (the same on every rank). Kept from the write on, so
  that host eviction gives slots back to the host-slot ledger without recounting the owners; ``split`` and
  ``concat`` carry it along. ``None`` (metadata built from outside): ``host_slots_by_rank`` counts.

All tensors are CPU tensors (tree bookkeeping is CPU-side and long-lived nodes must not pin device memory):
``owned_positions`` and ``host_indices`` int64, ``owner_ranks`` int8. A rank may own nothing in a node.

Validation: the constructor checks every invariant above (input from elsewhere). Metadata derived by this
package from data that already holds them (the controller's reservation, ``split``, ``concat``) is built
with ``derived``, which skips the checks: they cost more than the bookkeeping of a backup or load-back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

import numpy as np
import torch


@dataclass(frozen=True)
class CpHiCacheNodeMetadata:
    logical_len: int
    owned_positions: torch.Tensor
    host_indices: torch.Tensor
    owner_ranks: torch.Tensor
    slots_by_rank: Optional[np.ndarray] = field(default=None, compare=False)

    def __post_init__(self):
        if isinstance(self.logical_len, bool) or not isinstance(self.logical_len, int):
            raise TypeError(f"logical_len must be an int, got {type(self.logical_len).__name__}")
        if self.logical_len < 0:
            raise ValueError(f"logical_len must be >= 0, got {self.logical_len}")
        _check_cpu_vector("owned_positions", self.owned_positions, torch.int64)
        _check_cpu_vector("host_indices", self.host_indices, torch.int64)
        _check_cpu_vector("owner_ranks", self.owner_ranks, torch.int8)
        if len(self.owned_positions) != len(self.host_indices):
            raise ValueError(
                f"owned_positions ({len(self.owned_positions)}) and host_indices "
                f"({len(self.host_indices)}) must have the same length"
            )
        if len(self.owner_ranks) != self.logical_len:
            raise ValueError(
                f"owner_ranks must have one entry per position ({self.logical_len}), "
                f"got {len(self.owner_ranks)}"
            )
        positions = self.owned_positions
        if positions.numel():
            if int(positions[0]) < 0 or int(positions[-1]) >= self.logical_len:
                raise ValueError(
                    f"owned_positions must lie in [0, {self.logical_len}), got "
                    f"[{int(positions[0])}, {int(positions[-1])}]"
                )
            if positions.numel() > 1 and not bool((positions[1:] > positions[:-1]).all()):
                raise ValueError("owned_positions must be strictly increasing")
        if self.owner_ranks.numel() and int(self.owner_ranks.min()) < 0:
            raise ValueError("owner_ranks must be >= 0")
        if self.slots_by_rank is not None:
            slots = self.slots_by_rank
            if not isinstance(slots, np.ndarray) or slots.dtype != np.int64 or slots.ndim != 1:
                raise ValueError("slots_by_rank must be a 1-D NumPy int64 array")
            counted = _positions_by_owner(self.owner_ranks, len(slots))
            if len(counted) != len(slots) or not np.array_equal(counted, slots):
                raise ValueError(
                    f"slots_by_rank {slots.tolist()} does not count the owners ({counted.tolist()})"
                )

    @classmethod
    def derived(
        cls,
        logical_len: int,
        owned_positions: torch.Tensor,
        host_indices: torch.Tensor,
        owner_ranks: torch.Tensor,
        slots_by_rank: Optional[np.ndarray] = None,
    ) -> "CpHiCacheNodeMetadata":
        """Build without checks, for metadata derived from data that already meets the invariants
        (module docstring); anything else goes through the checking constructor."""
        metadata = object.__new__(cls)
        # Frozen dataclass: fields are set the way its generated __init__ sets them.
        object.__setattr__(metadata, "logical_len", logical_len)
        object.__setattr__(metadata, "owned_positions", owned_positions)
        object.__setattr__(metadata, "host_indices", host_indices)
        object.__setattr__(metadata, "owner_ranks", owner_ranks)
        object.__setattr__(metadata, "slots_by_rank", slots_by_rank)
        return metadata

    def host_slots_by_rank(self, cp_size: int) -> np.ndarray:
        """Host slots each of the ``cp_size`` ranks holds for the node (identical on every rank):
        ``slots_by_rank`` when kept, else the positions per owner, counted now."""
        if self.slots_by_rank is not None and len(self.slots_by_rank) == cp_size:
            return self.slots_by_rank
        return _positions_by_owner(self.owner_ranks, cp_size)

    @property
    def num_owned(self) -> int:
        """Positions (= physical host slots) this rank holds for the node."""
        return len(self.owned_positions)

    def split(self, split_len: int) -> Tuple["CpHiCacheNodeMetadata", "CpHiCacheNodeMetadata"]:
        """Metadata of ``[0, split_len)`` and of ``[split_len, logical_len)``, the latter rebased to 0.

        Host slots follow their positions (cut where the sorted positions cross ``split_len``, not after
        the first ``split_len`` entries): a rank holds only a subset of the positions, so slot i is not
        position i. The halves are views; metadata tensors are never written in place.
        """
        if isinstance(split_len, bool) or not isinstance(split_len, int):
            raise TypeError(f"split_len must be an int, got {type(split_len).__name__}")
        if split_len < 0 or split_len > self.logical_len:
            raise ValueError(f"split_len must be in [0, {self.logical_len}], got {split_len}")
        # Positions are sorted: the parent's are a prefix of them.
        num_in_parent = int(torch.searchsorted(self.owned_positions, split_len))
        parent_slots = child_slots = None
        if self.slots_by_rank is not None:
            # Each rank's slots go with its positions: count the parent's owners, the child keeps
            # the rest.
            parent_slots = _positions_by_owner(self.owner_ranks[:split_len], len(self.slots_by_rank))
            child_slots = self.slots_by_rank - parent_slots
        parent = CpHiCacheNodeMetadata.derived(
            logical_len=split_len,
            owned_positions=self.owned_positions[:num_in_parent],
            host_indices=self.host_indices[:num_in_parent],
            owner_ranks=self.owner_ranks[:split_len],
            slots_by_rank=parent_slots,
        )
        child = CpHiCacheNodeMetadata.derived(
            logical_len=self.logical_len - split_len,
            owned_positions=self.owned_positions[num_in_parent:] - split_len,
            host_indices=self.host_indices[num_in_parent:],
            owner_ranks=self.owner_ranks[split_len:],
            slots_by_rank=child_slots,
        )
        return parent, child

    @classmethod
    def concat(cls, parts: Sequence["CpHiCacheNodeMetadata"]) -> "CpHiCacheNodeMetadata":
        """One metadata for consecutive nodes (a load-back path); positions are shifted by the
        logical lengths before them."""
        if not parts:
            raise ValueError("concat needs at least one metadata")
        if len(parts) == 1:
            return parts[0]  # frozen, and its tensors are never written in place
        shifted_positions = []
        offset = 0
        for part in parts:
            shifted_positions.append(part.owned_positions + offset)
            offset += part.logical_len
        slots = [p.slots_by_rank for p in parts]
        if any(s is None for s in slots) or len({len(s) for s in slots}) != 1:
            slots = None
        else:
            slots = np.sum(slots, axis=0)
        # Each part's positions are sorted and inside its own length, so the shifted ones stay so.
        return cls.derived(
            logical_len=offset,
            owned_positions=torch.cat(shifted_positions),
            host_indices=torch.cat([p.host_indices for p in parts]),
            owner_ranks=torch.cat([p.owner_ranks for p in parts]),
            slots_by_rank=slots,
        )


def _positions_by_owner(owner_ranks: torch.Tensor, cp_size: int) -> np.ndarray:
    """Positions of each rank in ``owner_ranks`` (int64, at least ``cp_size`` entries)."""
    return np.bincount(owner_ranks.numpy(), minlength=cp_size).astype(np.int64, copy=False)


def _check_cpu_vector(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got device {tensor.device}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
    if tensor.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
