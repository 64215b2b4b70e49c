"""The host mirror of req_to_token stays equal to the device table through sglang's own writers.

sglang's ``alloc_for_extend`` / ``alloc_for_decode`` / ``cache_unfinished_req`` / ``cache_finished_req``
run on real tree caches (ChunkCache, RadixCache, CpHiRadixCache with host backup and load-back) and
our allocator, with the mirror hooks applied; after every step each running request's mirrored pages
must equal ``req_to_token`` at every position, and every tree node's host page ids its value.

Planted bugs, each caught here: the decode writer hook left out (``test_a_missed_writer_is_caught``);
``cache_unfinished_req``'s rewrite left out (the same test, the dedup case); the split of a node's
pages taken in the wrong order (the radix and HiCache scenarios and random runs failed) and load-back
pages offset by one page (the HiCache scenario failed); both planted by hand, then reverted.
"""

import collections
import os
import random
import unittest
from types import SimpleNamespace
from unittest import mock

import torch

from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.mem_cache import req_to_page_mirror_writers
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror import ReqToPageMirror, mirror_of
from sglang_cp_shared_kv.settings import REQ_TO_PAGE_MIRROR_CHECK_ENV
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror_writers import ROWS_ATTR
from sglang_cp_shared_kv.mem_cache.tree_value_pages import inserting_from
from sglang_cp_shared_kv_testing.cp_hicache_stack import build_cp_hicache_stack, settle_write_acks
from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks
from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import mark_dummy_run
from sglang_cp_shared_kv.model_executor.gather_scratch import create_gather_scratch
from sglang_cp_shared_kv_testing.multi_rank import single_process_group
from sglang_cp_shared_kv_testing.page_mirror import mirrored
from sglang_cp_shared_kv_testing.shared_kv_state import attach_runtime
from sglang_cp_shared_kv_testing.runtime_check import make_nsa_pool
from sglang_cp_shared_kv_testing.scheduler_writes import SchedulerWrites, mirrored_cp_stack

register_cpu_ci(est_time=60, suite="stage-a-test-cpu")

PAGE = 64
CP_SIZE = 2


def _plain_stack(cache_class, physical_pages=40):
    return mirrored_cp_stack(cache_class, physical_pages, CP_SIZE, PAGE)


def _hicache_stack(physical_pages=40):
    stack = build_cp_hicache_stack(
        cp_size=CP_SIZE, cp_rank=0, group=single_process_group(), physical_pages=physical_pages,
        max_context_len=2048,
    )  # fmt: skip
    ReqToPageMirror.attach(stack.req_to_token_pool, PAGE)
    return SchedulerWrites(stack.cache, stack.req_to_token_pool, stack.allocator)


def _tokens(rng, n):
    return [rng.randrange(1, 30_000) for _ in range(n)]


class _Scenario:
    """One serving story; ``check`` runs after every step."""

    def __init__(self, test, writes: SchedulerWrites, seed=0):
        self.test, self.w, self.rng = test, writes, random.Random(seed)
        self.steps = 0

    def check(self, what):
        self.steps += 1
        problems = self.w.mismatches()
        self.test.assertEqual(problems, [], f"after {what}")

    def chunked_prefill(self, req, chunk):
        prefix = len(req.prefix_indices)
        while True:
            end = min(prefix + chunk, len(req.origin_input_ids))
            self.w.extend([req], [end])
            self.check(f"extend of request {req.rid} to {end}")
            self.w.after_extend(req)
            self.check(f"caching request {req.rid} at {end}")
            if end == len(req.origin_input_ids):
                return
            prefix = len(req.prefix_indices)

    def decode(self, steps):
        for step in range(steps):
            self.w.decode()
            self.check(f"decode step {step}")

    def run(self):
        rng, w = self.rng, self.w
        document = _tokens(rng, 5 * PAGE + 17)
        # A long prompt in unaligned chunks (the second chunk continues a page), then decode across
        # a page boundary.
        a = w.admit(document + _tokens(rng, 40))
        self.chunked_prefill(a, chunk=100)
        self.decode(PAGE + 3)
        # Two requests with one prompt in one batch: each gets its own pages, then the second's
        # cache_unfinished_req finds the first's in the tree and rewrites its row to them.
        prompt = _tokens(rng, 2 * PAGE + 30)
        b, c = w.admit(prompt), w.admit(list(prompt))
        w.extend([b, c], [len(prompt), len(prompt)])
        self.check("extend of a batch of two equal prompts")
        for req in (b, c):
            w.after_extend(req)
            self.check(f"caching request {req.rid}")
        self.decode(5)
        # A request whose prefix is in the tree (a match that splits a node), with a fresh suffix.
        d = w.admit(document[: 2 * PAGE + 10] + _tokens(rng, 3 * PAGE))
        self.chunked_prefill(d, chunk=2 * PAGE)
        self.decode(2)
        for req in (a, b):
            w.finish(req)
            self.check(f"finish of request {req.rid}")
        # Freed rows reused by new requests.
        e = w.admit(_tokens(rng, PAGE + 1))
        f = w.admit(document[:PAGE] + _tokens(rng, 2 * PAGE))
        w.extend([e, f], [len(e.origin_input_ids), len(f.origin_input_ids)])
        self.check("extend on reused rows")
        for req in (e, f):
            w.after_extend(req)
        self.decode(PAGE)
        for req in list(w.running):
            w.finish(req)
            self.check(f"finish of request {req.rid}")
        return document


