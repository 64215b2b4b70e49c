"""CpHiRadixCache tree bookkeeping: backup state, hit counting, splits, load-back and host eviction in
CP mode, the ghost-node and short-bigram fixes, and the fail-fast checks. One rank's view, real pools."""

import dataclasses
import logging
import os
import unittest
from unittest import mock

import torch

from sglang_cp_shared_kv_testing.cp_hicache_stack import settle_write_acks
from sglang_cp_shared_kv_testing.cp_hicache_stack import (
    HiCacheServerArgs,
    build_cp_hicache_stack,
    unpinned_host_pools,
)
from sglang_cp_shared_kv_testing.multi_rank import single_process_group
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseNSATokenToKVPool
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, NSATokenToKVPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode
from sglang.srt.plugins.hook_registry import HookType
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.mem_cache import cp_hiradix_cache, cp_hiradix_host_tier, nsa_host_kv_row_width
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.mem_cache.allocator import CPSharedPagedTokenToKVPoolAllocator
from sglang_cp_shared_kv.mem_cache.cp_hiradix_cache import CpHiRadixCache, _check_supported
from sglang_cp_shared_kv.settings import CP_SHARED_KV_ENV

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")

PAGE = 64
FLAG = "--enable-nsa-prefill-cp-shared-kv"


def _tokens(first, num_pages):
    """A page-aligned token sequence starting with ``first`` (+1 token so bigram keys keep it)."""
    return list(range(first, first + num_pages * PAGE + 1))


def _nsa_pool(physical_pages=4):
    return NSATokenToKVPool(
        size=physical_pages * PAGE,
        page_size=PAGE,
        kv_lora_rank=16,
        dtype=torch.bfloat16,
        qk_rope_head_dim=8,
        layer_num=1,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=24,
    )


def _params(allocator, group):
    return CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=allocator,
        page_size=PAGE,
        tp_cache_group=group,
        attn_cp_cache_group=group,
    )


@dataclasses.dataclass
class _FinishedReq:
    """The fields ``RadixCache.cache_finished_req`` reads from a finished request."""

    req_pool_idx: int
    origin_input_ids: list
    output_ids: list = dataclasses.field(default_factory=list)
    extra_key: object = None
    cache_protected_len: int = 0
    last_node: object = None
    priority: int = 0

    def pop_committed_kv_cache(self):
        return len(self.origin_input_ids) + len(self.output_ids)


class _RecordingRegistry:
    def __init__(self):
        self.registered = []

    def register(self, target, hook, hook_type):
        self.registered.append((target, hook, hook_type))


