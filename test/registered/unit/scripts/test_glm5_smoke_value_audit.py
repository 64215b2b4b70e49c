"""The smoke's value audit: its reference, its row map, its graph-replay path, its verdict, its plants.

* ``reference_attention`` equals the project's independent kernel references composed
  (``paged_mqa_logits_reference`` -> top-k -> ``sparse_mla_decode_reference``), bf16 and fp8 rows.
  Seen failing with the causal mask one token long, the head weights dropped and ``topk`` ignored.
* ``query_rows`` maps each attention query row to its request and context length for every forward
  sglang builds: decode, prefill (one request, several, split round robin over CP ranks), the MTP
  verify and draft extend. Seen failing with a split prefill's rows taken from the front.
* Under CUDA graphs the check must judge what a replay wrote into the captured tensors, never the
  capture's values: a capture kept with stale outputs fails after its replay, refreshed ones pass.
  Seen failing with the replay check skipped (``after_replay`` returning early).
* The verdict derives its tolerance from the stock reference's errors; a run without rows, without
  graph-replay rows where graphs ran, or with impossible checks fails.
* Each checked per-owner row carries the merge form that ran in its attention call (a replay: its
  capture's); a run with the one-exchange merge asked fails without rows merged by it (replayed ones
  too where graphs replayed), one without it fails with any; such a failure is no value plant's
  catch. Seen failing with the form kept across attention calls (a prefill row after a decode layer
  counted as merged) and with the replay's rows left without their capture's form.
* The planted bugs act as the docstring says: the graph-stale LSE is a no-op eagerly and feeds the
  warm-up's LSE to a capture; the gathered-scale plant scales the gathered region only.
"""

import json
import math
import sys
import tempfile
import unittest
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing import nsa_decode_reference as ref
from sglang_cp_shared_kv_testing.runtime_check import make_nsa_pool

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "scripts" / "smoke_plugin"))
from cp_shared_kv_smoke_hooks import planted_bugs, value_audit, value_audit_compare  # noqa: E402

register_cpu_ci(est_time=15, suite="stage-a-test-cpu")

HEADS, INDEX_HEADS, PAGE = 8, 4, 64
SCALING = 576**-0.5


def _random_context(g, n, fp8):
    kv = torch.randn(n, 576, generator=g)
    rows = ref.fp8_kv_rows(kv.to(torch.bfloat16)) if fp8 else kv.to(torch.bfloat16).view(torch.uint8).reshape(n, -1)
    keys = torch.randn(n, 128, generator=g).to(torch.float8_e4m3fn)
    scales = torch.rand(n, generator=g) + 0.5
    return rows, keys, scales