class TestMirrorFollowsSglangWriters(CustomTestCase):
    def _hooks(self):
        return applied_hooks(req_to_page_mirror_writers.register_hooks)

    def test_radix_cache(self):
        with self._hooks():
            _Scenario(self, _plain_stack(RadixCache)).run()

    def test_chunk_cache(self):
        with self._hooks():
            _Scenario(self, _plain_stack(ChunkCache)).run()

    def test_hicache_with_load_back(self):
        with self._hooks():
            writes = _hicache_stack()
            scenario = _Scenario(self, writes)
            document = scenario.run()
            tree = writes.tree
            settle_write_acks(tree)
            tree.evict(EvictParams(num_tokens=writes.allocator.size))
            self.assertGreater(tree.evictable_size_ + writes.allocator.available_size(), 0)
            # The document's pages now live on host only: a new request loads them back into new
            # locs, its prefix comes from the loaded nodes, then it decodes.
            g = writes.admit(document + _tokens(scenario.rng, PAGE))
            self.assertGreater(g.host_hit_length, 0)
            self.assertGreater(len(g.prefix_indices), 4 * PAGE)
            tree.ready_to_load_host_cache()
            tree.loading_check()
            scenario.check("load-back")
            scenario.chunked_prefill(g, chunk=PAGE + 5)
            scenario.decode(PAGE)
            writes.finish(g)
            scenario.check("finish after load-back")

    def test_a_missed_writer_is_caught(self):
        # The check fails when a write is not mirrored: decode steps (the hook left out), and
        # cache_unfinished_req's rewrite of a row to the tree's pages (the insert still tracked).
        def rewrite_not_mirrored(original, tree, req, *args, **kwargs):
            with inserting_from(tree, mirror_of(tree.req_to_token_pool).pages[req.req_pool_idx].copy()):
                return original(tree, req, *args, **kwargs)

        plants = {"alloc_for_decode": None, "cache_unfinished_req": rewrite_not_mirrored}
        for target_suffix, planted in plants.items():
            def register(registry, target_suffix=target_suffix, planted=planted):
                real = registry.register

                def register_planted(target, hook, kind):
                    if not target.endswith(target_suffix):
                        real(target, hook, kind)
                    elif planted is not None:
                        real(target, planted, kind)

                registry.register = register_planted
                try:
                    req_to_page_mirror_writers.register_hooks(registry)
                finally:
                    registry.register = real

            with applied_hooks(register):
                with self.assertRaises(AssertionError, msg=target_suffix) as raised:
                    _Scenario(self, _plain_stack(RadixCache)).run()
            self.assertIn("positions differ", str(raised.exception))

    def test_mirror_check_reads_every_position(self):
        pool = ReqToTokenPool(2, 4 * PAGE, "cpu", False)
        mirror = ReqToPageMirror.attach(pool, PAGE)
        self.assertIs(mirror_of(pool), mirror)
        pool.req_to_token[1, : 2 * PAGE] = torch.arange(5 * PAGE, 7 * PAGE)
        mirror.write(1, 0, [5, 6])
        self.assertEqual(mirror.mismatches(pool.req_to_token, [1], [2 * PAGE]), [])
        pool.req_to_token[1, PAGE + 3] = 9 * PAGE  # one token off its page
        self.assertEqual(len(mirror.mismatches(pool.req_to_token, [1], [2 * PAGE])), 1)
        with self.assertRaisesRegex(RuntimeError, "host mirror of req_to_token differs"):
            mirror.check(pool.req_to_token, [1], [2 * PAGE])


