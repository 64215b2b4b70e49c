"""Per-owner decode through sglang's own decode methods, on 2 and 3 gloo ranks: the hooked
``get_indexer_metadata`` + ``Indexer._get_topk_paged`` + ``_forward_flashmla_kv`` give every rank the
output a replicated pool gives, without the gather scratch.

Each rank holds a real fp8 ``NSATokenToKVPool`` shard (cut from one replicated pool by the layout)
and runs: the backend's metadata hook (per-owner begin, no plan), the decode token's KV store
through the owner-filtered hook, sglang's paged indexer (deep_gemm replaced by its torch reference)
and sglang's ``_forward_flashmla_kv`` (FlashMLA replaced by its torch reference). The parent checks
every rank's output equals the others' and the replicated attention's (bf16 tolerance), that the
ranks' indices cover the replicated selection exactly once, and that the scratch stayed untouched.

Planted bugs, each made this test fail (then reverted): the attention hook returning the partial
without the merge; the indexer hook keeping the logical ``real_page_table``; ``serves_physical``
always False (getters demand the scratch: RuntimeError); ``attach`` ignoring SGLANG_NSA_FUSE_TOPK.
"""

import math
import sys
import types
import unittest
from types import SimpleNamespace
from unittest import mock

import torch

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.testing.multi_rank import run_ranks

register_cpu_ci(est_time=120, suite="stage-a-test-cpu")

HEADS, INDEX_HEADS, TOPK, PAGE = 64, 32, 128, 64
SEQ_LENS = [900, 128, 70, 400]  # one of exactly k, one shorter than k
SM_SCALE = 576**-0.5


def _case(cp_size, seed=7):
    """The replicated pool and queries, identical on every rank and in the parent."""
    from sglang_cp_shared_kv.testing import nsa_decode_reference as ref
    from sglang_cp_shared_kv.testing.per_owner_decode_cases import random_batch

    g = torch.Generator().manual_seed(seed + cp_size)
    batch = random_batch(g, cp_size, PAGE, SEQ_LENS)
    rows = batch.logical_pages * PAGE
    kv = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
    new_kv = torch.randn(len(SEQ_LENS), 576, generator=g).to(torch.bfloat16)  # the decode tokens
    last_locs = batch.token_locs().gather(1, (batch.seq_lens - 1)[:, None]).reshape(-1)
    kv[last_locs] = new_kv
    index_k = torch.randn(rows, 128, generator=g).to(torch.float8_e4m3fn)
    index_scale = torch.rand(rows, generator=g) + 0.5
    q_index = torch.randn(len(SEQ_LENS), INDEX_HEADS, 128, generator=g).to(torch.float8_e4m3fn)
    weights = torch.rand(len(SEQ_LENS), INDEX_HEADS, generator=g) * 0.1
    q = (torch.randn(len(SEQ_LENS), HEADS, 576, generator=g) * 3.0).to(torch.bfloat16)
    return SimpleNamespace(
        batch=batch,
        kv_rows=ref.fp8_kv_rows(kv),
        new_kv=new_kv,
        last_locs=last_locs,
        index_pages=ref.index_pages(index_k, index_scale, PAGE),
        q_index=q_index,
        weights=weights,
        q=q,
    )


def _fake_kernels():
    """deep_gemm for the indexer and sgl_kernel.flash_mla for attention, as torch references."""
    from sglang_cp_shared_kv.testing import nsa_decode_reference as ref
    from sglang_cp_shared_kv.testing import sgl_kernel_cpu_shim

    def fp8_paged_mqa_logits(q, kv_cache, weights, lens, block_table, schedule, max_len, clean_logits):
        pages = kv_cache.reshape(kv_cache.shape[0], -1)
        return ref.paged_mqa_logits_reference(q[:, 0], weights, pages, block_table, lens, PAGE)

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits, softmax_scale, indices, is_fp8_kvcache, **_):
        rows = ref.kv_rows_as_float(k_cache.view(torch.uint8).reshape(-1, k_cache.shape[-1]))
        out, lse = ref.sparse_mla_decode_reference(q[:, 0].float(), rows, indices[:, 0], softmax_scale, head_dim_v)
        return out.to(q.dtype)[:, None], lse[:, :, None]

    sgl_kernel_cpu_shim.install()
    flash_mla = types.ModuleType("sgl_kernel.flash_mla")
    flash_mla.flash_mla_with_kvcache = flash_mla_with_kvcache
    sys.modules["sgl_kernel.flash_mla"] = flash_mla
    sys.modules["sgl_kernel"].flash_mla = flash_mla
    return SimpleNamespace(fp8_paged_mqa_logits=fp8_paged_mqa_logits)


