"""scripts/gpu/check_per_owner_decode_graphs.py on the CPU (torch references; a "capture" records the
layer's ops after a warm-up and a "replay" re-runs them on the same tensors, ``cpu_graph_recorder``,
as a CUDA graph would), for every decode impl it captures (flashmla_kv over fp8
KV; flashmla_sparse with its base-2 LSE and fa3 over the compacted owned indices, both over bf16
KV), in both merge forms (one exchange, the scaled sum): it passes on both batches, the one
exchange within the fresh-table tolerance of the scaled sum, and its stale-buffer plant (rank 1's
owner tables not refreshed before the second batch) fails the second batch only. Its summary counts
skipped impls and a run that checked nothing does not pass.

The script is only run on a lent GPU, so this is what notices when a change breaks it, or when it
stops catching the bug it exists to catch. Planted in the emulation (then reverted), each failed
this test: flashmla_sparse's LSE read as natural log; fa3 given the owned indices in place (-1
between them) with their count as ``cache_seqlens``."""

import contextlib
import io
import unittest
from unittest import mock

import torch

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv_testing.per_owner_decode_graph_emulation import reference_kernels
from sglang_cp_shared_kv_testing.repo_scripts import load_script

register_cpu_ci(est_time=160, suite="stage-a-test-cpu")

IMPLS = ("flashmla_kv", "flashmla_sparse", "fa3")


class TestCheckPerOwnerDecodeGraphsOnCpu(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.check = load_script("scripts/gpu/check_per_owner_decode_graphs.py")

    def _run(self, impl, plant="none", padded_rows=1, merge_form="all_gather"):
        args = self.check.parse_args(["--device", "cpu", "--cp-sizes", "2", "--plant", plant,
                                      "--padded-rows", str(padded_rows)])  # fmt: skip
        return self.check.run_cp(args, 2, reference_kernels(), impl, merge_form)

    def test_both_batches_pass_for_every_impl(self):
        self.assertEqual(self.check.parse_args([]).decode_impls, list(IMPLS))
        self.assertEqual(self.check.parse_args([]).merge_forms, ["all_gather", "scaled_sum"])
        for impl in IMPLS:
            with self.subTest(impl=impl):
                self.assertEqual(self._run(impl), [True, True])
        self.assertEqual(self._run("fa3", merge_form="scaled_sum"), [True, True])

    def test_the_one_exchange_replay_is_held_to_the_scaled_sum(self):
        """Planted: the one exchange's gathered LSEs read from the last two partial values (the
        packed buffer misread): the recorded replays fail on both batches, as does the comparison
        with the scaled sum (today's merge)."""
        from sglang_cp_shared_kv.model_executor.per_owner_decode import attention_lse_merge as merge

        def misread(gathered, dim):
            n, tokens, heads, _ = gathered.shape
            lses = gathered[..., dim - 2 : dim].contiguous().view(torch.float32).reshape(n, tokens, heads)
            return gathered[..., :dim], lses

        with mock.patch.object(merge, "unpack_gathered", misread):
            self.assertEqual(self._run("fa3"), [False, False])
            self.assertEqual(self._run("fa3", merge_form="scaled_sum"), [True, True])

    def test_several_padded_rows_pass_and_still_catch_stale_tables(self):
        """--padded-rows (the served crash replayed batch 6 in the graph of 8: two padded rows on
        every rank, owned by none): the layer stays right with 0 and 3 of them, and a stale table
        still fails with 3."""
        from sglang_cp_shared_kv_testing import per_owner_decode_graph_emulation as emu

        for padded_rows in (0, 3):
            with self.subTest(padded_rows=padded_rows), mock.patch.object(
                emu, "EmulatedDecodeLayer", wraps=emu.EmulatedDecodeLayer
            ) as layer:
                self.assertEqual(self._run("fa3", padded_rows=padded_rows), [True, True])
                bs = layer.call_args.args[3]  # the graph's batch: the real requests + the padded
                self.assertEqual(bs, len(self.check.SEQ_LENS_A) + padded_rows)
        self.assertEqual(self._run("flashmla_kv", "stale-tables", padded_rows=3), [True, False])
        with contextlib.redirect_stderr(io.StringIO()), self.assertRaises(SystemExit):
            self.check.parse_args(["--padded-rows", "-1"])

    def test_columns_carried_from_the_warm_up_fail_the_second_batch(self):
        """The served crash's cause (2026-12-03): the captured run reused the columns its warm-up
        derived, so no replay recomputed them. The recorded replay sees it (a re-run of the Python
        could not: it derives them again)."""
        from sglang_cp_shared_kv.model_executor.per_owner_decode.decode_forward import OwnerForward

        with mock.patch.object(OwnerForward, "begin_layer", lambda self, layer_id: None):
            self.assertEqual(self._run("fa3"), [True, False])

    def test_stale_tables_fail_the_second_batch(self):
        for impl in ("flashmla_kv", "fa3"):
            with self.subTest(impl=impl):
                self.assertEqual(self._run(impl, "stale-tables"), [True, False])

    def test_summary_counts_skipped_impls_and_nothing_checked_fails(self):
        from sglang_cp_shared_kv_testing import per_owner_decode_graph_emulation as emu

        def without_fa3(decode_impls):
            kernels = reference_kernels([i for i in decode_impls if i != "fa3"])
            kernels.skipped["fa3"] = "fa3 does not run here: test"
            return kernels

        base = ["--device", "cpu", "--cp-sizes", "2", "--hooked-cp-sizes", ""]
        # fa3 as where its kernel library is missing (the script takes its CPU kernels from here)
        with mock.patch.object(emu, "reference_kernels", without_fa3):
            for impls, code, summary in (
                ("flashmla_sparse,fa3", 0, "check: 4 passed, 0 failed, 1 impls skipped"),
                ("fa3", 1, "check: 0 passed, 0 failed, 1 impls skipped"),
            ):
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    self.assertEqual(self.check.main(base + ["--decode-impls", impls]), code)
                with self.subTest(impls=impls):
                    self.assertIn("SKIPPED fa3: fa3 does not run here: test", out.getvalue())
                    self.assertIn(summary, out.getvalue())
        self.assertEqual(self.check.main(base + ["--decode-impls", "flashmla_kv,tilelang"]), 2)
        self.assertEqual(self.check.main(base + ["--merge-forms", "all_gather,sum"]), 2)


if __name__ == "__main__":
    unittest.main()
