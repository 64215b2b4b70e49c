"""HiRadixCache for CP shared KV: a logical radix tree over per-rank physical host shards.

The tree is identical on every rank of the CP group and stays logical: ``node.value`` is the full logical
loc tensor, locks, ``evictable_size_``, thresholds and sglang's HiCache metrics count logical tokens.
Each rank backs up only the pages it owns; a node's host state is ``node.host_len`` (logical tokens, the
same on every rank) plus ``node.cp_hicache`` (``CpHiCacheNodeMetadata``: this rank's positions and host
slots). ``node.host_value`` stays ``None``, so every stock path that reads ``node.backuped`` or
``node.host_value`` is overridden here to use ``_node_backuped`` / ``_node_host_len`` /
``_node_host_evict_indices``.

Cross-rank agreement (the tree must stay identical although host pools are per rank): whether a node's
backup fits on every rank, and which host nodes to evict when it does not, every rank reads from its
``CpHostSlotLedger`` (every rank's free host slots, kept without a collective); a device allocation for
a load-back is agreed by a MIN all-reduce before anyone commits. Details in ``docs/cp-hicache.md``.

Registered as a class REPLACE of ``sglang.srt.mem_cache.hiradix_cache.HiRadixCache`` (runtime hooks exist
only with the flag on). Construction with any other allocator returns the stock ``HiRadixCache``.
"""

from __future__ import annotations

import contextlib
import copy
import heapq
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

import numpy as np
import torch

from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    EvictResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.evict_policy import (
    FIFOStrategy,
    FILOStrategy,
    LFUStrategy,
    LRUStrategy,
    PriorityStrategy,
    SLRUStrategy,
)
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
from sglang.srt.mem_cache.radix_cache import (
    RadixKey,
    TreeNode,
    split_node_hash_value,
)
from sglang.srt.plugins.hook_registry import HookType

from sglang_cp_shared_kv.mem_cache.cp_hybrid_cache_controller import CpHybridCacheController
from sglang_cp_shared_kv.mem_cache.cp_hicache_storage import (
    CpStoragePageIO,
    build_storage_backend,
)
from sglang_cp_shared_kv.mem_cache.allocator import CPSharedPagedTokenToKVPoolAllocator
from sglang_cp_shared_kv.mem_cache.cp_hicache_metadata import CpHiCacheNodeMetadata
from sglang_cp_shared_kv.mem_cache.cp_hicache_storage_keys import (
    StorageNamespace,
    chain_seed,
    page_hash_chain,
    storage_keys,
)
from sglang_cp_shared_kv.mem_cache.cp_host_slot_ledger import CpHostSlotLedger
from sglang_cp_shared_kv.mem_cache.eviction_candidates import EvictionCandidates
from sglang_cp_shared_kv.mem_cache.tree_value_pages import (
    record_inserted_values,
    set_value_pages,
    split_value_pages,
    tracks_value_pages,
    value_pages,
)
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FIELD
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG
from sglang_cp_shared_kv.settings import cp_shared_kv_enabled_in_env
from sglang_cp_shared_kv.startup_rules import parse_storage_extra_config, storage_layout_problem

if TYPE_CHECKING:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)



def register_hooks(registry) -> None:
    registry.register(
        "sglang.srt.mem_cache.hiradix_cache.HiRadixCache", CpHiRadixCache, HookType.REPLACE
    )


class _FinishedCollective:
    """The handle of a collective that already ran (the blocking fallback of an async one)."""

    def wait(self) -> bool:
        return True


FINISHED_COLLECTIVE = _FinishedCollective()

# Eviction policies of 0.5.11 under which an access never lowers a node's priority: last_access_time and
# hit_count only grow, node.priority only grows (max), creation_time never changes. Exact types: a
# subclass may compute its priority otherwise. Under any other policy (MRU: -last_access_time) an
# access re-queues the node (_touch).
ACCESS_RAISES_PRIORITY = (
    LRUStrategy, LFUStrategy, FIFOStrategy, FILOStrategy, PriorityStrategy, SLRUStrategy,
)  # fmt: skip


@dataclass
class _HostEvictionProgress:
    slots_freed_by_rank: np.ndarray  # every rank's host slots (identical on every rank)
    nodes_evicted: int = 0
    logical_tokens_evicted: int = 0  # identical on every rank (metrics, logs)


