"""CP shared KV runtime across real processes: shards + gather reproduce a replicated pool bit-exactly.

2 and 4 ranks joined by a gloo group each hold a CPU ``NSATokenToKVPool`` shard, run sglang's own
stores with our hooks (Triton kernels swapped for torch) through prefill, chunked prefill on a
cached prefix, and decode, and compare every read and every stored row with a replicated pool
(``sglang_cp_shared_kv.testing.runtime_check``).
"""

import multiprocessing
import os
import tempfile
import unittest

import torch
import torch.distributed as dist

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.testing import runtime_check
from sglang_cp_shared_kv.testing.nsa_cpu_kernels import act_quant_torch, cpu_kernels

register_cpu_ci(est_time=40, suite="stage-a-test-cpu")

TIMEOUT_S = 120


def _rank_main(rank, world_size, init_file, dtype_name, results):
    torch.set_num_threads(1)
    # A group of our own, not the default one: the forked parent may hold a default group already.
    group = dist.ProcessGroupGloo(dist.FileStore(init_file, world_size), rank, world_size)
    runtime_check.apply_hooks()  # this process only (forked child)
    with cpu_kernels():
        result = runtime_check.run_rank(
            rank, world_size, group, device="cpu", dtype_name=dtype_name,
            act_quant=act_quant_torch, seed=world_size,
        )
    results.put((rank, result.rows_compared, result.mismatches))


class TestRuntimeAcrossRanks(CustomTestCase):
    def _run_group(self, world_size, dtype_name):
        # fork: children inherit the imported sglang modules instead of importing them again.
        context = multiprocessing.get_context("fork")
        results = context.SimpleQueue()
        with tempfile.TemporaryDirectory() as tmp:
            init_file = os.path.join(tmp, "gloo_init")
            ranks = [
                context.Process(target=_rank_main, args=(r, world_size, init_file, dtype_name, results))
                for r in range(world_size)
            ]
            for process in ranks:
                process.start()
            for process in ranks:
                process.join(TIMEOUT_S)
            for process in ranks:
                if process.is_alive():
                    process.kill()
            self.assertEqual([p.exitcode for p in ranks], [0] * world_size)
        rows = sorted(results.get() for _ in range(world_size))
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
