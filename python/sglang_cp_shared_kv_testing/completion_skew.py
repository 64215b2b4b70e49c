"""Per-rank completion skew for CPU tests: each rank's host copies report finished at different times.

On the CPU stack a copy is finished once issued, so every rank's acks become ready at the same check
and a cache that releases locks on its own rank's completion (no agreement) looks correct. On GPUs the
ranks' copies finish when their streams get there. ``skew_completions`` makes every write and load ack
of one rank report unfinished for a random number of ``query()`` calls (0 .. ``max_late_queries``,
drawn per ack from the rank's own generator), so ranks see their copies finish at different checks.
"""

from __future__ import annotations

import random


class LateEvent:
    """A finish event that answers ``query()`` False for its first ``late_queries`` queries.

    ``synchronize()`` waits, as a real event would: the copy is finished afterwards."""

    def __init__(self, event, late_queries: int):
        self.event, self.late_queries = event, late_queries

    def query(self) -> bool:
        if self.late_queries > 0:
            self.late_queries -= 1
            return False
        return self.event.query()

    def synchronize(self) -> None:
        self.late_queries = 0
        self.event.synchronize()


class StrictLateEvent(LateEvent):
    """A ``LateEvent`` whose ``synchronize()`` before it has answered True is a bug of the caller:
    an ack applied (and its lock released) before this rank's copy finished."""

    answered_finished = False

    def query(self) -> bool:
        finished = super().query()
        self.answered_finished = self.answered_finished or finished
        return finished

    def synchronize(self) -> None:
        assert self.answered_finished, "an ack was applied before its copy finished on this rank"
        self.event.synchronize()


class _SkewedAcks(list):
    """An ack queue whose appended acks carry a ``LateEvent``."""

    def __init__(self, acks, rng: random.Random, max_late_queries: int):
        super().__init__(acks)
        self._rng, self._max_late = rng, max_late_queries

    def append(self, ack) -> None:
        late = LateEvent(ack.finish_event, self._rng.randint(0, self._max_late))
        super().append(ack._replace(finish_event=late))


def skew_completions(controller, rng: random.Random, max_late_queries: int) -> None:
    """From now on, ``controller``'s write and load acks finish up to ``max_late_queries`` queries late."""
    if max_late_queries < 0:
        raise ValueError(f"max_late_queries must be >= 0, got {max_late_queries}")
    controller.ack_write_queue = _SkewedAcks(controller.ack_write_queue, rng, max_late_queries)
    controller.ack_load_queue = _SkewedAcks(controller.ack_load_queue, rng, max_late_queries)
