"""The smoke's decode read audit: per-owner decode attending to the wrong row, owner or set is counted.

Every rank's per-owner top-k is run in one process (``per_owner_decode_cases``: real owner tables,
candidates, global selection and attention indices over a random page-sharded batch with a padded
request) and each rank's indices are audited against the backend's token table. Clean, nothing is
counted wrong; each planted bug is counted: the smoke's own ``decode-wrong-page`` plant (rank 1's
owned-page table rotated by a column), one rank's candidates lost, and a selection attributed to
the next rank. Planted in the audit itself, each of these made the test fail (then reverted):
``expected_attention_indices`` using ``page % cp`` as the physical page; ``missing`` counted
over padding rows too.
"""

import sys
import tempfile
import unittest
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing import per_owner_decode_cases as cases

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "scripts" / "smoke_plugin"))
from cp_shared_kv_smoke_hooks import decode_read_audit, planted_bugs  # noqa: E402

register_cpu_ci(est_time=5, suite="stage-a-test-cpu")

PAGE, TOPK = 64, 96
SEQ_LENS = [700, 64, 40, 1, 300]
PADDED = [False, False, False, True, False]


def _audit_counts(cp_size, seed=3, plant=None, topk=TOPK):
    g = torch.Generator().manual_seed(seed)
    batch = cases.random_batch(g, cp_size, PAGE, SEQ_LENS, PADDED)
    logits = torch.randn(len(SEQ_LENS), batch.page_table.shape[1] * PAGE, generator=g)
    build = cases.build_owner_decode_tables

    def build_with_plant(layout, page_table, seq_lens):
        tables = build(layout, page_table, seq_lens)
        if plant == "decode-wrong-page":
            return planted_bugs.decode_tables_one_page_off(tables, layout, page_table, seq_lens) or tables
        return tables

    with mock.patch.object(cases, "build_owner_decode_tables", build_with_plant):
        ranks = cases.per_owner_topk(batch, cases.emulated_local_logits(batch, logits), topk)
    if plant == "stale-columns":  # columns' positions never computed for this batch (capture-time -1)
        ranks = [replace(r, candidates=replace(r.candidates, positions=torch.full_like(r.candidates.positions, -1)))
                 for r in ranks]  # fmt: skip
    if plant == "lost-candidates":  # rank 0's candidates never reach the merge
        scores = torch.stack([r.candidates.scores for r in ranks])
        scores[0] = float("-inf")
        selection = cases.select_global(scores, topk)
        ranks = [
            replace(r, selection=selection, attention_indices=cases.owned_attention_indices(selection, r.candidates, i))
            for i, r in enumerate(ranks)
        ]
    with tempfile.TemporaryDirectory() as tmp:
        total = dict.fromkeys(decode_read_audit.COUNT_KEYS, 0)
        for rank, result in enumerate(ranks):
            audit = decode_read_audit.DecodeReadAudit(Path(tmp), rank)
            audit.begin_forward(batch.layout(rank), batch.token_locs(), batch.seq_lens.to(torch.int32))
            selection, candidates = result.selection, result.candidates
            if plant == "wrong-owner":  # this rank takes the next rank's selected tokens as its own
                nxt = (rank + 1) % cp_size
                rolled = selection.chosen_mask().roll(-1, dims=1)
                selection = SimpleNamespace(chosen_mask=lambda m=rolled: m)
                candidates = replace(candidates, positions=ranks[nxt].candidates.positions)
            audit.check(selection, candidates, result.attention_indices, rank)
            for key, value in audit.counts.items():
                total[key] += value
        total["ranks"] = cp_size
        return total


