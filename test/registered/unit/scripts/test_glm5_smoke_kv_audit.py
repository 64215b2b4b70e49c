"""The smoke's oracle on CPU: per-token bytes of NSA pages, merging ranks' pool dumps, and the
comparison that must pass rounding noise and fail a page of another token."""

import sys
import tempfile
import unittest
from pathlib import Path

from types import SimpleNamespace

import numpy as np
import torch

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "scripts" / "smoke_plugin"))
from cp_shared_kv_smoke_hooks import kv_audit_compare  # noqa: E402
from cp_shared_kv_smoke_hooks.kv_audit import token_bytes, write_pool_dump  # noqa: E402

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

PAGE = 64
LAYERS = 2


def kv_rows(token_ids, positions, layers=LAYERS):
    """bf16 KV rows that depend on (token, position) only, as layer-0 KV does."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(256, 576, generator=g)
    rows = torch.stack([table[t] * (1 + 0.001 * p) for t, p in zip(token_ids, positions)])
    return torch.stack([rows] * layers, 1).to(torch.bfloat16).view(torch.uint8).numpy()


def index_rows(token_ids, layers=LAYERS):
    g = torch.Generator().manual_seed(1)
    table = torch.randn(256, 128, generator=g).to(torch.float8_e4m3fn).view(torch.uint8)
    scale = torch.ones(len(token_ids), 1, dtype=torch.float32).view(torch.uint8)
    rows = torch.cat([table[torch.tensor(token_ids)], scale], 1)
    return torch.stack([rows] * layers, 1).numpy()


def write_dump(run_dir, rid, rank, positions, token_ids, kv, index):
    write_pool_dump(run_dir, rid, rank, positions, token_ids, kv[positions], index[positions])


class TestSmokeKvAudit(CustomTestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        rng = np.random.default_rng(0)
        self.tokens = rng.integers(0, 256, 4 * PAGE).tolist()
        self.positions = np.arange(len(self.tokens))
        self.kv = kv_rows(self.tokens, self.positions)
        self.index = index_rows(self.tokens)
        self.ref = Path(self.tmp.name) / "ref"
        write_dump(self.ref, "r0", 0, self.positions, self.tokens, self.kv, self.index)

    def shared_run(self, kv=None, index=None, drop_last=False):
        """Two ranks, page p on rank p % 2, as shared KV stores it."""
        run = Path(self.tmp.name) / f"run{len(list(Path(self.tmp.name).iterdir()))}"
        kv = self.kv if kv is None else kv
        index = self.index if index is None else index
        for rank in (0, 1):
            mine = self.positions[(self.positions // PAGE) % 2 == rank]
            if drop_last and rank == 1:
                mine = mine[:-1]
            write_dump(run, "r0", rank, mine, self.tokens, kv, index)
        return run

    def test_token_bytes_reads_head_and_scale_of_a_slot(self):
        page = torch.arange(PAGE * 132, dtype=torch.int64).remainder(251).to(torch.uint8)
        got = token_bytes(page[None].repeat(2, 1), torch.tensor([0, 5]), PAGE, "index")
        expect_5 = torch.cat([page[5 * 128 : 6 * 128], page[PAGE * 128 + 20 : PAGE * 128 + 24]])
        self.assertTrue(torch.equal(got[1], expect_5))
        kv_page = torch.arange(PAGE * 8, dtype=torch.int64).to(torch.uint8)
        self.assertTrue(torch.equal(token_bytes(kv_page[None], torch.tensor([3]), PAGE, "kv")[0], kv_page[24:32]))

    def test_same_bytes_pass(self):
        result = kv_audit_compare.compare_runs(self.shared_run(), self.ref)
        self.assertEqual(result.failures, [])
        self.assertEqual(result.positions_compared, len(self.tokens))
        self.assertEqual(result.layer0_identical_kv_rows, len(self.tokens))

    def test_rounding_noise_passes(self):
        noisy = torch.from_numpy(self.kv.copy()).view(torch.bfloat16)
        noisy = (noisy.float() * (1 + 4e-3 * torch.randn(noisy.shape))).to(torch.bfloat16)
        result = kv_audit_compare.compare_runs(self.shared_run(kv=noisy.view(torch.uint8).numpy()), self.ref)
        self.assertEqual(result.failures, [])
        self.assertLess(result.layer0_identical_kv_rows, len(self.tokens))

    def test_a_page_of_other_tokens_fails(self):
        wrong = self.kv.copy()
        wrong[PAGE : 2 * PAGE] = self.kv[2 * PAGE : 3 * PAGE]  # page 1 holds page 2's rows
        result = kv_audit_compare.compare_runs(self.shared_run(kv=wrong), self.ref)
        self.assertEqual(len(result.failures), 1)
        self.assertIn("layer-0 rows of another token: KV", result.failures[0])
        self.assertGreaterEqual(result.layer0_wrong_kv_rows, PAGE - 2)  # a token may repeat by chance

    def test_a_wrong_indexer_page_fails(self):
        wrong = self.index.copy()
        wrong[:PAGE] = self.index[3 * PAGE :]
        result = kv_audit_compare.compare_runs(self.shared_run(index=wrong), self.ref)
        self.assertGreater(result.layer0_wrong_index_rows, PAGE // 2)

    def test_a_copy_passes_the_transfer_audit_only_if_every_byte_of_every_layer_is_equal(self):
        """The PD transfer audit: the decode server's dump (prompt and output positions) against the
        prefill's (prompt positions) of the same request."""
        decode = Path(self.tmp.name) / "decode"
        out_tokens = self.tokens + [7] * PAGE  # decode positions beyond the prompt are not compared
        out_positions = np.arange(len(out_tokens))
        kv, index = kv_rows(out_tokens, out_positions), index_rows(out_tokens)
        write_dump(decode, "r0", 0, out_positions, out_tokens, kv, index)
        clean = kv_audit_compare.compare_runs(decode, self.ref)
        self.assertEqual(kv_audit_compare.copy_failures(clean, "transfer"), [])
        self.assertEqual(clean.identical_kv_positions, len(self.tokens))
        # One byte of a deep layer (which the layer-0 rule does not judge) fails a copy.
        kv[3 * PAGE + 5, LAYERS - 1, 17] ^= 1
        write_dump(decode, "r0", 0, out_positions, out_tokens, kv, index)
        flipped = kv_audit_compare.compare_runs(decode, self.ref)
        self.assertEqual(flipped.failures, [])
        self.assertEqual(
            kv_audit_compare.copy_failures(flipped, "transfer"),
            [f"transfer: 1 of {len(self.tokens)} positions differ in some kv byte"],
        )

    def test_a_position_no_rank_stored_fails(self):
        result = kv_audit_compare.compare_runs(self.shared_run(drop_last=True), self.ref)
        self.assertTrue(any("stored by no rank" in f for f in result.failures))

    def test_a_rank_that_stores_no_token_of_a_request_dumps_an_empty_part(self):
        # Found on the GPU: the dump of an empty row set failed (reshape of 0 elements) and crashed the
        # scheduler of the rank that stored nothing (replicated rank 1; a shared-KV rank owning no page).
        from unittest import mock

        from cp_shared_kv_smoke_hooks import kv_audit
        from sglang_cp_shared_kv_testing.runtime_check import make_nsa_pool

        pool = make_nsa_pool(4 * PAGE, "bf16", LAYERS, "cpu")
        for buf in pool.kv_buffer:
            buf.copy_(torch.randn(buf.shape).to(buf.dtype))
        n = 2 * PAGE + 5
        req_to_token = torch.zeros((2, 4 * PAGE), dtype=torch.int32)
        req_to_token[1, :n] = torch.arange(PAGE, PAGE + n)
        cache = SimpleNamespace(
            token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool),
            req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        )
        req = SimpleNamespace(rid="r1", kv_committed_len=n, req_pool_idx=1,
                              origin_input_ids=self.tokens[: n - 3], output_ids=self.tokens[n - 3 : n])  # fmt: skip
        run = Path(self.tmp.name) / "replicated"
        for rank in (1, 0):
            with mock.patch.object(kv_audit, "_rank", return_value=rank):
                kv_audit.dump_finished_request(run, cache, req)
        parts = kv_audit_compare.load_dumps(run)["r1"]
        self.assertEqual(sorted(len(p["positions"]) for p in parts), [0, n])
        merged = kv_audit_compare.merge_request("r1", parts)
        self.assertEqual(merged.problems, [])
        expected = pool.kv_buffer[1][PAGE + 7].flatten().view(torch.uint8).numpy()
        self.assertTrue(np.array_equal(merged.kv[7, 1], expected))

    def test_audit_layer_limit_dumps_the_leading_layers_only(self):
        """A GLM-5-width model's dumps of every layer would not fit a run; layer 0 is what judges."""
        import os
        from unittest import mock

        from cp_shared_kv_smoke_hooks import SMOKE_AUDIT_LAYERS_ENV, kv_audit
        from sglang_cp_shared_kv_testing.runtime_check import make_nsa_pool

        pool = make_nsa_pool(4 * PAGE, "bf16", 3, "cpu")
        for buf in pool.kv_buffer:
            buf.copy_(torch.randn(buf.shape).to(buf.dtype))
        n = PAGE + 3
        req_to_token = torch.zeros((2, 4 * PAGE), dtype=torch.int32)
        req_to_token[1, :n] = torch.arange(PAGE, PAGE + n)
        cache = SimpleNamespace(
            token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool),
            req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        )
        req = SimpleNamespace(rid="r2", kv_committed_len=n, req_pool_idx=1, origin_input_ids=self.tokens[:n], output_ids=[])
        for limit, layers in ((None, 3), ("1", 1), ("2", 2), ("9", 3)):
            run = Path(self.tmp.name) / f"limit{limit}"
            env = {SMOKE_AUDIT_LAYERS_ENV: limit} if limit else {}
            with mock.patch.dict(os.environ, env), mock.patch.object(kv_audit, "_rank", return_value=0):
                if not limit:
                    os.environ.pop(SMOKE_AUDIT_LAYERS_ENV, None)
                kv_audit.dump_finished_request(run, cache, req)
            merged = kv_audit_compare.merge_request("r2", kv_audit_compare.load_dumps(run)["r2"])
            self.assertEqual(merged.kv.shape[1], layers, limit)
            self.assertEqual(merged.index.shape[1], layers, limit)
            expected = pool.kv_buffer[0][PAGE + 2].flatten().view(torch.uint8).numpy()
            self.assertTrue(np.array_equal(merged.kv[2, 0], expected))

    def test_a_dump_cut_off_by_shutdown_is_waited_for_and_never_loaded(self):
        # A server stopped while dumping leaves its ".<name>" file behind, possibly empty: the compare
        # must not read it (it once died on one with EOFError), and the runner must wait for dumps
        # being written before it stops the server.
        run = Path(self.tmp.name) / "cut_off"
        pool = run / "pool"
        pool.mkdir(parents=True)
        np.savez(pool / "r1.rank0.npz", positions=np.arange(2), token_ids=np.arange(2))
        (pool / ".r2.rank0.npz").write_bytes(b"")
        self.assertEqual([p.name for p in kv_audit_compare.finished_dumps(run)], ["r1.rank0.npz"])
        self.assertEqual(sorted(kv_audit_compare.load_dumps(run)), ["r1"])
        self.assertFalse(kv_audit_compare.wait_for_settled_dumps(run, timeout_s=0.6, quiet_s=0.1))
        (pool / ".r2.rank0.npz").rename(pool / "r2.rank0.npz")
        self.assertTrue(kv_audit_compare.wait_for_settled_dumps(run, timeout_s=5, quiet_s=0.1))

    def test_read_audit_fails_on_wrong_rows_and_dummy_references_not_on_rounding(self):
        ok = {"ranks": 2, "dummy_refs": 0, "kv_rows": 10, "kv_bit_diffs": 3, "kv_wrong": 0,
              "index_rows": 10, "index_bit_diffs": 1, "index_wrong": 0}  # fmt: skip
        self.assertEqual(kv_audit_compare.read_audit_failures(ok), [])
        self.assertTrue(kv_audit_compare.read_audit_failures({**ok, "kv_wrong": 1}))
        self.assertTrue(kv_audit_compare.read_audit_failures({**ok, "index_wrong": 1}))
        self.assertTrue(kv_audit_compare.read_audit_failures({**ok, "dummy_refs": 1}))
        self.assertTrue(kv_audit_compare.read_audit_failures({**ok, "index_rows": 0}))
        self.assertTrue(kv_audit_compare.read_audit_failures({}))


if __name__ == "__main__":
    unittest.main()
