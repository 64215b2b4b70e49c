"""Tree value pages under every key shape sglang 0.5.11 builds: MTP (EAGLE bigram keys), extra_key.

With ``--speculative-algorithm EAGLE / NEXTN`` the scheduler builds its tree with ``is_eagle=True``:
the tree keys its children by token bigrams, a bigram key of ``n`` tokens has ``n - 1`` logical
units (bigram ``i`` holds position ``i``'s KV loc), and its page alignment rounds the bigram count.
These tests drive sglang's own ``cache_unfinished_req``, ``cache_finished_req`` and a second
request's ``match_prefix`` + ``alloc_for_extend`` (whose prefix pages come from
``tree_value_pages.path_pages``) on ``RadixCache`` and ``CpHiRadixCache`` (with a HiCache backup,
device eviction and load-back of the EAGLE-keyed prefix), with prompts longer than one page; after
every step the host mirror must equal ``req_to_token`` and every node's page ids its value.

Planted bugs, each caught here:
* children looked up by raw tokens (main before this test: ``record_inserted_values`` built
  ``tuple(tokens[d:d+64])``): every EAGLE test raised "radix node N has no host page ids" inside
  the first ``cache_unfinished_req``;
* depth advanced by the node's raw token count (``len(child.key.token_ids)``, one more than a
  bigram key's length) instead of its key length: the EAGLE tests failed (a node with wrong pages,
  or the insert refused);
* ``extra_key`` dropped from the child lookup: the extra_key tests raised "no host page ids".
"""

import contextlib
import random
import unittest

import numpy as np
import torch

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.mem_cache import req_to_page_mirror_writers
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror import ReqToPageMirror, mirror_of
from sglang_cp_shared_kv.mem_cache.tree_value_pages import inserting_from, path_pages, value_pages
from sglang_cp_shared_kv.model_executor.peer_page_plan import build_peer_page_plan
from sglang_cp_shared_kv_testing.cp_hicache_stack import build_cp_hicache_stack, settle_write_acks
from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks
from sglang_cp_shared_kv_testing.multi_rank import single_process_group
from sglang_cp_shared_kv_testing.scheduler_writes import SchedulerWrites, mirrored_cp_stack

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

PAGE = 64


_HOOKS = contextlib.ExitStack()


def setUpModule():
    # The mirror's writer hooks, applied once for the module (applying them costs about a second).
    _HOOKS.enter_context(applied_hooks(req_to_page_mirror_writers.register_hooks))


def tearDownModule():
    _HOOKS.close()


def _radix_stack(is_eagle):
    return mirrored_cp_stack(RadixCache, 40, 2, PAGE, is_eagle=is_eagle)


def _hicache_stack(is_eagle, physical_pages=40):
    stack = build_cp_hicache_stack(
        cp_size=2, cp_rank=0, group=single_process_group(), physical_pages=physical_pages,
        max_context_len=2048, is_eagle=is_eagle,
    )  # fmt: skip
    ReqToPageMirror.attach(stack.req_to_token_pool, PAGE)
    return SchedulerWrites(stack.cache, stack.req_to_token_pool, stack.allocator)