def _rank(rank, world_size, _unused):
    from sglang.srt.layers.attention.nsa import nsa_indexer
    from sglang.srt.layers.attention.nsa_backend import (
        NativeSparseAttnBackend,
        NSAFlashMLAMetadata,
        NSAMetadata,
    )
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang_cp_shared_kv.model_executor import (
        owner_filtered_writes,
        peer_page_reads,
        per_owner_decode,
    )
    from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import CpSharedKVRuntime
    from sglang_cp_shared_kv.testing.hook_sandbox import applied_hooks
    from sglang_cp_shared_kv.testing.nsa_cpu_kernels import cpu_kernels
    from sglang_cp_shared_kv.testing.runtime_check import make_nsa_pool

    case = _case(world_size)
    batch = case.batch
    deep_gemm = _fake_kernels()
    layout = batch.layout(rank)
    with applied_hooks(
        owner_filtered_writes.register_hooks, peer_page_reads.register_hooks, per_owner_decode.register_hooks
    ), cpu_kernels(), mock.patch.object(nsa_indexer, "deep_gemm", deep_gemm, create=True):
        pool = make_nsa_pool((batch.physical_pages - 1) * PAGE, "fp8", 1, "cpu")
        scratch = make_nsa_pool(world_size * (batch.physical_pages - 1) * PAGE, "fp8", 1, "cpu")
        shard_rows = batch.shard_rows(rank)
        pool.kv_buffer[0].view(torch.uint8)[: shard_rows.numel(), 0] = case.kv_rows[shard_rows]
        own_last = layout.owned_by_this_rank(case.last_locs)
        physical_last = layout.physical_locs_or_dummy(case.last_locs)[own_last]
        pool.kv_buffer[0].view(torch.uint8)[physical_last.long()] = 0  # the decode store must write them
        pages = layout.logical_page_of(torch.arange(batch.physical_pages))
        pool.index_k_with_scale_buffer[0][: batch.physical_pages] = case.index_pages[pages]
        runtime = CpSharedKVRuntime(pool, layout, scratch, torch.distributed.group.WORLD)
        assert per_owner_decode.attach(runtime, "flashmla_kv") is not None

        seq_lens = batch.seq_lens.to(torch.int32)
        backend = object.__new__(NativeSparseAttnBackend)
        backend.nsa_kv_cache_store_fp8, backend.nsa_prefill_impl = True, "flashmla_kv"
        backend.flashmla_kv_num_q_heads, backend.real_page_size = HEADS, PAGE
        backend.kv_cache_dim, backend.nsa_index_topk = 656, TOPK
        zeros = torch.zeros(1, dtype=torch.int32)
        backend.forward_metadata = NSAMetadata(
            page_size=PAGE, cache_seqlens_int32=seq_lens, max_seq_len_q=1,
            max_seq_len_k=int(seq_lens.max()), cu_seqlens_q=zeros, cu_seqlens_k=zeros,
            page_table_1=batch.token_locs().to(torch.int32), real_page_table=batch.page_table,
            nsa_cache_seqlens_int32=seq_lens.clamp(max=TOPK), nsa_cu_seqlens_q=zeros,
            nsa_cu_seqlens_k=zeros, nsa_extend_seq_lens_list=[1] * len(SEQ_LENS),
            nsa_seqlens_expanded=seq_lens,
            flashmla_metadata=NSAFlashMLAMetadata(zeros, zeros),
        )
        forward_batch = SimpleNamespace(
            forward_mode=ForwardMode.DECODE, token_to_kv_pool=pool, hisparse_coordinator=None,
            out_cache_loc=case.last_locs,
        )
        peer_page_reads.remap_forward_metadata(None, backend, forward_batch)
        assert runtime.plan is None
        layer = SimpleNamespace(layer_id=0, tp_q_head_num=HEADS, head_dim=576)
        pool.set_mla_kv_buffer(layer, case.last_locs, case.new_kv[:, None, :512], case.new_kv[:, None, 512:])
        metadata = backend.get_indexer_metadata(0, forward_batch)
        indexer = object.__new__(nsa_indexer.Indexer)
        indexer.index_topk = TOPK
        indices = nsa_indexer.Indexer._get_topk_paged(
            indexer, forward_batch, 0, case.q_index, case.weights[:, :, None], metadata
        )
        kv_cache = pool.get_key_buffer(0)
        out = backend._forward_flashmla_kv(
            q_all=case.q, kv_cache=kv_cache, v_head_dim=512, sm_scale=SM_SCALE, layer=layer,
            metadata=backend.forward_metadata, page_table_1=indices,
        )
        scratch_untouched = not scratch.kv_buffer[0].view(torch.uint8).any().item()
        stored = bool(torch.equal(
            pool.kv_buffer[0].view(torch.uint8)[physical_last.long(), 0], case.kv_rows[case.last_locs[own_last]]
        ))
    return out, indices, scratch_untouched, stored


