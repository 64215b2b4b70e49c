"""A seeded CP HiCache workload run on a counting clock, logging every eviction in order.

Tests of the eviction order compare two runs of the same workload from the same start (clock, node ids):
the cache as it is and an oracle (a per-call heap, a per-node clock). ``monotonic`` counts calls, so two
runs that read the clock in the same relative order see the same order of timestamps, and a tie means
the same thing in both.
"""

from __future__ import annotations

import contextlib
import time
import types
from typing import Callable, List, Optional
from unittest import mock

from sglang.srt.mem_cache import hiradix_cache as stock_hiradix_module
from sglang.srt.mem_cache import radix_cache as stock_radix_module
from sglang.srt.mem_cache.radix_cache import TreeNode

from sglang_cp_shared_kv.mem_cache import cp_hiradix_cache as cp_module
from sglang_cp_shared_kv_testing.cp_hicache_simulation_workload import CpHiCacheWorkload
from sglang_cp_shared_kv_testing.cp_hicache_stack import (
    NSA_PAGE_SIZE,
    build_cp_hicache_stack,
)
from sglang_cp_shared_kv_testing.multi_rank import single_process_group

# Every policy RadixCache.__init__ accepts in sglang 0.5.11.
EVICTION_POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "priority", "slru")


class CountingClock:
    """``time`` as the radix modules see it: ``monotonic`` returns 1, 2, 3, ... and counts its calls."""

    def __init__(self):
        self.reads = 0
        self.namespace = types.SimpleNamespace(monotonic=self.monotonic, perf_counter=time.perf_counter)

    def monotonic(self) -> float:
        self.reads += 1
        return float(self.reads)


@contextlib.contextmanager
def counting_clock():
    clock = CountingClock()
    patches = [
        mock.patch.object(module, "time", clock.namespace)
        for module in (stock_radix_module, stock_hiradix_module, cp_module)
    ]
    for patch in patches:
        patch.start()
    try:
        yield clock
    finally:
        for patch in patches:
            patch.stop()


def run_logged(
    eviction_policy: str,
    write_policy: str,
    seed: int,
    *,
    num_ops: int,
    physical_pages: int = 16,
    configure: Optional[Callable] = None,
) -> List[tuple]:
    """Run one seeded workload (cp 2, rank 0's view); ``configure(cache)`` runs on the built cache.

    Returns the log: ``("evict-device" | "evict-host", node id)`` per node removed, and
    ``("write-through" | "write-back", node id, logical tokens written)`` per backup attempt.
    """
    with counting_clock():
        TreeNode.counter = 1_000_000  # the same node ids in every run
        stack = build_cp_hicache_stack(
            cp_size=2,
            cp_rank=0,
            group=single_process_group(),
            physical_pages=physical_pages,
            write_policy=write_policy,
            hicache_ratio=1.5,
            eviction_policy=eviction_policy,
            max_running_requests=3,
        )
        cache = stack.cache
        if configure is not None:
            configure(cache)
        log: List[tuple] = []
        record_remove, write_backup = cache._record_remove_event, cache.write_backup

        def logged_remove(node, medium=None):
            log.append(("evict-host" if str(medium).endswith("CPU") else "evict-device", node.id))
            return record_remove(node, medium=medium)

        def logged_write_backup(node, write_back=False):
            written = write_backup(node, write_back=write_back)
            log.append(("write-back" if write_back else "write-through", node.id, written))
            return written

        cache._record_remove_event = logged_remove
        cache.write_backup = logged_write_backup
        logical_tokens = 2 * physical_pages * NSA_PAGE_SIZE
        workload = CpHiCacheWorkload(
            stack, seed=seed, max_running_requests=3, max_request_tokens=logical_tokens * 45 // 100
        )
        for _ in range(num_ops):
            workload.run(workload.next_operation())
        workload.drain()
        return log


def first_divergence(ours: List[tuple], oracle: List[tuple]) -> str:
    for i, (a, b) in enumerate(zip(ours, oracle)):
        if a != b:
            return f"entry {i}: ours {a}, oracle {b}"
    return f"lengths differ: ours {len(ours)}, oracle {len(oracle)}"
