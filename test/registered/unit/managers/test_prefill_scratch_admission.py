"""Admission caps prefill batches to a prefill-sized gather scratch; a context that cannot fit errors.

The real ``PrefillAdder`` over a real ``RadixCache`` and the CP allocator: cached prefixes are in
the tree, so sglang's own budgets (new tokens only) would admit every request below. With slot 0
sized for prefill (decode per owner), the hooks must stop a batch before its contexts exceed the
scratch, count chunk-truncated contexts, abort a request whose context alone exceeds it, and leave
admission exactly as stock when slot 0 holds the logical capacity.

Plants seen failing (then reverted): the cap comparing against the remaining pages without the
batch's used pages (``test_batch_that_would_overflow_is_capped``); counting the untruncated
context of a chunked request (``test_chunked_request_counts_its_chunk``); the too-long check
skipped (``test_context_longer_than_the_scratch_is_rejected``).
"""

import logging
import unittest
from types import SimpleNamespace
from unittest import mock

import torch

from sglang_cp_shared_kv_testing import sgl_kernel_cpu_shim

sgl_kernel_cpu_shim.install()

import sglang.srt.server_args as sglang_server_args  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import InsertParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402
from sglang.test.test_utils import CustomTestCase  # noqa: E402

from sglang_cp_shared_kv.managers import prefill_scratch_admission  # noqa: E402
from sglang_cp_shared_kv.mem_cache.allocator import (  # noqa: E402
    CPSharedPagedTokenToKVPoolAllocator,
)
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout  # noqa: E402
from sglang_cp_shared_kv.model_executor.cp_shared_kv_state import CpSharedKVState  # noqa: E402
from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks  # noqa: E402

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

PAGE = 4
CP_SIZE = 2
PHYSICAL_TOKENS = 64 * PAGE
SCRATCH_PAGES = 1 + 20  # dummy page + 80 tokens


def _kvcache(scratch_serves_decode):
    pool = SimpleNamespace(size=PHYSICAL_TOKENS)
    state = CpSharedKVState(pool, spec=None)  # admission reads only the runtime's scratch
    state.runtime = SimpleNamespace(
        scratch_serves_decode=scratch_serves_decode, scratch_num_pages=SCRATCH_PAGES
    )
    return pool


class _Round:
    """A tree with three cached 40-token prefixes and an adder over it."""

    PREFIXES = [list(range(1000 * k, 1000 * k + 40)) for k in (1, 2, 3)]

    def __init__(self, scratch_serves_decode=False, rem_chunk_tokens=None):
        self.allocator = CPSharedPagedTokenToKVPoolAllocator(
            CP_SIZE * PHYSICAL_TOKENS,
            PAGE,
            torch.int64,
            "cpu",
            kvcache=_kvcache(scratch_serves_decode),
            need_sort=False,
            layout=CpSharedKVLayout(CP_SIZE, 0, PAGE),
        )
        self.tree = RadixCache(
            CacheInitParams(
                disable=False,
                req_to_token_pool=None,
                token_to_kv_pool_allocator=self.allocator,
                page_size=PAGE,
            )
        )
        for prefix in self.PREFIXES:
            self.tree.insert(InsertParams(key=RadixKey(prefix), value=self.allocator.alloc(40)))
        self.adder = PrefillAdder(
            PAGE,
            self.tree,
            self.allocator,
            running_batch=None,
            new_token_ratio=1.0,
            rem_input_tokens=4096,
            rem_chunk_tokens=rem_chunk_tokens,
        )

    def add(self, rid, token_ids):
        req = Req(rid, "", list(token_ids), SamplingParams(max_new_tokens=4))
        req.init_next_round_input(self.tree)
        return req, self.adder.add_one_req(req, False, None)


