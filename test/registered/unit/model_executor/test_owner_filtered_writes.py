"""Owner-filtered writes: each rank's shard keeps exactly its owned rows; the rest sink into page 0.

sglang's real ``set_mla_kv_buffer`` / ``Indexer._store_index_k_cache`` run with our hooks applied;
only their Triton kernels are swapped for torch (``nsa_cpu_kernels``).
"""

import unittest
from types import SimpleNamespace

import torch

from sglang.srt.layers.attention.nsa.nsa_indexer import Indexer
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.model_executor import owner_filtered_writes, peer_page_reads
from sglang_cp_shared_kv.model_executor.gather_scratch import create_gather_scratch
from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks
from sglang_cp_shared_kv_testing.nsa_cpu_kernels import (
    IndexerStub,
    act_quant_torch,
    cpu_kernels,
    set_k_and_s_torch,
)
from sglang_cp_shared_kv_testing.runtime_check import PAGE_SIZE, make_nsa_pool
from sglang_cp_shared_kv_testing.page_mirror import mirrored
from sglang_cp_shared_kv_testing.shared_kv_state import attach_runtime

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

CP_SIZE = 2
PHYSICAL_PAGES = 3
# Logical pages 2..7 exist (0 and 1 are dummies); write parts of 2, 3, 4, 7 plus padded loc 0.
LOGICAL_LOCS = torch.tensor(
    [2 * 64 + 5, 2 * 64 + 6, 3 * 64, 3 * 64 + 63, 4 * 64 + 1, 7 * 64 + 10, 0, 0], dtype=torch.int64
)


def _served_shard(rank, dtype_name, layers=2):
    layout = CpSharedKVLayout(CP_SIZE, rank, PAGE_SIZE)
    shard = make_nsa_pool(PHYSICAL_PAGES * PAGE_SIZE, dtype_name, layers, "cpu")
    return attach_runtime(shard, layout, create_gather_scratch(shard, CP_SIZE), cp_group=None)


def _replica(dtype_name, layers=2):
    return make_nsa_pool((CP_SIZE * (PHYSICAL_PAGES + 1) - 1) * PAGE_SIZE, dtype_name, layers, "cpu")


def _physical_rows(runtime):
    """Physical locs of the real pages (1..) and the logical locs they store."""
    layout, pages = runtime.layout, torch.arange(1, PHYSICAL_PAGES + 1)
    physical = layout.rows_of_pages(pages * PAGE_SIZE)
    return physical, layout.rows_of_pages(layout.logical_page_of(pages) * PAGE_SIZE)


def _hooks():
    return applied_hooks(owner_filtered_writes.register_hooks, peer_page_reads.register_hooks)


class TestPhysicalLocsOrDummy(CustomTestCase):
    def test_owned_rows_map_to_physical_rows_and_others_to_page_zero(self):
        layout = CpSharedKVLayout(cp_size=4, cp_rank=1, page_size=64)
        # page 5: owner 1 -> physical page 1; page 6: owner 2; page 9: owner 1 -> physical 2; loc 0
        locs = torch.tensor([5 * 64 + 3, 6 * 64 + 7, 9 * 64, 0], dtype=torch.int32)
        mapped = layout.physical_locs_or_dummy(locs)
        self.assertEqual(mapped.tolist(), [64 + 3, 7, 128, 0])
        self.assertEqual(mapped.dtype, torch.int32)


class TestMlaKvWrites(CustomTestCase):
    def _check(self, dtype_name):
        torch.manual_seed(0)
        nope = torch.randn(len(LOGICAL_LOCS), 1, 512).to(torch.bfloat16)
        rope = torch.randn(len(LOGICAL_LOCS), 1, 64).to(torch.bfloat16)
        layer = SimpleNamespace(layer_id=1)
        replica = _replica(dtype_name)
        runtimes = [_served_shard(rank, dtype_name) for rank in range(CP_SIZE)]
        with _hooks(), cpu_kernels():
            replica.set_mla_kv_buffer(layer, LOGICAL_LOCS, nope, rope)
            for runtime in runtimes:
                runtime.pool.set_mla_kv_buffer(layer, LOGICAL_LOCS, nope, rope)
        written = replica.kv_buffer[1][LOGICAL_LOCS[:6]].view(torch.uint8)
        self.assertTrue(bool((written != 0).any(dim=-1).all()))
        stored = 0
        for runtime in runtimes:
            physical, logical = _physical_rows(runtime)
            shard_rows = runtime.pool.kv_buffer[1][physical].view(torch.uint8)
            self.assertTrue(torch.equal(shard_rows, replica.kv_buffer[1][logical].view(torch.uint8)))
            stored += int((shard_rows != 0).any(dim=-1).sum())
            # The other layer is untouched.
            self.assertEqual(int(runtime.pool.kv_buffer[0].view(torch.uint8).count_nonzero()), 0)
        self.assertEqual(stored, 6)  # every real row landed on exactly one rank

    def test_bf16_rows(self):
        self._check("bf16")

    def test_fp8_656_byte_rows(self):
        self._check("fp8")