class TestDecodeReadAudit(CustomTestCase):
    def test_clean_per_owner_decode_passes(self):
        for cp_size, topk in ((2, TOPK), (3, TOPK), (3, 1024)):
            with self.subTest(cp_size=cp_size, topk=topk):
                t = _audit_counts(cp_size, topk=topk)
                self.assertEqual(decode_read_audit.failures(t), [])
                # every real request's min(seq_len, k) tokens are attended once across the ranks
                expected = sum(min(n, topk) for n, pad in zip(SEQ_LENS, PADDED) if not pad)
                self.assertEqual(t["attended_rows"], expected)
                self.assertEqual(t["selected"], expected * cp_size)
                self.assertEqual(t["padding_requests"], cp_size)

    def test_planted_wrong_page_is_caught(self):
        t = _audit_counts(2, plant="decode-wrong-page")
        self.assertGreater(t["wrong_rows"], 0)
        self.assertTrue(any("wrong_rows" in f or "row other than" in f for f in decode_read_audit.failures(t)))

    def test_lost_candidates_are_caught(self):
        # k above every request's length: each token is selected, so a lost one shows as missing
        # (with shorter k the other owners' next tokens fill the selection; the merge check catches that)
        t = _audit_counts(3, plant="lost-candidates", topk=1024)
        self.assertGreater(t["missing"], 0)
        self.assertTrue(decode_read_audit.failures(t))

    def test_wrong_owner_is_caught(self):
        t = _audit_counts(2, plant="wrong-owner")
        self.assertGreater(t["wrong_owner"], 0)
        self.assertTrue(decode_read_audit.failures(t))

    def test_chosen_candidates_without_a_position_are_missing(self):
        """What a replay read when the columns were cached across sglang's warm-ups (2026-12-03):
        every position -1, so the expected rows were -1 too and only this count sees it (seen
        failing without it: 0 counted)."""
        t = _audit_counts(2, plant="stale-columns")
        expected = sum(min(n, TOPK) for n, pad in zip(SEQ_LENS, PADDED) if not pad)
        self.assertEqual(t["missing"], expected)
        self.assertTrue(decode_read_audit.failures(t))

    def test_replays_are_checked_on_the_captured_tensors(self):
        """During a capture the layer's tensors are kept; after a replay of that batch size they are
        checked as rewritten; a replay of another size, or none at all, checks nothing (and graph
        runs whose replays were never checked fail)."""
        g = torch.Generator().manual_seed(5)
        batch = cases.random_batch(g, 2, PAGE, SEQ_LENS, PADDED)
        logits = torch.randn(len(SEQ_LENS), batch.page_table.shape[1] * PAGE, generator=g)
        ranks = cases.per_owner_topk(batch, cases.emulated_local_logits(batch, logits), TOPK)
        bs = len(SEQ_LENS)
        with tempfile.TemporaryDirectory() as tmp:
            audit = decode_read_audit.DecodeReadAudit(Path(tmp), 0)
            r = ranks[0]
            with mock.patch.object(decode_read_audit, "capturing", return_value=True):
                for _ in range(2):  # two layers captured
                    audit.keep_captured(r.selection, r.candidates, r.attention_indices, 0)
            audit.end_capture(bs)
            args = (batch.layout(0), batch.token_locs(), batch.seq_lens.to(torch.int32))
            audit.check_replay(*args, bs=bs + 1)
            self.assertEqual(audit.counts["graph_replays"], 0)
            audit.check_replay(*args, bs=bs)
            self.assertEqual((audit.counts["graph_replays"], audit.counts["graph_layers"]), (1, 2))
            self.assertEqual(audit.counts["wrong_rows"] + audit.counts["missing"], 0)
            r.candidates.positions.fill_(-1)  # the replay rewrote them with stale columns
            audit.check_replay(*args, bs=bs)
            self.assertGreater(audit.counts["missing"], 0)
        unchecked = {"ranks": 2, "graph_forwards": 5, "graph_replays": 0}
        self.assertIn("replay audit checked none", " ".join(decode_read_audit.failures(unchecked)))

    def test_silent_without_per_owner_decode(self):
        with tempfile.TemporaryDirectory() as tmp:
            t = decode_read_audit.totals(Path(tmp))
        self.assertEqual(t["ranks"], 0)
        self.assertEqual(decode_read_audit.failures(t), [])  # gather decode: nothing to judge

    def test_hook_targets_resolve(self):
        import pkgutil

        registered = []
        registry = SimpleNamespace(register=lambda target, hook, kind: registered.append(target))
        decode_read_audit.register_hooks(registry, Path("."))
        planted_bugs.register_hooks(registry, "decode-wrong-page")
        for target in registered:
            owner, name = target.rsplit(".", 1)
            self.assertTrue(callable(getattr(pkgutil.resolve_name(owner), name)), target)


if __name__ == "__main__":
    unittest.main()
