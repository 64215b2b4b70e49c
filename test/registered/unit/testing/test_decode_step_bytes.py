"""Collectives and bytes per decode step: the counts equal what a real ``PerOwnerDecode`` issues through
injected counting collectives (GLM-5 at CP 2, 4 and 8, batches 1 to 128, before and after the
one-exchange merge), the per-owner path does not grow with the context while the page gather does,
and the documented tables are this module's output.

Planted bugs: the all-gather form's LSE counted as 2 bytes -> the buffer-size test fails
(reverted); the bf16 KV row as 1152 - 132 bytes -> the documented table no longer matches
(reverted); ``PerOwnerDecode.merge`` always taking the scaled sum (the code before the one-exchange
form) -> ``test_the_real_per_owner_decode_makes_the_counted_collectives`` (3 collectives per layer
where 2 are counted); the rule comparing the one exchange's whole bytes, not its extra bytes, with
the setting -> ``test_the_rule_at_glm5_widths`` and the documented tables (reverted).
"""

import unittest

import torch

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.model_executor.per_owner_decode import attention_lse_merge as merge
from sglang_cp_shared_kv.model_executor.per_owner_decode.decode_topk_merge import local_candidates
from sglang_cp_shared_kv.model_executor.per_owner_decode.owner_decode_tables import (
    build_owner_decode_tables,
)
from sglang_cp_shared_kv.settings import MODELED_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES, CpSharedKVSettings
from sglang_cp_shared_kv_testing.decode_step_bytes import (
    GLM5_BF16,
    GLM5_FP8,
    DecodeShapes,
    candidate_bytes_per_token_layer,
    exchange_table,
    merge_bytes_per_token_layer,
    page_gather_bytes,
    per_owner_bytes,
    per_owner_collectives,
    served_merge_form,
    step_bytes_table,
)
from sglang_cp_shared_kv_testing.per_owner_decode_cases import random_batch
from sglang_cp_shared_kv_testing.repo_scripts import REPO_ROOT
from sglang_cp_shared_kv_testing.shared_kv_state import per_owner_pool_state

register_cpu_ci(est_time=40, suite="stage-a-test-cpu")

SMALL = DecodeShapes(layers=3, heads=4, kv_lora_rank=16, hidden=24, index_topk=32, kv_row_bytes=656)
PAGE = 64


class CountingCollectives:
    """Collectives of one rank of ``cp_size`` (every rank sends the same tensor) that count the calls
    and the bytes this rank receives (ring: all-gather ``(cp - 1) s``, all-reduce ``2 (cp - 1) / cp s``)."""

    def __init__(self, cp_size: int):
        self.cp_size, self.calls, self.received = cp_size, 0, 0.0

    def all_gather(self, tensor):
        self.calls += 1
        self.received += (self.cp_size - 1) * tensor.numel() * tensor.element_size()
        return torch.stack([tensor] * self.cp_size)

    def all_reduce_sum(self, tensor):
        self.calls += 1
        self.received += 2 * (self.cp_size - 1) / self.cp_size * tensor.numel() * tensor.element_size()
        return tensor * self.cp_size


def run_step(shapes, cp_size, batch, max_extra_bytes, layers=("topk",)):
    """One decode step of ``layers`` (``topk`` or ``skip``) through a real ``PerOwnerDecode`` with
    counting collectives: (calls, received bytes)."""
    counting = CountingCollectives(cp_size)
    layout = CpSharedKVLayout(cp_size, 0, PAGE)
    settings = CpSharedKVSettings(merge_one_exchange_max_extra_bytes=max_extra_bytes)
    state = per_owner_pool_state(layout, (counting.all_gather, counting.all_reduce_sum), settings=settings)
    g = torch.Generator().manual_seed(cp_size * 1000 + batch)
    cases = random_batch(g, cp_size, PAGE, [300] * batch)
    state.per_owner.begin_static_forward(build_owner_decode_tables(layout, cases.page_table, cases.seq_lens), None)
    logits = torch.randn(batch, cases.page_table.shape[1] * PAGE, generator=g)
    out = torch.randn(batch, shapes.heads, shapes.kv_lora_rank, generator=g).to(torch.bfloat16)
    lse = torch.randn(batch, shapes.heads, generator=g)
    for layer_id, kind in enumerate(layers):
        state.per_owner.forward.begin_layer(layer_id)
        if kind == "topk":
            state.per_owner.select(logits, shapes.index_topk)
        state.per_owner.merge(out, lse)
    return counting.calls, counting.received