class TestIndexKWrites(CustomTestCase):
    def _batch(self, pool):
        return SimpleNamespace(out_cache_loc=LOGICAL_LOCS.clone(), token_to_kv_pool=pool)

    def test_fallback_branch_keeps_owned_rows_and_restores_the_batch(self):
        key = torch.randn(len(LOGICAL_LOCS), 128).to(torch.bfloat16)
        replica = _replica("fp8")
        runtimes = [_served_shard(rank, "fp8") for rank in range(CP_SIZE)]
        with _hooks(), cpu_kernels():
            Indexer._store_index_k_cache(
                IndexerStub(), self._batch(replica), 1, key, act_quant=act_quant_torch
            )
            for runtime in runtimes:
                batch = self._batch(runtime.pool)
                locs = batch.out_cache_loc
                Indexer._store_index_k_cache(IndexerStub(), batch, 1, key, act_quant=act_quant_torch)
                self.assertIs(batch.out_cache_loc, locs)
                self.assertIs(batch.token_to_kv_pool, runtime.pool)
        self._check_index_pages(runtimes, replica)

    def test_fused_branch_gets_the_physical_buffer_from_the_getter(self):
        # sglang's fused store fetches its target with get_index_k_with_scale_buffer; during our
        # physical write that getter must hand out the pool's buffer (not the scratch), here with
        # a forward planned so the getter would otherwise serve the scratch.
        def fused_like_store(indexer, forward_batch, layer_id, key, *, act_quant=None):
            pool = forward_batch.token_to_kv_pool
            buf = pool.get_index_k_with_scale_buffer(layer_id=layer_id)
            index_k, scale = act_quant_torch(key)
            set_k_and_s_torch(
                pool=pool, buf=buf, loc=forward_batch.out_cache_loc, index_k=index_k,
                index_k_scale=scale,
            )

        key = torch.randn(len(LOGICAL_LOCS), 128).to(torch.bfloat16)
        replica = _replica("bf16")
        fused_like_store(None, self._batch(replica), 1, key)
        runtimes = [_served_shard(rank, "bf16") for rank in range(CP_SIZE)]
        req_to_token = torch.zeros((2, 256), dtype=torch.int32)
        with _hooks():
            for runtime in runtimes:
                batch = self._batch(runtime.pool)
                # One fresh request over pages 2, 3, 4 (all new: no collective needed).
                req_to_token[1, :192] = torch.arange(2 * 64, 5 * 64)
                runtime.begin_forward(
                    mirrored(SimpleNamespace(
                        forward_mode=ForwardMode.EXTEND,
                        seq_lens_cpu=torch.tensor([192]),
                        extend_seq_lens_cpu=[192],
                        req_pool_indices=torch.tensor([1]),
                        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
                        token_to_kv_pool=runtime.pool,
                    ))
                )
                owner_filtered_writes.store_index_k_cache(fused_like_store, None, batch, 1, key)
                # ...and the scratch got the rows of the forward's own pages.
                scratch = runtime.pool.get_index_k_with_scale_buffer(layer_id=1)
                self.assertIsNot(scratch, runtime.pool.index_k_with_scale_buffer[1])
                self.assertGreater(int(scratch.count_nonzero()), 0)
        self._check_index_pages(runtimes, replica)

    def test_batch_restored_when_the_store_raises(self):
        runtime = _served_shard(0, "bf16")
        batch = self._batch(runtime.pool)
        locs = batch.out_cache_loc

        def failing_store(*args, **kwargs):
            raise RuntimeError("kernel failed")

        with self.assertRaisesRegex(RuntimeError, "kernel failed"):
            owner_filtered_writes.store_index_k_cache(failing_store, None, batch, 0, None)
        self.assertIs(batch.out_cache_loc, locs)
        self.assertIs(batch.token_to_kv_pool, runtime.pool)
        self.assertFalse(runtime.writing_physical)

    def _check_index_pages(self, runtimes, replica):
        stored = 0
        for runtime in runtimes:
            physical, logical = _physical_rows(runtime)
            pages, logical_pages = physical[::PAGE_SIZE] // PAGE_SIZE, logical[::PAGE_SIZE] // PAGE_SIZE
            shard_pages = runtime.pool.index_k_with_scale_buffer[1][pages]
            self.assertTrue(torch.equal(shard_pages, replica.index_k_with_scale_buffer[1][logical_pages]))
            stored += int(shard_pages.count_nonzero())
        self.assertGreater(stored, 0)


class TestUnfilteredStoresRefused(CustomTestCase):
    def test_set_kv_buffer_refused_on_a_served_pool_only(self):
        runtime = _served_shard(0, "bf16")
        replica = _replica("bf16")
        layer = SimpleNamespace(layer_id=0)
        rows = torch.ones(1, 1, 576, dtype=torch.bfloat16)
        with _hooks():
            with self.assertRaisesRegex(ValueError, "enable-nsa-prefill-cp-shared-kv"):
                runtime.pool.set_kv_buffer(layer, torch.tensor([200]), rows, rows)
            replica.set_kv_buffer(layer, torch.tensor([200]), rows, rows)
        self.assertEqual(float(replica.kv_buffer[0][200].float().sum()), 576.0)


if __name__ == "__main__":
    unittest.main()
