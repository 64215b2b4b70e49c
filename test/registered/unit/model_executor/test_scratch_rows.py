"""One store per layer: storing into the scratch slot and copying raw bytes to the pool gives the pool
and the scratch exactly the bytes of the former two stores (pool at physical locs, scratch at the
fill locs), for bf16 and fp8 KV rows and for both parts of the paged indexer rows.

Planted and seen failing: copying only the indexer's K part (scales left out) and building the
physical rows from the scratch locs instead of the logical ones.
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
from sglang_cp_shared_kv.model_executor.gather_scratch import SCRATCH_LAYER, create_gather_scratch
from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks
from sglang_cp_shared_kv_testing.nsa_cpu_kernels import IndexerStub, act_quant_torch, cpu_kernels
from sglang_cp_shared_kv_testing.page_mirror import mirrored
from sglang_cp_shared_kv_testing.peer_page_plan_fills import fill_locs
from sglang_cp_shared_kv_testing.runtime_check import PAGE_SIZE, make_nsa_pool
from sglang_cp_shared_kv_testing.shared_kv_state import attach_runtime

register_cpu_ci(est_time=15, suite="stage-a-test-cpu")

CP_SIZE, PHYSICAL_PAGES, LAYER = 2, 4, 1
# One fresh request over logical pages 2, 3, 4, 7 (150 + 40 tokens: the last page partly filled),
# then two padded tokens (loc 0).
PAGES = [2, 3, 4, 7]
SEQ_LEN = 3 * PAGE_SIZE + 40


def _locs():
    positions = torch.arange(SEQ_LEN)
    pages = torch.tensor(PAGES)[positions // PAGE_SIZE]
    return torch.cat([pages * PAGE_SIZE + positions % PAGE_SIZE, torch.zeros(2, dtype=torch.int64)])


def _planned_runtime(rank, dtype_name):
    layout = CpSharedKVLayout(CP_SIZE, rank, PAGE_SIZE)
    shard = make_nsa_pool(PHYSICAL_PAGES * PAGE_SIZE, dtype_name, 2, "cpu")
    runtime = attach_runtime(shard, layout, create_gather_scratch(shard, CP_SIZE), cp_group=None)
    req_to_token = torch.zeros((2, 512), dtype=torch.int32)
    req_to_token[1, :SEQ_LEN] = _locs()[:SEQ_LEN].int()
    runtime.begin_forward(_extend_batch(req_to_token, shard))
    return runtime


def _extend_batch(req_to_token, pool):
    """An EXTEND of request 1's ``SEQ_LEN`` new tokens over ``req_to_token``, with its host mirror
    (the one ``pool``'s runtime plans from)."""
    return mirrored(
        SimpleNamespace(
            forward_mode=ForwardMode.EXTEND,
            seq_lens_cpu=torch.tensor([SEQ_LEN]),
            extend_seq_lens_cpu=[SEQ_LEN],
            req_pool_indices=torch.tensor([1]),
            req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
            token_to_kv_pool=pool,
        )
    )


def _real_pages(runtime):
    """Real physical pages (1..) of the pool and the scratch pages of the forward's pages."""
    physical = torch.arange(1, PHYSICAL_PAGES + 1)
    scratch_pages = runtime.plan.lookup[torch.tensor(PAGES)].long()
    return physical, scratch_pages


class TestSingleStoreBytes(CustomTestCase):
    def _two_store_reference(self, runtime, dtype_name, store):
        """The former path on fresh pools: sglang's store into the pool at physical locs and into
        the scratch at the fill locs."""
        pool = make_nsa_pool(PHYSICAL_PAGES * PAGE_SIZE, dtype_name, 2, "cpu")
        scratch = create_gather_scratch(pool, CP_SIZE)
        locs = _locs()
        store(pool, LAYER, runtime.layout.physical_locs_or_dummy(locs))
        store(scratch, 0, fill_locs(runtime.plan, locs))
        return pool, scratch

    def _check_kv(self, dtype_name):
        torch.manual_seed(0)
        nope = torch.randn(len(_locs()), 1, 512).to(torch.bfloat16)
        rope = torch.randn(len(_locs()), 1, 64).to(torch.bfloat16)
        for rank in range(CP_SIZE):
            runtime = _planned_runtime(rank, dtype_name)

            def store(pool, layer_id, locs):
                layer = SimpleNamespace(layer_id=layer_id) if layer_id else SCRATCH_LAYER
                pool.set_mla_kv_buffer(layer, locs, nope, rope)

            with cpu_kernels():
                ref_pool, ref_scratch = self._two_store_reference(runtime, dtype_name, store)
                with applied_hooks(owner_filtered_writes.register_hooks, peer_page_reads.register_hooks):
                    runtime.pool.set_mla_kv_buffer(SimpleNamespace(layer_id=LAYER), _locs(), nope, rope)
            physical, scratch_pages = _real_pages(runtime)
            rows = runtime.layout.rows_of_pages(physical * PAGE_SIZE)
            got = runtime.pool.kv_buffer[LAYER][rows].view(torch.uint8)
            self.assertTrue(torch.equal(got, ref_pool.kv_buffer[LAYER][rows].view(torch.uint8)))
            self.assertGreater(int(got.count_nonzero()), 0)
            scratch_rows = runtime.layout.rows_of_pages(scratch_pages * PAGE_SIZE)
            slot = runtime.kv_slot_for_read(LAYER)
            self.assertTrue(
                torch.equal(
                    slot.kv_buffer[0][scratch_rows].view(torch.uint8),
                    ref_scratch.kv_buffer[0][scratch_rows].view(torch.uint8),
                )
            )

    def test_bf16_kv_rows(self):
        self._check_kv("bf16")

    def test_fp8_kv_rows(self):
        self._check_kv("fp8")

    def test_indexer_rows_both_parts(self):
        torch.manual_seed(1)
        key = torch.randn(len(_locs()), 128).to(torch.bfloat16)
        for rank in range(CP_SIZE):
            runtime = _planned_runtime(rank, "fp8")

            def store(pool, layer_id, locs):
                batch = SimpleNamespace(out_cache_loc=locs, token_to_kv_pool=pool)
                Indexer._store_index_k_cache(IndexerStub(), batch, layer_id, key, act_quant=act_quant_torch)

            with cpu_kernels():
                ref_pool, ref_scratch = self._two_store_reference(runtime, "fp8", store)
                with applied_hooks(owner_filtered_writes.register_hooks, peer_page_reads.register_hooks):
                    batch = SimpleNamespace(out_cache_loc=_locs(), token_to_kv_pool=runtime.pool)
                    Indexer._store_index_k_cache(IndexerStub(), batch, LAYER, key, act_quant=act_quant_torch)
            physical, scratch_pages = _real_pages(runtime)
            got = runtime.pool.index_k_with_scale_buffer[LAYER][physical]
            self.assertTrue(torch.equal(got, ref_pool.index_k_with_scale_buffer[LAYER][physical]))
            scale_part = got[:, PAGE_SIZE * 128 :]
            self.assertGreater(int(scale_part.count_nonzero()), 0)  # scales landed too
            slot = runtime.index_slot_for_read(LAYER)
            self.assertTrue(
                torch.equal(
                    slot.index_k_with_scale_buffer[0][scratch_pages],
                    ref_scratch.index_k_with_scale_buffer[0][scratch_pages],
                )
            )


class TestRowMapsOncePerForward(CustomTestCase):
    def test_maps_are_reused_for_the_same_plan_and_locs(self):
        runtime = _planned_runtime(0, "bf16")
        locs = _locs()
        maps = runtime.row_maps(runtime.plan, locs)
        self.assertIs(runtime.row_maps(runtime.plan, locs), maps)
        self.assertIsNot(runtime.row_maps(runtime.plan, locs.clone()), maps)  # another tensor
        old_plan = runtime.plan
        runtime.begin_forward(_extend_batch(torch.zeros((2, 512), dtype=torch.int32), runtime.pool))
        self.assertIsNot(runtime.plan, old_plan)
        self.assertIsNot(runtime.row_maps(runtime.plan, locs), maps)  # a new forward rebuilds


if __name__ == "__main__":
    unittest.main()