class TestPrefillScratchAdmission(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls._saved_global_args = sglang_server_args._global_server_args
        sglang_server_args.set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))
        # Req.set_finish_with_abort logs on TP rank 0 (no TP group in a unit test).
        cls._rank = mock.patch(
            "sglang.srt.managers.schedule_batch.get_tensor_model_parallel_rank", return_value=0
        )
        cls._rank.start()

    @classmethod
    def tearDownClass(cls):
        cls._rank.stop()
        sglang_server_args._global_server_args = cls._saved_global_args

    def _requests(self, round_):
        """Three requests, each a cached 40-token prefix + 8 new tokens: 12 scratch pages each."""
        return [
            round_.add(f"r{k}", prefix + list(range(9000 + 10 * k, 9008 + 10 * k)))
            for k, prefix in enumerate(round_.PREFIXES)
        ]

    def test_batch_that_would_overflow_is_capped(self):
        prefill_scratch_admission._CapLog.logged = False
        with applied_hooks(prefill_scratch_admission.register_hooks):
            round_ = _Round()
            with self.assertLogs(prefill_scratch_admission.logger, logging.INFO) as logs:
                (first, r1), (second, r2), _ = self._requests(round_)
        self.assertEqual(len(first.prefix_indices), 40)  # sglang budgets only 8 new tokens
        self.assertEqual(r1, AddReqResult.CONTINUE)
        # 1 + 12 + 12 pages > 21: the second request waits, the batch stops there.
        self.assertEqual(r2, AddReqResult.OTHER)
        self.assertEqual(round_.adder.can_run_list, [first])
        self.assertIsNone(second.to_finish)
        self.assertIn("prefill batch capped at 1 requests", logs.output[0])

    def test_stock_admission_when_the_scratch_holds_the_logical_capacity(self):
        with applied_hooks(prefill_scratch_admission.register_hooks):
            round_ = _Round(scratch_serves_decode=True)
            results = [r for _, r in self._requests(round_)]
        stock = _Round(scratch_serves_decode=True)
        stock_results = [r for _, r in self._requests(stock)]
        self.assertEqual(results, stock_results)
        self.assertEqual(len(round_.adder.can_run_list), 3)

    def test_chunked_request_counts_its_chunk(self):
        with applied_hooks(prefill_scratch_admission.register_hooks):
            round_ = _Round(rem_chunk_tokens=16)
            # 30 new tokens chunked to 16: 40 + 16 = 56 tokens (14 pages) read, not 70 (18 pages).
            # (70 tokens fit the scratch: the last chunk, which reads them all, can run.)
            long_req, r1 = round_.add("long", round_.PREFIXES[0] + list(range(5000, 5030)))
            self.assertIs(round_.adder.new_chunked_req, long_req)
            self.assertEqual(len(long_req.fill_ids), 56)
            used = prefill_scratch_admission._pages_used(round_.adder)
        self.assertIsNone(long_req.to_finish)
        self.assertEqual(used, 1 + 14)

    def test_continuing_chunked_request_is_counted_first(self):
        with applied_hooks(prefill_scratch_admission.register_hooks):
            round_ = _Round(rem_chunk_tokens=64)
            chunked = Req("c", "", list(range(7000, 7036)), SamplingParams(max_new_tokens=4))
            chunked.init_next_round_input(round_.tree)
            round_.adder.add_chunked_req(chunked)
            # 1 + 9 pages used; a request of 11 pages just fits 21, a second one does not.
            _, r1 = round_.add("a", round_.PREFIXES[1] + [1, 2, 3])
            self.assertEqual(prefill_scratch_admission._pages_used(round_.adder), 1 + 9 + 11)
            _, r2 = round_.add("b", round_.PREFIXES[2] + [4, 5, 6])
        self.assertEqual((r1, r2), (AddReqResult.CONTINUE, AddReqResult.OTHER))

    def test_context_longer_than_the_scratch_is_rejected(self):
        with applied_hooks(prefill_scratch_admission.register_hooks):
            round_ = _Round(rem_chunk_tokens=16)
            req, result = round_.add("huge", list(range(20000, 20081)))  # 21 pages > 20
        self.assertIsInstance(req.to_finish, FINISH_ABORT)
        self.assertIn("SGLANG_CP_SHARED_KV_PREFILL_SCRATCH_TOKENS", req.to_finish.message)
        # sglang prefills an aborted request as one token and then returns its error.
        self.assertEqual(len(req.fill_ids), 1)
        self.assertEqual(round_.adder.can_run_list, [req])
        self.assertNotEqual(result, AddReqResult.NO_TOKEN)


if __name__ == "__main__":
    unittest.main()