class TestPerOwnerDecodeGloo(CustomTestCase):
    def test_every_rank_gets_the_replicated_output(self):
        from sglang_cp_shared_kv.model_executor.decode_topk_merge import replicated_topk_positions
        from sglang_cp_shared_kv.testing import nsa_decode_reference as ref

        for cp_size in (2, 3):
            case = _case(cp_size)
            batch = case.batch
            logits = ref.paged_mqa_logits_reference(
                case.q_index, case.weights, case.index_pages, batch.page_table, batch.seq_lens, PAGE
            )
            positions = replicated_topk_positions(logits, batch.seq_lens, TOPK)
            locs = torch.where(positions >= 0, batch.token_locs().gather(1, positions.clamp(min=0).long()), -1)
            expected, _ = ref.sparse_mla_decode_reference(
                case.q.float(), ref.kv_rows_as_float(case.kv_rows), locs, SM_SCALE
            )
            results = run_ranks(_rank, cp_size, (None,))
            with self.subTest(cp_size=cp_size):
                first = results[0][0]
                self.assertEqual(tuple(first.shape), (len(SEQ_LENS), 1, HEADS, 512))
                for out, _, scratch_untouched, stored in results:
                    self.assertTrue(torch.equal(out, first))
                    self.assertTrue(scratch_untouched)
                    self.assertTrue(stored)
                torch.testing.assert_close(first[:, 0].float(), expected, rtol=2e-2, atol=2e-2)
                covered = []
                for rank, (_, indices, _, _) in enumerate(results):
                    rows = indices[indices >= 0].long()
                    covered += batch.shard_rows(rank)[rows].tolist()
                self.assertEqual(sorted(covered), sorted(locs[locs >= 0].tolist()))


class TestPerOwnerDecodeStartup(CustomTestCase):
    def _runtime(self):
        from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
        from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import CpSharedKVRuntime
        from sglang_cp_shared_kv.testing.multi_rank import single_process_group
        from sglang_cp_shared_kv.testing.runtime_check import make_nsa_pool

        pool = make_nsa_pool(2 * PAGE, "fp8", 1, "cpu")
        scratch = make_nsa_pool(2 * PAGE, "fp8", 1, "cpu")
        return CpSharedKVRuntime(pool, CpSharedKVLayout(1, 0, PAGE), scratch, single_process_group())

    def test_attaches_only_for_flashmla_kv_with_fused_top_k(self):
        from sglang.srt.environ import envs
        from sglang_cp_shared_kv.model_executor import per_owner_decode

        runtime = self._runtime()
        self.assertIsNone(per_owner_decode.attach(runtime, "fa3"))
        self.assertIsNone(per_owner_decode.per_owner_of(runtime.pool))
        with envs.SGLANG_NSA_FUSE_TOPK.override(False):
            self.assertIsNone(per_owner_decode.attach(runtime, "flashmla_kv"))
        state = per_owner_decode.attach(runtime, "flashmla_kv")
        self.assertIs(per_owner_decode.per_owner_of(runtime.pool), state)
        self.assertFalse(per_owner_decode.serves_physical(runtime))  # no decode forward begun

    def test_every_target_resolves_in_sglang(self):
        import pkgutil

        from sglang_cp_shared_kv.model_executor import per_owner_decode

        registered = []
        registry = SimpleNamespace(register=lambda target, hook, kind: registered.append(target))
        per_owner_decode.register_hooks(registry)
        for target in registered:
            owner, name = target.rsplit(".", 1)
            self.assertTrue(callable(getattr(pkgutil.resolve_name(owner), name)), target)


if __name__ == "__main__":
    unittest.main()
