"""Non-blocking write acknowledgement on two CP ranks (gloo): ``writing_check`` starts the ack count's
all-reduce and returns without waiting for the other rank; the next check applies the agreed count, so
both ranks pop the same acks at the same check, also when one rank's copy finishes later and when a rank
owns nothing in the node (one ack per write still)."""

import tempfile
import time
import unittest
from pathlib import Path

import numpy as np
import torch.distributed as dist

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing.completion_skew import StrictLateEvent
from sglang_cp_shared_kv_testing.multi_rank import run_ranks

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")

PAGE = 64
CP_SIZE = 2
# Rank 1 enters its first check only after rank 0's returned (a file, outside the process group):
# a blocking check on rank 0 would wait for rank 1 forever, so rank 1 gives up after this long and
# reports it, and the test fails without hanging.
HANDSHAKE_TIMEOUT_S = 60.0


def _rank(rank, world_size, handshake_dir):
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sglang_cp_shared_kv_testing.cp_hicache_stack import build_cp_hicache_stack

    stack = build_cp_hicache_stack(
        cp_size=CP_SIZE, cp_rank=rank, group=dist.group.WORLD, physical_pages=16
    )
    cache, allocator = stack.cache, stack.allocator
    controller = cache.cache_controller
    report = {"timeline": [], "acks_per_write": []}

    def insert(first, num_pages, owner=None):
        tokens = list(range(first, first + num_pages * PAGE))
        locs = allocator.alloc_with_owners(np.full(num_pages, owner)) if owner is not None else None
        if locs is None:
            locs = allocator.alloc(len(tokens))
        acks_before = len(controller.ack_write_queue)
        cache.insert(InsertParams(key=RadixKey(tokens), value=locs))
        report["acks_per_write"].append(len(controller.ack_write_queue) - acks_before)

    def check(label):
        cache.writing_check()
        report["timeline"].append(
            (label, sorted(cache.ongoing_write_through), cache.protected_size())
        )

    # 1. The check returns while the peer is not there yet; the ack is applied at the next check.
    insert(0, 2)
    returned = Path(handshake_dir) / "rank0_first_check_returned"
    if rank == 1:
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        while not returned.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        report["peer_returned_before_this_rank_joined"] = returned.exists()
    check("started")
    if rank == 0:
        returned.touch()
    check("applied")

    # 2. Rank 1's copy finishes two checks late: no rank applies the ack before both finished.
    insert(10_000, 2)
    if rank == 1:
        ack = controller.ack_write_queue[-1]
        controller.ack_write_queue[-1] = type(ack)(ack[0], StrictLateEvent(ack[1], 2), ack[2])
    for i in range(4):
        check(f"late {i}")

    # 3. A node whose pages all belong to rank 0: rank 1 owns nothing and still acks it once.
    insert(20_000, 2, owner=0)
    check("owned by rank 0, started")
    check("owned by rank 0, applied")
    return report


class TestAsyncWriteAcks(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        with tempfile.TemporaryDirectory() as handshake_dir:
            cls.reports = run_ranks(_rank, CP_SIZE, args=(handshake_dir,), timeout_s=180)

    def test_check_does_not_wait_for_the_peer(self):
        self.assertIs(self.reports[1]["peer_returned_before_this_rank_joined"], True)

    def test_ranks_apply_the_same_acks_at_the_same_check(self):
        self.assertEqual(self.reports[0]["timeline"], self.reports[1]["timeline"])

    def test_acks_apply_one_check_after_both_ranks_finished(self):
        ongoing = [(label, len(ids)) for label, ids, _ in self.reports[0]["timeline"]]
        self.assertEqual(
            ongoing,
            [
                ("started", 1),
                ("applied", 0),
                ("late 0", 1),  # rank 1 unfinished: MIN 0
                ("late 1", 1),  # applies 0; rank 1 still unfinished
                ("late 2", 1),  # applies 0; both finished now: MIN 1 started
                ("late 3", 0),  # applied
                ("owned by rank 0, started", 1),
                ("owned by rank 0, applied", 0),
            ],
        )
        self.assertEqual(self.reports[0]["timeline"][-1][2], 0)  # every write lock released

    def test_one_ack_per_write_on_every_rank(self):
        for report in self.reports:
            self.assertEqual(report["acks_per_write"], [1, 1, 1])


if __name__ == "__main__":
    unittest.main()