class TestRandomServing(CustomTestCase):
    """Seeded random serving on each cache: admissions (shared prefixes, chunked), decode steps,
    finishes, and on HiCache device evictions and load-backs; the mirror checked after every step."""

    OPS = 160

    def _run(self, writes, seed, hicache=False):
        rng = random.Random(seed)
        documents = [_tokens(rng, rng.randrange(PAGE, 6 * PAGE)) for _ in range(4)]
        room = lambda: writes.allocator.available_size() + writes.tree.evictable_size()  # noqa: E731
        stats = collections.Counter()
        for step in range(self.OPS):
            chunked = [r for r in writes.running if r.is_chunked]
            decoding = [r for r in writes.running if not r.is_chunked]
            op = rng.random()
            if chunked and op < 0.3:
                req = chunked[0]
                end = min(len(req.prefix_indices) + rng.randrange(1, 3 * PAGE), len(req.origin_input_ids))
                if end - len(req.prefix_indices) + 2 * PAGE < room():
                    writes.extend([req], [end])
                    writes.after_extend(req)
                    stats["chunk"] += 1
            elif op < 0.55 and len(writes.running) < 6:
                base = rng.choice(documents)
                tokens = base[: rng.randrange(0, len(base) + 1)] + _tokens(rng, rng.randrange(2, 3 * PAGE))
                req = writes.admit(tokens)
                stats["load-back"] += int(getattr(req, "host_hit_length", 0) > 0)
                end = len(tokens) if rng.random() < 0.5 else min(len(tokens), len(req.prefix_indices) + PAGE + 7)
                if chunked or end - len(req.prefix_indices) + 2 * PAGE >= room():
                    writes.tree.dec_lock_ref(req.last_node)  # declined (one chunked request at a time)
                    continue
                writes.extend([req], [end])
                writes.after_extend(req)
                stats["admit"] += 1
                if hicache:
                    writes.tree.ready_to_load_host_cache()
                    writes.tree.loading_check()
            elif op < 0.8 and decoding and len(decoding) * PAGE < room():
                for _ in range(rng.randrange(1, PAGE)):
                    writes.decode(decoding)
                stats["decode"] += 1
            elif decoding:
                writes.finish(rng.choice(decoding))
                stats["finish"] += 1
            if hicache and rng.random() < 0.2:
                settle_write_acks(writes.tree)
                writes.tree.evict(EvictParams(num_tokens=rng.randrange(PAGE, 12 * PAGE)))
                stats["evict"] += 1
            self.assertEqual(writes.mismatches(), [], f"seed {seed} step {step}")
        return stats

    def test_radix_cache(self):
        with applied_hooks(req_to_page_mirror_writers.register_hooks):
            stats = self._run(_plain_stack(RadixCache), seed=1)
        self.assertGreater(min(stats["chunk"], stats["admit"], stats["decode"], stats["finish"]), 0)

    def test_chunk_cache(self):
        with applied_hooks(req_to_page_mirror_writers.register_hooks):
            self._run(_plain_stack(ChunkCache), seed=2)

    def test_hicache(self):
        with applied_hooks(req_to_page_mirror_writers.register_hooks):
            stats = self._run(_hicache_stack(physical_pages=24), seed=3, hicache=True)
        self.assertGreater(stats["load-back"], 0, stats)


