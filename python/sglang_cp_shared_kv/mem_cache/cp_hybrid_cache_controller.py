"""The HiCache transfer controller under CP shared KV: logical locs in, owned physical shards moved.

Above this controller everything is logical (radix ``node.value``, the allocator); below it the device pool
and the host pools are this rank's physical shards. The translation happens here and nowhere else:

* write: the owned subset of a node's logical locs (``CpSharedKVLayout``) becomes physical device rows,
  host slots are taken for those rows only, and KV and the NSA indexer move for exactly the same rows.
* load: full logical locs are allocated (same decision on every rank), the positions this rank holds on
  host pick their new logical locs, those become physical rows, and only owned pairs move.

Both operations are split in two (plan or allocate, then transfer) so that every rank can reach the same
decision before any rank commits tree state: a write's host slots by the cache's host-slot ledger
(``CpHostSlotLedger``), a load-back's device locs by an agreement (see ``CpHiRadixCache`` and
``docs/cp-hicache.md``).

The MTP draft pool (``set_draft_kv_pool``; its host pools come from ``cp_hicache_draft_pool``) is
sharded by the target's layout, so its rows of a node are the target's physical rows: every write and
load moves the draft's KV and indexer K at exactly the target's host slots and device rows, inside the
same copy, and adds no host slot, ack or load operation of its own.

Acknowledgement cardinality: ``CpHiRadixCache.writing_check`` and ``loading_check`` pop acks after a MIN
all-reduce of completed counts, so every rank must produce one ack per write and one load operation per
load even when it owns nothing in the node.
A rank that owns nothing records a completed ack / an empty load op and launches no transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch

from sglang.srt.managers.cache_controller import HiCacheAck
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
    CacheOperation,
    HybridCacheController,
)
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
from sglang.srt.mem_cache.memory_pool_host import HostPoolGroup
from sglang.srt.utils import get_device_module

from sglang_cp_shared_kv.observability.cp_shared_kv_metrics import metrics as cp_metrics
from sglang_cp_shared_kv.mem_cache.cp_hicache_metadata import CpHiCacheNodeMetadata
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG

device_module = get_device_module()


@dataclass
class CpWriteReservation:
    """What one rank needs to back up one node, and the host slots it got (``None``: not enough)."""

    logical_len: int
    page_owners: np.ndarray  # owner rank of each page of the node, identical on every rank
    owned_positions: torch.Tensor  # CPU int64, node-local
    owner_ranks: torch.Tensor  # CPU int8, one per position, identical on every rank
    physical_device_indices: torch.Tensor  # rows of this rank's device pool, on the device
    host_indices: Optional[torch.Tensor]  # CPU int64 host slots, None if the host pool was short

    @property
    def required_host_slots(self) -> int:
        """Physical host slots this rank needs for the node (0 if it owns nothing in it)."""
        return self.owned_positions.shape[0]

    @property
    def ok(self) -> bool:
        return self.host_indices is not None


class CpHybridCacheController(HybridCacheController):
    """``HybridCacheController`` whose write/load take logical locs and move this rank's shards.

    Not constructed: ``adopt`` re-types the controller sglang's NSA assembler built inside
    ``HiRadixCache.__init__`` (``attach_hybrid_nsa_pool_to_hiradix_cache``). That assembler allocates the
    host pools (pinned and registered with CUDA in production) and registers the layer counter on the
    device pool; building a second controller would allocate host memory twice, and replacing
    ``HybridCacheController`` globally would also change the Mamba / unified caches that use it. The
    only state this subclass adds is ``layout``, which answers every ownership question.
    """

    layout: CpSharedKVLayout

    @classmethod
    def adopt(
        cls, controller: HybridCacheController, layout: CpSharedKVLayout
    ) -> "CpHybridCacheController":
        if type(controller) is not HybridCacheController:
            raise TypeError(
                f"{FLAG}: expected the stock HybridCacheController, got {type(controller).__name__}"
            )
        if not isinstance(controller.mem_pool_device, NSATokenToKVPool):
            raise ValueError(
                f"{FLAG}: HiCache needs an NSATokenToKVPool device pool, got "
                f"{type(controller.mem_pool_device).__name__}"
            )
        host = controller.mem_pool_host
        if not isinstance(host, HostPoolGroup) or host.anchor_entry.name != PoolName.KV:
            raise ValueError(f"{FLAG}: HiCache needs a host pool group anchored on the KV pool")
        for entry in host.entries:
            if entry is not host.anchor_entry and not entry.share_indices_with_anchor:
                # Such a pool would need its own owned subset; only index-sharing pools
                # (the NSA indexer) are translated here.
                raise ValueError(
                    f"{FLAG}: host pool {entry.name} does not share indices with the KV pool"
                )
        if layout.page_size != controller.page_size:
            raise ValueError(
                f"{FLAG}: layout page size {layout.page_size} != HiCache page size "
                f"{controller.page_size}"
            )
        controller.__class__ = cls
        controller.layout = layout
        if cp_metrics() is not None:
            cp_metrics().watch(controller=controller)
        return controller

    # ---- write (device -> host) ----

    def plan_host_write(self, logical_device_indices: torch.Tensor) -> CpWriteReservation:
        """Owned subset of a node's logical locs and its physical rows; no host slot taken yet.

        A node's value is whole logical pages (the allocator is paged) and ownership is a per-page
        property, so only the page heads travel to the CPU (1/page_size of the locs, one device
        sync); positions, owners and physical rows are expanded from the owned pages. The page-level
        arithmetic runs in NumPy: a few thousand heads, where torch's per-op cost would dominate.
        """
        logical_len = logical_device_indices.shape[0]
        self._check_page_aligned_len(logical_len)
        page_size, layout = self.page_size, self.layout
        logical_pages = (
            self._page_heads_on_cpu(logical_device_indices, "logical device locs") // page_size
        )
        page_owners = layout.owner_of_page(logical_pages)
        # Node-local page numbers (the method forms of NumPy's functions: no Python wrapper).
        owned_pages = (page_owners == layout.cp_rank).nonzero()[0]
        if owned_pages.shape[0] == logical_pages.shape[0]:
            # Every page is this rank's (always so at cp 1): the rows of pages 0, 1, .. are the
            # positions 0 .. logical_len-1, and the owned pages are all of them.
            owned_positions = np.arange(logical_len, dtype=np.int64)
            owned_logical_pages = logical_pages
        else:
            owned_positions = layout.rows_of_pages(owned_pages * page_size)
            owned_logical_pages = logical_pages[owned_pages]
        return CpWriteReservation(
            logical_len=logical_len,
            page_owners=page_owners,
            owned_positions=torch.from_numpy(owned_positions),
            owner_ranks=torch.from_numpy(page_owners.astype(np.int8).repeat(page_size)),
            physical_device_indices=self._physical_rows_on_device(owned_logical_pages),
            host_indices=None,
        )

    def take_host_slots(self, reservation: CpWriteReservation) -> bool:
        """Host slots for a planned write; False (nothing taken) if this rank's host pool is short."""
        if reservation.required_host_slots == 0:
            reservation.host_indices = torch.empty((0,), dtype=torch.int64)
            return True
        host_indices = self.mem_pool_host.alloc(reservation.required_host_slots)
        if host_indices is None:
            return False
        # The host pool's free list is a CPU tensor: this is a view of it, not a copy.
        host_indices = host_indices.cpu()
        self._check_host_slots_whole_pages(host_indices)
        reservation.host_indices = host_indices
        return True

    def write_reserved(
        self,
        reservation: CpWriteReservation,
        node_id: int,
        priority: Optional[int] = None,
        slots_by_rank: Optional[np.ndarray] = None,
    ) -> CpHiCacheNodeMetadata:
        """Start the device->host copy of a reservation; exactly one write ack for ``node_id``.

        ``slots_by_rank`` (every rank's host slots for the node, as the cache's ledger counted them)
        is kept in the metadata for the node's host eviction."""
        if not reservation.ok:
            raise ValueError("write_reserved needs a reservation that got its host slots")
        if reservation.required_host_slots == 0:
            self._append_completed_write_ack(node_id)
        else:
            self.write_queue.append(
                CacheOperation(
                    reservation.host_indices,
                    reservation.physical_device_indices,
                    node_id,
                    priority,
                    pool_transfers=self._index_sharing_transfers(
                        reservation.host_indices, reservation.physical_device_indices
                    ),
                )
            )
            self.start_writing()
        if cp_metrics() is not None:
            cp_metrics().host_backup_pages.inc(reservation.required_host_slots // self.page_size)
            cp_metrics().observe_usage()
        # Built from our own reservation (sorted whole-page positions, one slot each): no re-checks.
        return CpHiCacheNodeMetadata.derived(
            logical_len=reservation.logical_len,
            owned_positions=reservation.owned_positions,
            host_indices=reservation.host_indices,
            owner_ranks=reservation.owner_ranks,
            slots_by_rank=slots_by_rank,
        )

    def _append_completed_write_ack(self, node_id: int) -> None:
        # Recorded on the write stream behind earlier copies, so acks still complete in queue order.
        start_event = device_module.Event()
        finish_event = device_module.Event()
        start_event.record()
        with device_module.stream(self.write_stream):
            start_event.wait(self.write_stream)
            finish_event.record()
        self.ack_write_queue.append(HiCacheAck(start_event, finish_event, [node_id]))

    # ---- load (host -> device) ----

    def alloc_logical_locs(self, metadata: CpHiCacheNodeMetadata) -> Optional[torch.Tensor]:
        """New logical locs for ``metadata``'s positions, each page on the rank that holds it on host.

        The owners come from the metadata (identical on every rank), so the allocator takes the same
        decision on every rank; ``None`` if it cannot place them.
        """
        return self.mem_pool_device_allocator.alloc_with_owners(self.page_owners(metadata))

    def device_page_shortfall(self, metadata: CpHiCacheNodeMetadata) -> List[int]:
        """Free device pages each owner rank lacks for ``alloc_logical_locs(metadata)``."""
        return self.mem_pool_device_allocator.page_shortfall_by_owner(self.page_owners(metadata))

    def page_owners(self, metadata: CpHiCacheNodeMetadata) -> np.ndarray:
        """Owner rank of each page of ``metadata`` (identical on every rank), a view of its owners."""
        self._check_page_aligned_len(metadata.logical_len)
        # Constant within each page by construction: built per page in plan_host_write, and
        # nodes split and join only at page boundaries.
        return metadata.owner_ranks.numpy()[:: self.page_size]

    def load_reserved(
        self,
        metadata: CpHiCacheNodeMetadata,
        logical_device_indices: torch.Tensor,
        node_id: int,
        priority: Optional[int] = None,
    ) -> None:
        """Queue the host->device copy of this rank's positions into their new logical locs.

        Queues exactly one operation even when this rank holds nothing, so that ``start_loading``
        produces the same producer event on every rank.
        """
        if len(logical_device_indices) != metadata.logical_len:
            raise ValueError(
                f"load needs {metadata.logical_len} logical locs, got {len(logical_device_indices)}"
            )
        if metadata.num_owned == 0:
            operation = CacheOperation(
                torch.empty((0,), dtype=torch.int64),
                torch.empty((0,), dtype=torch.int64, device=self.device),
                node_id,
                priority,
            )
        else:
            # Owned positions are whole pages of the node (built so in plan_host_write, not
            # re-checked): map the new logical pages at those page numbers only.
            owned_pages = metadata.owned_positions.numpy()[:: self.page_size] // self.page_size
            logical_heads = self._page_heads_on_cpu(logical_device_indices, "logical device locs")
            new_logical_pages = logical_heads[owned_pages] // self.page_size
            if (self.layout.owner_of_page(new_logical_pages) != self.layout.cp_rank).any():
                # Their bytes are only on this rank's host.
                raise ValueError(
                    f"load of node {node_id}: owned pages placed on logical pages of another rank"
                )
            physical = self._physical_rows_on_device(new_logical_pages)
            operation = CacheOperation(
                metadata.host_indices,
                physical,
                node_id,
                priority,
                pool_transfers=self._index_sharing_transfers(metadata.host_indices, physical),
            )
        self.load_queue.append(operation)
        if cp_metrics() is not None:
            cp_metrics().host_load_back_pages.inc(metadata.num_owned // self.page_size)
            cp_metrics().observe_usage()

    # ---- the MTP draft pool (managers/cp_hicache_draft_pool.py builds its host pools) ----

    def set_draft_kv_pool(self, draft_device_pool, draft_host_pool) -> None:
        """Stock's registration, for a draft pool sharded like the target's and host pools that can
        hold all of it at the target's host slots (refused otherwise: its KV or indexer K would come
        back stale or truncated from host)."""
        problems = self.draft_pool_problems(draft_device_pool, draft_host_pool)
        if problems:
            raise ValueError(f"{FLAG} with --enable-hierarchical-cache: " + "; ".join(problems))
        super().set_draft_kv_pool(draft_device_pool, draft_host_pool)

    def draft_pool_problems(self, draft_device_pool, draft_host_pool) -> List[str]:
        """Why this draft pool's host copy could not share the target's host slots (empty: it can)."""
        target = self.mem_pool_device
        if not isinstance(draft_device_pool, NSATokenToKVPool):
            return [f"the draft pool is a {type(draft_device_pool).__name__}, not an NSATokenToKVPool"]
        problems = []
        for name in ("size", "page_size"):
            if getattr(draft_device_pool, name) != getattr(target, name):
                problems.append(
                    f"the draft pool's {name} is {getattr(draft_device_pool, name)}, the target's "
                    f"{getattr(target, name)} (its rows must sit at the target's physical rows)"
                )
        if draft_device_pool.layer_num > self.layer_num:
            problems.append(
                f"the draft pool has {draft_device_pool.layer_num} layers, more than the target's "
                f"{self.layer_num}"
            )
        if (
            not isinstance(draft_host_pool, HostPoolGroup)
            or draft_host_pool.anchor_entry.name != PoolName.KV
        ):
            return problems + [
                f"the draft host pool is a {type(draft_host_pool).__name__}, not a KV-anchored host "
                "pool group (sglang's KV-only draft host pool has no indexer K)"
            ]
        if PoolName.INDEXER not in draft_host_pool.entry_map or not (
            draft_host_pool.entry_map[PoolName.INDEXER].share_indices_with_anchor
        ):
            problems.append("the draft host pools have no indexer pool sharing the KV pool's slots")
        kv_host = draft_host_pool.anchor_entry.host_pool
        if getattr(kv_host, "kv_cache_dim", None) != draft_device_pool.kv_cache_dim:
            problems.append(
                f"the draft's KV host rows are {getattr(kv_host, 'kv_cache_dim', None)} wide, its "
                f"device rows {draft_device_pool.kv_cache_dim}"
            )
        if draft_host_pool.size < self.mem_pool_host.size:
            problems.append(
                f"the draft host pools hold {draft_host_pool.size} slots, fewer than the target's "
                f"{self.mem_pool_host.size}"
            )
        return problems

    def start_writing(self) -> None:
        """Stock's hybrid write, plus the draft's backup at the same host slots and device rows, on the
        write stream before the ack's finish event (stock's base controller does the same; the hybrid
        override dropped it). Without a draft: stock's."""
        if not self.has_draft:
            return super().start_writing()
        if not self.write_queue:
            return
        op = CacheOperation.merge_ops(self.write_queue)
        host_indices, device_indices, transfers = self.move_hybrid_indices(op)
        self.write_queue.clear()
        start_event = device_module.Event()
        finish_event = device_module.Event()
        start_event.record()
        with device_module.stream(self.write_stream):
            start_event.wait(self.write_stream)
            for host_group, device_pool in self._target_and_draft_pools():
                # The index-sharing transfers (indexer) name their pool: each group moves its own.
                host_group.backup_from_device_all_layer(
                    device_pool, host_indices, device_indices, self.io_backend, pool_transfers=transfers
                )
            finish_event.record()
            self._record_transfer_indices_on_stream(
                self.write_stream, host_indices, device_indices, transfers
            )
        self.ack_write_queue.append(HiCacheAck(start_event, finish_event, op.node_ids))

    def start_loading(self) -> int:
        """Stock's hybrid load, plus the draft's layers restored at the same rows, each before the
        target's layer of the same number completes (as stock's base controller). The draft pool has
        no layer counter of its own: its forward runs after the target's on the compute stream, and
        the target's waits for every layer's event. Without a draft: stock's."""
        if not self.has_draft:
            return super().start_loading()
        if not self.load_queue:
            return -1
        producer_id = self.layer_done_counter.update_producer()
        op = CacheOperation.merge_ops(self.load_queue)
        host_indices, device_indices, transfers = self.move_hybrid_indices(op)
        self.load_queue.clear()
        producer_event = self.layer_done_counter.events[producer_id]
        producer_event.start_event.record()
        draft_layers = self.mem_pool_device_draft.layer_num
        with device_module.stream(self.load_stream):
            producer_event.start_event.wait(self.load_stream)
            for layer in range(self.layer_num):
                for host_group, device_pool in self._target_and_draft_pools(layer < draft_layers):
                    host_group.load_to_device_per_layer(
                        device_pool, host_indices, device_indices, layer, self.io_backend,
                        pool_transfers=transfers,
                    )  # fmt: skip
                producer_event.complete(layer)
            self._record_transfer_indices_on_stream(
                self.load_stream, host_indices, device_indices, transfers
            )
        self.ack_load_queue.append(
            HiCacheAck(producer_event.start_event, producer_event.finish_event, op.node_ids)
        )
        return producer_id

    def _target_and_draft_pools(self, with_draft: bool = True):
        pools = [(self.mem_pool_host, self.mem_pool_device)]
        if with_draft:
            pools.append((self.mem_pool_host_draft, self.mem_pool_device_draft))
        return pools

    # ---- host usage ----

    def physical_host_slots_used(self) -> int:
        return self.mem_pool_host.size - self.mem_pool_host.available_size()

    # ---- stock entry points take physical indices: refuse logical ones ----

    def write(self, *args, **kwargs):
        raise RuntimeError(
            f"{FLAG}: HiCache write takes logical locs here; use plan_host_write/take_host_slots/write_reserved"
        )

    def load(self, *args, **kwargs):
        raise RuntimeError(
            f"{FLAG}: HiCache load takes logical locs here; use alloc_logical_locs/load_reserved"
        )

    # ---- helpers ----

    def _index_sharing_transfers(
        self, host_indices: torch.Tensor, physical_device_indices: torch.Tensor
    ) -> List[PoolTransfer]:
        # The NSA indexer pool shares slot indices with the KV anchor: same rows, so the indexer pages
        # travel with exactly the KV rows (NSAIndexerPoolHost takes every page_size-th row as a page).
        return [
            PoolTransfer(
                name=entry.name,
                host_indices=host_indices,
                device_indices=physical_device_indices,
            )
            for entry in self.mem_pool_host.entries
            if entry.share_indices_with_anchor
        ]

    def _check_page_aligned_len(self, logical_len: int) -> None:
        if logical_len % self.page_size != 0:
            raise ValueError(
                f"a HiCache node must hold whole pages, got {logical_len} tokens "
                f"(page_size {self.page_size})"
            )

    def _page_heads_on_cpu(self, rows: torch.Tensor, what: str) -> np.ndarray:
        """First row of each page of ``rows`` (whole pages, any unit), as a NumPy array.

        The rows inside a page are not looked at: paged allocators (device, host) hand out and take
        back whole pages, so a page-aligned head stands for its page. Checked here, at page
        granularity, because the indexer moves rows page by page.
        """
        if rows.numel() % self.page_size != 0:
            raise ValueError(
                f"{what}: {rows.numel()} rows are not whole pages (page_size {self.page_size})"
            )
        heads = rows[:: self.page_size].cpu().numpy()
        if np.count_nonzero(heads % self.page_size):
            raise ValueError(f"{what} are not whole pages (page_size {self.page_size})")
        return heads

    def _check_host_slots_whole_pages(self, host_indices: torch.Tensor) -> None:
        """Host slots are CPU tensors on every deployment: their page heads are read as a NumPy view
        (no torch op), unlike device locs (``_page_heads_on_cpu``)."""
        heads = host_indices.numpy()[:: self.page_size]
        if np.count_nonzero(heads % self.page_size):
            raise ValueError(f"host slots are not whole pages (page_size {self.page_size})")

    def _physical_rows_on_device(self, owned_logical_pages: np.ndarray) -> torch.Tensor:
        """Physical device rows of logical pages this rank owns (callers have checked that).

        Expanded on the host and copied once: one host-to-device copy of the rows (8 bytes a token)
        costs less than copying the heads and expanding them with two device ops, on any device."""
        physical_heads = self.layout.physical_page_of(owned_logical_pages) * self.page_size
        rows = torch.from_numpy(self.layout.rows_of_pages(physical_heads))
        # A pageable source is staged before this returns: no stream sync, and the array may go.
        return rows.to(self.device, non_blocking=True)
