"""The smoke's MTP draft checks on synthetic pool dumps: merging the draft rows, the reference
comparison (reported, never judged), the PD copy rule over the draft rows, the cached-prefix ledger
and the draft audits' verdicts; and the pool dump of a server with a draft pool.

Planted in ``kv_audit_compare`` and reverted, each caught here: the ledger taking the *first* earlier
request with the prefix as the source instead of the latest
(``test_ledger_sources_each_position_from_the_latest_request_that_held_it`` failed); ``copy_failures``
skipping the draft rows (``test_pd_copy_rule_covers_the_draft_rows`` failed); the draft rows merged
from the target's positions (``test_a_draft_position_no_rank_stored_fails`` failed).
"""

import sys
import tempfile
import unittest
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "scripts" / "smoke_plugin"))
from cp_shared_kv_smoke_hooks import kv_audit_compare  # noqa: E402

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

PAGE = 64


def rows(seed, n, width, layers=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, layers, width // 2, generator=g).to(torch.bfloat16).view(torch.uint8).numpy()


def index_rows(seed, n, layers=1):
    g = torch.Generator().manual_seed(seed)
    head = torch.randn(n, layers, 128, generator=g).to(torch.float8_e4m3fn).view(torch.uint8)
    scale = torch.ones(n, layers, 1, dtype=torch.float32).view(torch.uint8)
    return torch.cat([head, scale], -1).numpy()


class Request:
    """One request's rows as every position's owner would dump them (target: 2 layers, draft: 1)."""

    def __init__(self, tokens, seed, cached_tokens=0):
        n = len(tokens)
        self.tokens = np.asarray(tokens)
        self.cached_tokens = cached_tokens
        self.kv, self.index = rows(seed, n, 1152, 2), index_rows(seed, n, 2)
        self.draft_kv, self.draft_index = rows(seed + 1000, n, 1152), index_rows(seed + 1000, n)

    def reuse(self, source, positions):
        """Positions served from the cache hold the source's rows (what a correct cache does)."""
        for name in ("kv", "index", "draft_kv", "draft_index"):
            getattr(self, name)[positions] = getattr(source, name)[positions]
        return self

    def write(self, run_dir, rid, cp=2, draft=True, draft_drop=None):
        out = Path(run_dir) / "pool"
        out.mkdir(parents=True, exist_ok=True)
        positions = np.arange(len(self.tokens))
        for rank in range(cp):
            mine = positions[(positions // PAGE) % cp == rank]
            arrays = dict(positions=mine, token_ids=self.tokens, kv=self.kv[mine], index=self.index[mine],
                          kv_dtype=np.array("torch.bfloat16"), cached_tokens=np.array(self.cached_tokens))  # fmt: skip
            if draft:
                draft_mine = mine[mine != draft_drop]
                arrays.update(draft_positions=draft_mine, draft_kv=self.draft_kv[draft_mine],
                              draft_index=self.draft_index[draft_mine])  # fmt: skip
            np.savez(out / f"{rid}.rank{rank}.npz", **arrays)


def tokens(seed, n):
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


class TestDraftRowsInTheDumps(CustomTestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.root = Path(self.tmp.name)
        self.prompt = tokens(0, 3 * PAGE)

    def test_a_draft_position_no_rank_stored_fails(self):
        Request(self.prompt, 1).write(self.root / "run", "smoke-0-a", draft_drop=PAGE + 3)
        parts = kv_audit_compare.load_dumps(self.root / "run")["smoke-0-a"]
        merged = kv_audit_compare.merge_request("smoke-0-a", parts)
        self.assertEqual(merged.problems, ["smoke-0-a (draft): 1 of 192 positions stored by no rank"])
        clean = Request(self.prompt, 1)
        clean.write(self.root / "clean", "smoke-0-a")
        merged = kv_audit_compare.merge_request("smoke-0-a", kv_audit_compare.load_dumps(self.root / "clean")["smoke-0-a"])
        self.assertEqual(merged.problems, [])
        self.assertTrue(np.array_equal(merged.draft_kv, clean.draft_kv))

    def test_draft_rows_against_the_reference_are_reported_not_judged(self):
        """A deep-layer-like draft row differs from the reference's by attention noise: even a
        reference with other draft bytes everywhere fails nothing; the figures show it."""
        run, ref = Request(self.prompt, 1), Request(self.prompt, 1)
        ref.draft_kv = rows(77, len(self.prompt), 1152)
        run.write(self.root / "run", "smoke-0-a")
        ref.write(self.root / "ref", "smoke-0-a", cp=1)
        result = kv_audit_compare.compare_runs(self.root / "run", self.root / "ref")
        self.assertEqual(result.failures, [])
        self.assertEqual(result.draft_requests, 1)
        self.assertEqual(result.draft_identical_index_positions, len(self.prompt))
        self.assertEqual(result.draft_identical_kv_positions, 0)
        self.assertGreater(result.draft_kv_rows_above_wrong_row_error, len(self.prompt) // 2)
        # A reference without MTP: counted, nothing compared.
        Request(self.prompt, 1).write(self.root / "ref_no_mtp", "smoke-0-a", cp=1, draft=False)
        result = kv_audit_compare.compare_runs(self.root / "run", self.root / "ref_no_mtp")
        self.assertEqual((result.draft_requests, result.draft_requests_without_reference_draft), (0, 1))

    def test_pd_copy_rule_covers_the_draft_rows(self):
        prefill = Request(self.prompt, 1)
        prefill.write(self.root / "prefill", "pd-0-a")
        decode = Request(self.prompt, 1)
        decode.write(self.root / "decode", "pd-0-a", cp=1)
        same = kv_audit_compare.compare_runs(self.root / "decode", self.root / "prefill")
        self.assertEqual(kv_audit_compare.copy_failures(same, "transfer", with_draft=True), [])
        decode.draft_index[70, 0, 5] ^= 1  # one byte of one draft indexer row
        decode.write(self.root / "decode", "pd-0-a", cp=1)
        flipped = kv_audit_compare.compare_runs(self.root / "decode", self.root / "prefill")
        self.assertEqual(kv_audit_compare.copy_failures(flipped, "transfer"), [])  # without MTP: target only
        self.assertEqual(
            kv_audit_compare.copy_failures(flipped, "transfer", with_draft=True),
            ["transfer: 1 of 192 positions differ in some draft index byte"],
        )
        Request(self.prompt, 1).write(self.root / "decode_no_draft", "pd-0-a", cp=1, draft=False)
        missing = kv_audit_compare.compare_runs(self.root / "decode_no_draft", self.root / "prefill")
        self.assertEqual(len(kv_audit_compare.copy_failures(missing, "transfer", with_draft=True)), 1)


def _three_requests(test, shared_tokens: int) -> None:
    """A first request with a 3-page prefix; a second sharing its first ``shared_tokens`` tokens
    and served its first 2 pages from the cache; a replay of the first with all 3 pages cached."""
    test.tmp = tempfile.TemporaryDirectory()
    test.addCleanup(test.tmp.cleanup)
    test.run_dir = Path(test.tmp.name) / "run"
    prefix = tokens(0, 3 * PAGE)
    test.first = Request(prefix + tokens(1, 20), 1)
    test.second = Request(prefix[:shared_tokens] + tokens(2, 3 * PAGE - shared_tokens + 20), 2,
                          cached_tokens=2 * PAGE)  # fmt: skip
    test.second.reuse(test.first, slice(0, 2 * PAGE))
    test.replay = Request(list(test.first.tokens), 3, cached_tokens=3 * PAGE)
    test.replay.reuse(test.first, slice(0, 3 * PAGE))


class TestCachedRowLedger(CustomTestCase):
    """Request 0 computes a 3-page prefix; request 1 (another suffix) gets its first 2 pages from the
    cache; request 2 replays request 0 with all 3 pages cached."""

    def setUp(self):
        _three_requests(self, shared_tokens=2 * PAGE)

    def write(self):
        self.first.write(self.run_dir, "smoke-0-first")
        self.second.write(self.run_dir, "smoke-1-second")
        self.replay.write(self.run_dir, "smoke-2-replay")
        return kv_audit_compare.cached_row_ledger(self.run_dir, PAGE, bigram_keys=False)

    def test_rows_restored_with_the_prefix_pass(self):
        ledger = self.write()
        self.assertEqual(ledger.draft_failures(), [])
        self.assertEqual(ledger.requests_with_cached_tokens, 2)
        self.assertEqual(ledger.positions_checked, 5 * PAGE)
        self.assertEqual(ledger.draft_positions_checked, 5 * PAGE)
        self.assertEqual(ledger.positions_without_source, 0)
        self.assertEqual(ledger.target_kv_rows_changed + ledger.draft_kv_rows_changed, 0)

    def test_a_stale_draft_page_of_a_loaded_back_prefix_fails(self):
        stale = Request(list(self.second.tokens), 9)  # what the new locs held before
        self.second.draft_kv[PAGE : 2 * PAGE] = stale.draft_kv[PAGE : 2 * PAGE]
        self.second.draft_index[PAGE : 2 * PAGE] = stale.draft_index[PAGE : 2 * PAGE]
        self.replay.reuse(self.second, slice(0, 2 * PAGE))  # the tree now holds the stale rows
        ledger = self.write()
        self.assertEqual((ledger.draft_kv_rows_changed, ledger.draft_index_rows_changed), (PAGE, PAGE))
        self.assertEqual(ledger.changed_by_request, {"smoke-1-second": PAGE})
        self.assertEqual(len(ledger.draft_failures()), 1)
        self.assertEqual(ledger.target_kv_rows_changed, 0)

    def test_target_rows_are_counted_and_left_to_the_reference_comparison(self):
        self.replay.kv[5, 1] = Request(list(self.replay.tokens), 9).kv[5, 1]
        ledger = self.write()
        self.assertEqual(ledger.target_kv_rows_changed, 1)
        self.assertEqual(ledger.draft_failures(), [])

    def test_ledger_sources_each_position_from_the_latest_request_that_held_it(self):
        """Request 1 recomputed the prefix (cached_tokens 0, as after a prefix lost from the cache):
        the tree then holds its rows, so request 2's cached rows must equal request 1's."""
        self.second = Request(list(self.first.tokens[: 2 * PAGE]) + tokens(2, PAGE + 20), 2)
        self.replay = Request(list(self.first.tokens), 3, cached_tokens=3 * PAGE).reuse(self.first, slice(0, 3 * PAGE))
        self.replay.reuse(self.second, slice(0, 2 * PAGE))
        ledger = self.write()
        self.assertEqual(ledger.draft_failures(), [])
        self.assertEqual(ledger.positions_checked, 3 * PAGE)
        self.replay.reuse(self.first, slice(0, 2 * PAGE))  # the older copy: not what the tree held
        self.assertEqual(self.write().draft_kv_rows_changed, 2 * PAGE)

    def test_nothing_cached_cannot_judge_and_concurrent_requests_are_left_out(self):
        self.first.write(self.run_dir, "smoke-0-first")
        ledger = kv_audit_compare.cached_row_ledger(self.run_dir, PAGE, bigram_keys=False)
        self.assertEqual(len(ledger.draft_failures()), 1)
        self.assertIn("no position", ledger.draft_failures()[0])
        self.second.draft_kv[:] = 0
        self.second.write(self.run_dir, "burst-3")  # concurrent requests: not in the ledger
        self.assertEqual(kv_audit_compare.cached_row_ledger(self.run_dir, PAGE, bigram_keys=False).positions_checked, 0)


class TestCachedRowLedgerWithBigramKeys(CustomTestCase):
    """What a served MTP run showed (2026-12-03): under EAGLE's bigram keys two requests with the
    same first 3 pages share only 2 in the tree (the third's last bigram reaches into the differing
    token), so the second computes its own copy of page 2 (other bytes: other kernel batches), and a
    replay of the first gets the first's page 2. The ledger sourcing page 2 from the second (the
    token-prefix rule) failed that clean run; here it must pass, and a replay served the second's
    copy (a wrong tree branch) must still fail."""

    def setUp(self):
        _three_requests(self, shared_tokens=3 * PAGE)

    def ledger(self, bigram_keys=True):
        self.first.write(self.run_dir, "smoke-0-first")
        self.second.write(self.run_dir, "smoke-1-second")
        self.replay.write(self.run_dir, "smoke-2-replay")
        return kv_audit_compare.cached_row_ledger(self.run_dir, PAGE, bigram_keys=bigram_keys)

    def test_shared_pages_follow_the_tree_key(self):
        self.assertEqual(kv_audit_compare.shared_prefix_tokens(3 * PAGE, PAGE, bigram_keys=True), 2 * PAGE)
        self.assertEqual(kv_audit_compare.shared_prefix_tokens(3 * PAGE + 1, PAGE, bigram_keys=True), 3 * PAGE)
        self.assertEqual(kv_audit_compare.shared_prefix_tokens(3 * PAGE, PAGE, bigram_keys=False), 3 * PAGE)
        self.assertEqual(kv_audit_compare.shared_prefix_tokens(0, PAGE, bigram_keys=True), 0)

    def test_a_page_the_second_request_recomputed_is_sourced_from_the_first(self):
        ledger = self.ledger()
        self.assertEqual(ledger.draft_failures(), [])
        self.assertEqual(ledger.positions_checked, 5 * PAGE)
        self.assertEqual(ledger.target_kv_rows_changed + ledger.draft_kv_rows_changed, 0)
        # The token-prefix rule (what keys without bigrams share) judges this clean run wrong.
        self.assertEqual(self.ledger(bigram_keys=False).draft_kv_rows_changed, PAGE)

    def test_a_replay_served_the_other_branch_still_fails(self):
        self.replay.reuse(self.second, slice(2 * PAGE, 3 * PAGE))
        ledger = self.ledger()
        self.assertEqual((ledger.draft_kv_rows_changed, ledger.draft_index_rows_changed), (PAGE, PAGE))
        self.assertEqual(ledger.changed_by_request, {"smoke-2-replay": PAGE})


class TestDraftAuditVerdicts(CustomTestCase):
    def test_write_and_read_audits_judge_wrong_rows_not_rounding(self):
        read = {"ranks": 2, "dummy_refs": 0, "kv_rows": 8, "kv_bit_diffs": 2, "kv_wrong": 0,
                "index_rows": 8, "index_bit_diffs": 0, "index_wrong": 0}  # fmt: skip
        write = {"ranks": 2, "kv_rows": 8, "kv_bit_diffs": 1, "kv_wrong": 0, "index_rows": 8,
                 "index_bit_diffs": 0, "index_wrong": 0}  # fmt: skip
        ok = {"draft_read_audit": read, "draft_write_audit": write}
        self.assertEqual(kv_audit_compare.draft_audit_failures(ok), [])
        for audit, key in (("draft_write_audit", "kv_wrong"), ("draft_write_audit", "index_wrong"),
                           ("draft_read_audit", "kv_wrong"), ("draft_write_audit", "kv_rows")):  # fmt: skip
            bad = {**ok, audit: {**ok[audit], key: 0 if key.endswith("rows") else 1}}
            self.assertEqual(len(kv_audit_compare.draft_audit_failures(bad)), 1, (audit, key))
        self.assertTrue(kv_audit_compare.draft_audit_failures({"draft_read_audit": read, "draft_write_audit": {}}))

    def test_totals_sum_each_file_kind_over_ranks(self):
        import json

        with tempfile.TemporaryDirectory() as tmp:
            for rank in (0, 1):
                (Path(tmp) / f"draft_write_audit.rank{rank}.json").write_text(json.dumps({"kv_rows": 3}))
                (Path(tmp) / f"read_audit.rank{rank}.json").write_text(json.dumps({"kv_rows": 100}))
            (Path(tmp) / "read_audit_draft.rank0.json").write_text(json.dumps({"kv_rows": 5}))
            totals = kv_audit_compare.draft_audit_totals(Path(tmp))
        self.assertEqual(totals["draft_write_audit"], {"kv_rows": 6, "ranks": 2})
        self.assertEqual(totals["draft_read_audit"], {"kv_rows": 5, "ranks": 1})


class TestPoolDumpWithADraftPool(CustomTestCase):
    def test_dump_holds_the_draft_rows_and_the_cached_tokens(self):
        from cp_shared_kv_smoke_hooks import kv_audit
        from sglang_cp_shared_kv_testing.runtime_check import make_nsa_pool

        pool, draft = make_nsa_pool(4 * PAGE, "bf16", 2, "cpu"), make_nsa_pool(4 * PAGE, "bf16", 1, "cpu")
        for p in (pool, draft):
            for buf in p.kv_buffer:
                buf.copy_(torch.randn(buf.shape).to(buf.dtype))
            for buf in p.index_k_with_scale_buffer:
                buf.copy_(torch.randint(0, 255, buf.shape, dtype=torch.uint8))
        n = PAGE + 9
        req_to_token = torch.zeros((2, 4 * PAGE), dtype=torch.int32)
        req_to_token[1, :n] = torch.arange(2 * PAGE, 2 * PAGE + n)
        cache = SimpleNamespace(
            token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool),
            req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        )
        req = SimpleNamespace(rid="smoke-4-x", kv_committed_len=n, req_pool_idx=1, cached_tokens=PAGE,
                              origin_input_ids=tokens(0, n), output_ids=[])  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            with mock.patch.object(kv_audit, "_rank", return_value=0):
                kv_audit.dump_finished_request(Path(tmp), cache, req, draft)
            merged = kv_audit_compare.merge_request("smoke-4-x", kv_audit_compare.load_dumps(Path(tmp))["smoke-4-x"])
        self.assertEqual(merged.problems, [])
        self.assertEqual(merged.cached_tokens, PAGE)
        self.assertEqual(merged.draft_kv.shape[1], 1)
        loc = 2 * PAGE + 70
        self.assertTrue(np.array_equal(merged.draft_kv[70, 0], draft.kv_buffer[0][loc].flatten().view(torch.uint8).numpy()))
        self.assertFalse(np.array_equal(merged.draft_kv[70, 0], merged.kv[70, 0]))
        page, slot = divmod(loc, PAGE)
        head = draft.index_k_with_scale_buffer[0][page, slot * 128 : (slot + 1) * 128].numpy()
        self.assertTrue(np.array_equal(merged.draft_index[70, 0, :128], head))


if __name__ == "__main__":
    unittest.main()
