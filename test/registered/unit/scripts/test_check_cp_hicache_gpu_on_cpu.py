"""scripts/gpu/check_cp_hicache_gpu.py on the CPU: the GPU bit-exactness check must still pass on the
code it checks, and must fail when a load-back lands on the wrong physical rows.

The script is only run on a lent GPU, so nothing else notices when a change to the cache breaks it (it
once counted the writes a non-blocking ack had not applied yet as lost, and failed on correct code)."""

import argparse
import subprocess
import sys
import unittest
from pathlib import Path
from unittest import mock

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv_testing.repo_scripts import load_script

# Installs the CPU stand-in of sgl_kernel (sglang's host pools import it) before the controller.
from sglang_cp_shared_kv_testing import cp_hicache_stack  # noqa: F401  isort: skip
from sglang_cp_shared_kv.mem_cache.cp_hybrid_cache_controller import CpHybridCacheController  # isort: skip

register_cpu_ci(est_time=55, suite="stage-a-test-cpu")

REPO = Path(__file__).resolve().parents[4]
SCRIPT = REPO / "scripts" / "gpu" / "check_cp_hicache_gpu.py"


def load_check():
    return load_script("scripts/gpu/check_cp_hicache_gpu.py")


class TestCheckCpHicacheGpuOnCpu(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.check = load_check()

    def test_the_whole_check_passes_at_cp_2(self):
        # Two ranks in two processes, as on the GPU (the CPU runs the direct backend only); run as
        # the script, since its ranks import it by name.
        command = [sys.executable, str(SCRIPT), "--device", "cpu", "--cp-sizes", "2", "--kv-formats", "bf16"]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
        self.assertEqual(done.returncode, 0, done.stdout[-3000:] + done.stderr[-3000:])
        self.assertIn("check: 1 passed, 0 failed", done.stdout)

    def test_the_storage_leg_passes_at_cp_2_to_3(self):
        """--storage file: written by a CP 2 group, restored bit-exact by a CP 3 group (3 processes).
        Planted and seen to fail (then reverted): owner-blind writes (each rank storing its host
        pages as the node's leading pages) -> "[FAIL] ... restored [192, 192, 192] tokens". It also
        caught a real bug: concurrent CP ranks racing to create the file backend's directory."""
        command = [sys.executable, str(SCRIPT), "--device", "cpu", "--cp-sizes", "2", "--kv-formats",
                   "bf16", "--storage", "file"]  # fmt: skip
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
        self.assertEqual(done.returncode, 0, done.stdout[-3000:] + done.stderr[-3000:])
        self.assertIn("[PASS] L3 file: write cp=2 -> restore cp=3 bf16", done.stdout)
        self.assertIn("check: 1 passed, 0 failed", done.stdout)

    def test_storage_leg_options_are_checked(self):
        with self.assertRaises(SystemExit):  # the CPU shim cannot copy page-first layouts
            self.check.parse_args(["--device", "cpu", "--storage", "mooncake"])
        args = self.check.parse_args(["--device", "cpu", "--storage", "file", "--cp-sizes", "2", "4"])
        self.assertEqual(self.check.world_size(args), 5)
        self.assertEqual(self.check.group_sizes(args), [2, 3, 4, 5])
        args = self.check.parse_args(["--storage", "mooncake", "--kv-formats", "bf16", "--cp-sizes", "2"])
        self.assertEqual([layout for *_, layout in self.check.configurations(args)],
                         ["page_first", "page_first_direct"])  # fmt: skip

    def _rank0(self, cp_size: int, *options, plant=None):
        """Rank 0's numbers for one configuration, as a rank of a one-process group."""
        from sglang_cp_shared_kv_testing.multi_rank import single_process_group

        args = self.check.parse_args(["--device", "cpu", "--kv-formats", "bf16", *options])
        self.assertIsInstance(args, argparse.Namespace)
        return self.check.run_configuration(
            args, 0, single_process_group(), cp_size, "bf16", "direct", "layer_first", seed=5,
            plant=plant,
        )  # fmt: skip

    def test_with_a_draft_pool_its_bytes_come_back_too(self):
        result = self._rank0(2, "--draft")
        self.assertEqual(result["problems"], [])
        self.assertEqual(result["kv_bad"] + result["index_bad"], 0)
        self.assertEqual(result["draft_kv_bad"] + result["draft_index_bad"], 0)

    def test_each_draft_plant_is_caught_and_leaves_the_target_exact(self):
        for plant in self.check.DRAFT_PLANTS:
            with self.subTest(plant=plant):
                result = self._rank0(2, "--draft", "--draft-plants", plant=plant)
                self.assertGreater(result["draft_kv_bad"], 0)
                self.assertGreater(result["draft_index_bad"], 0)
                self.assertEqual(result["kv_bad"] + result["index_bad"], 0)

    def test_rank_sees_its_bytes_come_back(self):
        result = self._rank0(cp_size=2)
        self.assertEqual(result["problems"], [])
        self.assertGreater(result["owned"], 0)
        self.assertEqual(result["kv_bad"] + result["index_bad"], 0)

    def test_a_load_back_onto_the_next_physical_page_is_caught(self):
        original = CpHybridCacheController._physical_rows_on_device

        def next_page(controller, owned_logical_pages):
            return original(controller, owned_logical_pages) + controller.page_size

        with mock.patch.object(CpHybridCacheController, "_physical_rows_on_device", next_page):
            result = self._rank0(cp_size=2)
        self.assertGreater(result["kv_bad"], 0)
        self.assertGreater(result["index_bad"], 0)


if __name__ == "__main__":
    unittest.main()