class TestDecodeStepBytes(CustomTestCase):
    def test_formulas_equal_the_bytes_each_exchange_sends(self):
        tokens, cp_size = 5, 4
        out = torch.randn(tokens, SMALL.heads, SMALL.kv_lora_rank).to(torch.bfloat16)
        lse = torch.randn(tokens, SMALL.heads)
        counting = CountingCollectives(cp_size)
        merge.merge_by_all_gather(out, lse, counting.all_gather)
        self.assertEqual(counting.received, merge_bytes_per_token_layer(SMALL, cp_size, "all_gather") * tokens)

        counting = CountingCollectives(cp_size)
        merge.merge_by_scaled_sum(out, lse, counting.all_gather, counting.all_reduce_sum)
        self.assertAlmostEqual(counting.received, merge_bytes_per_token_layer(SMALL, cp_size, "scaled_sum") * tokens)

        # what the runtime all-gathers: the candidates' scores (local_candidates, as select runs it)
        width = 2 * SMALL.index_topk
        columns = torch.arange(width, dtype=torch.int32).expand(tokens, -1)
        sent_scores = local_candidates(
            torch.randn(tokens, width), torch.full((tokens,), width), columns, columns, SMALL.index_topk
        ).scores
        self.assertEqual(
            (cp_size - 1) * sent_scores.numel() * sent_scores.element_size(),
            candidate_bytes_per_token_layer(SMALL, cp_size) * tokens,
        )

    def test_the_real_per_owner_decode_makes_the_counted_collectives(self):
        """GLM-5's widths (64 heads, 512 values, top-k 2048), one top-k layer per CP size and batch:
        3 collectives before (the scaled sum), 2 wherever the rule picks one exchange, and the bytes
        the formulas count. A step of top-k and skip layers adds up the same way."""
        for cp_size in (2, 4, 8):
            for batch in (1, 8, 32, 128):
                one_layer = DecodeShapes(**{**GLM5_FP8.__dict__, "layers": 1})
                before = run_step(one_layer, cp_size, batch, max_extra_bytes=None)
                after = run_step(one_layer, cp_size, batch, max_extra_bytes=MODELED_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES)
                form = served_merge_form(one_layer, cp_size, batch)
                with self.subTest(cp_size=cp_size, batch=batch):
                    self.assertEqual(before[0], 3)
                    self.assertEqual(after[0], 2 if form == "all_gather" else 3)
                    self.assertEqual(before, (per_owner_collectives(one_layer, "scaled_sum"),
                                              per_owner_bytes(one_layer, cp_size, batch, "scaled_sum")))
                    self.assertEqual(after, (per_owner_collectives(one_layer, form),
                                             per_owner_bytes(one_layer, cp_size, batch, form)))
        step = DecodeShapes(**{**SMALL.__dict__, "topk_layers": 2})
        for max_extra_bytes, form in ((None, "scaled_sum"), (0, "all_gather")):
            with self.subTest(step=form):
                self.assertEqual(
                    run_step(step, 2, 5, max_extra_bytes, layers=("topk", "skip", "topk")),
                    (per_owner_collectives(step, form), per_owner_bytes(step, 2, 5, form)),
                )

    def test_the_rule_at_glm5_widths(self):
        """Every batch at CP 2 (equal bytes), up to 30 tokens at CP 4 and 8 at CP 8 with the default
        setting; never with the setting off."""
        largest_one_exchange = {}
        for cp_size in (2, 4, 8):
            forms = [served_merge_form(GLM5_BF16, cp_size, batch) for batch in range(1, 257)]
            largest_one_exchange[cp_size] = forms.count("all_gather")
            self.assertEqual(forms, sorted(forms))  # "all_gather" first, then "scaled_sum"
            self.assertEqual(served_merge_form(GLM5_BF16, cp_size, 1, max_extra_bytes=None), "scaled_sum")
        self.assertEqual(largest_one_exchange, {2: 256, 4: 30, 8: 8})

    def test_per_owner_is_flat_in_context_and_far_below_the_gather(self):
        for batch in (1, 32):
            per_owner = per_owner_bytes(GLM5_FP8, 8, batch, served_merge_form(GLM5_FP8, 8, batch))
            gather_4k = page_gather_bytes(GLM5_FP8, 8, batch * 4096)
            gather_128k = page_gather_bytes(GLM5_FP8, 8, batch * 131072)
            self.assertAlmostEqual(gather_128k / gather_4k, 32.0)
            self.assertLess(per_owner, gather_4k)
        # The documented GLM-5 numbers (docs/runtime.md): 7.0 GB gather for one 128K request at cp 8.
        self.assertAlmostEqual(page_gather_bytes(GLM5_FP8, 8, 131072) / 1e9, 7.05, places=2)
        self.assertAlmostEqual(merge_bytes_per_token_layer(GLM5_FP8, 8, "all_gather"), 460544)
        self.assertAlmostEqual(merge_bytes_per_token_layer(GLM5_FP8, 8, "scaled_sum"), 116480)

    def test_docs_tables_are_the_code_output(self):
        """docs/runtime.md shows users the table this module computes (GLM-5, cp 2/8, batch 1/32,
        4K-128K), and docs/measurements.md the before/after exchange table, not numbers typed by hand."""
        table = step_bytes_table()
        self.assertIn("| 8 | 1 x 128K | 7.05 GB | 11.5 GB | 40.4 MB |", table)
        self.assertIn(table, (REPO_ROOT / "docs" / "runtime.md").read_text())
        exchanges = exchange_table()
        self.assertIn("| 2 | 1 | bf16 | 234 | 5,770,752 | one all-gather | 156 | 5,770,752 |", exchanges)
        self.assertIn(exchanges, (REPO_ROOT / "docs" / "measurements.md").read_text())


if __name__ == "__main__":
    unittest.main()
