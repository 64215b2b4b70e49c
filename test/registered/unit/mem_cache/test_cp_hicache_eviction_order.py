"""CpHiRadixCache evicts (device and host) in exactly the order of the per-call heap it used before
``EvictionCandidates``, for every eviction policy sglang 0.5.11 offers and every write policy.

Each case runs one seeded simulation workload twice (``sglang_cp_shared_kv_testing/eviction_log.py``): once with the cache
as it is, once with ``evict`` / ``evict_host`` replaced by the per-call-heap oracle below. Every device
eviction, write-back and host eviction is logged in order, and the two logs must be equal.
"""

import heapq
import types
import unittest

# First: installs the CPU kernel shim that importing sglang's memory pools needs.
from sglang_cp_shared_kv_testing.cp_hicache_stack import settle_write_acks
from sglang_cp_shared_kv_testing.cp_hicache_stack import (
    NSA_PAGE_SIZE,
    build_cp_hicache_stack,
)
from sglang_cp_shared_kv_testing.multi_rank import single_process_group
from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult, InsertParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing.cp_hicache_simulation import WRITE_POLICIES
from sglang_cp_shared_kv_testing.eviction_log import (
    EVICTION_POLICIES,
    first_divergence,
    run_logged,
)

register_cpu_ci(est_time=40, suite="stage-a-test-cpu")

NUM_OPS = 150


class _PerCallHeapEviction:
    """The oracle: a heap rebuilt from the leaf set on every call, parents pushed as stock pushes them."""

    # Its methods are bound onto a built cache (instance attributes win over the class's).

    def _entry(self, node):
        return (self.eviction_strategy.get_priority(node), node.id, node)

    def evict(self, params: EvictParams) -> EvictResult:
        write_back = self.cache_controller.write_policy == "write_back"
        heap = [self._entry(node) for node in self.evictable_leaves]
        heapq.heapify(heap)
        num_evicted, write_back_nodes = 0, []
        while num_evicted < params.num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if node.lock_ref > 0:
                continue
            if self._node_backuped(node):
                num_evicted += self._evict_backuped(node)
            elif write_back:
                written = self.write_backup(node, write_back=True)
                num_evicted += written
                if written > 0:
                    write_back_nodes.append(node)
            else:
                num_evicted += self._evict_regular(node)
            if all(s.evicted or s in write_back_nodes for s in node.parent.children.values()):
                heapq.heappush(heap, self._entry(node.parent))
        if write_back:
            self.writing_check(write_back=True)
            for node in write_back_nodes:
                self._evict_backuped(node)
        return EvictResult(num_tokens_evicted=num_evicted)

    def evict_host(self, physical_slots_needed: int) -> int:
        rank = self.cp_layout.cp_rank
        heap = self._host_heap()
        progress = self._new_host_eviction_progress()
        freed = progress.slots_freed_by_rank
        self._heap_evict_host(heap, progress, lambda: freed[rank] >= physical_slots_needed)
        target = self._max_over_ranks(progress.nodes_evicted)
        self._heap_evict_host(heap, progress, lambda: progress.nodes_evicted >= target)
        return int(freed[rank])

    def _evict_host_until(self, shortfall_by_rank) -> None:
        progress = self._new_host_eviction_progress()
        freed = progress.slots_freed_by_rank
        self._heap_evict_host(self._host_heap(), progress, lambda: (freed >= shortfall_by_rank).all())

    def _host_heap(self):
        heap = [self._entry(node) for node in self.evictable_host_leaves]
        heapq.heapify(heap)
        return heap

    def _heap_evict_host(self, heap, progress, done) -> None:
        while heap and not done():
            _, _, node = heapq.heappop(heap)
            if not node.evicted or node.host_ref_counter > 0:
                continue
            self._record_remove_event(node, medium=StorageMedium.CPU)
            self.cache_controller.evict_host(node.cp_hicache.host_indices)
            slots = self.host_ledger.slots_of_pages(self.cache_controller.page_owners(node.cp_hicache))
            self.host_ledger.give_back(slots)
            progress.slots_freed_by_rank += slots
            progress.nodes_evicted += 1
            self.host_logical_tokens -= node.host_len
            node.host_len, node.cp_hicache = 0, None
            parent = node.parent
            parent.children.pop(node.key.child_key(self.page_size))
            self.evictable_host_leaves.discard(node)
            self._update_host_leaf_status(parent)
            if len(parent.children) == 0 and parent.evicted:
                heapq.heappush(heap, self._entry(parent))


