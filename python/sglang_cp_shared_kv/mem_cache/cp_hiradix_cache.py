"""HiRadixCache for CP shared KV: a logical radix tree over per-rank physical host shards.

The tree is identical on every rank of the CP group and stays logical: ``node.value`` is the full logical
loc tensor, locks, ``evictable_size_``, thresholds and sglang's HiCache metrics count logical tokens.
Each rank backs up only the pages it owns; a node's host state is ``node.host_len`` (logical tokens, the
same on every rank) plus ``node.cp_hicache`` (``CpHiCacheNodeMetadata``: this rank's positions and host
slots). ``node.host_value`` stays ``None``, so every stock path that reads ``node.backuped`` or
``node.host_value`` is overridden to use ``_node_backuped`` / ``_node_host_len`` /
``_node_host_evict_indices``.

``CpHiRadixCache`` is sglang's ``HiRadixCache`` with one part mixed in per concept, each in its module:

* this module: construction, node state, reset, and the tree operations (match, insert, split), which
  read the clock once per operation;
* ``cp_hiradix_host_tier``: a node's owned pages to this rank's host pool and back (write, load-back);
* ``cp_hiradix_eviction``: device and host eviction, in one order every rank shares;
* ``cp_hiradix_rank_agreement``: the collectives every rank joins, and the write and load acks they
  release (the ordering rule that keeps the ranks in step is stated there);
* ``cp_hiradix_l3_storage``: L3 storage under owner-free page keys, and the restore into the tree.

Tree bookkeeping stays in the cache, transfers in the controller (``CpHybridCacheController``). Details
in ``docs/cp-hicache.md``.

Registered as a class REPLACE of ``sglang.srt.mem_cache.hiradix_cache.HiRadixCache`` (runtime hooks exist
only with the flag on). Construction with any other allocator returns the stock ``HiRadixCache``.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from typing import TYPE_CHECKING, Optional

import torch

from sglang.srt.mem_cache.base_prefix_cache import (
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
from sglang.srt.mem_cache.radix_cache import (
    RadixKey,
    TreeNode,
    split_node_hash_value,
)
from sglang.srt.plugins.hook_registry import HookType

from sglang_cp_shared_kv.mem_cache.cp_hybrid_cache_controller import CpHybridCacheController
from sglang_cp_shared_kv.mem_cache.allocator import CPSharedPagedTokenToKVPoolAllocator
from sglang_cp_shared_kv.mem_cache.cp_hiradix_eviction import CpHiRadixEviction
from sglang_cp_shared_kv.mem_cache.cp_hiradix_host_tier import CpHiRadixHostTier
from sglang_cp_shared_kv.mem_cache.cp_hiradix_l3_storage import CpHiRadixL3Storage
from sglang_cp_shared_kv.mem_cache.cp_hiradix_rank_agreement import CpHiRadixRankAgreement
from sglang_cp_shared_kv.mem_cache.cp_host_slot_ledger import CpHostSlotLedger
from sglang_cp_shared_kv.mem_cache.tree_value_pages import (
    record_inserted_values,
    split_value_pages,
    tracks_value_pages,
    value_pages,
)
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FIELD
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG
from sglang_cp_shared_kv.settings import cp_shared_kv_enabled_in_env
from sglang_cp_shared_kv.startup_rules import storage_layout_problem

if TYPE_CHECKING:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def register_hooks(registry) -> None:
    registry.register(
        "sglang.srt.mem_cache.hiradix_cache.HiRadixCache", CpHiRadixCache, HookType.REPLACE
    )


class CpHiRadixCache(
    CpHiRadixHostTier,
    CpHiRadixEviction,
    CpHiRadixRankAgreement,
    CpHiRadixL3Storage,
    HiRadixCache,
):
    """HiRadixCache whose host copies are this rank's owned shards (see the module docstring). The
    parts come before ``HiRadixCache`` so that their overrides of its methods win."""

    def __new__(cls, params: CacheInitParams, server_args: ServerArgs):
        if isinstance(params.token_to_kv_pool_allocator, CPSharedPagedTokenToKVPoolAllocator):
            return super().__new__(cls)
        if getattr(server_args, CP_SHARED_KV_FIELD, False) or cp_shared_kv_enabled_in_env():
            raise ValueError(
                f"{FLAG} with --enable-hierarchical-cache needs the CP shared-KV allocator, got "
                f"{type(params.token_to_kv_pool_allocator).__name__}"
            )
        # Not a shared-KV server: build sglang's own cache. The class REPLACE rebinds every
        # module-level name bound to the stock class (this module's ``HiRadixCache`` included),
        # so the stock class is reached through our fixed base (the last: the parts come first).
        stock_class = CpHiRadixCache.__bases__[-1]
        cache = object.__new__(stock_class)
        cache.__init__(params, server_args)
        return cache

    def __init__(self, params: CacheInitParams, server_args: ServerArgs):
        """Stock constructor, between a check of the layout against the CP group and adopt()."""
        allocator = params.token_to_kv_pool_allocator
        _check_supported(allocator.get_kvcache(), server_args)
        cp_rank, cp_size = self._attn_cp_rank_and_size(params)
        if (allocator.layout.cp_rank, allocator.layout.cp_size) != (cp_rank, cp_size):
            raise ValueError(
                f"{FLAG}: the allocator is laid out for cp rank {allocator.layout.cp_rank} of "
                f"{allocator.layout.cp_size}, but the attention CP group says rank {cp_rank} of {cp_size}"
            )
        # sglang 0.5.11 leaves these at 0/1; the NSA assembler forwards them to the controller.
        params.attn_cp_rank, params.attn_cp_size = cp_rank, cp_size
        self.cp_layout = allocator.layout
        self._host_events = 0  # host writes and evictions (``_note_host_event``)
        self.host_logical_tokens = 0  # logical tokens of all backed-up nodes (same on every rank)
        self._op_stamp = 0.0  # the clock read of the current tree operation (see _start_tree_op)
        self.host_ledger: Optional[CpHostSlotLedger] = None  # built once the host pools exist
        self._init_rank_agreement()
        self._init_l3_storage()
        stock_args = server_args
        if server_args.hicache_storage_backend is not None:
            stock_args = copy.copy(server_args)
            stock_args.hicache_storage_backend = None
        super().__init__(params, stock_args)
        self.cache_controller = CpHybridCacheController.adopt(self.cache_controller, self.cp_layout)
        self.host_ledger = CpHostSlotLedger(
            self._host_capacity_by_rank(cp_size), cp_rank, self.page_size,
            self.cache_controller.mem_pool_host,
        )  # fmt: skip
        self._init_eviction_order()
        if server_args.hicache_storage_backend is not None:
            self._build_storage(server_args, cp_rank, cp_size)
        logger.info(
            "CP HiCache on cp rank %d of %d: %d physical host slots",
            cp_rank,
            cp_size,
            self.cache_controller.mem_pool_host.size,
        )

    def _attn_cp_rank_and_size(self, params: CacheInitParams) -> tuple[int, int]:
        """This rank's place in the attention CP group (not ``params.attn_cp_rank``: unset in 0.5.11)."""
        group = params.attn_cp_cache_group
        if group is None:
            return 0, 1
        return (
            torch.distributed.get_rank(group=group),
            torch.distributed.get_world_size(group=group),
        )

    # ---- node state (see module docstring) ----

    def _new_node(self, priority: int) -> TreeNode:
        node = TreeNode(priority=priority)
        node.last_access_time = node.creation_time = self._access_stamp()
        # 0.5.11's TreeNode.children is a defaultdict(TreeNode): a lookup of a missing key would
        # insert an empty "ghost" child. Our nodes use a plain dict.
        node.children = {}
        node.host_len = 0
        node.cp_hicache = None
        return node

    def _node_backuped(self, node: TreeNode) -> bool:
        # The root counts as backed up (stock: root.host_value == []): backups may start below it.
        if node is self.root_node:
            return True
        return node.host_len > 0 and node.cp_hicache is not None

    def _node_host_len(self, node: TreeNode) -> int:
        """Logical tokens the node holds on host (the same on every rank)."""
        return node.host_len

    def _node_host_evict_indices(self, node: TreeNode) -> torch.Tensor:
        """This rank's physical host slots of the node (possibly none)."""
        return node.cp_hicache.host_indices

    def reset(self):
        """Stock reset, then what a freshly built cache has: plain-dict root children, no backed-up
        logical tokens, and no write or load-back tracked.

        ``/flush_cache`` may come with a write or load-back in flight (sglang's idle check ignores
        HiCache). A write-ack count in flight is waited for (every rank started it) and dropped with
        the acks. Stock reset clears the controller's ack queues but keeps ``ongoing_write_through`` /
        ``ongoing_load_back``, whose entries then never get an ack: every ``writing_check`` of the
        idle scheduler would enter the write-ack all-reduce forever. Every rank tracks the same
        entries, so every rank drops the same ones.
        """
        self._drop_write_acks_in_flight()
        super().reset()
        for tracked in (
            self.ongoing_write_through,
            self.ongoing_load_back,
            self.ongoing_prefetch,
            self.ongoing_backup,
        ):
            tracked.clear()
        self.root_node.children = {}
        self.host_logical_tokens = 0
        self._write_logical_lens.clear()
        if self.host_ledger is not None:  # None while the stock constructor resets
            self.host_ledger.reset()

    # ---- timestamps ----
    # One clock read per tree operation (match_prefix, insert), shared by every node it touches or
    # creates; stock reads the clock per node. The LRU order is unchanged: nodes of different
    # operations compare as before, and the nodes of one operation lie on one root path, so no two of
    # them are eviction candidates at the same time (a candidate is a leaf); their ties go by node.id.
    # Stamps strictly increase, so two operations never tie on one rank and not on another.

    def _start_tree_op(self) -> None:
        now = time.monotonic()
        self._op_stamp = now if now > self._op_stamp else math.nextafter(self._op_stamp, math.inf)

    def _access_stamp(self) -> float:
        """The timestamp of a node touched now (the current operation's)."""
        return self._op_stamp

    def _match_prefix_helper(self, node: TreeNode, key: RadixKey):
        """Stock, but every node of the walk gets the operation's one timestamp (``_start_tree_op``)."""
        node.last_access_time = self._access_stamp()
        child_key = key.child_key(self.page_size)
        value = []
        while len(key) > 0 and child_key in node.children:
            child = node.children[child_key]
            child.last_access_time = self._access_stamp()
            prefix_len = child.key.match(key, page_size=self.page_size)
            if prefix_len < len(child.key):
                new_node = self._split_node(child.key, child, prefix_len)
                if not new_node.evicted:
                    value.append(new_node.value)
                node = new_node
                break
            if not child.evicted:
                value.append(child.value)
            node = child
            key = key[prefix_len:]
            if len(key):
                child_key = key.child_key(self.page_size)
        return value, node

    # ---- matching and insertion ----

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Stock, with ``_node_host_len`` and ``_node_backuped`` for ``host_value`` and ``backuped``."""
        key, _ = params.key.maybe_to_bigram_view(self.is_eagle)
        # A key shorter than one page (e.g. a short EAGLE bigram key) aligns to empty and matches nothing.
        key = key.page_aligned(self.page_size)
        self._start_tree_op()
        if self.disable or len(key) == 0:
            return MatchResult(
                device_indices=torch.empty((0,), dtype=torch.int64, device=self.device),
                last_device_node=self.root_node,
                last_host_node=self.root_node,
                host_hit_length=0,
            )
        values, last_node = self._match_prefix_helper(self.root_node, key)
        self._touch_path(last_node)
        if len(last_node.children) == 1:
            # The match may have split an accessed node; its lower half is this only child.
            self._touch(next(iter(last_node.children.values())))
        if values:
            device_indices = torch.cat(values)
        else:
            device_indices = torch.empty((0,), dtype=torch.int64, device=self.device)

        host_hit_length = 0  # logical tokens on host below the device-resident prefix
        last_host_node = last_node
        while last_node.evicted:
            host_hit_length += self._node_host_len(last_node)
            last_node = last_node.parent
        while not self._node_backuped(last_host_node):
            last_host_node = last_host_node.parent
        return MatchResult(
            device_indices=device_indices,
            last_device_node=last_node,
            last_host_node=last_host_node,
            host_hit_length=host_hit_length,
        )

    def _split_node(self, key: RadixKey, child: TreeNode, split_len: int) -> TreeNode:
        """Stock, but host state splits as ``cp_hicache`` + ``host_len``, not ``host_value``."""
        # child is split into new_node (first split_len tokens) -> child (the rest).
        pages = value_pages(child) if tracks_value_pages(self) else None
        new_node = self._new_node(priority=child.priority)
        new_node.children = {key[split_len:].child_key(self.page_size): child}
        new_node.parent = child.parent
        new_node.lock_ref = child.lock_ref
        new_node.key = child.key[:split_len]
        new_node.hit_count = child.hit_count
        if not child.evicted:
            new_node.value = child.value[:split_len].clone()
            child.value = child.value[split_len:].clone()
        if self._node_backuped(child):
            # Host slots follow their positions (see CpHiCacheNodeMetadata.split).
            new_node.cp_hicache, child.cp_hicache = child.cp_hicache.split(split_len)
            new_node.host_len = split_len
            child.host_len -= split_len
        new_node.hash_value, child.hash_value = split_node_hash_value(
            child.hash_value, split_len, self.page_size
        )
        child.parent = new_node
        child.key = child.key[split_len:]
        new_node.parent.children[key.child_key(self.page_size)] = new_node
        split_value_pages(new_node, child, pages, split_len, self.page_size)
        return new_node

    def insert(self, params: InsertParams) -> InsertResult:
        """Stock, but new nodes come from ``_new_node`` and no storage hash value is computed."""
        priority = params.priority or 0
        key, value = params.key.maybe_to_bigram_view(self.is_eagle, params.value)
        # A key shorter than one page aligns to empty: nothing is inserted, and the caller frees the
        # locs beyond the returned prefix length (all of them).
        key = key.page_aligned(self.page_size)
        if value is not None:
            value = value[: len(key)]
        if len(key) == 0:
            return InsertResult(prefix_len=0)

        self._start_tree_op()
        inserted_key = key
        node = self.root_node
        child_key = key.child_key(self.page_size)
        total_prefix_length = 0
        while len(key) > 0 and child_key in node.children:
            node = node.children[child_key]
            node.last_access_time = self._access_stamp()
            node.priority = max(node.priority, priority)
            prefix_len = node.key.match(key, page_size=self.page_size)
            self._touch(node)  # before a split: the accessed node stays below it
            if prefix_len < len(node.key):
                node = self._split_node(node.key, node, prefix_len)
                node.priority = max(node.priority, priority)
            if node.evicted:
                # Recomputed KV for a node that lives on host only: take the new device locs.
                node.value = value[:prefix_len].clone()
                self.evictable_size_ += prefix_len
                self._update_leaf_status(node)
                self._update_host_leaf_status(node)
                self._update_leaf_status(node.parent)
            else:
                self._inc_hit_count(node, params.chunked)
                total_prefix_length += prefix_len
            key = key[prefix_len:]
            value = value[prefix_len:]
            if len(key):
                child_key = key.child_key(self.page_size)

        if len(key):
            new_node = self._new_node(priority=priority)
            new_node.parent = node
            new_node.key = key
            new_node.value = value.clone()
            node.children[child_key] = new_node
            self.evictable_size_ += len(value)
            self._update_leaf_status(node)
            self._update_leaf_status(new_node)
            self._record_store_event(new_node)
            if self.cache_controller.write_policy != "write_back":
                self._inc_hit_count(new_node, params.chunked)
            self._touch(new_node)
        if tracks_value_pages(self):
            # New and revived nodes took the inserted row's locs: their host page ids too.
            record_inserted_values(self, inserted_key)
        return InsertResult(prefix_len=total_prefix_length)


def _check_supported(kv_pool, server_args: ServerArgs) -> None:
    """Stage 1 serves host-only HiCache on a plain NSA pool; refuse the rest before host memory is taken."""
    from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseNSATokenToKVPool

    if isinstance(kv_pool, HiSparseNSATokenToKVPool):
        raise ValueError(f"{FLAG} does not support HiSparse NSA KV pools")
    if not isinstance(kv_pool, NSATokenToKVPool):
        raise ValueError(
            f"{FLAG} with HiCache needs an NSA (DSA) KV pool, got {type(kv_pool).__name__}"
        )
    backend = server_args.hicache_storage_backend
    if backend is not None:
        problem = storage_layout_problem(backend, server_args.hicache_mem_layout)
        if problem:
            raise ValueError(f"{FLAG}: {problem}")