class TestCpHiRadixCacheTree(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        # Rank 1's view of a 2-rank layout (owns the odd logical pages).
        cls.stack = build_cp_hicache_stack(
            cp_size=2, cp_rank=1, group=single_process_group(), physical_pages=16
        )

    def setUp(self):
        super().setUp()
        self.cache = self.stack.cache
        self.cache.reset()
        self.stack.allocator.clear()

    def _insert_backed(self, tokens):
        """Insert ``tokens`` on fresh locs (write-through backs it up), ack the write; return the leaf."""
        key = RadixKey(tokens)
        locs = self.stack.allocator.alloc(len(tokens) // PAGE * PAGE)
        self.cache.insert(InsertParams(key=key, value=locs))
        settle_write_acks(self.cache)
        self.assertEqual(self.cache.ongoing_write_through, {})
        return self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).last_device_node

    def _host_slots_used(self):
        return self.stack.controller.physical_host_slots_used()

    def test_backed_up_node_is_recognised_although_host_value_is_none(self):
        node = self._insert_backed(_tokens(0, 4))
        self.assertIsNone(node.host_value)
        self.assertFalse(node.backuped)  # the stock property cannot see CP backups
        self.assertTrue(self.cache._node_backuped(node))
        self.assertEqual(node.host_len, 4 * PAGE)
        self.assertEqual(node.cp_hicache.logical_len, 4 * PAGE)
        self.assertTrue(self.cache._node_backuped(self.cache.root_node))
        self.assertFalse(self.cache._node_backuped(self.cache._new_node(priority=0)))

    def test_repeated_hits_do_not_rewrite_a_backed_up_node(self):
        tokens = _tokens(0, 2)
        node = self._insert_backed(tokens)
        used = self._host_slots_used()
        self.assertEqual(used, node.cp_hicache.num_owned)
        for _ in range(3):
            self.cache.insert(InsertParams(key=RadixKey(tokens), value=node.value.clone()))
            settle_write_acks(self.cache)
        self.assertEqual(self._host_slots_used(), used)
        # What the stock hit counter (node.backuped) would do: back the node up again.
        HiRadixCache._inc_hit_count(self.cache, node)
        settle_write_acks(self.cache)
        self.assertEqual(self._host_slots_used(), 2 * used)

    def test_split_divides_host_len_and_metadata_by_position(self):
        node = self._insert_backed(_tokens(0, 4))
        original = node.cp_hicache
        expected_parent, expected_child = original.split(2 * PAGE)
        diverging = _tokens(0, 2)[:-1] + _tokens(10_000, 2)
        locs = self.stack.allocator.alloc(4 * PAGE)
        self.cache.insert(InsertParams(key=RadixKey(diverging), value=locs))
        settle_write_acks(self.cache)
        parent = node.parent
        self.assertIsNot(parent, self.cache.root_node)
        self.assertEqual((parent.host_len, node.host_len), (2 * PAGE, 2 * PAGE))
        for got, want in ((parent.cp_hicache, expected_parent), (node.cp_hicache, expected_child)):
            self.assertEqual(got.logical_len, want.logical_len)
            self.assertTrue(torch.equal(got.owned_positions, want.owned_positions))
            self.assertTrue(torch.equal(got.host_indices, want.host_indices))
            self.assertTrue(torch.equal(got.owner_ranks, want.owner_ranks))
        self.assertIs(type(parent.children), dict)

    def test_load_back_sizes_from_host_len_on_a_rank_that_owns_nothing(self):
        tokens = _tokens(0, 1)  # one page: on rank 0, so this rank holds nothing on host
        node = self._insert_backed(tokens)
        self.assertEqual(node.cp_hicache.num_owned, 0)
        self.cache.evict(EvictParams(num_tokens=PAGE))
        self.assertTrue(node.evicted)
        match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        self.assertEqual(match.host_hit_length, PAGE)
        device_indices = self.cache.load_back(match.last_host_node)
        self.assertEqual(len(device_indices), PAGE)
        self.assertTrue(torch.equal(node.value, device_indices))
        self.assertEqual(self.cache.cache_controller.start_loading() >= 0, True)
        self.cache.loading_check()
        self.assertEqual(self.cache.evictable_size(), PAGE)
        self.assertEqual(self.cache.ongoing_load_back, {})

    def test_host_eviction_counts_physical_slots_not_logical_tokens(self):
        empty_here = self._insert_backed(_tokens(0, 1))  # older; its page is on rank 0
        holds_one_page = self._insert_backed(_tokens(5_000, 2))
        self.assertEqual(
            (empty_here.cp_hicache.num_owned, holds_one_page.cp_hicache.num_owned), (0, PAGE)
        )
        owned_slots = holds_one_page.cp_hicache.host_indices.clone()
        self.cache.evict(EvictParams(num_tokens=3 * PAGE))
        used = self._host_slots_used()

        freed = self.cache.evict_host(PAGE)
        # The first (logical) PAGE tokens evicted free nothing here; eviction must go on.
        self.assertEqual(freed, PAGE)
        self.assertEqual(self._host_slots_used(), used - PAGE)
        self.assertEqual(self.cache.root_node.children, {})
        self.assertEqual((empty_here.host_len, holds_one_page.host_len), (0, 0))
        self.assertIsNone(holds_one_page.cp_hicache)
        free_slots = self.stack.controller.mem_pool_host.anchor_entry.host_pool.free_slots
        self.assertEqual(sorted(free_slots[-PAGE:].tolist()), sorted(owned_slots.tolist()))

    def test_every_node_has_plain_dict_children(self):
        self._insert_backed(_tokens(0, 4))
        self._insert_backed(_tokens(0, 2)[:-1] + _tokens(9_000, 1))  # split
        self.cache.evict(EvictParams(num_tokens=10 * PAGE))
        match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(_tokens(0, 4))))
        self.cache.load_back(match.last_host_node)
        stack, seen = [self.cache.root_node], 0
        while stack:
            node = stack.pop()
            seen += 1
            self.assertIs(type(node.children), dict)
            with self.assertRaises(KeyError):
                node.children[("no", "such", "child")]
            stack.extend(node.children.values())
        self.assertEqual(seen, 4)  # root, shared prefix, two suffixes: no ghost was added

    def test_stock_treenode_grows_a_ghost_child_on_lookup(self):
        stock = RadixCache.create_simulated()
        stock.insert(InsertParams(key=RadixKey([1, 2, 3])))
        leaf = stock.root_node.children[1]
        self.assertIsInstance(leaf, TreeNode)
        leaf.children["missing"]  # a lookup...
        self.assertEqual(len(leaf.children), 1)  # ...inserted an empty child
        with self.assertRaises(AttributeError):
            stock.pretty_print()  # which breaks walking the tree (the ghost has no key)

    def test_storage_backend_cannot_be_attached(self):
        ok, message = self.cache.attach_storage_backend("file")
        self.assertFalse(ok)
        self.assertIn(FLAG, message)

    def test_host_usage_is_logged_per_rank(self):
        self.cache.HOST_USAGE_LOG_INTERVAL = 1
        self.addCleanup(delattr, self.cache, "HOST_USAGE_LOG_INTERVAL")
        with self.assertLogs(cp_hiradix_host_tier.logger, level=logging.INFO) as logs:
            self._insert_backed(_tokens(0, 2))
        self.assertTrue(
            any("cp rank 1 of 2" in line and "physical slots used" in line for line in logs.output)
        )