class TestPlanSideOfTheMirror(CustomTestCase):
    def test_forward_batch_keeps_its_rows_on_the_host(self):
        pool = ReqToTokenPool(4, 4 * PAGE, "cpu", False)
        batch = SimpleNamespace(reqs=[SimpleNamespace(req_pool_idx=r) for r in (3, 1)])
        result = SimpleNamespace(req_to_token_pool=pool)
        req_to_page_mirror_writers.keep_batch_rows(result, None, batch)
        self.assertFalse(hasattr(result, ROWS_ATTR))  # no mirror: the flag is off
        ReqToPageMirror.attach(pool, PAGE)
        req_to_page_mirror_writers.keep_batch_rows(result, None, batch)
        self.assertEqual(getattr(result, ROWS_ATTR).tolist(), [3, 1])

    def test_tree_caches_whose_writes_are_not_mirrored_are_refused(self):
        writes = _plain_stack(RadixCache)
        scheduler = SimpleNamespace(req_to_token_pool=writes.pool, tree_cache=writes.tree)
        req_to_page_mirror_writers.refuse_untracked_tree_cache(None, scheduler)
        scheduler.tree_cache = type("UnifiedRadixCache", (RadixCache,), {})(_params(writes))
        with self.assertRaisesRegex(ValueError, "enable-nsa-prefill-cp-shared-kv.*UnifiedRadixCache"):
            req_to_page_mirror_writers.refuse_untracked_tree_cache(None, scheduler)

    def test_debug_check_catches_a_stale_mirror_in_the_plan(self):
        """The check is a setting the spec read once: a runtime built with it on checks every
        plan; one built with it off never does, whatever the environment says later (the per-forward
        path reads no setting)."""
        pool = ReqToTokenPool(2, 4 * PAGE, "cpu", False)
        pool.req_to_token[1, : 2 * PAGE] = torch.arange(4 * PAGE, 6 * PAGE)

        def runtime_and_stale_batch():
            shard = make_nsa_pool(8 * PAGE, "bf16", 1, "cpu")
            runtime = attach_runtime(
                shard, CpSharedKVLayout(2, 0, PAGE), create_gather_scratch(shard, 2), None
            )
            batch = mirrored(SimpleNamespace(
                forward_mode=ForwardMode.EXTEND, seq_lens_cpu=torch.tensor([2 * PAGE]),
                extend_seq_lens_cpu=[PAGE], req_pool_indices=torch.tensor([1]), req_to_token_pool=pool,
                token_to_kv_pool=shard,
            ))  # fmt: skip
            mirror_of(pool).pages[1, 1] = 7  # a write the mirror missed
            return runtime, batch

        runtime, batch = runtime_and_stale_batch()
        with mock.patch.dict(os.environ, {REQ_TO_PAGE_MIRROR_CHECK_ENV: "1"}):
            runtime.begin_forward(batch)  # off when the spec was built: the plan trusts the mirror
        with mock.patch.dict(os.environ, {REQ_TO_PAGE_MIRROR_CHECK_ENV: "1"}):
            runtime, batch = runtime_and_stale_batch()
        with self.assertRaisesRegex(RuntimeError, "row 1: 64 of 128 positions differ"):
            runtime.begin_forward(batch)


    def test_warm_up_batches_plan_on_the_padding_row(self):
        # ModelRunner._dummy_run builds its batch without init_new (no host rows); its requests all
        # sit on row 0. Outside it, a batch without host rows is refused.
        shard = make_nsa_pool(8 * PAGE, "bf16", 1, "cpu")
        pool = ReqToTokenPool(2, 4 * PAGE, "cpu", False)
        runtime = attach_runtime(
            shard, CpSharedKVLayout(2, 0, PAGE), create_gather_scratch(shard, 2), None,
            req_to_token_pool=pool,
        )  # fmt: skip
        batch = SimpleNamespace(
            forward_mode=ForwardMode.DECODE, seq_lens_cpu=torch.tensor([1, 1]),
            req_pool_indices=torch.zeros(2, dtype=torch.int64), req_to_token_pool=pool,
        )  # fmt: skip
        with self.assertRaisesRegex(RuntimeError, "no host mirror of req_to_token"):
            runtime.begin_forward(batch)
        model_runner = SimpleNamespace(token_to_kv_pool=shard)
        plans = []
        mark_dummy_run(lambda runner: plans.append(runtime.begin_forward(batch)), model_runner)
        self.assertEqual(plans[0].gather_pages_per_rank, 0)
        self.assertEqual(plans[0].scratch_pages_used, 1)
        self.assertFalse(runtime.in_dummy_run)


def _params(writes):
    return CacheInitParams(
        disable=False, req_to_token_pool=writes.pool, token_to_kv_pool_allocator=writes.allocator,
        page_size=PAGE,
    )  # fmt: skip


class TestWriterHookTargets(CustomTestCase):
    def test_every_target_resolves_in_sglang(self):
        import pkgutil

        registered = []

        class Registry:
            @staticmethod
            def register(target, hook, kind):
                registered.append(target)

        req_to_page_mirror_writers.register_hooks(Registry)
        self.assertEqual(len(registered), len(set(registered)))
        for target in registered:
            owner, name = target.rsplit(".", 1)
            self.assertTrue(callable(getattr(pkgutil.resolve_name(owner), name)), target)


if __name__ == "__main__":
    unittest.main()
