"""Eviction candidates kept in eviction order between calls, instead of a heap rebuilt per call.

Stock sglang 0.5.11 keeps the evictable leaves as a ``set`` and every ``evict`` / ``evict_host`` call
heapifies all of them: O(n) per call, 150 ms at 100K leaves. ``EvictionCandidates`` is that set (stock
code keeps adding, removing and testing members as before) plus a lazy min-heap over the same members,
ordered by ``(priority, node.id)``, the total order the CP cache evicts in (``node.id`` breaks ties the
same way on every rank).

Invariant: every member has at least one heap entry whose priority is <= its current priority.
``add`` pushes an entry; a caller whose node's priority may have *decreased* (an access under MRU) calls
``touch``, which pushes a fresh one. Entries are never updated in place, so the heap may hold stale
entries: of removed nodes (dropped when they reach the top) and of nodes whose priority has grown since
(LRU, LFU, priority, SLRU: re-keyed to the current priority when they reach the top). With the
invariant, the valid entry at the top is the member with the smallest current ``(priority, node.id)``,
exactly what a heap rebuilt from the set would pop first. The heap is rebuilt from the members when
stale entries outnumber them, so it stays O(members).
"""

from __future__ import annotations

import heapq
from typing import Any, Callable, Optional


class EvictionCandidates(set):
    """A set of tree nodes with ``peek`` / ``pop_top``: the member a fresh per-call heap would pop first."""

    # Rebuild once the heap holds this many entries beyond twice the members (amortised O(1) per push).
    COMPACT_SLACK = 64

    def __init__(self, priority_of: Callable[[Any], Any]):
        super().__init__()
        self._priority_of = priority_of  # the cache's eviction_strategy.get_priority
        # (priority when pushed, node.id, push sequence, node): the sequence keeps nodes out of comparisons.
        self._heap: list = []
        self._pushes = 0

    def add(self, node) -> None:
        if node not in self:
            super().add(node)
            self._push(node)

    def clear(self) -> None:
        super().clear()
        self._heap.clear()

    def touch(self, node) -> None:
        """``node``'s priority may have changed: give it an entry at its current priority if it is a member."""
        if node in self:
            self._push(node)

    def peek(self) -> Optional[tuple]:
        """``(priority, node.id, sequence, node)`` of the member that evicts first, or ``None``; not removed."""
        heap = self._heap
        while heap:
            priority, node_id, sequence, node = heap[0]
            if node not in self:
                heapq.heappop(heap)  # removed since it was pushed
                continue
            current = self._priority_of(node)
            if current != priority:
                # Its priority grew since this entry was pushed (a decrease comes with a fresher entry).
                heapq.heapreplace(heap, (current, node_id, self._next_sequence(), node))
                continue
            return heap[0]
        return None

    def pop_top(self):
        """Remove the entry ``peek`` returned and give back its node; the node stays a member."""
        return heapq.heappop(self._heap)[3]

    def _push(self, node) -> None:
        if len(self._heap) >= 2 * len(self) + self.COMPACT_SLACK:
            self._compact()  # the members, ``node`` included, get one entry each
            return
        heapq.heappush(self._heap, (self._priority_of(node), node.id, self._next_sequence(), node))

    def _compact(self) -> None:
        self._heap = [(self._priority_of(n), n.id, self._next_sequence(), n) for n in self]
        heapq.heapify(self._heap)

    def _next_sequence(self) -> int:
        self._pushes += 1
        return self._pushes