class TestShortBigramKeys(CustomTestCase):
    def test_key_shorter_than_a_page_matches_and_inserts_nothing_and_frees_its_page(self):
        stack = build_cp_hicache_stack(
            cp_size=2, cp_rank=0, group=single_process_group(), physical_pages=4, is_eagle=True
        )
        tokens = list(range(20))  # 19 bigrams < one page
        # The hazard: a page-sized child key of such a key indexes past its end.
        with self.assertRaises(IndexError):
            RadixKey(tokens, is_bigram=True).child_key(PAGE)

        full = stack.allocator.available_size()
        locs = stack.allocator.alloc(PAGE)
        stack.req_to_token_pool.write((1, slice(0, PAGE)), locs.to(torch.int32))
        stack.cache.cache_finished_req(_FinishedReq(req_pool_idx=1, origin_input_ids=tokens))
        self.assertEqual(stack.cache.root_node.children, {})
        self.assertEqual(stack.allocator.available_size(), full)
        match = stack.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        self.assertEqual((len(match.device_indices), match.host_hit_length), (0, 0))
        self.assertIs(match.last_host_node, stack.cache.root_node)


class TestConstructionChecks(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.group = single_process_group()

    def _cp_allocator(self, kv_pool, cp_size=2, cp_rank=0):
        return CPSharedPagedTokenToKVPoolAllocator(
            size=cp_size * kv_pool.size,
            page_size=PAGE,
            dtype=torch.bfloat16,
            device="cpu",
            kvcache=kv_pool,
            need_sort=False,
            layout=CpSharedKVLayout(cp_size, cp_rank, PAGE),
        )

    def test_flag_on_with_the_stock_allocator_is_refused(self):
        pool = _nsa_pool()
        allocator = PagedTokenToKVPoolAllocator(pool.size, PAGE, torch.bfloat16, "cpu", pool, False)
        with self.assertRaisesRegex(ValueError, FLAG):
            CpHiRadixCache(_params(allocator, self.group), HiCacheServerArgs())

    def test_storage_backends_other_than_file_and_mooncake_are_refused(self):
        allocator = self._cp_allocator(_nsa_pool(), cp_size=1)
        args = HiCacheServerArgs(hicache_storage_backend="nixl")
        with self.assertRaisesRegex(ValueError, "--hicache-storage-backend nixl"):
            CpHiRadixCache(_params(allocator, self.group), args)
        args = HiCacheServerArgs(hicache_storage_backend="mooncake", hicache_mem_layout="layer_first")
        with self.assertRaisesRegex(ValueError, "--hicache-mem-layout layer_first"):
            CpHiRadixCache(_params(allocator, self.group), args)

    def test_rank_must_match_the_attention_cp_group(self):
        allocator = self._cp_allocator(_nsa_pool(), cp_size=2, cp_rank=1)
        with self.assertRaisesRegex(ValueError, FLAG):
            CpHiRadixCache(_params(allocator, self.group), HiCacheServerArgs())

    def test_only_plain_nsa_pools_are_supported(self):
        mla_pool = MLATokenToKVPool(
            size=4 * PAGE,
            page_size=PAGE,
            dtype=torch.bfloat16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
        )
        with self.assertRaisesRegex(ValueError, "NSA"):
            _check_supported(mla_pool, HiCacheServerArgs())
        # Only the type matters for this check: an uninitialised HiSparse pool is enough.
        hisparse_pool = HiSparseNSATokenToKVPool.__new__(HiSparseNSATokenToKVPool)
        with self.assertRaisesRegex(ValueError, "HiSparse"):
            _check_supported(hisparse_pool, HiCacheServerArgs())

    def test_without_the_flag_the_stock_cache_is_built(self):
        pool = _nsa_pool()
        allocator = PagedTokenToKVPoolAllocator(pool.size, PAGE, torch.bfloat16, "cpu", pool, False)
        args = HiCacheServerArgs(enable_nsa_prefill_cp_shared_kv=False)
        # Flag off means off in the environment too (another test may have validated it on).
        environ = mock.patch.dict(os.environ)
        environ.start()
        self.addCleanup(environ.stop)
        os.environ.pop(CP_SHARED_KV_ENV, None)
        # HookRegistry's class REPLACE rebinds every module-level name of the stock class, ours too.
        original_binding = cp_hiradix_cache.HiRadixCache
        cp_hiradix_cache.HiRadixCache = CpHiRadixCache
        self.addCleanup(setattr, cp_hiradix_cache, "HiRadixCache", original_binding)
        with unpinned_host_pools():
            cache = CpHiRadixCache(_params(allocator, self.group), args)
        self.assertIs(type(cache), HiRadixCache)

    def test_register_hooks_replaces_the_hiradix_cache_class(self):
        registry = _RecordingRegistry()
        cp_hiradix_cache.register_hooks(registry)
        self.assertEqual(
            registry.registered,
            [("sglang.srt.mem_cache.hiradix_cache.HiRadixCache", CpHiRadixCache, HookType.REPLACE)],
        )

    def test_the_plugin_widens_host_rows_wherever_it_replaces_the_cache(self):
        from sglang_cp_shared_kv import plugin

        registry = _RecordingRegistry()
        plugin.register_runtime_hooks(registry)
        self.assertIn(
            ("sglang.srt.mem_cache.hiradix_cache.HiRadixCache", CpHiRadixCache, HookType.REPLACE),
            registry.registered,
        )
        self.assertIn(
            (
                nsa_host_kv_row_width.BUILD_KV_HOST_POOL,
                nsa_host_kv_row_width.build_kv_host_pool_with_device_row_width,
                HookType.AROUND,
            ),
            registry.registered,
        )


if __name__ == "__main__":
    unittest.main()
