"""Peer-page reads: the backend's tables are remapped once per forward and the getters serve the scratch."""

import dataclasses
import unittest
from types import SimpleNamespace

import torch

from sglang.srt.layers.attention.nsa.nsa_indexer import Indexer
from sglang.srt.layers.attention.nsa_backend import NativeSparseAttnBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.model_executor import forward_dispatch, owner_filtered_writes, peer_page_reads
from sglang_cp_shared_kv.model_executor.gather_scratch import create_gather_scratch
from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks
from sglang_cp_shared_kv_testing.nsa_cpu_kernels import IndexerStub, act_quant_torch, cpu_kernels
from sglang_cp_shared_kv_testing.runtime_check import PAGE_SIZE, make_nsa_pool, nsa_metadata_for
from sglang_cp_shared_kv_testing.page_mirror import mirrored
from sglang_cp_shared_kv_testing.shared_kv_state import attach_runtime

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

CP_SIZE, RANK, PHYSICAL_PAGES = 2, 1, 4
# One fresh request on logical pages 7, 2, 5 (owners 1, 0, 1), 150 tokens: every page is new, so
# the forward needs no collective and one process can play rank 1.
PAGES = [7, 2, 5]
SEQ_LEN = 150
LOGICAL_LOCS = torch.tensor([PAGES[p // 64] * 64 + p % 64 for p in range(SEQ_LEN)])


def _runtime(dtype_name="bf16"):
    shard = make_nsa_pool(PHYSICAL_PAGES * PAGE_SIZE, dtype_name, 2, "cpu")
    layout = CpSharedKVLayout(CP_SIZE, RANK, PAGE_SIZE)
    return attach_runtime(shard, layout, create_gather_scratch(shard, CP_SIZE), cp_group=None)


def _forward_batch(pool, mode=ForwardMode.EXTEND):
    req_to_token = torch.zeros((2, 256), dtype=torch.int32)
    req_to_token[1, :SEQ_LEN] = LOGICAL_LOCS
    return mirrored(SimpleNamespace(
        forward_mode=mode,
        seq_lens_cpu=torch.tensor([SEQ_LEN]),
        extend_seq_lens_cpu=[SEQ_LEN],
        req_pool_indices=torch.tensor([1]),
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        out_cache_loc=LOGICAL_LOCS.clone(),
        token_to_kv_pool=pool,
    ))


def _hooks():
    return applied_hooks(owner_filtered_writes.register_hooks, peer_page_reads.register_hooks)


class TestMetadataRemap(CustomTestCase):
    def test_tables_become_scratch_locs_and_pages(self):
        runtime = _runtime()
        batch = _forward_batch(runtime.pool)
        table = batch.req_to_token_pool.req_to_token[1:, :SEQ_LEN]
        metadata = nsa_metadata_for(table)
        backend = SimpleNamespace(forward_metadata=metadata)
        forward_dispatch.dispatch_forward_metadata(None, backend, batch)
        plan = runtime.plan
        remapped = backend.forward_metadata
        self.assertTrue(torch.equal(remapped.page_table_1, plan.remap_token_locs(table)))
        self.assertTrue(torch.equal(remapped.real_page_table, plan.remap_pages(metadata.real_page_table)))
        self.assertIsNone(remapped.page_table_1_flattened)
        self.assertIs(remapped.cu_seqlens_q, metadata.cu_seqlens_q)
        # Pages in first-use order land on distinct scratch pages, slots kept.
        scratch_pages = remapped.real_page_table[0].tolist()
        self.assertEqual(sorted(scratch_pages), [1, 2, 3])
        self.assertEqual((remapped.page_table_1 % 64).tolist(), (table % 64).tolist())

    def test_flattened_table_is_remapped_too(self):
        runtime = _runtime()
        batch = _forward_batch(runtime.pool)
        table = batch.req_to_token_pool.req_to_token[1:, :SEQ_LEN]
        metadata = nsa_metadata_for(table)
        backend = SimpleNamespace(
            forward_metadata=dataclasses.replace(metadata, page_table_1_flattened=table[0].clone())
        )
        forward_dispatch.dispatch_forward_metadata(None, backend, batch)
        self.assertTrue(torch.equal(
            backend.forward_metadata.page_table_1_flattened, runtime.plan.remap_token_locs(table[0])
        ))

    def test_unserved_pool_keeps_metadata(self):
        batch = _forward_batch(make_nsa_pool(PAGE_SIZE, "bf16", 1, "cpu"))
        backend = SimpleNamespace(forward_metadata=object())
        metadata = backend.forward_metadata
        forward_dispatch.dispatch_forward_metadata(None, backend, batch)
        self.assertIs(backend.forward_metadata, metadata)

    def test_unplanned_forward_modes_are_refused(self):
        # TARGET_VERIFY, DRAFT_EXTEND and DRAFT_EXTEND_V2 are planned
        # (test_cp_shared_kv_runtime.TestPlannedLengths); extend modes the flag never runs are not.
        runtime = _runtime()
        for mode in (ForwardMode.SPLIT_PREFILL, ForwardMode.DLLM_EXTEND):
            with self.subTest(mode=mode.name):
                with self.assertRaisesRegex(ValueError, mode.name):
                    runtime.begin_forward(_forward_batch(runtime.pool, mode))
        runtime.begin_forward(_forward_batch(runtime.pool, ForwardMode.DRAFT_EXTEND_V2))


class TestGettersServeTheScratch(CustomTestCase):
    def _store_layer(self, runtime, replica, layer_id):
        torch.manual_seed(layer_id)
        nope = torch.randn(SEQ_LEN, 1, 512).to(torch.bfloat16)
        rope = torch.randn(SEQ_LEN, 1, 64).to(torch.bfloat16)
        key = torch.randn(SEQ_LEN, 128).to(torch.bfloat16)
        layer = SimpleNamespace(layer_id=layer_id)
        for pool in (runtime.pool, replica):
            batch = _forward_batch(pool)
            pool.set_mla_kv_buffer(layer, batch.out_cache_loc, nope, rope)
            Indexer._store_index_k_cache(IndexerStub(), batch, layer_id, key, act_quant=act_quant_torch)

    def test_kv_and_index_reads_match_the_replicated_pool(self):
        for dtype_name in ("bf16", "fp8"):
            self._check(dtype_name)

    def _check(self, dtype_name):
        runtime = _runtime(dtype_name)
        replica = make_nsa_pool((CP_SIZE * (PHYSICAL_PAGES + 1) - 1) * PAGE_SIZE, dtype_name, 2, "cpu")
        batch = _forward_batch(runtime.pool)
        with _hooks(), cpu_kernels():
            plan = runtime.begin_forward(batch)
            with self.assertRaisesRegex(RuntimeError, "read before its store"):
                runtime.pool.get_key_buffer(1)
            self._store_layer(runtime, replica, 1)
            scratch_locs = plan.remap_token_locs(LOGICAL_LOCS)
            kv = runtime.pool.get_key_buffer(1)
            self.assertEqual(kv.data_ptr(), runtime.scratch.kv_buffer[0].data_ptr())
            self.assertEqual(kv.dtype, replica.get_key_buffer(1).dtype)
            self.assertTrue(torch.equal(
                kv[scratch_locs].view(torch.uint8), replica.get_key_buffer(1)[LOGICAL_LOCS].view(torch.uint8)
            ))
            with self.assertRaisesRegex(RuntimeError, "layer 0"):
                runtime.pool.get_key_buffer(0)

            lens = torch.tensor([SEQ_LEN])
            scratch_pages = plan.remap_pages(torch.tensor([PAGES]))
            k, s = runtime.pool.get_index_k_scale_buffer(1, lens, scratch_pages, SEQ_LEN, SEQ_LEN)
            k_ref, s_ref = replica.get_index_k_scale_buffer(1, lens, torch.tensor([PAGES]), SEQ_LEN, SEQ_LEN)
            self.assertTrue(torch.equal(k, k_ref) and torch.equal(s, s_ref))
            self.assertGreater(int(k.count_nonzero()), 0)
            index_buffer = runtime.pool.get_index_k_with_scale_buffer(layer_id=1)
            self.assertEqual(index_buffer.data_ptr(), runtime.scratch.index_k_with_scale_buffer[0].data_ptr())
            # Pools no runtime serves read their own buffers.
            self.assertEqual(replica.get_key_buffer(1).data_ptr(), replica.kv_buffer[1].data_ptr())


class TestUnservedReadersRefused(CustomTestCase):
    def test_continuous_index_reads_and_mla_gathers_refused_on_a_served_pool(self):
        runtime = _runtime()
        with _hooks():
            for call in (
                lambda: runtime.pool.get_index_k_continuous(0, 64, torch.tensor([1])),
                lambda: runtime.pool.get_index_k_scale_continuous(0, 64, torch.tensor([1])),
                lambda: runtime.pool.get_mla_kv_buffer(SimpleNamespace(layer_id=0), torch.tensor([64])),
            ):
                with self.assertRaisesRegex(ValueError, "enable-nsa-prefill-cp-shared-kv"):
                    call()
        refuse = peer_page_reads.refuse_when_served("get_index_k_continuous")
        self.assertEqual(refuse(lambda pool, *args: "original", object(), 0), "original")

    def test_cuda_graph_capture_and_replay_refused(self):
        with _hooks():
            for method in (
                NativeSparseAttnBackend.init_forward_metadata_capture_cuda_graph,
                NativeSparseAttnBackend.init_forward_metadata_replay_cuda_graph,
            ):
                with self.assertRaisesRegex(ValueError, "--disable-cuda-graph"):
                    method(object(), 1, 1, None, None, None, None, None)


if __name__ == "__main__":
    unittest.main()