def _per_call_heap(cache) -> None:
    for name in ("_entry", "evict", "evict_host", "_evict_host_until", "_host_heap", "_heap_evict_host"):
        setattr(cache, name, types.MethodType(getattr(_PerCallHeapEviction, name), cache))


def _run(eviction_policy, write_policy, seed, oracle, plant=None):
    def configure(cache):
        if oracle:
            _per_call_heap(cache)
        if plant is not None:
            plant(cache)

    return run_logged(eviction_policy, write_policy, seed, num_ops=NUM_OPS, configure=configure)


def _cases():
    """Every eviction policy (write policies in rotation), and every write policy under LRU and MRU."""
    cases = [(p, WRITE_POLICIES[i % len(WRITE_POLICIES)]) for i, p in enumerate(EVICTION_POLICIES)]
    cases += [(p, w) for p in ("lru", "mru") for w in WRITE_POLICIES]
    return sorted(set(cases))


class TestEvictionOrderMatchesPerCallHeap(CustomTestCase):
    def test_every_eviction_policy(self):
        for eviction_policy, write_policy in _cases():
            seed = 7 + EVICTION_POLICIES.index(eviction_policy)
            with self.subTest(eviction_policy=eviction_policy, write_policy=write_policy):
                ours = _run(eviction_policy, write_policy, seed, oracle=False)
                oracle = _run(eviction_policy, write_policy, seed, oracle=True)
                kinds = {entry[0] for entry in oracle}
                # A clean comparison must have compared both evictions.
                self.assertTrue({"evict-device", "evict-host"} <= kinds, kinds)
                self.assertGreater(len(oracle), 40)
                self.assertEqual(ours, oracle, first_divergence(ours, oracle))

    def test_a_missed_access_is_caught(self):
        """Under MRU an access lowers a leaf's priority; without the re-key the order differs."""

        def no_touch(cache):
            cache._touch = lambda node: None

        ours = _run("mru", "write_through", 8, oracle=False, plant=no_touch)
        oracle = _run("mru", "write_through", 8, oracle=True)
        self.assertNotEqual(ours, oracle)


class TestSkippedCandidatesComeBack(CustomTestCase):
    """A node one call takes but cannot evict (host-protected) stays a candidate for the next call."""

    def test_host_protected_leaf_is_evicted_once_released(self):
        stack = build_cp_hicache_stack(cp_size=2, cp_rank=0, group=single_process_group(), physical_pages=8)
        cache = stack.cache
        tokens = list(range(1, 2 * NSA_PAGE_SIZE + 1))
        cache.insert(InsertParams(key=RadixKey(tokens), value=stack.allocator.alloc(len(tokens))))
        settle_write_acks(cache)
        cache.evict(EvictParams(num_tokens=len(tokens)))
        (node,) = cache.root_node.children.values()
        self.assertTrue(node.evicted)
        node.protect_host()
        cache.evict_host(stack.controller.mem_pool_host.size)
        self.assertIs(node.parent.children.get(node.key.child_key(NSA_PAGE_SIZE)), node)
        node.release_host()
        cache.evict_host(stack.controller.mem_pool_host.size)
        self.assertEqual(cache.root_node.children, {})
        self.assertEqual(cache.evictable_host_leaves, set())


if __name__ == "__main__":
    unittest.main()
