"""CP shared KV runtime across real processes: shards + gather reproduce a replicated pool bit-exactly.

2 and 4 ranks joined by a gloo group each hold a CPU ``NSATokenToKVPool`` shard, run sglang's own
stores with our hooks (Triton kernels swapped for torch) through prefill, chunked prefill on a
cached prefix, and decode, and compare every read and every stored row with a replicated pool
(``sglang_cp_shared_kv.testing.runtime_check``).
"""

import unittest

import torch.distributed as dist

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.testing import runtime_check
from sglang_cp_shared_kv.testing.multi_rank import run_ranks
from sglang_cp_shared_kv.testing.nsa_cpu_kernels import act_quant_torch, cpu_kernels

register_cpu_ci(est_time=40, suite="stage-a-test-cpu")

TIMEOUT_S = 120


def _rank(rank, world_size, dtype_name):
    runtime_check.apply_hooks()  # this rank's process only
    with cpu_kernels():
        result = runtime_check.run_rank(
            rank, world_size, dist.group.WORLD, device="cpu", dtype_name=dtype_name,
            act_quant=act_quant_torch, seed=world_size,
        )
    return rank, result.rows_compared, result.mismatches


class TestRuntimeAcrossRanks(CustomTestCase):
    def _run_group(self, world_size, dtype_name):
        # Ranks fork from a server that imported sglang and this check once.
        rows = run_ranks(
            _rank,
            world_size,
            (dtype_name,),
            start_method="forkserver",
            preload=[runtime_check.__name__],
            timeout_s=TIMEOUT_S,
            deadline_s=TIMEOUT_S,
        )
        self.assertEqual([r[0] for r in rows], list(range(world_size)))
        compared = {r[1] for r in rows}
        self.assertEqual(len(compared), 1)  # every rank checked the same reads
        self.assertGreater(compared.pop(), 1000)
        self.assertEqual([r[2] for r in rows], [0] * world_size)

    def test_two_ranks_bf16(self):
        self._run_group(2, "bf16")

    def test_two_ranks_fp8(self):
        self._run_group(2, "fp8")

    def test_four_ranks_fp8(self):
        self._run_group(4, "fp8")


if __name__ == "__main__":
    unittest.main()
