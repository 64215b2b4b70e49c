"""The graph check's CUDA kernels (``cuda_kernels`` in scripts/gpu/check_per_owner_decode_graphs.py)
call deep_gemm, FlashMLA and fa3 as sglang's NSA backend does, for every decode impl: run on the CPU
against stand-ins that assert what the real kernels require (the shapes and dtypes of
``_forward_flashmla_kv``, ``_forward_flashmla_sparse`` and ``_forward_fa3``'s calls: indices int32
[B, 1, k] for FlashMLA, fa3's page-size-1 views, ``cache_seqlens`` the count of the owned indices
compacted to the front) and then answer with the torch references; both batches must pass. Where
fa3 does not run its cases are skipped with the reason, not run on a reference.

The GPU run is one shot; this is what runs those code paths before it. Planted (then reverted),
each failed this test: ``flash_mla_sparse_fwd`` given indices [B, k]; fa3 given the owned indices
in place (-1 between them)."""

import sys
import types
import unittest
from unittest import mock

import torch
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv_testing import nsa_decode_reference as ref
from sglang_cp_shared_kv_testing import per_owner_decode_hooked as hooked
from sglang_cp_shared_kv_testing.repo_scripts import load_script

register_cpu_ci(est_time=60, suite="stage-a-test-cpu")

HEADS, TOPK, PAGE = 64, 2048, 64


def _int32(t, shape=None):
    assert t.dtype == torch.int32, t.dtype
    assert shape is None or tuple(t.shape) == tuple(shape), (tuple(t.shape), shape)


def fake_deep_gemm(calls):
    module = types.ModuleType("deep_gemm")
    module.get_num_sms = lambda: 132

    def get_paged_mqa_logits_metadata(lens, page_size, num_sms):
        _int32(lens)
        assert page_size == PAGE
        return torch.zeros(num_sms + 1, 2, dtype=torch.int32)

    def fp8_paged_mqa_logits(q, kv, weights, lens, block_table, schedule, max_len, clean_logits):
        assert q.dtype == torch.float8_e4m3fn and q.shape[1] == 1
        assert kv.dtype == torch.uint8 and tuple(kv.shape[1:]) == (PAGE, 1, 132)
        _int32(lens)
        _int32(block_table)
        assert block_table.is_contiguous() and max_len == block_table.shape[1] * PAGE and schedule is not None
        calls.append("deep_gemm")
        return ref.paged_mqa_logits_reference(q[:, 0], weights, kv.reshape(kv.shape[0], -1), block_table, lens, PAGE)

    module.get_paged_mqa_logits_metadata = get_paged_mqa_logits_metadata
    module.fp8_paged_mqa_logits = fp8_paged_mqa_logits
    return module


def fake_flash_mla(calls):
    reference = hooked._reference_flash_mla()
    module = types.ModuleType("sgl_kernel.flash_mla")

    def get_mla_metadata(cache_seqlens, q_heads, q_len, k_heads, is_fp8, topk):
        _int32(cache_seqlens)
        return torch.zeros(8, 16, dtype=torch.int32), torch.zeros(cache_seqlens.shape[0] + 1, dtype=torch.int32)

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits, softmax_scale, indices, is_fp8_kvcache):
        batch = q.shape[0]
        assert q.dtype == torch.bfloat16 and tuple(q.shape[1:]) == (1, HEADS, 576)
        assert k_cache.dtype == torch.float8_e4m3fn and tuple(k_cache.shape[1:]) == (PAGE, 1, 656)
        _int32(block_table, (batch, 0))
        _int32(cache_seqlens, (batch,))
        _int32(indices, (batch, 1, TOPK))
        assert is_fp8_kvcache and head_dim_v == 512
        calls.append("flash_mla_with_kvcache")
        return reference.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
                                                tile_scheduler_metadata, num_splits, softmax_scale,
                                                indices, is_fp8_kvcache)

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v):
        tokens = q.shape[0]
        assert q.dtype == torch.bfloat16 and tuple(q.shape[1:]) == (HEADS, 576) and q.is_contiguous()
        assert kv.dtype == torch.bfloat16 and tuple(kv.shape[1:]) == (1, 576) and kv.is_contiguous()
        _int32(indices, (tokens, 1, TOPK))
        assert d_v == 512
        calls.append("flash_mla_sparse_fwd")
        return ref.flash_mla_sparse_fwd_reference(q, kv, indices, sm_scale, d_v)

    module.get_mla_metadata = get_mla_metadata
    module.flash_mla_with_kvcache = flash_mla_with_kvcache
    module.flash_mla_sparse_fwd = flash_mla_sparse_fwd
    return module


