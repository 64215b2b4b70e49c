"""The soak's tree dump (smoke plugin ``tree_dump.py``) on the real CP HiCache, and the skip-load-ack plant.

Two CP ranks' views (rank 0 and 1 of 2) of the real ``CpHiRadixCache`` (``sglang_cp_shared_kv_testing/cp_hicache_stack.py``,
one process) receive the same calls: insert a sequence, back it up to host, evict it from device, match
it on host and load it back. Their dumps must be equal in every shared field; with the
``skip-load-ack`` plant on rank 1's ``loading_check`` the load's lock stays on rank 1, and the
comparison the soak makes (``soak.compare_tree_dumps``) names the lock reference. Planted check:
with the plant's re-lock removed (the hook a plain pass-through), the second test fails (the
dumps stay equal).
"""

import sys
import tempfile
import unittest
from pathlib import Path

import torch

from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing.cp_hicache_stack import build_cp_hicache_stack, settle_write_acks
from sglang_cp_shared_kv_testing.e2e import soak
from sglang_cp_shared_kv_testing.multi_rank import single_process_group
from sglang_cp_shared_kv_testing.repo_scripts import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts" / "smoke_plugin"))
from cp_shared_kv_smoke_hooks import planted_bugs, tree_dump  # noqa: E402
from sglang_cp_shared_kv.mem_cache.cp_hiradix_cache import CpHiRadixCache  # noqa: E402

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")

CP_SIZE = 2
PAGE = 64
PHYSICAL_PAGES = 8  # per rank: the group's device holds 2 x 8 pages


def build_views():
    # Every view is built before any is driven (TreeNode.counter is process-global).
    return [
        build_cp_hicache_stack(cp_size=CP_SIZE, cp_rank=r, group=single_process_group(), physical_pages=PHYSICAL_PAGES)
        for r in range(CP_SIZE)
    ]


def store_and_evict(stack, tokens):
    """Insert ``tokens`` with fresh locs, back them up to host, and evict them from device."""
    cache, allocator = stack.cache, stack.allocator
    locs = allocator.alloc(len(tokens))
    cache.insert(InsertParams(key=RadixKey(tokens), value=locs))
    settle_write_acks(cache)
    cache.evict(EvictParams(num_tokens=len(tokens)))


def load_back(stack, tokens, loading_check):
    """Match ``tokens`` on host, load them back, and acknowledge the load with ``loading_check``."""
    cache = stack.cache
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    assert match.host_hit_length > 0, "nothing matched on host"
    cache.inc_lock_ref(match.last_device_node)
    _, new_last = cache.init_load_back(
        InitLoadBackParams(last_host_node=match.last_host_node, host_hit_length=match.host_hit_length)
    )
    cache.dec_lock_ref(match.last_device_node)
    cache.ready_to_load_host_cache()
    loading_check(cache)
    return new_last


