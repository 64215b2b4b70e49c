"""Transfer blocks of a shared-KV PD prefill: few large blocks, engine calls of bounded size, and still
every byte at the decode.

Through the real transfer path (``sglang_cp_shared_kv_testing/fake_pd_transfer.py``: ``send_kv_chunk``, the stock sender
bookkeeping and transfer worker, stock ``group_concurrent_contiguous``, our subclasses) and the real
allocators. Planted bugs, each seen failing (then reverted): the allocator ignoring
``owner_run_pages`` (placement ``j % cp_size``) fails ``test_pd_prefill_sends_runs_of_pages``,
``test_allocator_places_runs_of_pages``, ``test_benchmark_layouts_match_the_real_path`` and
``test_runs_with_contiguous_decode_pages_need_one_call_per_batch``; ``_transfer_data`` submitting
the whole batch in one call
fails ``test_calls_fit_a_bounded_engine_queue`` (the fake engine rejects the call, as mooncake's TCP
queue does, and the request fails); ``owner_run_pages`` returning 16 whatever the chunk fails
``test_owner_run_pages_rule``."""

import importlib.util
import sys
import unittest
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.disaggregation.mooncake import conn as shared_kv_conn
from sglang_cp_shared_kv.disaggregation.transfer_blocks import (
    MAX_BLOCKS_PER_TRANSFER_CALL,
    bounded_calls,
)
from sglang_cp_shared_kv.mem_cache.allocator import CPSharedPagedTokenToKVPoolAllocator
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.mem_cache.owner_run_placement import (
    PD_PREFILL_OWNER_RUN_PAGES,
    owner_run_pages,
)
from sglang_cp_shared_kv_testing import fake_pd_transfer as pd

register_cpu_ci(est_time=60, suite="stage-a-test-cpu")

PAGE = pd.PAGE
REPO = Path(__file__).resolve().parents[4]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_pd_transfer_blocks", REPO / "benchmark/bench_pd_transfer_blocks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def pd_prefill_args(chunk_tokens=8192):
    return SimpleNamespace(disaggregation_mode="prefill", chunked_prefill_size=chunk_tokens)


def fresh_locs(cp_size, physical_pages, tokens, run):
    """Logical locs our allocator hands the first request of a fresh pool."""
    pool = SimpleNamespace(size=physical_pages * PAGE)
    alloc = CPSharedPagedTokenToKVPoolAllocator(
        cp_size * pool.size, PAGE, torch.bfloat16, "cpu", pool, False,
        CpSharedKVLayout(cp_size, 0, PAGE), run,
    )
    zero = torch.zeros(1, dtype=torch.int64)
    seq = torch.tensor([tokens])
    return alloc.alloc_extend(zero, zero.clone(), seq, seq.clone(), torch.tensor([-1]), tokens)


class TestOwnerRunPagesRule(CustomTestCase):
    def test_owner_run_pages_rule(self):
        """Runs only on a PD prefill server, never longer than a chunk's share of one rank."""
        self.assertEqual(owner_run_pages(pd_prefill_args(8192), 2, PAGE), PD_PREFILL_OWNER_RUN_PAGES)
        self.assertEqual(owner_run_pages(pd_prefill_args(8192), 8, PAGE), 16)  # 128 pages / 8
        self.assertEqual(owner_run_pages(pd_prefill_args(2048), 8, PAGE), 4)  # 32 pages / 8
        self.assertEqual(owner_run_pages(pd_prefill_args(64), 2, PAGE), 1)
        self.assertEqual(owner_run_pages(pd_prefill_args(None), 4, PAGE), PD_PREFILL_OWNER_RUN_PAGES)
        self.assertEqual(owner_run_pages(pd_prefill_args(-1), 4, PAGE), PD_PREFILL_OWNER_RUN_PAGES)
        self.assertEqual(owner_run_pages(pd_prefill_args(8192), 1, PAGE), 1)
        for mode in ("null", "decode"):
            args = SimpleNamespace(disaggregation_mode=mode, chunked_prefill_size=8192)
            self.assertEqual(owner_run_pages(args, 2, PAGE), 1)

    def test_bounded_calls_keep_every_block_in_order(self):
        blocks = [(i, 10 * i, i + 1) for i in range(1000)]
        calls = list(bounded_calls(blocks, 256))
        self.assertEqual([len(c) for c in calls], [256, 256, 256, 232])
        self.assertEqual([b for c in calls for b in c], blocks)
        self.assertEqual(list(bounded_calls([], 256)), [])
        with self.assertRaises(ValueError):
            list(bounded_calls(blocks, 0))


