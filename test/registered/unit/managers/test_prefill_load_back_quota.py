"""Prefill admission passes its remaining token budget to HiCache load-back (design README fix 1).

Everything runs through the real ``PrefillAdder`` and the real ``HiRadixCache`` tree logic (match,
insert, evict, lock, ``init_load_back``/``load_back``) over our CP allocator, so budgets are logical
tokens. Only the transfer controller is a stub: it takes and frees device slots, which is all the
budget depends on.
"""

import unittest
from types import SimpleNamespace

import torch

from sglang_cp_shared_kv_testing import sgl_kernel_cpu_shim

sgl_kernel_cpu_shim.install()  # before hiradix_cache imports memory_pool_host

import sglang.srt.server_args as sglang_server_args  # noqa: E402
from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402
from sglang.test.test_utils import CustomTestCase  # noqa: E402

from sglang_cp_shared_kv.managers import prefill_load_back_quota  # noqa: E402
from sglang_cp_shared_kv.mem_cache.allocator import (  # noqa: E402
    CPSharedPagedTokenToKVPoolAllocator,
)
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout  # noqa: E402
from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks  # noqa: E402

register_cpu_ci(est_time=15, suite="stage-a-test-cpu")

PAGE = 4
CP_SIZE = 4
PHYSICAL_TOKENS = 16 * PAGE  # per rank
POOL_TOKENS = CP_SIZE * PHYSICAL_TOKENS  # logical, what the scheduler budgets with


class _TransferControllerStub:
    """Stands in for HiCacheController: moves no bytes, only takes and frees device slots."""

    write_policy = "write_through"

    def __init__(self, allocator):
        self.mem_pool_device_allocator = allocator

    def load(self, host_indices, node_id, **extra_pools):
        return self.mem_pool_device_allocator.alloc(len(host_indices))

    def evict_device(self, device_indices):
        self.mem_pool_device_allocator.free(device_indices)
        return len(device_indices)

    def evict_host(self, host_indices):
        return len(host_indices)

    def reset(self):
        pass


class _HiRadixCacheWithStubController(HiRadixCache):
    """The real HiRadixCache tree; its __init__ would build pinned host pools and a CUDA controller."""

    def __init__(self, params: CacheInitParams):
        self.cache_controller = _TransferControllerStub(params.token_to_kv_pool_allocator)
        self.token_to_kv_pool_host = SimpleNamespace(clear=lambda: None)
        self.enable_storage = False
        self.enable_storage_metrics = False
        self.ongoing_write_through = {}
        self.ongoing_load_back = {}
        self.ongoing_prefetch = {}
        self.ongoing_backup = {}
        self.prefetch_loaded_tokens_by_reqid = {}
        # Backups are completed by the test (complete_write_through), never by insert.
        self.write_through_threshold = 1 << 30
        self.load_back_threshold = 10
        self.evictable_host_leaves = set()
        self.mem_quotas_seen = []
        RadixCache.__init__(self, params)

    def load_back(self, node, mem_quota=None):
        self.mem_quotas_seen.append(mem_quota)
        return super().load_back(node, mem_quota)

    def complete_write_through(self, token_ids):
        """The state ``writing_check`` commits once a write-through finished: host copies exist."""
        node = self.root_node
        key = RadixKey(token_ids)
        while len(key):
            node = node.children[key.child_key(self.page_size)]
            node.host_value = torch.arange(len(node.value), dtype=torch.int64)
            key = key[len(node.key) :]


def _request(rid, token_ids, max_new_tokens):
    req = Req(rid, "", list(token_ids), SamplingParams(max_new_tokens=max_new_tokens))
    return req


class TestPrefillLoadBackQuota(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        # PrefillAdder reads the CP mode from the global server args.
        cls._saved_global_args = sglang_server_args._global_server_args
        sglang_server_args.set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))

    @classmethod
    def tearDownClass(cls):
        sglang_server_args._global_server_args = cls._saved_global_args

    def _admission_round(self, cp_rank=0):
        """One prefill round on ``cp_rank``: ``first`` is admitted, then ``second`` whose prefix
        sits on the host. Returns what a caller needs to compare runs of the same round.
        """
        allocator = CPSharedPagedTokenToKVPoolAllocator(
            POOL_TOKENS,
            PAGE,
            torch.int64,
            "cpu",
            kvcache=SimpleNamespace(size=PHYSICAL_TOKENS),
            need_sort=False,
            layout=CpSharedKVLayout(CP_SIZE, cp_rank, PAGE),
        )
        tree = _HiRadixCacheWithStubController(
            CacheInitParams(
                disable=False,
                req_to_token_pool=None,
                token_to_kv_pool_allocator=allocator,
                page_size=PAGE,
            )
        )
        shared_prefix = list(range(1000, 1032))
        tree.insert(InsertParams(key=RadixKey(shared_prefix), value=allocator.alloc(32)))
        tree.complete_write_through(shared_prefix)
        tree.evict(EvictParams(num_tokens=32))  # prefix now only on the host

        adder = PrefillAdder(
            PAGE,
            tree,
            allocator,
            running_batch=None,
            new_token_ratio=1.0,
            rem_input_tokens=4096,
            rem_chunk_tokens=None,
        )
        first = _request("first", range(1, 101), max_new_tokens=20)
        first.init_next_round_input(tree)
        self.assertEqual(adder.add_one_req(first, False, None), AddReqResult.CONTINUE)

        second = _request("second", shared_prefix + list(range(2000, 2008)), max_new_tokens=10)
        second.init_next_round_input(tree)
        self.assertEqual(len(second.prefix_indices), 0)
        self.assertEqual(second.host_hit_length, 32)
        result = adder.add_one_req(second, False, None)
        return SimpleNamespace(
            tree=tree, allocator=allocator, adder=adder, second=second, result=result
        )

    def test_load_back_receives_the_admission_budget_and_stock_passes_none(self):
        stock = self._admission_round()
        with applied_hooks(prefill_load_back_quota.register_hooks):
            hooked = [self._admission_round(cp_rank) for cp_rank in range(CP_SIZE)]

        # Stock 0.5.11: the all-or-nothing gate in load_back gets no quota, so it can never refuse.
        self.assertEqual(stock.tree.mem_quotas_seen, [None])

        # Before `second`: 256 free logical tokens, `first` promised 100 input + 20 new + 1 page.
        remaining_before_second = POOL_TOKENS - (100 + 20 + PAGE)
        # `second` needs, besides its 32-token load-back: 8 new input + 10 new + 1 page.
        expected_quota = remaining_before_second - (8 + 10 + PAGE)
        self.assertGreater(expected_quota, PHYSICAL_TOKENS)  # only a logical budget is this large
        for rank_run in hooked:  # every rank takes the same decision, no collective needed
            self.assertEqual(rank_run.tree.mem_quotas_seen, [expected_quota])

    def test_load_back_that_fits_is_admitted_exactly_as_stock(self):
        stock = self._admission_round()
        with applied_hooks(prefill_load_back_quota.register_hooks):
            hooked = self._admission_round()

        for run in (stock, hooked):
            self.assertEqual(run.result, AddReqResult.CONTINUE)
            self.assertEqual(len(run.second.prefix_indices), 32)  # loaded back, not recomputed
            self.assertEqual(run.second.extend_input_len, 8)
            self.assertFalse(run.second.last_node.evicted)
        self.assertEqual(hooked.allocator.available_size(), stock.allocator.available_size())
        self.assertEqual(hooked.adder.rem_total_tokens, stock.adder.rem_total_tokens)


if __name__ == "__main__":
    unittest.main()
