"""Multi-rank CP HiCache simulation: randomized workloads on every rank of cp 2 and cp 4 gloo groups keep
every invariant, also with an MTP draft pool on EAGLE bigram keys, and the harness reports planted
cross-rank bugs (a wrong host slot freed, a write committed against the group's refusal, a skipped
collective, the draft of a loaded-back prefix left stale, a draft page restored one page off) with
seed, step, rank and invariant; ranks whose copies finish at different times (per-rank completion
skew) still agree.

Also the regression test of the bug the simulation found in ``CpHiRadixCache.load_back``.
"""

import unittest

import numpy as np

from sglang_cp_shared_kv_testing.cp_hicache_simulation import (
    WRITE_POLICIES,
    SimulationScenario,
    SimulationViolation,
    run_simulation,
)
from sglang_cp_shared_kv_testing.cp_hicache_stack import (
    build_cp_hicache_stack,
    draft_load_one_page_off,
)
from sglang_cp_shared_kv_testing.multi_rank import single_process_group
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=80, suite="stage-a-test-cpu")

PAGE = 64

# Decisions the randomized workload must reach for a clean run to mean something. Not "host writes
# refused": with every rank's need known, a write is refused only when host nodes it would evict are
# protected by a load-back in flight, which test_cp_hicache_agreement sets up on purpose.
_COVERAGE = (
    "load-backs done",
    "load-backs declined",
    "host writes committed",
    "host evictions",
    "host evictions for a write",
    "node splits",
    "node splits on host",
    "injected device allocation failures fired",
    "op continue_chunk",
    "op decode",
)


# ---- deliberate bugs, planted on one rank (module level: pickled into the rank processes) ----


def _plant_wrong_host_slot_freed(stack, cp_rank):
    """Rank 1's host eviction frees the page after the node's page (someone else's slot)."""
    if cp_rank != 1:
        return
    controller = stack.controller
    evict_host = controller.evict_host

    def shifted_evict_host(host_indices, backup_only=True):
        wrong = (host_indices + PAGE) % controller.mem_pool_host.size
        return evict_host(wrong, backup_only)

    controller.evict_host = shifted_evict_host


def _plant_write_decided_on_own_host_pool(stack, cp_rank):
    """Rank 1 decides host writes (and how far host eviction goes) by its own free slots only, as if
    the other ranks' shortfall did not matter."""
    if cp_rank != 1:
        return
    ledger = stack.cache.host_ledger
    fits, shortfall = ledger.fits, ledger.shortfall

    def own_only(slots_by_rank):
        own = np.zeros_like(slots_by_rank)
        own[cp_rank] = slots_by_rank[cp_rank]
        return own

    ledger.fits = lambda slots_by_rank: fits(own_only(slots_by_rank))
    ledger.shortfall = lambda slots_by_rank: shortfall(own_only(slots_by_rank))


def _plant_zero_owned_rank_skips_load_agreement(stack, cp_rank):
    """Rank 1 skips the load-back allocation agreement when it holds nothing of the loaded nodes."""
    if cp_rank != 1:
        return
    cache, controller = stack.cache, stack.controller
    alloc, agree = controller.alloc_logical_locs, cache._all_ranks_ok
    last = {}

    def remembering_alloc(metadata):
        last["metadata"] = metadata
        return alloc(metadata)

    def skipping_agree(ok):
        metadata = last.pop("metadata", None)
        if metadata is not None and metadata.num_owned == 0:
            return ok
        return agree(ok)

    controller.alloc_logical_locs = remembering_alloc
    cache._all_ranks_ok = skipping_agree


def _plant_draft_restore_skipped(stack, cp_rank):
    """Rank 1 restores the target only, as sglang 0.5.11's NSA controller does: the draft rows of a
    loaded-back prefix keep whatever they held."""
    if cp_rank != 1:
        return
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    controller = stack.controller
    controller.start_loading = lambda: HybridCacheController.start_loading(controller)


def _plant_draft_page_restored_one_page_off(stack, cp_rank):
    """Rank 1 restores the first draft page of every load one physical page further on."""
    if cp_rank != 1:
        return
    group = stack.controller.mem_pool_host_draft
    group.load_to_device_per_layer = draft_load_one_page_off(group.load_to_device_per_layer, PAGE)


