"""Device and host eviction of the CP HiCache tree, in one order that every rank shares.

Both evictions pop in one total order, ``(eviction priority, node.id)``: node.id breaks priority ties
the same way on every rank (ids follow the identical sequence of tree operations); stock compares
nodes, which falls back to set iteration order. The candidates are the leaf sets
(``EvictionCandidates``, kept ordered between calls) plus, within one call, the parents stock pushes
onto its per-call heap although they are not (yet) leaves; the sequence is exactly the one a heap
rebuilt from the leaf set at the start of the call would give (``docs/cp-hicache-performance.md``).

Host eviction frees this rank's physical host slots and gives every rank's back to the host ledger;
its progress counts physical slots, not logical ``host_len`` (a long node may hold nothing on this
rank). ``_evict_host_until`` needs no collective (the ledger knows every rank's need);
``evict_host``, asked for this rank's slots only, agrees on a node count (``cp_hiradix_rank_agreement``).
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult
from sglang.srt.mem_cache.evict_policy import (
    FIFOStrategy,
    FILOStrategy,
    LFUStrategy,
    LRUStrategy,
    PriorityStrategy,
    SLRUStrategy,
)
from sglang.srt.mem_cache.radix_cache import TreeNode

from sglang_cp_shared_kv.mem_cache.eviction_candidates import EvictionCandidates

logger = logging.getLogger(__name__)

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


class CpHiRadixEviction:
    """The eviction part of ``CpHiRadixCache`` (mixed in before sglang's ``HiRadixCache``, whose
    ``eviction_strategy``, leaf updates and ``_evict_backuped`` / ``_evict_regular`` it uses)."""

    _access_requeues = True  # until _init_eviction_order knows the eviction policy (see _touch)

    def _init_eviction_order(self) -> None:
        """Once the stock constructor chose the eviction policy."""
        # The leaf sets stay sets for stock code, and keep their eviction order between calls.
        self.evictable_leaves = EvictionCandidates(self.eviction_strategy.get_priority)
        self.evictable_host_leaves = EvictionCandidates(self.eviction_strategy.get_priority)
        # Whether an access must re-queue the candidates it touches (see _touch).
        self._access_requeues = type(self.eviction_strategy) not in ACCESS_RAISES_PRIORITY

    # ---- eviction order ----

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

