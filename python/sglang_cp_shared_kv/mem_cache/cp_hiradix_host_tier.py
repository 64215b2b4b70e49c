"""The host tier of the CP HiCache tree: a node's owned pages to this rank's host pool and back.

A node's host copy is sharded like its device pages: each rank writes only the pages it owns
(``CpHybridCacheController`` translates logical locs to this rank's physical rows and moves them),
and records ``node.host_len`` (logical, the same on every rank) and ``node.cp_hicache``
(``CpHiCacheNodeMetadata``: this rank's positions and host slots).

* Write (device -> host): whether a node's pages fit on every rank, and which host nodes to evict
  when they do not, comes from the host ledger (``CpHostSlotLedger``), identical on every rank, so a
  write takes no collective.
* Load (host -> device): every rank allocates the same logical locs, with each page on the rank that
  holds it on host, and the ranks agree that every one got them (``cp_hiradix_rank_agreement``)
  before any rank commits tree state.

Quantities that decide are logical (``host_len``, ``host_hit_len``) so every rank takes the same
decision; physical ones (host slots, device rows) are per rank.
"""

from __future__ import annotations

import logging
import time
from typing import List, Optional

import numpy as np
import torch

from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.radix_cache import TreeNode

from sglang_cp_shared_kv.mem_cache.cp_hicache_metadata import CpHiCacheNodeMetadata
from sglang_cp_shared_kv.mem_cache.tree_value_pages import set_value_pages, tracks_value_pages
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG

logger = logging.getLogger(__name__)