class TestCpHiCacheSimulation(CustomTestCase):
    def _assert_clean_run(self, cp_size, num_ops, seeds, draft_layers=0, eagle_keys=False):
        scenarios = [
            SimulationScenario(
                seed=seed, num_ops=num_ops, write_policy=policy, draft_layers=draft_layers,
                eagle_keys=eagle_keys,
            )
            for seed, policy in zip(seeds, WRITE_POLICIES)
        ]
        report = run_simulation(cp_size, scenarios)  # raises SimulationViolation
        self.assertEqual(report.ops_executed, len(scenarios) * (num_ops + 1))
        stats = report.total_stats()
        missing = [name for name in _COVERAGE if stats[name] == 0]
        self.assertEqual(missing, [], f"the workload never reached: {missing}")

    def test_cp2_every_write_policy_keeps_every_invariant(self):
        self._assert_clean_run(cp_size=2, num_ops=450, seeds=(11, 12, 13))

    def test_cp4_every_write_policy_keeps_every_invariant(self):
        self._assert_clean_run(cp_size=4, num_ops=220, seeds=(21, 22, 23))

    def test_cp2_with_an_mtp_draft_pool_every_write_policy_keeps_every_invariant(self):
        """An MTP server's stack: the draft's KV and indexer bytes (written with the target's) stay
        right on device and on host through every load-back, split, write-back and host eviction of
        the workload, on the tree the scheduler builds for EAGLE / NEXTN (bigram keys). With tree
        value pages looked up by raw tokens (main before the bigram fix) it failed at its first
        cache_unfinished_req (``exception``: "radix node N has no host page ids")."""
        self._assert_clean_run(
            cp_size=2, num_ops=300, seeds=(31, 32, 33), draft_layers=1, eagle_keys=True
        )

    def test_cp2_ranks_agree_when_their_copies_finish_at_different_times(self):
        """Per-rank completion skew (each rank's acks finish up to 3 queries late, independently) and
        requests declined right after their load-back: trees, evictable sizes and ack queues agree at
        every step. Failed before load acks were agreed (stock ``loading_check``): rank-agreement at
        step 158, the declined load's node evicted on one rank only."""
        scenario = SimulationScenario(
            seed=42, num_ops=200, write_policy="write_back", completion_skew=3, decline_after_load=0.5
        )
        report = run_simulation(2, [scenario])  # raises SimulationViolation
        stats = report.total_stats()
        self.assertGreater(stats["admission declined after its load-back"], 0)
        self.assertGreater(stats["load-backs done"], 0)

    def _planted_violation(self, plant, seed, draft_layers=0) -> SimulationViolation:
        scenario = SimulationScenario(
            seed=seed, num_ops=800, plant=plant, draft_layers=draft_layers
        )
        with self.assertRaises(SimulationViolation) as caught:
            run_simulation(2, [scenario])
        violation = caught.exception
        self.assertEqual(violation.seed, seed)
        self.assertEqual(violation.rank, 1)
        message = str(violation)
        for part in (f"seed={seed}", f"step={violation.step}", "rank=1", violation.invariant):
            self.assertIn(part, message)
        return violation

    def test_reports_a_rank_that_frees_a_wrong_host_slot(self):
        violation = self._planted_violation(_plant_wrong_host_slot_freed, seed=0)
        self.assertEqual(violation.invariant, "host-slots")

    def test_reports_a_rank_that_decides_writes_on_its_own_host_pool(self):
        violation = self._planted_violation(_plant_write_decided_on_own_host_pool, seed=7)
        # Caught by the digest (the trees or ledgers differ), or, when the extra ack makes rank 1
        # enter an all-reduce first, by the collective trace.
        self.assertIn(violation.invariant, ("rank-agreement", "collective-sequence"))

    def test_reports_a_rank_that_leaves_the_draft_of_a_loaded_back_prefix_stale(self):
        violation = self._planted_violation(_plant_draft_restore_skipped, seed=0, draft_layers=1)
        self.assertEqual(violation.invariant, "draft-device-bytes")

    def test_reports_a_rank_that_restores_a_draft_page_one_page_off(self):
        violation = self._planted_violation(
            _plant_draft_page_restored_one_page_off, seed=0, draft_layers=1
        )
        self.assertEqual(violation.invariant, "draft-device-bytes")

    def test_reports_a_rank_that_skips_a_collective(self):
        violation = self._planted_violation(_plant_zero_owned_rank_skips_load_agreement, seed=0)
        self.assertEqual(violation.invariant, "collective-sequence")
        self.assertIn("rank 0 in _all_ranks_ok", violation.detail)


