"""fp8 NSA KV host rows must be as wide as the device rows, or load-back corrupts every KV row."""

import unittest

import torch

from sglang_cp_shared_kv_testing import sgl_kernel_cpu_shim

sgl_kernel_cpu_shim.install()

from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler  # noqa: E402
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402
from sglang.test.test_utils import CustomTestCase  # noqa: E402

from sglang_cp_shared_kv.mem_cache import nsa_host_kv_row_width  # noqa: E402
from sglang_cp_shared_kv_testing.cp_hicache_stack import (  # noqa: E402
    HiCacheServerArgs,
    unpinned_host_pools,
)
from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks  # noqa: E402

register_cpu_ci(est_time=15, suite="stage-a-test-cpu")

# GLM-5 / DeepSeek-V3.2 fp8 NSA rows: 512 fp8 nope values + 16 B of scales + 64 bf16 rope values.
FP8_ROW_BYTES = 656
BF16_ROW_ELEMS = 512 + 64


def nsa_pool(dtype, kv_cache_dim):
    return NSATokenToKVPool(
        size=2 * 64,
        page_size=64,
        kv_lora_rank=512,
        dtype=dtype,
        qk_rope_head_dim=64,
        layer_num=1,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=kv_cache_dim,
    )


def host_row_bytes(kv_pool):
    with unpinned_host_pools():  # no CUDA here to register pinned memory with
        host = hybrid_pool_assembler.build_kv_host_pool(
            kv_pool=kv_pool,
            page_size=64,
            server_args=HiCacheServerArgs(hicache_ratio=1.0, hicache_mem_layout="layer_first"),
            use_mla=True,
        )
    return host.kv_cache_dim * host.dtype.itemsize


def device_row_bytes(kv_pool):
    row = kv_pool.kv_buffer[0][0]
    return row.numel() * row.element_size()


class TestNsaHostKvRowWidth(CustomTestCase):
    def setUp(self):
        self.fp8 = nsa_pool(torch.float8_e4m3fn, FP8_ROW_BYTES)
        self.bf16 = nsa_pool(torch.bfloat16, BF16_ROW_ELEMS)

    def test_stock_assembler_builds_fp8_host_rows_too_narrow(self):
        self.assertEqual(device_row_bytes(self.fp8), FP8_ROW_BYTES)
        self.assertEqual(host_row_bytes(self.fp8), BF16_ROW_ELEMS)  # 576 < 656: the stock bug

    def test_hooked_assembler_builds_host_rows_as_wide_as_device_rows(self):
        with applied_hooks(nsa_host_kv_row_width.register_hooks):
            self.assertEqual(host_row_bytes(self.fp8), FP8_ROW_BYTES)
            # bf16 is unchanged: its rows were already right.
            self.assertEqual(host_row_bytes(self.bf16), device_row_bytes(self.bf16))
        # Leaving the block restores the stock assembler.
        self.assertEqual(host_row_bytes(self.fp8), BF16_ROW_ELEMS)


if __name__ == "__main__":
    unittest.main()