class TestAllocatorOwnerRuns(CustomTestCase):
    def test_allocator_places_runs_of_pages(self):
        """A fresh request of a multiple of ``cp * run`` pages gets page ``j`` on owner
        ``(j // run) % cp``, on consecutive physical pages of each owner; any length keeps the
        allocator's balance (owners' page counts within one page), which wins over the runs."""
        for cp_size, run, pages in ((2, 4, 32), (4, 2, 32), (2, 16, 128), (8, 16, 128), (4, 2, 30), (2, 16, 100)):
            layout = CpSharedKVLayout(cp_size, 0, PAGE)
            locs = fresh_locs(cp_size, 200, pages * PAGE, run).numpy()
            logical = locs[::PAGE] // PAGE
            owners = layout.owner_of_page(logical)
            msg = (cp_size, run, pages)
            self.assertEqual(len(set(logical.tolist())), pages, msg)
            counts = np.bincount(owners, minlength=cp_size)
            self.assertLessEqual(int(counts.max() - counts.min()), 1, msg)
            if pages % (cp_size * run):
                continue
            self.assertEqual(owners.tolist(), [(j // run) % cp_size for j in range(pages)], msg)
            for rank in range(cp_size):
                physical = layout.physical_page_of(logical[owners == rank])
                self.assertTrue((np.diff(physical) == 1).all(), msg + (rank,))

    def test_default_and_invalid_runs(self):
        locs = fresh_locs(4, 50, 12 * PAGE, 1).numpy()
        self.assertEqual((locs[::PAGE] // PAGE % 4).tolist(), [j % 4 for j in range(12)])
        for bad in (0, -1, 1.5, True):
            with self.assertRaises(ValueError):
                fresh_locs(2, 10, PAGE, bad)


class TestTransferBlocksOnRealPath(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.bench = load_bench()

    def test_pd_prefill_sends_runs_of_pages(self):
        """8K prompt, decode pages contiguous: every sending rank of the shared-KV pair sends its share
        in blocks of ``run`` pages (4 KV + 4 indexer per layer at cp 2), where round-robin placement
        made one block per page; stock sends one block per layer."""
        for cp_size in (2, 4, 8):
            run = owner_run_pages(pd_prefill_args(8192), cp_size, PAGE)
            ours = self.bench.count_real_blocks(cp_size, 8192, "shared-kv", "contiguous", 8192)
            before = self.bench.count_real_blocks(cp_size, 8192, "shared-kv-round-robin", "contiguous", 8192)
            for rank in range(cp_size):
                self.assertEqual(ours[rank]["kv"], [run] * (128 // (cp_size * run)), (cp_size, rank))
                self.assertEqual(ours[rank]["indexer"], [run] * (128 // (cp_size * run)), (cp_size, rank))
                self.assertEqual(before[rank]["kv"], [1] * (128 // cp_size), (cp_size, rank))
            stock = self.bench.count_real_blocks(cp_size, 8192, "stock", "contiguous", 8192)
            self.assertEqual([r["kv"] for r in stock], [[128]] + [[]] * (cp_size - 1))

    def test_benchmark_layouts_match_the_real_path(self):
        """The layouts ``measure`` times are the blocks the real path submits (pages per block, in order,
        layer 0), so its timings are of the pair's real transfers (requests of a multiple of
        ``cp * run`` pages, where the allocator's balance does not move pages between owners)."""
        for cp_size in (2, 4):
            for pages in (128, 64):
                shape = self.bench.RequestShape(pages, 1, PAGE * 8, PAGE * 4)
                run = owner_run_pages(pd_prefill_args(8192), cp_size, PAGE)
                for layout, pair in (("stock", "stock"), ("ranges", "stock-all-cp"),
                                     ("shared-kv-round-robin", "shared-kv-round-robin"), ("shared-kv", "shared-kv")):  # fmt: skip
                    real = self.bench.count_real_blocks(cp_size, pages * PAGE, pair, "contiguous", 8192)
                    for rank in range(cp_size):
                        kv, indexer = self.bench.rank_blocks(shape, layout, cp_size, rank, run)
                        msg = (cp_size, pages, layout, rank)
                        self.assertEqual([n // shape.kv_item_bytes for _, _, n in kv], real[rank]["kv"], msg)
                        if layout != "ranges":  # stock-all-cp sends every indexer page from every rank
                            self.assertEqual([n // shape.indexer_item_bytes for _, _, n in indexer],
                                             real[rank]["indexer"], msg)  # fmt: skip


class QueueLimitedEngine:
    """Wraps a rank's fake engine: a call of more than ``queue`` blocks fails as a whole (mooncake's
    TCP transport rejects requests beyond its per-peer queue, and the call returns -1)."""

    def __init__(self, engine, queue):
        self.real, self.queue, self.calls = engine.batch_transfer_sync, queue, []
        engine.batch_transfer_sync = self

    def __call__(self, session_id, buffers, peer_buffer_addresses, lengths):
        self.calls.append(len(buffers))
        if len(buffers) > self.queue:
            return -1
        return self.real(session_id, buffers, peer_buffer_addresses, lengths)


class TestBoundedCalls(CustomTestCase):
    LAYERS = 20
    TOKENS = 128 * PAGE - 5  # 128 pages, the last one partial

    def run_pair(self, cp_size, shared_kv, run, queue, scattered_decode):
        """One request through every prefill rank; returns the decode, the ranks and their engines."""
        rng = np.random.default_rng(cp_size)
        pages = -(-self.TOKENS // PAGE)
        physical = pages + 2
        decode_pages = 3 * pages
        if scattered_decode:
            dst = rng.choice(np.arange(1, decode_pages + 1), pages, replace=False)
        else:
            dst = np.arange(1, pages + 1)
        replicated = pd.build_nsa_pool(cp_size * (physical + 1), layer_num=self.LAYERS)
        generator = torch.Generator().manual_seed(cp_size)
        pd.fill_random(replicated, generator)
        if shared_kv:
            locs = fresh_locs(cp_size, physical, self.TOKENS, run)
        else:
            locs = torch.arange(PAGE, PAGE + self.TOKENS)  # stock: logical = physical pages 1..
        decode = pd.DecodeInstance.build(decode_pages)
        decode.pool = pd.build_nsa_pool(decode_pages, layer_num=self.LAYERS)
        ranks, engines = [], []
        for rank in range(cp_size):
            if shared_kv:
                layout = CpSharedKVLayout(cp_size, rank, PAGE)
                pool = shard_with_layers(replicated, layout, physical, generator, self.LAYERS)
            else:
                pool = replicated
            prefill = pd.build_prefill_rank(cp_size=cp_size, cp_rank=rank, pool=pool, decode=decode,
                                            shared_kv=shared_kv, all_cp_ranks=shared_kv)  # fmt: skip
            engines.append(QueueLimitedEngine(prefill.engine, queue))
            pd.connect_decode(prefill, decode, 9, dst, aux_index=1)
            pd.send_request(prefill, room=9, logical_locs=locs, chunk_ends=[4096, self.TOKENS],
                            first_output_id=5, aux_index=1)  # fmt: skip
            ranks.append(prefill)
        return decode, ranks, engines, replicated, locs, dst

    def test_calls_fit_a_bounded_engine_queue(self):
        """Scattered decode pages (one block per page): every shared-KV call stays within a queue of
        ``MAX_BLOCKS_PER_TRANSFER_CALL`` blocks, the request succeeds on every rank, and the decode
        holds exactly the stock bytes; stock's single call per batch overflows the same queue."""
        for cp_size in (2, 4):
            run = owner_run_pages(pd_prefill_args(4096), cp_size, PAGE)
            decode, ranks, engines, replicated, locs, dst = self.run_pair(
                cp_size, True, run, MAX_BLOCKS_PER_TRANSFER_CALL, scattered_decode=True
            )
            for prefill, engine in zip(ranks, engines):
                self.assertEqual(prefill.engine.errors, [])
                self.assertLessEqual(max(engine.calls), MAX_BLOCKS_PER_TRANSFER_CALL)
                self.assertGreater(sum(engine.calls), MAX_BLOCKS_PER_TRANSFER_CALL)  # the cap did split
                self.assertEqual(prefill.manager.check_status(9), KVPoll.Success)
            self.assertEqual(decode.senders_done(9), set(range(cp_size)))
            expected = pd.build_nsa_pool(decode.pool.size // PAGE, layer_num=self.LAYERS)
            logical_pages = locs.numpy()[::PAGE] // PAGE
            pd.copy_pages(replicated, logical_pages, expected, dst)
            for got, want in zip(pd.pool_page_views(decode.pool), pd.pool_page_views(expected)):
                self.assertTrue(torch.equal(got[dst], want[dst]), cp_size)

            _, stock_ranks, _, _, _, _ = self.run_pair(cp_size, False, 1, MAX_BLOCKS_PER_TRANSFER_CALL, True)
            self.assertEqual(stock_ranks[0].manager.check_status(9), KVPoll.Failed)

    def test_runs_with_contiguous_decode_pages_need_one_call_per_batch(self):
        """Contiguous decode pages: the runs make few blocks, so no batch needs splitting (the cap
        costs nothing where blocks are already few)."""
        run = owner_run_pages(pd_prefill_args(4096), 2, PAGE)
        _, ranks, engines, _, _, _ = self.run_pair(2, True, run, MAX_BLOCKS_PER_TRANSFER_CALL, False)
        for prefill, engine in zip(ranks, engines):
            # chunk 1 KV, chunk 2 KV, indexer, aux: 4 calls, the KV ones of (32 / run) blocks x 20 layers
            self.assertEqual(len(engine.calls), 4)
            self.assertEqual(engine.calls[0], (4096 // PAGE // 2 // run) * self.LAYERS)
            self.assertEqual(prefill.manager.check_status(9), KVPoll.Success)


def shard_with_layers(replicated, layout, physical, generator, layers):
    """``pd.shard_of`` with ``layers`` layers: the owned logical pages at their physical pages, every
    other byte random."""
    out = pd.build_nsa_pool(physical, layer_num=layers)
    pd.fill_random(out, generator)
    pages = np.arange(1, physical + 1)
    pd.copy_pages(replicated, layout.logical_page_of(pages), out, pages)
    return out


if __name__ == "__main__":
    unittest.main()
