"""L3 storage of the CP HiCache tree: host copies stored under owner-free page keys, and restored.

* Store: when a node's host write is acknowledged, each rank stores the pages it owns of it (KV and
  NSA indexer) under keys of the stock page hash chain (``cp_hicache_storage_keys``), so a page's key
  does not depend on which rank owned it; only attention-TP rank 0 of each CP rank writes.
* Restore (``prefetch_from_storage_cp``): the pages of a request beyond the tree's match are read from
  storage into host slots, each page on the rank ``q % cp_size`` that owns page ``q`` of the sequence,
  and hang below the match as one host-only node; ``load_back`` brings it to device like any host node.

Every decision here is taken from state identical on every rank (the tree, the host ledger, page owners,
request lengths) or from a MIN that every rank enters, a rank that owns none of the pages included
(``cp_hiradix_rank_agreement``): the trees and ledgers never drift apart. The page transfers are the
controller side's (``CpStoragePageIO``). Details in ``docs/hicache-storage.md``.

Stock's own storage path (its controller's threads, ``write_backup_storage``, ``attach_storage_backend``)
never runs: the stock cache is built without a backend, and a backend attached at runtime is refused.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, List, Optional

import numpy as np
import torch

from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sglang_cp_shared_kv.mem_cache.cp_hicache_storage import (
    CpStoragePageIO,
    build_storage_backend,
)
from sglang_cp_shared_kv.mem_cache.cp_hicache_metadata import CpHiCacheNodeMetadata
from sglang_cp_shared_kv.mem_cache.cp_hicache_storage_keys import (
    StorageNamespace,
    chain_seed,
    page_hash_chain,
    storage_keys,
)
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG
from sglang_cp_shared_kv.startup_rules import parse_storage_extra_config

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


class CpHiRadixL3Storage:
    """The L3 storage part of ``CpHiRadixCache`` (mixed in before sglang's ``HiRadixCache``)."""

    def _init_l3_storage(self) -> None:
        """No storage until ``_build_storage``; before the stock constructor (its reset)."""
        # L3 storage is ours (``_build_storage``): stock's controller would start its storage threads
        # and let only TP rank 0 write (``backup_skip``), so the stock cache is built without it.
        self.cp_storage: Optional[CpStoragePageIO] = None
        self.storage_node_writes = 0  # nodes offered to storage (the same on every rank)
        # Logical tokens of each host write in flight, by node id (``_store_write``).
        self._write_logical_lens: dict = {}
        self.storage_prefetches = 0  # prefetch decisions taken (the same on every rank)

    def _build_storage(self, server_args: ServerArgs, cp_rank: int, cp_size: int) -> None:
        host = self.cache_controller.mem_pool_host
        kv_host = host.anchor_entry.host_pool
        indexer_host = host.entry_map[PoolName.INDEXER].host_pool
        namespace = StorageNamespace(
            model=str(getattr(server_args, "model_path", None) or server_args.served_model_name),
            kv_dtype=str(kv_host.dtype),
            kv_row_bytes=kv_host.kv_cache_dim * kv_host.dtype.itemsize,
            indexer_page_bytes=int(self.kv_cache.index_k_with_scale_buffer[0].shape[1]),
            page_size=self.page_size,
            layer_num=kv_host.layer_num,
            host_layout=kv_host.layout,
        )
        attn_tp_rank, attn_tp_size = self._attn_tp_rank_and_size()
        backend_name = server_args.hicache_storage_backend
        # sglang's reading (startup judged it): the backend's config without stock's prefetch
        # keys, and stock's prefetch threshold (tokens).
        extra, threshold = parse_storage_extra_config(server_args.hicache_storage_backend_extra_config)
        backend = build_storage_backend(
            backend_name, kv_host, indexer_host,
            model_name=server_args.served_model_name,
            attn_tp_rank=attn_tp_rank, attn_tp_size=attn_tp_size,
            attn_cp_rank=cp_rank, attn_cp_size=cp_size,
            extra_config=extra,
        )  # fmt: skip
        self.cp_storage = CpStoragePageIO(
            backend, backend_name, kv_host, indexer_host, namespace, writes=attn_tp_rank == 0
        )
        self.storage_prefetch_threshold = max(threshold, self.page_size)
        logger.info(
            "CP HiCache L3 storage %s on cp rank %d of %d (%s): keys %s_<page hash> (%s)",
            backend_name, cp_rank, cp_size,
            "writer" if attn_tp_rank == 0 else "reader only",
            namespace.tag(), namespace.describe(),
        )  # fmt: skip

    def _attn_tp_rank_and_size(self) -> tuple[int, int]:
        group = self.attn_tp_group
        if group is None:
            return 0, 1
        return torch.distributed.get_rank(group=group), torch.distributed.get_world_size(group=group)

    def _node_page_hashes(self, node: TreeNode) -> List[str]:
        """The stock hash chain of ``node``'s pages from the root (kept in ``node.hash_value``, which
        ``_split_node`` splits as stock does)."""
        if node is self.root_node:
            return []
        pages = len(node.key) // self.page_size
        if node.hash_value is not None and len(node.hash_value) == pages:
            return node.hash_value
        above = self._node_page_hashes(node.parent)
        prior = above[-1] if above else chain_seed(node.key.extra_key)
        node.hash_value = page_hash_chain(node.key.token_ids, self.page_size, prior)
        return node.hash_value

    def _track_write_for_storage(self, node: TreeNode) -> None:
        """A host write of ``node`` starts: keep its logical length for its store (``_store_write``)."""
        if self.cp_storage is not None:
            self._write_logical_lens[node.id] = node.host_len

    def _store_write(self, node: TreeNode) -> None:
        """A host write is acknowledged: store every page it wrote, whatever splits happened
        while it was in flight.

        The ack names the node the write was recorded under; a split while in flight (the next
        step's match splits a shared prefix exactly so) leaves that node the lower part and puts
        the upper part in new nodes between it and its old parent, each with its host slots and
        ``host_len`` (and the write-through lock: they cannot be evicted before the ack). So the
        write's pages are the nodes from ``node`` upward whose keys add up to the logical length
        written. (Stock 0.5.11's ``writing_check`` passes only the recorded node to
        ``write_backup_storage``, so it loses the upper part's pages the same way.)
        """
        logical_len = self._write_logical_lens.pop(node.id, node.host_len)
        parts = []
        while logical_len > 0 and node is not self.root_node:
            parts.append(node)
            logical_len -= len(node.key)
            node = node.parent
        for part in reversed(parts):
            self._store_node(part)

    def _store_node(self, node: TreeNode) -> None:
        """A node's host copy is confirmed: this rank stores the pages it owns of it (KV and
        indexer) under owner-free keys. Every rank counts the node, whether it owns any or not."""
        if self.cp_storage is None or not self._node_backuped(node):
            return
        self.storage_node_writes += 1
        metadata = node.cp_hicache
        if metadata.num_owned == 0 or not self.cp_storage.writes:
            return
        hashes = self._node_page_hashes(node)
        owned_pages = metadata.owned_positions.numpy()[:: self.page_size] // self.page_size
        keys = storage_keys(self.cp_storage.namespace, [hashes[p] for p in owned_pages])
        stored = self.cp_storage.write_pages(keys, metadata.host_indices)
        if stored < len(keys):
            # A page missing from storage only shortens later hits (every rank checks every page).
            logger.warning(
                "CP HiCache storage: stored %d of %d owned pages of node %d", stored, len(keys), node.id
            )

    def prefetch_from_storage_cp(self, req_id: str, token_ids, extra_key=None) -> int:
        """Restore from storage the pages of ``token_ids`` beyond what the tree holds, into host
        slots, as one host-only node below the match; returns the logical tokens restored (0:
        nothing). Synchronous; every rank calls it for the same request at the same step.

        1. Every rank hashes the pages and asks storage about them in order, up to the first whose
           KV or indexer object is missing (the file backend: two ``stat`` calls a page, whatever
           the store holds); the hit is the MIN over ranks of the leading pages found.
        2. Under the write-through policies the node the restore hangs below gets a host copy first
           (``_back_up_path``: a device-only node with a child cannot be evicted).
           Owners of the restored pages: page ``q`` of the sequence on rank ``q % cp_size``, the same
           on every rank. The ledger says whether every rank has the host slots, evicting host nodes
           if not; what still does not fit is cut off for every rank alike (never per rank).
        3. Each rank reads the pages it owns into its slots; the restored length is the MIN over
           ranks of the first page not read (a failed read on one rank cuts every rank there), and
           every rank gives back its slots beyond it.
        4. The node gets ``host_len`` and metadata as a host backup would (``load_back`` then
           restores it to device like any host node).
        """
        if self.cp_storage is None:
            return 0
        self.storage_prefetches += 1
        page_size = self.page_size
        match = self.match_prefix(MatchPrefixParams(key=RadixKey(list(token_ids), extra_key)))
        matched_len = len(match.device_indices) + match.host_hit_length
        below = match.last_host_node if match.host_hit_length else match.last_device_node
        first_page = matched_len // page_size
        candidate_pages = max(len(token_ids) // page_size - first_page, 0)
        if candidate_pages * page_size < self.storage_prefetch_threshold:
            return 0  # lengths only: identical on every rank
        hashes = page_hash_chain(
            token_ids[: (first_page + candidate_pages) * page_size], page_size, chain_seed(extra_key)
        )[first_page:]
        keys = storage_keys(self.cp_storage.namespace, hashes)
        try:
            found = self.cp_storage.hit_pages(keys)
        except Exception:  # a failed query is a miss on this rank; the MIN makes it everyone's
            logger.exception("CP HiCache storage: existence query failed")
            found = 0
        hit_pages = self._min_over_ranks(found)
        if hit_pages == 0:
            return 0
        if not self._back_up_path(below):
            return 0

        below.protect_host()  # host eviction for the slots must not take the matched path
        try:
            owners = (first_page + np.arange(hit_pages, dtype=np.int64)) % self.cp_layout.cp_size
            owners, host_indices = self._reserve_storage_slots(owners)
        finally:
            below.release_host()
        if len(owners) == 0:
            return 0
        metadata = self._read_owned_pages(owners, host_indices, keys[: len(owners)])
        if metadata is None:
            return 0
        logical_len = metadata.logical_len
        key = RadixKey(list(token_ids[matched_len : matched_len + logical_len]), extra_key)
        self._insert_storage_node(below, key, metadata, hashes[: logical_len // page_size])
        self.prefetch_loaded_tokens_by_reqid[req_id] = logical_len
        return logical_len

    def _back_up_path(self, node: TreeNode) -> bool:
        """Whether a restored node may hang below ``node``: backs up the path's tail that has no
        host copy, top-down, under the write-through policies (False: it could not, restore nothing).

        A node without a host copy is evicted from device by freeing it as a leaf (stock
        ``_evict_regular`` asserts it has no children), and an evicted host-only child does not
        stop it from being a device leaf. Under ``write_through_selective`` (and under
        ``write_through`` where a write did not fit) a prefix served once has no host copy, so a
        restored tail below it crashed the next device eviction on every rank. Backing the path up
        keeps stock's write-through invariant (a backed-up node's parent is backed up), so
        eviction keeps the node's host copy instead; the host writes cost what write-through would
        have paid, and store the path to L3 when acknowledged. Under ``write_back`` eviction writes
        a node back before it frees it, so nothing is needed. Every decision comes from the tree
        and the host ledger, identical on every rank.
        """
        if self.cache_controller.write_policy == "write_back":
            return True
        path = []
        while not self._node_backuped(node):
            path.append(node)
            node = node.parent
        for node in reversed(path):
            if self.write_backup(node) == 0:
                return False
        return True

    def _reserve_storage_slots(self, owners: np.ndarray):
        """(The leading ``owners`` every rank has host slots for, this rank's slots for its pages of
        them), after host eviction if needed; the ledger's answer, the same on every rank."""
        ledger, page_size = self.host_ledger, self.page_size
        if not ledger.fits(ledger.slots_of_pages(owners)):
            self._evict_host_until(ledger.shortfall(ledger.slots_of_pages(owners)))
        pages = len(owners)
        while pages and not ledger.fits(ledger.slots_of_pages(owners[:pages])):
            pages -= 1
        owners = owners[:pages]
        owned = int(np.count_nonzero(owners == self.cp_layout.cp_rank))
        host_indices = torch.empty((0,), dtype=torch.int64)
        if owned:
            host_indices = self.cache_controller.mem_pool_host.alloc(owned * page_size)
            if host_indices is None:
                ledger.check_own_entry("before a storage read")  # raises: the ledger said it fits
                raise RuntimeError("CP HiCache: the host pool refused slots its ledger has free")
            host_indices = host_indices.cpu()
        if pages:
            ledger.take(ledger.slots_of_pages(owners))
        return owners, host_indices

    def _read_owned_pages(
        self, owners: np.ndarray, host_indices: torch.Tensor, keys: List[str]
    ) -> Optional[CpHiCacheNodeMetadata]:
        """Read this rank's pages into ``host_indices``, agree on the restored length, give back the
        slots beyond it; the metadata of what was restored (None: nothing)."""
        page_size, ledger = self.page_size, self.host_ledger
        owned_pages = (owners == self.cp_layout.cp_rank).nonzero()[0]
        read = self.cp_storage.read_pages([keys[p] for p in owned_pages], host_indices)
        first_missing = int(owned_pages[read]) if read < len(owned_pages) else len(owners)
        restored_pages = self._min_over_ranks(first_missing)
        kept = int(np.count_nonzero(owned_pages < restored_pages))
        if restored_pages < len(owners):
            if kept < len(owned_pages):
                self.cache_controller.mem_pool_host.free(host_indices[kept * page_size :])
            ledger.give_back(ledger.slots_of_pages(owners[restored_pages:]))
        if restored_pages == 0:
            return None
        owners = owners[:restored_pages]
        positions = (
            owned_pages[:kept, None] * page_size + np.arange(page_size, dtype=np.int64)
        ).reshape(-1)
        return CpHiCacheNodeMetadata.derived(
            logical_len=restored_pages * page_size,
            owned_positions=torch.from_numpy(positions.astype(np.int64)),
            host_indices=host_indices[: kept * page_size].clone(),
            owner_ranks=torch.from_numpy(owners.astype(np.int8).repeat(page_size)),
            slots_by_rank=ledger.slots_of_pages(owners),
        )

    def _insert_storage_node(
        self, parent: TreeNode, key: RadixKey, metadata: CpHiCacheNodeMetadata, hashes: List[str]
    ) -> TreeNode:
        """A host-only node for restored pages below ``parent``, where the tree's match ended
        (stock's ``_insert_helper_host``, with CP host state)."""
        child_key = key.child_key(self.page_size)
        if child_key in parent.children:
            raise RuntimeError(f"storage restore below node {parent.id}: the tree matched further")
        if self.cache_controller.write_policy != "write_back" and not self._node_backuped(parent):
            raise RuntimeError(f"storage restore below node {parent.id}, which has no host copy")
        node = self._new_node(priority=parent.priority)
        node.parent = parent
        node.key = key
        node.value = None
        node.host_len = metadata.logical_len
        node.cp_hicache = metadata
        node.hash_value = list(hashes)
        parent.children[child_key] = node
        self.host_logical_tokens += node.host_len
        self._update_host_leaf_status(node)
        self._update_leaf_status(parent)
        self._update_host_leaf_status(parent)
        self._record_store_event(node, medium=StorageMedium.CPU)
        self._note_host_event()
        return node

    # ---- the stock storage API ----

    def attach_storage_backend(self, storage_backend: str, *args, **kwargs) -> tuple[bool, str]:
        """Stock attaches a storage backend at runtime; here only at startup (refused)."""
        return (
            False,
            f"attaching a HiCache storage backend at runtime is not supported with {FLAG}: start "
            "the server with --hicache-storage-backend file or mooncake (docs/hicache-storage.md)",
        )

    def detach_storage_backend(self) -> tuple[bool, str]:
        """Stock detaches its storage threads; ours has none, and stays attached (refused)."""
        return False, f"detaching the HiCache storage backend is not supported with {FLAG}"

    def clear_storage_backend(self) -> bool:
        """Stock clears the controller's backend; here ours (every writer clears the same store)."""
        backend = getattr(self.cp_storage, "backend", None)
        if backend is None or not hasattr(backend, "clear"):
            return False
        backend.clear()
        return True