class TestLoadBackKeepsItsHostCopies(CustomTestCase):
    """Found by the simulation (cp 2, write_back, seed 3, step 473): a load-back whose device allocation
    failed evicted device nodes; write_back wrote them to host, which host-evicted the very node being
    loaded. The node left the tree, its host slots were reused, and the load read the other node's
    bytes while ``protected_size_`` kept counting the detached node."""

    def test_write_back_eviction_during_load_back_spares_the_loaded_node(self):
        stack = build_cp_hicache_stack(
            cp_size=1,
            cp_rank=0,
            group=single_process_group(),
            physical_pages=4,
            write_policy="write_back",
            hicache_ratio=1.0,  # 5 host pages: a's 2, and 3 free where b's write-back needs 4
        )
        cache, allocator = stack.cache, stack.allocator
        host = stack.controller.mem_pool_host
        a = list(range(1_000, 1_000 + 2 * PAGE))
        b = list(range(5_000, 5_000 + 4 * PAGE))
        cache.insert(InsertParams(key=RadixKey(a), value=allocator.alloc(len(a))))
        cache.evict(EvictParams(num_tokens=len(a)))  # write_back: a now lives on host only
        node_a = cache.match_prefix(MatchPrefixParams(key=RadixKey(a))).last_host_node
        cache.insert(InsertParams(key=RadixKey(b), value=allocator.alloc(len(b))))  # device full

        self.assertIsNone(cache.load_back(node_a))  # refused: a cannot make room for itself
        self.assertIs(cache.root_node.children.get(node_a.key.child_key(PAGE)), node_a)
        self.assertEqual(node_a.host_len, len(a))
        self.assertEqual(host.available_size(), 3 * PAGE)  # b's write-back was refused, a kept
        self.assertEqual((cache.protected_size_, cache.evictable_size_), (0, len(b)))


class TestSimulationScriptArguments(CustomTestCase):
    """``scripts/simulate_cp_hicache.py`` refuses a host pool smaller than the device pool up front:
    stock HiCache asserts host > device when it builds the host pool, so a run could only report that
    assertion as a simulation "VIOLATION". Failed before the check: the script ran the scenarios and
    returned 1 with a VIOLATION line instead of an argparse error."""

    @classmethod
    def setUpClass(cls):
        from sglang_cp_shared_kv_testing.repo_scripts import load_script

        cls.script = load_script("scripts/simulate_cp_hicache.py")

    def test_refuses_a_ratio_below_one(self):
        import contextlib
        import io

        for ratio in ("0.5", "0.99", "-1"):
            stderr = io.StringIO()
            with self.subTest(ratio=ratio), contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(
                io.StringIO()
            ):
                with self.assertRaises(SystemExit) as caught:
                    self.script.main(["--hicache-ratio", ratio, "--cp-sizes", "2", "--seeds", "0", "--ops", "5"])
                self.assertEqual(caught.exception.code, 2)
                self.assertIn("--hicache-ratio", stderr.getvalue())
                self.assertIn("at least 1", stderr.getvalue())

    def test_accepts_ratios_from_one(self):
        for ratio in ("1", "1.5", "4"):
            self.assertEqual(self.script.parse_args(["--hicache-ratio", ratio]).hicache_ratio, float(ratio))

    def test_eagle_keys_reach_every_scenario(self):
        import contextlib
        import io
        from unittest import mock

        from sglang_cp_shared_kv_testing.cp_hicache_simulation import SimulationReport

        for argv, expected in (([], False), (["--eagle-keys"], True)):
            ran = []

            def fake(cp_size, scenarios, timeout_s, ran=ran):
                ran.extend(scenarios)
                return SimulationReport(cp_size, [], 0.0)

            with self.subTest(argv=argv), mock.patch.object(self.script, "run_simulation", fake), \
                    contextlib.redirect_stdout(io.StringIO()):  # fmt: skip
                self.assertEqual(self.script.main(argv + ["--cp-sizes", "2", "--seeds", "0", "1"]), 0)
                self.assertEqual({s.eagle_keys for s in ran}, {expected})
                self.assertEqual(len(ran), 2 * 3)  # seeds x write policies


if __name__ == "__main__":
    unittest.main()