class CpHiRadixCache(HiRadixCache):
    """HiRadixCache whose host copies are this rank's owned shards (see the module docstring)."""

    # Host write + host eviction events between two per-rank host usage log lines.
    HOST_USAGE_LOG_INTERVAL = 256
    _access_requeues = True  # until __init__ knows the eviction policy (see _touch)

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
        # so the stock class is reached through our fixed base.
        stock_class = CpHiRadixCache.__bases__[0]
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
        self._host_events = 0
        self.host_logical_tokens = 0  # logical tokens of all backed-up nodes (same on every rank)
        self._op_stamp = 0.0  # the clock read of the current tree operation (see _start_tree_op)
        # The agreement collectives' tensors, reused by every call (see _all_ranks_ok).
        self._agreed_ok = torch.zeros((), dtype=torch.int32)
        self._agreed_max = torch.zeros((), dtype=torch.int64)
        self._agreed_write_acks = torch.zeros((), dtype=torch.int32)
        self._agreed_load_acks = torch.zeros((), dtype=torch.int32)
        self._write_acks_in_flight = None  # the write-ack all-reduce started by the last writing_check
        self._ack_reduce_groups = None  # groups the write-ack count reduces over (first writing_check)
        self.host_ledger: Optional[CpHostSlotLedger] = None  # built once the host pools exist
        # L3 storage is ours (``_build_storage``): stock's controller would start its storage threads
        # and let only TP rank 0 write (``backup_skip``), so the stock cache is built without it.
        self.cp_storage: Optional[CpStoragePageIO] = None
        self.storage_node_writes = 0  # nodes offered to storage (the same on every rank)
        # Logical tokens of each host write in flight, by node id (``_store_write``).
        self._write_logical_lens: dict = {}
        self.storage_prefetches = 0  # prefetch decisions taken (the same on every rank)
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
        # The leaf sets stay sets for stock code, and keep their eviction order between calls.
        self.evictable_leaves = EvictionCandidates(self.eviction_strategy.get_priority)
        self.evictable_host_leaves = EvictionCandidates(self.eviction_strategy.get_priority)
        # Whether an access must re-queue the candidates it touches (see _touch).
        self._access_requeues = type(self.eviction_strategy) not in ACCESS_RAISES_PRIORITY
        if server_args.hicache_storage_backend is not None:
            self._build_storage(server_args, cp_rank, cp_size)
        logger.info(
            "CP HiCache on cp rank %d of %d: %d physical host slots",
            cp_rank,
            cp_size,
            self.cache_controller.mem_pool_host.size,
        )

    def _host_capacity_by_rank(self, cp_size: int) -> List[int]:
        """Every CP rank's host slots, which the ledger starts from: one startup agreement that they
        are the same (a MIN of ``(slots, -slots)``), and a clear error if they are not."""
        slots = self.cache_controller.mem_pool_host.available_size()
        bounds = torch.tensor([slots, -slots], dtype=torch.int64)
        self._all_reduce_attn_groups(bounds, torch.distributed.ReduceOp.MIN)
        smallest, largest = int(bounds[0]), -int(bounds[1])
        if smallest != largest:
            raise ValueError(
                f"{FLAG}: the CP ranks' host pools differ ({smallest} to {largest} slots); "
                "--hicache-ratio / --hicache-size must give every rank the same host pool"
            )
        return [slots] * cp_size

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
        work, self._write_acks_in_flight = self._write_acks_in_flight, None
        if work is not None:
            work.wait()
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

    # ---- cross-rank agreement ----

    # Every agreement reduces a scalar preallocated in ``__init__`` (no tensor is built per collective).
    # Host writes need none (the host ledger answers on every rank); what is left per step is the
    # write-ack count, plus one allocation agreement per load-back (docs/cp-hicache-performance.md).

    def _all_ranks_ok(self, ok: bool) -> bool:
        flag = self._agreed_ok
        flag.fill_(int(ok))
        self._all_reduce_attn_groups(flag, torch.distributed.ReduceOp.MIN)
        return bool(flag.item())

    def _max_over_ranks(self, value: int) -> int:
        tensor = self._agreed_max
        tensor.fill_(value)
        self._all_reduce_attn_groups(tensor, torch.distributed.ReduceOp.MAX)
        return int(tensor.item())

    # ---- write acknowledgement ----

    def writing_check(self, write_back: bool = False):
        """Stock agrees on finished write acks with a blocking all-reduce and applies them at once; here
        the all-reduce starts now and its agreed count is applied at the next ``writing_check``.

        Every rank still pops the same acks at the same call: the count started at one call is the MIN
        over ranks of the acks finished then, and the next call waits for it (long done by then) and
        pops exactly that many before counting again. The blocking ``write_back`` path has no
        collective and stays stock (after the count in flight is applied).
        """
        self._apply_write_acks_in_flight()
        if write_back or len(self.ongoing_write_through) == 0:
            # All ranks have the same ongoing writes, so all skip the collective together.
            # (write_back: stock waits for every write; then they go on to storage, in order.)
            written = list(self.ongoing_write_through.values()) if write_back else []
            result = super().writing_check(write_back=write_back)
            for node in written:
                self._store_write(node)
            return result
        finished = 0
        for _, finish_event, _ in self.cache_controller.ack_write_queue:
            if not finish_event.query():
                break
            finished += 1
        count = self._agreed_write_acks
        count.fill_(finished)
        # Keep cache state transitions identical across CPxTP participants.
        self._write_acks_in_flight = self._start_all_reduce_attn_groups(
            count, torch.distributed.ReduceOp.MIN
        )

    def _apply_write_acks_in_flight(self) -> None:
        work, self._write_acks_in_flight = self._write_acks_in_flight, None
        if work is not None:
            work.wait()
            self._apply_write_acks(int(self._agreed_write_acks.item()))

    def _start_all_reduce_attn_groups(self, tensor: torch.Tensor, op):
        """``_all_reduce_attn_groups`` without waiting: a handle whose ``wait()`` leaves the result in
        ``tensor``. Over two groups (attention CP, then attention TP) the second reduces the first's
        result, so that case stays blocking and returns a finished handle."""
        groups = self._ack_reduce_groups
        if groups is None:
            # The groups are fixed once the cache is built: worked out at the first check only.
            groups = [
                group
                for group in (self.attn_cp_group, self.attn_tp_group)
                if group is not None and torch.distributed.get_world_size(group=group) > 1
            ]
            if not groups and self.tp_world_size > 1:
                groups = [self.tp_group]
            self._ack_reduce_groups = groups
        if len(groups) == 1:
            return torch.distributed.all_reduce(tensor, op=op, group=groups[0], async_op=True)
        self._all_reduce_attn_groups(tensor, op)
        return FINISHED_COLLECTIVE

    def _apply_write_acks(self, count: int) -> None:
        """Pop the first ``count`` write acks (finished on every rank): host copy confirmed, unlock."""
        queue = self.cache_controller.ack_write_queue
        for _, finish_event, ack_list in queue[:count]:
            finish_event.synchronize()
            for ack_id in ack_list:
                node = self.ongoing_write_through.pop(ack_id)
                self._record_store_event(node, medium=StorageMedium.CPU)
                self.dec_lock_ref(node)
                self._store_write(node)
        del queue[:count]

    # ---- load acknowledgement ----

    def loading_check(self):
        """Release the locks of the load-backs finished on EVERY rank, the same ones at the same call.

        Stock releases a load's lock when this rank's copy finished, with no collective. When that lock
        is the node's only one (stock's ``PrefillAdder`` can decline a request right after
        ``init_load_back``, e.g. with a ``--chunked-prefill-size`` that is not a multiple of the page),
        a rank whose copy finished first has a larger ``evictable_size_`` and unlocked leaves, the same
        ``evict()`` then leaves different trees on different ranks, and their next decisions and
        collectives diverge (a hang). Acks being one per load on every rank does not help: the ranks'
        copies finish at different times. So the count of finished loads is agreed like the write
        acks' (a MIN over ranks; blocking, and only while a load-back is tracked, which every rank
        knows alike), and every rank pops exactly that many in queue order.
        """
        if len(self.ongoing_load_back) == 0:
            return  # every rank tracks the same load-backs: all skip the collective together
        queue = self.cache_controller.ack_load_queue
        finished = 0
        for _, finish_event, _ in queue:
            if not finish_event.query():
                break
            finished += 1
        count = self._agreed_load_acks
        count.fill_(finished)
        self._all_reduce_attn_groups(count, torch.distributed.ReduceOp.MIN)
        agreed = int(count.item())
        for _, finish_event, ack_list in queue[:agreed]:
            finish_event.synchronize()  # finished on this rank already (MIN <= this rank's count)
            for ack_id in ack_list:
                self.dec_lock_ref(self.ongoing_load_back.pop(ack_id))
        del queue[:agreed]

    # ---- eviction order ----
    # Both evictions pop in one total order, ``(eviction priority, node.id)``: node.id breaks priority
    # ties the same way on every rank (ids follow the identical sequence of tree operations); stock
    # compares nodes, which falls back to set iteration order. The candidates are the leaf sets
    # (``EvictionCandidates``, kept ordered between calls) plus, within one call, the parents stock
    # pushes onto its per-call heap although they are not (yet) leaves; the sequence is exactly the one
    # a heap rebuilt from the leaf set at the start of the call would give.

    def _parent_entry(self, node: TreeNode):
        return (self.eviction_strategy.get_priority(node), node.id, node)

    def _next_candidate(
        self, candidates: EvictionCandidates, parents: list, taken: set
    ) -> Optional[TreeNode]:
        """The node a per-call heap would pop next: the smaller of the two tops, each node once per call."""
        while True:
            top = candidates.peek()
            if parents and (top is None or parents[0][:2] < top[:2]):
                node = heapq.heappop(parents)[2]
            elif top is not None:
                node = candidates.pop_top()
            else:
                return None
            if node not in taken:
                taken.add(node)
                return node

    @staticmethod
    def _requeue_taken(candidates: EvictionCandidates, taken: set) -> None:
        # A node taken but still a candidate (skipped, or its write-back refused) is back in the next
        # call, as in a heap rebuilt from the set: give it its entry again.
        for node in taken:
            candidates.touch(node)

    def _touch_path(self, node: Optional[TreeNode]) -> None:
        """``node`` and its ancestors were just accessed: re-key those that are eviction candidates
        (under MRU an access lowers the priority; see ``EvictionCandidates``)."""
        if not self._access_requeues:
            return
        while node is not None:
            self._touch(node)
            node = node.parent

    def _touch(self, node: TreeNode) -> None:
        """``node`` was just accessed. Under a policy where that can lower its priority (MRU, or one
        not known to be monotone), a candidate gets a fresh entry at its new priority. Under the
        others an access only raises (or keeps) the priority: the old entry stays valid (at most the
        current priority) and is re-keyed when it reaches the top, so nothing is pushed."""
        if self._access_requeues:
            self.evictable_leaves.touch(node)
            self.evictable_host_leaves.touch(node)

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
        if self.cp_storage is not None:
            self._write_logical_lens[node.id] = node.host_len  # see _store_write
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

    # ---- host eviction ----

    def evict_host(self, physical_slots_needed: int) -> int:
        """Stock frees ``host_value`` tokens per rank; here physical slots, with one agreed node set.

        Evict host-only nodes until this rank freed ``physical_slots_needed`` host slots, keeping the
        evicted set identical on every rank. Returns this rank's physical slots freed.

        Progress counts physical slots, not logical ``host_len``: a node can be long and hold nothing
        on this rank. Each rank evicts in the same order until its own need is met; then all evict up
        to the largest node count any rank needed, so every rank ends with the same tree.
        """
        rank = self.cp_layout.cp_rank
        with self._host_eviction_call() as (progress, evict_until):
            evict_until(lambda: progress.slots_freed_by_rank[rank] >= physical_slots_needed)
            nodes_target = self._max_over_ranks(progress.nodes_evicted)
            evict_until(lambda: progress.nodes_evicted >= nodes_target)
        return int(progress.slots_freed_by_rank[rank])

    def _evict_host_until(self, shortfall_by_rank: np.ndarray) -> None:
        """Evict host-only nodes until every rank freed its ``shortfall_by_rank`` slots (or none is
        left). No collective: every rank knows every rank's slots per node (their owners are the
        same everywhere), so all evict the same nodes; the same set ``evict_host`` reaches with a
        MAX agreement when each rank knows only its own need."""
        with self._host_eviction_call() as (progress, evict_until):
            evict_until(
                lambda: not np.count_nonzero(progress.slots_freed_by_rank < shortfall_by_rank)
            )

    @contextlib.contextmanager
    def _host_eviction_call(self):
        """One host-eviction call: its progress, and ``evict_until(done)``, which evicts in order
        until ``done()`` (several passes share the call's parents and taken nodes). At the end, nodes
        taken but not evicted get their candidate entries back and the call is logged."""
        parents, taken = [], set()
        progress = self._new_host_eviction_progress()

        def evict_until(done) -> None:
            self._evict_host_nodes(parents, taken, progress, done)

        yield progress, evict_until
        self._requeue_taken(self.evictable_host_leaves, taken)
        self._log_host_eviction(progress)

    def _new_host_eviction_progress(self) -> _HostEvictionProgress:
        return _HostEvictionProgress(
            slots_freed_by_rank=np.zeros(self.cp_layout.cp_size, dtype=np.int64)
        )

    def _log_host_eviction(self, progress: _HostEvictionProgress) -> None:
        if not logger.isEnabledFor(logging.DEBUG):
            return  # skip the .tolist() below
        logger.debug(
            "CP HiCache host eviction: %d nodes, %d logical tokens, physical slots by rank %s",
            progress.nodes_evicted,
            progress.logical_tokens_evicted,
            progress.slots_freed_by_rank.tolist(),
        )

    def _evict_host_nodes(
        self, parents: list, taken: set, progress: _HostEvictionProgress, done
    ) -> None:
        candidates = self.evictable_host_leaves
        while not done():
            node = self._next_candidate(candidates, parents, taken)
            if node is None:
                return
            if not node.evicted or node.host_ref_counter > 0:
                continue
            self._record_remove_event(node, medium=StorageMedium.CPU)
            self.cache_controller.evict_host(self._node_host_evict_indices(node))
            # Counted once, when the node was written (split and concat carry it along).
            slots_by_rank = node.cp_hicache.host_slots_by_rank(self.cp_layout.cp_size)
            self.host_ledger.give_back(slots_by_rank)
            progress.slots_freed_by_rank += slots_by_rank
            progress.logical_tokens_evicted += self._node_host_len(node)
            progress.nodes_evicted += 1
            self.host_logical_tokens -= node.host_len
            node.host_len = 0
            node.cp_hicache = None
            parent = node.parent
            removed = parent.children.pop(node.key.child_key(self.page_size), None)
            assert removed is node, f"host eviction: node {node.id} is not its parent's child"
            candidates.discard(node)
            self._update_host_leaf_status(parent)
            if len(parent.children) == 0 and parent.evicted and parent not in candidates:
                heapq.heappush(parents, self._parent_entry(parent))
            self._note_host_event()

    def _update_host_leaf_status(self, node: TreeNode):
        """Stock, with ``_node_backuped`` for ``child.backuped``."""
        if not node.evicted or node.lock_ref > 0:
            self.evictable_host_leaves.discard(node)
            return
        if any(self._node_backuped(child) for child in node.children.values()):
            self.evictable_host_leaves.discard(node)
            return
        self.evictable_host_leaves.add(node)

    # ---- device eviction ----

    def evict(self, params: EvictParams) -> EvictResult:
        """Stock, with ``_node_backuped`` for ``backuped`` and ``node.id`` breaking priority ties."""
        start_time = time.perf_counter()
        write_back = self.cache_controller.write_policy == "write_back"
        candidates, parents, taken = self.evictable_leaves, [], set()
        num_evicted = 0  # logical tokens
        write_back_nodes = []
        while num_evicted < params.num_tokens:
            node = self._next_candidate(candidates, parents, taken)
            if node is None:
                break
            if node.lock_ref > 0:
                continue
            if self._node_backuped(node):
                num_evicted += self._evict_backuped(node)
            elif write_back:
                written = self.write_backup(node, write_back=True)
                num_evicted += written
                if written > 0:
                    write_back_nodes.append(node)
            else:
                num_evicted += self._evict_regular(node)
            # Stock pushes the parent once every child is evicted or being written back. A parent that
            # became a leaf is a candidate already; one whose children are being written back is not
            # a leaf until they are evicted below, so it joins this call's parents.
            parent = node.parent
            siblings = parent.children.values()
            if (
                parent not in candidates
                and parent.lock_ref == 0
                and all(s.evicted or s in write_back_nodes for s in siblings)
            ):
                heapq.heappush(parents, self._parent_entry(parent))
        self._requeue_taken(candidates, taken)
        if write_back:
            self.writing_check(write_back=True)
            for node in write_back_nodes:
                assert self._node_backuped(node)
                self._evict_backuped(node)
        self.update_eviction_metrics(num_evicted, start_time)
        return EvictResult(num_tokens_evicted=num_evicted)

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

    # ---- L3 storage (docs/hicache-storage.md) ----
    # Every decision below is taken from state identical on every rank (the tree, the ledger, page
    # owners) or from a MIN over the attention groups that every rank enters, including a rank that
    # owns none of the pages: the trees and ledgers never drift apart.

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

    def _min_over_ranks(self, value: int) -> int:
        tensor = self._agreed_max
        tensor.fill_(value)
        self._all_reduce_attn_groups(tensor, torch.distributed.ReduceOp.MIN)
        return int(tensor.item())

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

    # ---- storage and observability ----

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