class _Story:
    """A document cached by one request, then matched by a second; checked after every step."""

    def __init__(self, test, writes: SchedulerWrites, extra_key=None, seed=0):
        self.test, self.w, self.extra_key = test, writes, extra_key
        self.rng = random.Random(seed)

    def tokens(self, n):
        return [self.rng.randrange(1, 30_000) for _ in range(n)]

    def check(self, what):
        self.test.assertEqual(self.w.mismatches(), [], f"after {what}")

    def prefill(self, req, chunk=None):
        """Chunked prefill (chunks not multiples of a page), ``cache_unfinished_req`` after each."""
        while True:
            prefix = len(req.prefix_indices)
            total = len(req.origin_input_ids)
            end = total if chunk is None else min(prefix + chunk, total)
            self.w.extend([req], [end])
            self.check(f"extend of request {req.rid} to {end}")
            self.w.after_extend(req)
            self.check(f"cache_unfinished_req of request {req.rid} at {end}")
            self.test.assertEqual(len(path_pages(req.last_node)) * PAGE, req.cache_protected_len)
            if end == len(req.origin_input_ids):
                return

    def assert_path_pages_are_the_prefix_pages(self, req):
        """The pages the next extend writes for a matched prefix (``path_pages``) are its locs' pages."""
        expected = (req.prefix_indices[:: PAGE] // PAGE).numpy()
        got = path_pages(req.last_node)
        self.test.assertEqual(got.tolist(), expected[: len(got)].tolist())
        self.test.assertEqual(len(got) * PAGE, len(req.prefix_indices) // PAGE * PAGE)

    def assert_plan_gathers_the_prefix(self, req, prefix_len):
        """The peer-page plan of ``req``'s extend, built from the mirror as the runtime builds it:
        every prefix token is read from a gathered scratch page holding its logical page."""
        allocator, row, seq_len = self.w.allocator, req.req_pool_idx, req.kv_allocated_len
        pages = mirror_of(self.w.pool).pages[row][: -(-seq_len // PAGE)]
        plan = build_peer_page_plan(
            layout=allocator.layout, request_pages=[pages], old_page_counts=[-(-prefix_len // PAGE)],
            num_logical_pages=allocator.size // PAGE + 1, scratch_num_pages=len(pages) * 2 + 1,
            device="cpu",
        )  # fmt: skip
        locs = self.w.pool.req_to_token[row, :prefix_len].long()
        scratch_pages = plan.remap_token_locs(locs) // PAGE
        gathered = (scratch_pages >= 1) & (scratch_pages <= plan.gathered_region_pages)
        self.test.assertTrue(bool(gathered.all()))
        self.test.assertEqual(sum(plan.gather_page_counts), -(-prefix_len // PAGE))

    def run(self, chunk=None):
        """The first request in ``chunk``-token chunks; the second in one extend (its plan checked)."""
        document = self.tokens(3 * PAGE + 10)
        a = self.w.admit(document + self.tokens(20), self.extra_key)
        self.prefill(a, chunk)
        for _ in range(5):
            self.w.decode([a])
        self.check("decode")
        self.w.finish(a)
        self.check("cache_finished_req")
        b = self.w.admit(document + self.tokens(PAGE), self.extra_key)
        self.test.assertEqual(len(b.prefix_indices), 3 * PAGE)
        self.assert_path_pages_are_the_prefix_pages(b)
        self.w.extend([b], [len(b.origin_input_ids)])
        self.check("the second request's extend")
        self.assert_plan_gathers_the_prefix(b, 3 * PAGE)
        self.w.after_extend(b)
        self.check("the second request's cache_unfinished_req")
        self.w.finish(b)
        self.check("the second request's finish")
        return document


class TestEagleBigramKeys(CustomTestCase):
    def test_radix_cache(self):
        _Story(self, _radix_stack(is_eagle=True)).run()

    def test_radix_cache_chunked_prefill(self):
        # Chunks of 100 tokens: every chunk's cache_unfinished_req inserts a longer bigram key that
        # continues (and splits) the nodes of the previous one.
        _Story(self, _radix_stack(is_eagle=True)).run(chunk=100)

    def test_radix_cache_with_extra_key(self):
        writes = _radix_stack(is_eagle=True)
        document = _Story(self, writes, extra_key="lora-7").run()
        # Another namespace never shares those nodes.
        other = writes.admit(document + [1, 2, 3], extra_key="salt-1")
        self.assertEqual(len(other.prefix_indices), 0)
        writes.tree.dec_lock_ref(other.last_node)

    def test_bigram_count_decides_what_a_prompt_caches(self):
        # A prompt of k pages + 1 tokens has k pages of bigrams; one of exactly k pages, k - 1.
        writes = _radix_stack(is_eagle=True)
        story = _Story(self, writes)
        for length, cached_pages in ((2 * PAGE + 1, 2), (2 * PAGE, 1), (PAGE, 0)):
            req = writes.admit(story.tokens(length))
            story.prefill(req)
            self.assertEqual(len(path_pages(req.last_node)), cached_pages, length)
            self.assertEqual(req.cache_protected_len, cached_pages * PAGE)

    def test_hicache_with_backup_eviction_and_load_back(self):
        writes = _hicache_stack(is_eagle=True)
        story = _Story(self, writes)
        document = story.run()
        tree = writes.tree
        settle_write_acks(tree)
        tree.evict(EvictParams(num_tokens=writes.allocator.size))
        # The document's EAGLE-keyed pages live on host only: a new request loads them back.
        c = writes.admit(document + story.tokens(PAGE))
        self.assertEqual(c.host_hit_length, 3 * PAGE)
        self.assertEqual(len(c.prefix_indices), 3 * PAGE)
        tree.ready_to_load_host_cache()
        tree.loading_check()
        story.check("load-back")
        story.assert_path_pages_are_the_prefix_pages(c)
        story.prefill(c, chunk=PAGE + 5)
        writes.finish(c)
        story.check("finish after load-back")

    def test_hicache_chunked_prefill_with_extra_key(self):
        _Story(self, _hicache_stack(is_eagle=True), extra_key="lora-7").run(chunk=100)


class TestPlainKeys(CustomTestCase):
    """The same stories on the tree a server without MTP builds (the pre-existing key shape)."""

    def test_radix_cache_with_extra_key(self):
        _Story(self, _radix_stack(is_eagle=False), extra_key="lora-7").run(chunk=100)

    def test_hicache(self):
        _Story(self, _hicache_stack(is_eagle=False)).run()


class TestPageSizeOne(CustomTestCase):
    """sglang's tree also runs with page size 1 (not a shared-KV server's: it needs 64); the walk
    reads its children the same way, plain and bigram, with and without extra_key."""

    def _tree(self, is_eagle):
        pool = ReqToTokenPool(2, 64, "cpu", False)
        ReqToPageMirror.attach(pool, 1)
        params = CacheInitParams(
            disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=None, page_size=1,
            is_eagle=is_eagle,
        )  # fmt: skip
        return RadixCache(params)

    def test_every_node_gets_its_pages(self):
        for is_eagle in (False, True):
            for extra_key in (None, "lora-7"):
                with self.subTest(is_eagle=is_eagle, extra_key=extra_key):
                    tree = self._tree(is_eagle)
                    first, second = list(range(1, 21)), list(range(1, 11)) + list(range(50, 60))
                    for tokens, base in ((first, 100), (second, 300), (first[:15], 500)):
                        row = np.arange(base, base + len(tokens), dtype=np.int32)
                        with inserting_from(tree, row):
                            tree.insert(
                                InsertParams(
                                    key=RadixKey(list(tokens), extra_key),
                                    value=torch.from_numpy(row).to(torch.int64),
                                )
                            )
                    stack, nodes = list(tree.root_node.children.values()), 0
                    while stack:
                        node = stack.pop()
                        stack += node.children.values()
                        nodes += 1
                        pages = value_pages(node)
                        self.assertIsNotNone(pages, f"node {node.id}")
                        self.assertEqual(pages.tolist(), node.value.tolist())
                    self.assertEqual(nodes, 4)  # shared [0, 10), then [10, 15) -> [15, 20), and [10, 20)


if __name__ == "__main__":
    unittest.main()