def fake_fa3(calls):
    def flash_attn_with_kvcache(q, k_cache, v_cache, qv, page_table, cache_seqlens, cu_seqlens_q,
                                cu_seqlens_k_new, max_seqlen_q, softmax_scale, causal, return_softmax_lse):
        tokens = q.shape[0]
        assert tuple(q.shape[1:]) == (HEADS, 64) and tuple(qv.shape[1:]) == (HEADS, 512)
        assert tuple(k_cache.shape[1:]) == (1, 1, 64) and tuple(v_cache.shape[1:]) == (1, 1, 512)
        assert k_cache.dtype == v_cache.dtype == torch.bfloat16
        assert all(t.stride(-1) == 1 for t in (q, qv, k_cache, v_cache))
        _int32(page_table, (tokens, TOPK))
        _int32(cache_seqlens, (tokens,))
        _int32(cu_seqlens_q, (tokens + 1,))
        _int32(cu_seqlens_k_new, (tokens + 1,))
        assert max_seqlen_q == 1 and causal and return_softmax_lse
        # fa3 reads the first cache_seqlens entries and does not skip -1: exactly those are valid
        column = torch.arange(page_table.shape[1])[None, :]
        assert bool(((page_table >= 0) == (column < cache_seqlens[:, None])).all()), "not compacted"
        calls.append("fa3")
        return ref.fa3_paged_decode_reference(
            q, k_cache, v_cache, qv=qv, page_table=page_table, cache_seqlens=cache_seqlens,
            cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale,
            causal=causal, return_softmax_lse=True,
        )

    return flash_attn_with_kvcache


class TestGraphCheckCudaKernelCalls(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.check = load_script("scripts/gpu/check_per_owner_decode_graphs.py")

    def _kernels(self, calls, fa3_problem=None):
        from sglang.srt.layers.attention import nsa_backend

        flash_mla = fake_flash_mla(calls)
        sgl_kernel = types.ModuleType("sgl_kernel")
        sgl_kernel.flash_mla = flash_mla
        modules = {"deep_gemm": fake_deep_gemm(calls), "sgl_kernel": sgl_kernel, "sgl_kernel.flash_mla": flash_mla}
        with mock.patch.dict(sys.modules, modules), \
                mock.patch.object(hooked, "real_fa3_problem", lambda device: fa3_problem):
            kernels = self.check.cuda_kernels()
        # fa3 is looked up at call time, as the backend's module attribute
        patcher = mock.patch.object(nsa_backend, "flash_attn_with_kvcache", fake_fa3(calls))
        patcher.start()
        self.addCleanup(patcher.stop)
        return kernels

    def test_every_impl_calls_its_kernel_as_sglang_does_and_passes(self):
        calls = []
        kernels = self._kernels(calls)
        self.assertEqual(sorted(kernels.attention), ["fa3", "flashmla_kv", "flashmla_sparse"])
        self.assertEqual(kernels.skipped, {})
        args = self.check.parse_args(["--device", "cpu", "--cp-sizes", "2"])
        for impl, kernel in (("flashmla_kv", "flash_mla_with_kvcache"),
                             ("flashmla_sparse", "flash_mla_sparse_fwd"), ("fa3", "fa3")):
            calls.clear()
            with self.subTest(impl=impl):
                self.assertEqual(self.check.run_cp(args, 2, kernels, impl), [True, True])
                self.assertIn(kernel, calls)
                self.assertIn("deep_gemm", calls)

    def test_fa3_is_skipped_with_the_reason_where_it_does_not_run(self):
        kernels = self._kernels([], fa3_problem="ImportError('no fa3')")
        self.assertEqual(sorted(kernels.attention), ["flashmla_kv", "flashmla_sparse"])
        self.assertEqual(kernels.skipped, {"fa3": "fa3 does not run here: ImportError('no fa3')"})


if __name__ == "__main__":
    unittest.main()
