"""The one-GPU capacity sweep (``bench_serving_runs.sh both capacity-sweep``): its table across CP sizes,
and the fake server's pools with per-owner decode, which the sweep's dry run serves.

What a user depends on: the table's on / off ratio is the logical capacity shared KV gives at each CP
size with pools sized by memory, a row is FAILED when a server's ranks disagree on their pool or a
CP size never reported, and the benchmark's own verdict (logical = cp x physical, physical = stock's
less the scratch's share) carries into the sweep.

Planted and caught (each reverted): ``capacity_row`` ignoring a second pool size (ranks disagreeing
then passed); ``main`` skipping a missing results file silently (a CP size killed by the budget then
read as PASSED); the fake server reserving slot 0 for the logical capacity under per-owner decode
(its tiny-model pool at CP 8 then came out negative, and the sweep's dry run failed).
"""

import io
import json
import os
import tempfile
import unittest
from contextlib import redirect_stdout
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv_testing.e2e import capacity_sweep

register_cpu_ci(est_time=5, suite="stage-a-test-cpu")


def results(tp, off_physical, on_physical, failures=()):
    return {
        "setup": {"tp": tp},
        "capacity": {
            "off": {"logical_device_tokens_per_cp_group": off_physical[0] if off_physical else None,
                    "physical_device_tokens_per_rank": off_physical},
            "on": {"logical_device_tokens_per_cp_group": tp * on_physical[0] if on_physical else None,
                   "physical_device_tokens_per_rank": on_physical},
            "failures": list(failures),
        },
    }  # fmt: skip


class TestCapacityTable(CustomTestCase):
    def test_rows_and_ratio(self):
        row = capacity_sweep.capacity_row(results(4, [100_000], [90_000]))
        self.assertEqual((row.cp_size, row.off_logical_tokens, row.on_logical_tokens), (4, 100_000, 360_000))
        self.assertEqual(row.ratio, 3.6)
        self.assertEqual(row.failures, [])
        lines = capacity_sweep.table([row, capacity_sweep.capacity_row(results(2, [100_000], [95_000]))], "one GPU")
        self.assertIn("one GPU", lines[0])
        self.assertEqual(lines[4], "| 2 | 100,000 | 190,000 | 1.90 | 100000 / 95000 | yes |")
        self.assertEqual(lines[5], "| 4 | 100,000 | 360,000 | 3.60 | 100000 / 90000 | yes |")

    def test_ranks_that_disagree_fail(self):
        row = capacity_sweep.capacity_row(results(8, [100_000], [90_000, 89_984]))
        self.assertEqual(len(row.failures), 1)
        self.assertIn("shared KV on", row.failures[0])
        self.assertIn("| NO |", capacity_sweep.table([row], "x")[-1])

    def test_a_server_that_never_reported_and_the_benchmarks_verdict_fail(self):
        row = capacity_sweep.capacity_row(results(2, [100_000], []))
        self.assertTrue(any("no logical capacity" in f for f in row.failures), row.failures)
        row = capacity_sweep.capacity_row(results(2, [100_000], [95_000], ["physical pool per rank is ..."]))
        self.assertEqual(row.failures, ["physical pool per rank is ..."])

    def test_main_fails_on_a_missing_cp_size(self):
        with tempfile.TemporaryDirectory() as tmp:
            good = Path(tmp) / "cp2.json"
            good.write_text(json.dumps(results(2, [100_000], [95_000])))
            out = io.StringIO()
            with redirect_stdout(out):
                self.assertEqual(capacity_sweep.main([str(good)]), 0)
                self.assertEqual(capacity_sweep.main([str(good), str(Path(tmp) / "cp8.json")]), 1)
        self.assertIn("capacity sweep: PASSED (1 CP sizes)", out.getvalue())
        self.assertIn("cp8.json: no results", out.getvalue())


class TestFakeServerPerOwnerPools(CustomTestCase):
    def test_per_owner_decode_reserves_one_prefill_batch(self):
        """The tiny model (4 layers) at CP 8: a logical-capacity slot 0 takes the whole budget; a
        prefill-sized one (context + one chunk) leaves a pool, and the fake logs its size as the
        runtime does, so the benchmark judges the pool against that reservation."""
        from sglang_cp_shared_kv.settings import DECODE_PATH_ENV, GATHER, PER_OWNER
        from sglang_cp_shared_kv_testing.e2e import fake_sglang_server as fake
        from sglang_cp_shared_kv_testing.e2e.server_log import parse_capacity_lines

        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "max_position_embeddings": 4096}))
            args = SimpleNamespace(model_path=tmp, kv_cache_dtype="auto", max_total_tokens=1 << 30, chunked_prefill_size=8192)
            with mock.patch.dict(os.environ, {DECODE_PATH_ENV: GATHER}):
                gather_rows, gather_slot0 = fake.physical_pool_tokens(args, 8)
            with mock.patch.dict(os.environ, {DECODE_PATH_ENV: PER_OWNER}):
                owner_rows, owner_slot0 = fake.physical_pool_tokens(args, 8)
            with mock.patch.dict(os.environ):  # the default (auto) decodes per owner with bf16 KV (fa3)
                os.environ.pop(DECODE_PATH_ENV, None)
                self.assertEqual(fake.physical_pool_tokens(args, 8), (owner_rows, owner_slot0))
        self.assertLessEqual(gather_rows, 0)
        self.assertEqual(owner_slot0, 4096 + 8192)
        self.assertGreater(owner_rows, 0)
        line = f"[2026-12-02 10:00:00 TP3] CP shared KV gather scratch slot 0: {owner_slot0} logical tokens x 1 layer (0.00 GB)"
        self.assertEqual(parse_capacity_lines([line]).scratch_slot0_tokens, {3: owner_slot0})


if __name__ == "__main__":
    unittest.main()