class CpHiRadixHostTier:
    """The host-tier part of ``CpHiRadixCache`` (mixed in before sglang's ``HiRadixCache``, whose
    controller, locks and metrics it uses)."""

    # Host write + host eviction events between two per-rank host usage log lines.
    HOST_USAGE_LOG_INTERVAL = 256

    # ---- write (device -> host) ----

    def write_backup(self, node: TreeNode, write_back: bool = False) -> int:
        """Stock writes all of ``node`` to ``host_value``; here owned pages, once all ranks got slots.

        Returns the logical tokens backed up (0 if not).
        """
        # Write-through keeps backed-up nodes a contiguous prefix from the root.
        if not write_back and not self._node_backuped(node.parent):
            return 0
        metadata = self._reserve_and_write(node)
        if metadata is None:
            return 0
        node.cp_hicache = metadata
        node.host_len = metadata.logical_len
        self.host_logical_tokens += node.host_len
        self.ongoing_write_through[node.id] = node
        self._track_write_for_storage(node)
        if not write_back:
            self.inc_lock_ref(node)
        self._note_host_event()
        return node.host_len

    def _reserve_and_write(self, node: TreeNode) -> Optional[CpHiCacheNodeMetadata]:
        """Write ``node``'s owned pages if they fit on every rank, after evicting host nodes if not.

        The ledger gives every rank the same answer without a collective (``CpHostSlotLedger``).
        """
        controller, ledger = self.cache_controller, self.host_ledger
        plan = controller.plan_host_write(node.value)
        slots_by_rank = ledger.slots_of_pages(plan.page_owners)
        if not ledger.fits(slots_by_rank):
            self._evict_host_until(ledger.shortfall(slots_by_rank))
            if not ledger.fits(slots_by_rank):
                return None
        if not controller.take_host_slots(plan):
            ledger.check_own_entry("before a host write")  # raises: the ledger said it fits
            raise RuntimeError("CP HiCache: the host pool refused slots its ledger has free")
        ledger.take(slots_by_rank)
        return controller.write_reserved(plan, node_id=node.id, slots_by_rank=slots_by_rank)

    def _inc_hit_count(self, node: TreeNode, chunked: bool = False):
        """Stock, with ``_node_backuped`` for ``node.backuped``; ``host_value`` is never set."""
        if self.cache_controller.write_policy == "write_back" or chunked:
            return
        node.hit_count += 1
        if not self._node_backuped(node) and node.hit_count >= self.write_through_threshold:
            self.write_backup(node)

    # ---- load (host -> device) ----

    def load_back(
        self, node: TreeNode, mem_quota: Optional[int] = None
    ) -> Optional[torch.Tensor]:
        """Stock loads ``host_value``; here ranks agree on the same new locs and each loads its own.

        Loads the evicted path ending at ``node``; returns its new logical locs or ``None``.
        """
        start_time = time.perf_counter()
        last_hit_node = node
        nodes_to_load: List[TreeNode] = []
        while node.evicted:
            assert self._node_backuped(node), "evicted node without host backup"
            nodes_to_load.insert(0, node)
            node = node.parent
        ancestor = node
        delta = self.inc_lock_ref(ancestor).delta

        # Logical length on purpose: identical on every rank, so every rank takes the same decision.
        host_hit_len = sum(self._node_host_len(n) for n in nodes_to_load)
        if host_hit_len < self.load_back_threshold or (
            mem_quota is not None and host_hit_len > mem_quota + delta
        ):
            self.dec_lock_ref(ancestor)
            return None

        metadata = CpHiCacheNodeMetadata.concat([n.cp_hicache for n in nodes_to_load])
        # A retry evicts device nodes; under write_back that writes them to host, which may evict
        # host-only leaves: never the nodes being loaded (their slots would be reused, the nodes dropped).
        for n in nodes_to_load:
            n.protect_host()
        device_indices = self._alloc_load_locs(metadata)
        for n in nodes_to_load:
            n.release_host()
        self.dec_lock_ref(ancestor)
        if device_indices is None:
            logger.warning(
                "load_back: FAILED to load %d tokens for node %d even after eviction "
                "(evictable_size=%d)",
                host_hit_len,
                last_hit_node.id,
                self.evictable_size_,
            )
            return None

        self.cache_controller.load_reserved(metadata, device_indices, node_id=last_hit_node.id)
        self.ongoing_load_back[last_hit_node.id] = last_hit_node
        # The allocator's host record of these locs gives the loaded values' page ids.
        loaded_pages = self._host_pages_of(device_indices) if tracks_value_pages(self) else None
        offset = 0
        for n in nodes_to_load:
            n.value = device_indices[offset : offset + n.host_len].clone()
            if loaded_pages is not None:
                page = offset // self.page_size
                set_value_pages(n, loaded_pages[page : page + n.host_len // self.page_size])
            offset += n.host_len
            self._record_store_event(n, medium=StorageMedium.GPU)
        self.evictable_size_ += host_hit_len
        self.inc_lock_ref(last_hit_node)

        if self.metrics_collector is not None:
            self.metrics_collector.observe_load_back_duration(time.perf_counter() - start_time)
            self.metrics_collector.increment_load_back_num_tokens(host_hit_len)
        return device_indices

    def _host_pages_of(self, device_indices: torch.Tensor) -> np.ndarray:
        record = self.cache_controller.mem_pool_device_allocator.last_allocation
        if record is None or record.locs is not device_indices:
            raise RuntimeError(f"{FLAG}: load-back locs are not the allocator's latest allocation")
        return record.new_pages

    def _alloc_load_locs(self, metadata: CpHiCacheNodeMetadata) -> Optional[torch.Tensor]:
        """Logical locs for a load-back that every rank got; evict device nodes and retry once if not.

        The allocator is identical on every rank, but a rank whose allocation succeeded while another's
        failed restores its allocator state exactly, so the ranks cannot drift apart.
        """
        allocator = self.cache_controller.mem_pool_device_allocator
        for attempt in range(2):
            if attempt:
                self._evict_for_load(metadata)
            state = allocator.backup_state()
            device_indices = self.cache_controller.alloc_logical_locs(metadata)
            if self._all_ranks_ok(device_indices is not None):
                return device_indices
            allocator.restore_state(state)
        return None

    def _evict_for_load(self, metadata: CpHiCacheNodeMetadata) -> None:
        """Evict device nodes until every owner rank has the free pages this load-back needs.

        Each loaded page must land on the rank that holds it on host, so evicting ``logical_len``
        tokens is not enough: the freed pages may belong to other owners. The shortfall depends only
        on the allocator, which is identical on every rank, so every rank evicts the same nodes.
        """
        while True:
            missing_pages = sum(self.cache_controller.device_page_shortfall(metadata))
            if missing_pages == 0:
                return
            evicted = self.evict(EvictParams(num_tokens=missing_pages * self.page_size))
            if evicted.num_tokens_evicted == 0:
                return

    # ---- host usage ----

    def _note_host_event(self) -> None:
        self._host_events += 1
        if self._host_events % self.HOST_USAGE_LOG_INTERVAL == 0:
            self.log_host_usage()

    def log_host_usage(self) -> None:
        """One INFO line per rank: physical host slots in use, to check against --hicache-ratio."""
        host = self.cache_controller.mem_pool_host
        used = self.cache_controller.physical_host_slots_used()
        logger.info(
            "CP HiCache host pool, cp rank %d of %d: %d of %d physical slots used (%.1f%%); "
            "%d logical tokens backed up in the tree",
            self.cp_layout.cp_rank,
            self.cp_layout.cp_size,
            used,
            host.size,
            100.0 * used / max(host.size, 1),
            self.host_logical_tokens,
        )