class TestReferenceAttention(CustomTestCase):
    def _check(self, fp8, n, topk):
        g = torch.Generator().manual_seed(5)
        rows, keys, scales = _random_context(g, n, fp8)
        r = 3
        q = torch.randn(r, HEADS, 576, generator=g) * 2
        index_q = torch.randn(r, INDEX_HEADS, 128, generator=g).to(torch.float8_e4m3fn)
        weights = torch.rand(r, INDEX_HEADS, generator=g)
        context = torch.tensor([n, n - 70, 40])
        kv_float = value_audit.kv_rows_as_float(rows, fp8)
        got = value_audit.reference_attention(q, index_q, weights, kv_float, keys.float(), scales, context, topk, SCALING)
        # Independently: the kernel references over one 64-token page table per row.
        pages = ref.index_pages(keys, scales, PAGE)
        table = torch.arange(n // PAGE)[None, :].repeat(r, 1)
        logits = ref.paged_mqa_logits_reference(index_q, weights, pages, table, context, PAGE)
        chosen = logits.topk(min(topk, n), dim=1).indices
        chosen = torch.where(torch.gather(logits, 1, chosen) > float("-inf"), chosen, -1)
        rows_float = ref.kv_rows_as_float(rows) if fp8 else rows.view(torch.bfloat16).float()
        want, _ = ref.sparse_mla_decode_reference(q, rows_float, chosen, SCALING)
        self.assertLess(float(value_audit.relative_errors(got, want).max()), 1e-5)

    def test_equals_the_kernel_references_bf16_and_fp8(self):
        for fp8 in (False, True):
            with self.subTest(fp8=fp8):
                self._check(fp8, n=512, topk=100)  # selection matters: topk < context

    def test_short_context_attends_everything(self):
        self._check(False, n=128, topk=2048)

    def test_relative_error_counts_non_finite_rows_as_infinite(self):
        out = torch.ones(2, 3, 4)
        out[1, 0, 0] = float("nan")
        errors = value_audit.relative_errors(out, torch.ones(2, 3, 4))
        self.assertEqual(errors[0].item(), 0.0)
        self.assertTrue(math.isinf(errors[1].item()))


def _batch(mode, seq_lens, extend_lens=None, req_pool_indices=None):
    return SimpleNamespace(
        forward_mode=mode,
        batch_size=len(seq_lens),
        seq_lens_cpu=torch.tensor(seq_lens),
        extend_seq_lens_cpu=extend_lens,
        req_pool_indices=torch.tensor(req_pool_indices or list(range(1, len(seq_lens) + 1))),
    )


class TestQueryRows(CustomTestCase):
    def test_decode_rows_are_requests(self):
        metadata = SimpleNamespace(cache_seqlens_int32=torch.tensor([7, 300, 1], dtype=torch.int32))
        rows = value_audit.query_rows(_batch(ForwardMode.DECODE, [7, 300, 1]), metadata, 4, None)
        self.assertEqual(rows.request.tolist(), [0, 1, 2, -1])  # a graph's padded row
        self.assertEqual(rows.context.tolist(), [7, 300, 1, 0])

    def test_prefill_rows_are_causal_per_request(self):
        batch = _batch(ForwardMode.EXTEND, [130, 5], extend_lens=[3, 2])  # 127 cached + 3, 3 cached + 2
        rows = value_audit.query_rows(batch, None, 5, None)
        self.assertEqual(rows.request.tolist(), [0, 0, 0, 1, 1])
        self.assertEqual(rows.context.tolist(), [128, 129, 130, 4, 5])

    def test_split_prefill_rows_are_every_cp_th_token(self):
        batch = _batch(ForwardMode.EXTEND, [130, 5], extend_lens=[3, 2])
        # 5 tokens over 2 ranks: rank 1 gets tokens 1 and 3, then a padded row (the chunk is padded to 6)
        rows = value_audit.query_rows(batch, None, 3, (1, 2))
        self.assertEqual(rows.request.tolist(), [0, 1, -1])
        self.assertEqual(rows.context.tolist(), [129, 4, 0])
        rank0 = value_audit.query_rows(batch, None, 3, (0, 2))
        self.assertEqual(rank0.request.tolist(), [0, 0, 1])
        self.assertEqual(rank0.context.tolist(), [128, 130, 5])

    def test_verify_and_draft_extend_rows(self):
        expanded = torch.tensor([11, 12, 13, 21, 22, 23], dtype=torch.int32)
        metadata = SimpleNamespace(nsa_seqlens_expanded=expanded)
        verify = value_audit.query_rows(_batch(ForwardMode.TARGET_VERIFY, [10, 20]), metadata, 6, None)
        self.assertEqual(verify.request.tolist(), [0, 0, 0, 1, 1, 1])
        self.assertEqual(verify.context.tolist(), expanded.tolist())
        draft = value_audit.query_rows(_batch(ForwardMode.DRAFT_EXTEND, [13, 23], extend_lens=[2, 4]), metadata, 6, None)
        self.assertEqual(draft.request.tolist(), [0, 0, 1, 1, 1, 1])

    def test_checked_request_skips_padding_and_takes_turns(self):
        batch = _batch(ForwardMode.DECODE, [9, 1, 30], req_pool_indices=[4, 0, 2])
        self.assertEqual([value_audit.checked_request(batch, t) for t in range(4)], [0, 2, 0, 2])
        prefill = _batch(ForwardMode.EXTEND, [50, 900, 900], extend_lens=[1, 1, 1])
        self.assertEqual(value_audit.checked_request(prefill, 3), 1)  # the longest context, first of equals


class _StockDecode:
    """A stock (replicated) pool with random rows, and one decode layer's inputs and true output
    (computed with the kernel references, not the audit's)."""

    def __init__(self, seed=0, seq_lens=(300, 90)):
        g = torch.Generator().manual_seed(seed)
        self.seq_lens = list(seq_lens)
        self.pool = make_nsa_pool(16 * PAGE, "bf16", 1, "cpu")
        width = max(-(-s // PAGE) for s in seq_lens)
        pages = torch.randperm(15, generator=g)[: len(seq_lens) * width] + 1  # never the dummy page 0
        self.req_to_token = torch.zeros(len(seq_lens) + 1, width * PAGE, dtype=torch.int64)
        for b, s in enumerate(seq_lens):
            own = pages[b * width : (b + 1) * width]
            self.req_to_token[b + 1] = (own[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
        n = self.pool.kv_buffer[0].shape[0]
        rows, keys, scales = _random_context(g, n, fp8=False)
        self.pool.kv_buffer[0].view(torch.uint8).reshape(n, -1)[:] = rows
        self.pool.index_k_with_scale_buffer[0][:] = ref.index_pages(keys, scales, PAGE)[: self.pool.index_k_with_scale_buffer[0].shape[0]]
        self.kv_float = rows.view(torch.bfloat16).float()
        self.keys, self.scales = keys.float(), scales
        self.g = g

    def layer_inputs(self, topk=64):
        b = len(self.seq_lens)
        q = torch.randn(b, HEADS, 576, generator=self.g) * 2
        index_q = torch.randn(b, INDEX_HEADS, 128, generator=self.g).to(torch.float8_e4m3fn)
        weights = torch.rand(b, INDEX_HEADS, 1, generator=self.g)
        out = torch.empty(b, HEADS, 512)
        for i, s in enumerate(self.seq_lens):
            locs = self.req_to_token[i + 1, :s]
            scores = torch.einsum("hd,td->ht", index_q[i].float(), self.keys[locs]) * self.scales[locs]
            logits = (scores.relu() * weights[i].float()).sum(0)
            chosen = locs[logits.topk(min(topk, s)).indices]
            out[i], _ = ref.sparse_mla_decode_reference(q[i : i + 1], self.kv_float, chosen[None], SCALING)
        return q, index_q, weights, out

    def forward_batch(self):
        return SimpleNamespace(
            forward_mode=ForwardMode.DECODE, batch_size=len(self.seq_lens), token_to_kv_pool=self.pool,
            seq_lens_cpu=torch.tensor(self.seq_lens), req_pool_indices=torch.tensor([1, 2]),
            req_to_token_pool=SimpleNamespace(req_to_token=self.req_to_token),
        )  # fmt: skip


class TestGraphReplayIsJudged(CustomTestCase):
    def _replayed_errors(self, refresh_out: bool, merge_form=None):
        case = _StockDecode()
        layer = SimpleNamespace(layer_id=0, tp_q_head_num=HEADS, v_head_dim=512, head_dim=576, scaling=SCALING)
        backend = SimpleNamespace(nsa_index_topk=64, forward_metadata=SimpleNamespace(
            cache_seqlens_int32=torch.tensor(case.seq_lens, dtype=torch.int32)))  # fmt: skip
        runner = SimpleNamespace(bs=2)
        with tempfile.TemporaryDirectory() as tmp:
            audit = value_audit.ValueAudit(Path(tmp), 0, lambda pool: 1)
            # Capture: sglang's dummy batch; the audit may only keep the tensors.
            q, index_q, weights, out = (torch.zeros(2, HEADS, 576), torch.zeros(2, INDEX_HEADS, 128).to(torch.float8_e4m3fn),
                                        torch.zeros(2, INDEX_HEADS, 1), torch.zeros(2, HEADS, 512))  # fmt: skip
            audit.begin_capture(runner, 2)
            with mock.patch.object(value_audit, "capturing", return_value=True):
                audit.keep_index_inputs(case.pool, 0, index_q, weights)
                if merge_form is not None:  # per-owner decode merged inside this attention call
                    audit.merged_by(merge_form)
                audit.attention_call(backend, layer, case.forward_batch(), q[..., :512], q[..., 512:], out)
            audit.end_capture()
            self.assertIsNone(audit.merge_form)  # taken by the call it ran in
            self.assertEqual(audit.errors["decode"], [])  # nothing judged during the capture
            # Replay: the graph rewrites its tensors in place with this batch's values.
            new_q, new_index_q, new_weights, new_out = case.layer_inputs()
            q.copy_(new_q)
            index_q.copy_(new_index_q)
            weights.copy_(new_weights)
            if refresh_out:
                out.copy_(new_out)
            for _ in range(2):
                audit.after_replay(runner, case.forward_batch(), backend.forward_metadata)
            saved = json.loads(audit.path.read_text())
            if merge_form is not None:
                return saved["rows_by_merge_form"]
            return saved["errors"]["decode_graph"], saved["graph_replays_by_bs"]

    def test_replayed_outputs_are_checked(self):
        errors, replays = self._replayed_errors(refresh_out=True)
        self.assertEqual(len(errors), 2)  # one request per replay, in turn
        self.assertLess(max(errors), 1e-5)
        self.assertEqual(replays, {"2": 2})

    def test_a_replay_leaving_stale_outputs_fails(self):
        errors, _ = self._replayed_errors(refresh_out=False)
        self.assertGreater(min(errors), 0.5)

    def test_replayed_rows_carry_the_merge_form_of_their_capture(self):
        for form in (value_audit.ONE_EXCHANGE, value_audit.SCALED_SUM):
            self.assertEqual(self._replayed_errors(refresh_out=True, merge_form=form), {"decode_graph": {form: 2}})

    def test_a_call_without_a_merge_records_no_form(self):
        case = _StockDecode()
        layer = SimpleNamespace(layer_id=0, tp_q_head_num=HEADS, v_head_dim=512, head_dim=576, scaling=SCALING)
        backend = SimpleNamespace(nsa_index_topk=64, forward_metadata=SimpleNamespace(
            cache_seqlens_int32=torch.tensor(case.seq_lens, dtype=torch.int32)))  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            audit = value_audit.ValueAudit(Path(tmp), 0, lambda pool: 1)
            for merged in (value_audit.ONE_EXCHANGE, None):  # a merged call, then one without a merge
                q, index_q, weights, out = case.layer_inputs()
                audit.keep_index_inputs(case.pool, 0, index_q, weights)
                if merged:
                    audit.merged_by(merged)
                audit.attention_call(backend, layer, case.forward_batch(), q[..., :512], q[..., 512:], out)
            saved = json.loads(audit.path.read_text())
        self.assertEqual(len(saved["errors"]["decode"]), 2)
        self.assertEqual(saved["rows_by_merge_form"], {"decode": {value_audit.ONE_EXCHANGE: 1}})


def _totals(errors_by_kind, problems=None, ranks=1, merge_forms=None):
    return {"errors": errors_by_kind, "layers_checked": {}, "problems": problems or {}, "graph_replays_by_bs": {},
            "rows_by_merge_form": merge_forms or {}, "ranks": ranks}  # fmt: skip


class TestVerdict(CustomTestCase):
    STOCK = _totals({"extend": [0.002, 0.003, 0.004], "decode": [0.003, 0.005]})

    def test_within_the_stock_band_passes(self):
        run = _totals({"extend": [0.003, 0.006], "decode": [0.004], "decode_graph": [0.009]})
        self.assertEqual(value_audit_compare.failures(run, self.STOCK, expect_graph_replays=True), [])

    def test_a_wrong_merge_fails_on_its_kind(self):
        run = _totals({"extend": [0.003], "decode": [0.004], "decode_graph": [0.004, 0.3]})
        found = value_audit_compare.failures(run, self.STOCK)
        self.assertEqual(len(found), 1)
        self.assertIn("(decode_graph): 1 of 2 rows", found[0])

    def test_nothing_checked_or_impossible_checks_fail(self):
        self.assertTrue(value_audit_compare.failures(_totals({}, ranks=0), self.STOCK))
        self.assertIn("no output row", value_audit_compare.failures(_totals({}), self.STOCK)[0])
        no_graph = value_audit_compare.failures(_totals({"extend": [0.001]}), self.STOCK, expect_graph_replays=True)
        self.assertTrue(any("CUDA-graph replays" in f for f in no_graph))
        problems = value_audit_compare.failures(_totals({"extend": [0.001]}, {"no_indexer_inputs": 3}), self.STOCK)
        self.assertTrue(any("no_indexer_inputs" in f for f in problems))

    def test_no_reference_errors_is_a_failure(self):
        found = value_audit_compare.failures(_totals({"extend": [0.001]}), _totals({}))
        self.assertTrue(any("tolerance" in f for f in found))

    def test_totals_join_ranks(self):
        with tempfile.TemporaryDirectory() as tmp:
            for rank, errors in enumerate(([0.1], [0.2, 0.3])):
                data = {"errors": {"decode": errors}, "layers_checked": {"decode": 1}, "problems": {"row_map_mismatch": rank},
                        "graph_replays_by_bs": {"16": 2}, "rows_by_merge_form": {"decode": {"all_gather": len(errors)}}}  # fmt: skip
                (Path(tmp) / f"value_audit.rank{rank}.json").write_text(json.dumps(data))
            t = value_audit_compare.totals(Path(tmp))
        self.assertEqual((t["ranks"], t["errors"]["decode"], t["graph_replays_by_bs"]), (2, [0.1, 0.2, 0.3], {"16": 4}))
        self.assertEqual(t["problems"], {"row_map_mismatch": 1})
        self.assertEqual(t["rows_by_merge_form"], {"decode": {"all_gather": 3}})
        self.assertEqual(value_audit_compare.report(t)["rows_by_merge_form"], {"all_gather": 3})


class TestMergeFormVerdict(CustomTestCase):
    ONE, SUM = value_audit.ONE_EXCHANGE, value_audit.SCALED_SUM
    ERRORS = {"extend": [0.001], "decode": [0.002], "decode_graph": [0.002]}

    def _failures(self, forms, asked, errors=None):
        run = _totals(errors or self.ERRORS, merge_forms=forms)
        return value_audit_compare.merge_form_failures(run, one_exchange_asked=asked)

    def test_asked_needs_rows_merged_by_the_one_exchange_replays_included(self):
        self.assertEqual(self._failures({"decode": {self.ONE: 4}, "decode_graph": {self.ONE: 6}}, True), [])
        self.assertIn("all 10 merged rows", self._failures({"decode": {self.SUM: 4}, "decode_graph": {self.SUM: 6}}, True)[0])
        self.assertIn("no replayed row", self._failures({"decode": {self.ONE: 4}, "decode_graph": {self.SUM: 6}}, True)[0])
        self.assertIn("no checked row was merged per owner", self._failures({}, True)[0])
        eager = {"extend": [0.001], "decode": [0.002]}  # no graphs ran: eager rows are enough
        self.assertEqual(self._failures({"decode": {self.ONE: 4}}, True, errors=eager), [])

    def test_not_asked_allows_no_row_merged_by_the_one_exchange(self):
        self.assertEqual(self._failures({"decode": {self.SUM: 4}, "decode_graph": {self.SUM: 6}}, False), [])
        self.assertEqual(self._failures({}, False), [])  # the gather path merges nothing
        self.assertIn("2 checked value-audit rows", self._failures({"decode_graph": {self.ONE: 2, self.SUM: 1}}, False)[0])

    def test_a_merge_form_failure_is_not_a_value_failure(self):
        for found in (self._failures({}, True), self._failures({"decode": {self.ONE: 1}}, False)):
            self.assertTrue(found[0].startswith("merge form:"), found)


class TestVerdictLines(CustomTestCase):
    """``smoke_verdicts``: a value-only plant is as expected only when the value audit caught it and
    no other check failed; a clean line shows the values checked and the replays by batch size.
    Seen failing with value plants judged as every plant is (any failure counted as caught)."""

    def _lines(self, runs):
        sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "scripts" / "gpu"))
        import smoke_verdicts

        with tempfile.TemporaryDirectory() as tmp:
            for name, failures, figures in runs:
                (Path(tmp) / name).mkdir()
                (Path(tmp) / name / "report.json").write_text(json.dumps({"runs": [
                    {"failures": failures, "records": [{}] * 3, "figures": figures}]}))  # fmt: skip
            return [smoke_verdicts.verdict(Path(tmp), name) for name, _, _ in runs]

    def test_value_plants_are_caught_by_the_value_audit_alone(self):
        lines = self._lines([
            ("plant_value-a", ["value audit (decode): 9 of 9 rows off", "teacher-forced: mean above"], {}),
            ("plant_value-b", ["read audit: 3 of 9 kv rows read hold another token"], {}),
            ("plant_value-c", [], {}),
            ("plant_other", ["read audit: 1 wrong"], {}),
            ("plant_value-d", ["merge form: the one-exchange merge was asked but no checked row was merged per owner"], {}),
        ])  # fmt: skip
        self.assertEqual([ok for _, ok in lines], [True, False, False, True, False])
        self.assertIn("not a value-only failure", lines[4][0])
        self.assertIn("caught by the value audit alone", lines[0][0])
        self.assertIn("not a value-only failure", lines[1][0])
        self.assertIn("PLANT NOT CAUGHT", lines[2][0])

    def test_a_clean_line_shows_values_and_replays_by_batch_size(self):
        figures = {"value_audit": {"all": {"rows": 120, "max": 0.004, "p99": 0.003}, "graph_replays_by_bs": {"2": 5, "16": 1},
                                   "rows_by_merge_form": {"all_gather": 40}},
                   "value_tolerance": {"max": 0.012}}  # fmt: skip
        ((line, ok),) = self._lines([("on_x", [], figures)])
        self.assertTrue(ok)
        self.assertIn("values 120 rows, max rel err 0.004, p99 0.003 (tolerance 0.012), graph replays by batch size", line)
        self.assertIn("merged rows: 40 by all_gather", line)


class TestValuePlants(CustomTestCase):
    def test_stale_lse_is_a_no_op_eagerly_and_the_warmup_lse_in_a_capture(self):
        merge = planted_bugs.merge_with_warmup_lse()
        state = SimpleNamespace(cp_rank=0)
        seen = []
        original = lambda state, out, lse: seen.append(lse.clone())  # noqa: E731
        warmup, replayed = torch.full((2, 4), -5.0), torch.full((2, 4), 3.0)
        with mock.patch.object(value_audit, "capturing", return_value=False):
            merge(original, state, None, warmup)
            merge(original, state, None, replayed)  # eager: its own LSE
        with mock.patch.object(value_audit, "capturing", return_value=True):
            merge(original, state, None, replayed)  # captured: the last eager call's copy
        self.assertTrue(torch.equal(seen[0], warmup) and torch.equal(seen[1], replayed))
        self.assertTrue(torch.equal(seen[2], replayed))  # the last warm-up was `replayed`...
        with mock.patch.object(value_audit, "capturing", return_value=False):
            merge(original, state, None, warmup)
        with mock.patch.object(value_audit, "capturing", return_value=True):
            merge(original, state, None, replayed)
        self.assertTrue(torch.equal(seen[4], warmup))  # ... and now `warmup`, whatever the graph computes

    def test_merge_skew_moves_rank_1_only(self):
        seen = []
        original = lambda state, out, lse: seen.append(lse)  # noqa: E731
        for rank in (0, 1):
            planted_bugs.merge_with_skewed_lse(original, SimpleNamespace(cp_rank=rank), None, torch.zeros(2))
        self.assertEqual([x.tolist() for x in seen], [[0.0, 0.0], [planted_bugs.MERGE_LSE_SKEW] * 2])

    def test_gathered_scale_touches_the_gathered_region_only(self):
        for dtype in ("bf16", "fp8"):
            with self.subTest(dtype=dtype):
                slot = make_nsa_pool(8 * PAGE, dtype, 1, "cpu")
                buffer = slot.kv_buffer[0]
                raw = buffer.view(torch.uint8) if buffer.element_size() == 1 else buffer
                if dtype == "bf16":
                    raw.copy_(torch.ones_like(raw))
                else:
                    raw[:, 0, 512:528].view(torch.float32).fill_(1.0)
                layout = SimpleNamespace(page_size=PAGE)
                plan = SimpleNamespace(layout=layout, gathered_region_pages=2)
                runtime = SimpleNamespace(plan=plan, kv_slot_for_read=lambda layer_id: slot)
                planted_bugs.scale_gathered_pages(None, runtime, None, SimpleNamespace(layer_id=0))
                if dtype == "bf16":
                    values = raw[:, 0, :512].float().mean(dim=1)
                else:
                    values = raw[:, 0, 512:528].contiguous().view(torch.float32).mean(dim=1)
                self.assertTrue(bool((values[:PAGE] == 1).all()))  # the dummy page
                self.assertTrue(bool((values[PAGE : 3 * PAGE] == planted_bugs.GATHERED_SCALE).all()))
                self.assertTrue(bool((values[3 * PAGE :] == 1).all()))  # pages filled locally


if __name__ == "__main__":
    unittest.main()
