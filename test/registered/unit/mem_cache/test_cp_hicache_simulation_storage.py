"""Multi-rank CP HiCache simulation with an L3 storage tier: every rank of a cp 2 gloo group shares one
file-backend directory; requests prefetch from storage on arrival, host-write acks store each rank's
own pages, host eviction and restarts (device and host emptied, storage kept) happen at random.
After every step the group checks every invariant of the simulation (identical trees, ledgers,
allocator and ack state on every rank; owned device and host bytes equal to their tokens' pattern,
KV rows and indexer pages alike) plus two of storage: the storage decisions every rank counts agree,
and no page's KV object is in storage without its indexer object.

Planted and seen to fail (then reverted): rank 1 restores KV pages from storage without reading their
indexer pages (counted as read) -> test_reports_a_rank_that_restores_kv_without_its_indexer_page
("device-bytes" and "host-bytes" at step 12); owner-blind writes (each rank storing its host pages as the node's leading pages),
run once by hand (cp 2, seed 1, write_through) -> "device-bytes" and "host-bytes" on both ranks at
step 180, the first restore of such a page.
"""

import shutil
import tempfile
import unittest

from sglang_cp_shared_kv_testing.cp_hicache_simulation import (
    WRITE_POLICIES,
    SimulationScenario,
    SimulationViolation,
    run_simulation,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=35, suite="stage-a-test-cpu")

# What a clean run must reach for it to mean something.
_COVERAGE = (
    "storage prefetches restored",
    "restarts",
    "load-backs done",
    "host evictions",
    "host writes committed",
)


def _plant_kv_restored_without_indexer(stack, cp_rank):
    """Rank 1's storage reads skip the indexer objects but report them read."""
    if cp_rank != 1:
        return
    from sglang.srt.mem_cache.hicache_storage import PoolName

    backend = stack.cache.cp_storage.backend
    batch_get_v2 = backend.batch_get_v2

    def kv_only(transfers):
        results = batch_get_v2([t for t in transfers if t.name != PoolName.INDEXER])
        for transfer in transfers:
            if transfer.name == PoolName.INDEXER:
                results[transfer.name] = [True] * len(transfer.keys)
        return results

    backend.batch_get_v2 = kv_only


class TestCpHiCacheSimulationWithStorage(CustomTestCase):
    def setUp(self):
        self.directory = tempfile.mkdtemp(prefix="cp-hicache-sim-l3-")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def test_cp2_every_write_policy_with_storage_keeps_every_invariant(self):
        scenarios = [
            SimulationScenario(seed=seed, num_ops=260, write_policy=policy, storage_dir=self.directory)
            for seed, policy in zip((41, 42, 43), WRITE_POLICIES)
        ]
        report = run_simulation(2, scenarios)  # raises SimulationViolation
        stats = report.total_stats()
        missing = [name for name in _COVERAGE if stats[name] == 0]
        self.assertEqual(missing, [], f"the workload never reached: {missing}")

    def test_reports_a_rank_that_restores_kv_without_its_indexer_page(self):
        scenario = SimulationScenario(seed=44, num_ops=400, storage_dir=self.directory,
                                      plant=_plant_kv_restored_without_indexer)  # fmt: skip
        with self.assertRaises(SimulationViolation) as caught:
            run_simulation(2, [scenario])
        # The restored host node is loaded back in the same admission: its indexer pages are wrong
        # on host and then on device, and the first check in order names it.
        self.assertIn(caught.exception.invariant, ("device-bytes", "host-bytes"))
        self.assertIn("rank 1 host-bytes", caught.exception.detail)
        self.assertEqual(caught.exception.rank, 1)


if __name__ == "__main__":
    unittest.main()