class TestTreeDump(CustomTestCase):
    TOKENS = [(7 * i + 3) % 251 for i in range(6 * PAGE)]

    def dumps_after_load_back(self, loading_check_of_rank):
        views = build_views()
        for rank, stack in enumerate(views):
            store_and_evict(stack, self.TOKENS)
            load_back(stack, self.TOKENS, loading_check_of_rank(rank))
        return views

    def compare(self, views):
        with tempfile.TemporaryDirectory() as tmp:
            for rank, stack in enumerate(views):
                tree_dump.write_dump(Path(tmp), rank, 0, tree_dump.tree_snapshot(stack.cache))
            return soak.compare_tree_dumps(Path(tmp), CP_SIZE)

    def test_ranks_given_the_same_calls_dump_the_same_tree(self):
        views = self.dumps_after_load_back(lambda rank: CpHiRadixCache.loading_check)
        snapshot = tree_dump.tree_snapshot(views[0].cache)
        self.assertTrue(snapshot["shared"]["nodes"], "the tree is empty")
        self.assertTrue(any(n["host_len"] for n in snapshot["shared"]["nodes"]), "nothing was backed up")
        self.assertEqual(snapshot["shared"]["ongoing_loads"], 0)
        self.assertEqual(self.compare(views), (1, []))
        # Each rank holds its own half of the host slots: reported, not compared.
        own = [tree_dump.tree_snapshot(s.cache)["rank_local"]["own_host_slots_in_tree"] for s in views]
        self.assertEqual(sum(own), len(self.TOKENS))

    def test_the_skip_load_ack_plant_leaves_rank_1_locked_and_the_comparison_says_so(self):
        def loading_check_of_rank(rank):
            if rank == 1:
                return lambda cache: planted_bugs.keep_load_locks_on_rank_1(CpHiRadixCache.loading_check, cache)
            return CpHiRadixCache.loading_check

        views = self.dumps_after_load_back(loading_check_of_rank)
        checkpoints, failures = self.compare(views)
        self.assertEqual(checkpoints, 1)
        self.assertEqual(len(failures), 1, failures)
        self.assertIn("rank 1 differs from rank 0", failures[0])
        self.assertTrue("lock_ref" in failures[0] or "evictable_size" in failures[0], failures[0])

    def test_the_hook_writes_one_numbered_dump_per_server_info(self):
        from types import SimpleNamespace

        hooks = {}
        registry = SimpleNamespace(register=lambda target, fn, kind: hooks.setdefault(target, fn))
        stack = build_views()[0]
        with tempfile.TemporaryDirectory() as tmp:
            tree_dump.register_hooks(registry, tmp)
            (hook,) = hooks.values()
            self.assertEqual(list(hooks), ["sglang.srt.managers.scheduler.Scheduler.get_internal_state"])
            for _ in range(2):
                hook(None, SimpleNamespace(tree_cache=stack.cache))
            tree_dir = Path(tmp) / "tree"
            self.assertEqual(sorted(p.name for p in tree_dir.iterdir()), ["tree.rank0.0000.json", "tree.rank0.0001.json"])
            self.assertEqual(soak.next_tree_dump_seq(tree_dir), 2)

    def test_a_rank_without_a_dump_fails_the_comparison(self):
        views = build_views()
        with tempfile.TemporaryDirectory() as tmp:
            tree_dump.write_dump(Path(tmp), 0, 0, tree_dump.tree_snapshot(views[0].cache))
            _, failures = soak.compare_tree_dumps(Path(tmp), CP_SIZE)
        self.assertEqual(failures, ["tree dump 0: ranks [1] wrote none"])


class TestPluginWiring(CustomTestCase):
    def test_audits_bring_the_tree_dump_and_the_pool_dumps_can_be_turned_off(self):
        import os

        import cp_shared_kv_smoke_hooks as plugin
        from sglang.srt.plugins.hook_registry import HookRegistry

        from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks

        dump = "sglang.srt.managers.scheduler.Scheduler.get_internal_state"
        pool = "sglang.srt.mem_cache.radix_cache.RadixCache.cache_finished_req"
        saved = dict(os.environ)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                for pool_env, expected in ((None, {dump, pool}), ("0", {dump}), ("-audit$", {dump, pool})):
                    with applied_hooks(), self.subTest(pool_env=pool_env):
                        os.environ[plugin.SMOKE_AUDIT_DIR_ENV] = tmp
                        os.environ.pop(plugin.SMOKE_AUDIT_POOL_ENV, None)
                        if pool_env:
                            os.environ[plugin.SMOKE_AUDIT_POOL_ENV] = pool_env
                        plugin.register()
                        self.assertEqual(set(HookRegistry._hooks) & {dump, pool}, expected)
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def test_the_plant_wraps_the_cp_loading_check(self):
        from sglang.srt.plugins.hook_registry import HookRegistry

        from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks

        with applied_hooks(lambda registry: planted_bugs.register_hooks(registry, "skip-load-ack")):
            self.assertIn("sglang_cp_shared_kv.mem_cache.cp_hiradix_cache.CpHiRadixCache.loading_check",
                          HookRegistry._hooks)  # fmt: skip


if __name__ == "__main__":
    unittest.main()
