"""Bytes per decode step: the formulas equal the bytes of the buffers the exchanges actually send, and
the per-owner path does not grow with the context while the page gather does.

Planted bugs: the all-gather form's LSE counted as 2 bytes -> the buffer-size test fails
(reverted); the bf16 KV row as 1152 - 132 bytes -> the documented table no longer matches (reverted).
"""

import unittest

import torch

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.model_executor.per_owner_decode import attention_lse_merge as merge
from sglang_cp_shared_kv_testing.decode_step_bytes import (
    GLM5_FP8,
    DecodeShapes,
    candidate_bytes_per_token_layer,
    merge_bytes_per_token_layer,
    page_gather_bytes,
    per_owner_bytes,
    step_bytes_table,
)
from sglang_cp_shared_kv.model_executor.per_owner_decode.decode_topk_merge import local_candidates
from sglang_cp_shared_kv_testing.lse_merge_reference import merge_by_all_gather
from sglang_cp_shared_kv_testing.repo_scripts import REPO_ROOT

register_cpu_ci(est_time=3, suite="stage-a-test-cpu")

SMALL = DecodeShapes(layers=3, heads=4, kv_lora_rank=16, hidden=24, index_topk=32, kv_row_bytes=656)


class TestDecodeStepBytes(CustomTestCase):
    def test_formulas_equal_the_bytes_each_exchange_sends(self):
        tokens, cp_size = 5, 4
        out = torch.randn(tokens, SMALL.heads, SMALL.kv_lora_rank).to(torch.bfloat16)
        lse = torch.randn(tokens, SMALL.heads)
        sent = {}

        def all_gather(tensor):
            sent.setdefault("gather", 0)
            sent["gather"] += tensor.numel() * tensor.element_size()
            return torch.stack([tensor] * cp_size)

        def all_reduce_sum(tensor):
            sent["reduce"] = tensor.numel() * tensor.element_size()
            return tensor * cp_size

        merge_by_all_gather(out, lse, all_gather)
        per_token = merge_bytes_per_token_layer(SMALL, cp_size, "all_gather")
        self.assertEqual((cp_size - 1) * sent["gather"], per_token * tokens)

        sent.clear()
        merge.merge_by_scaled_sum(out, lse, all_gather, all_reduce_sum)
        ring = 2 * (cp_size - 1) / cp_size
        received = (cp_size - 1) * sent["gather"] + ring * sent["reduce"]
        self.assertAlmostEqual(received, merge_bytes_per_token_layer(SMALL, cp_size, "scaled_sum") * tokens)

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

    def test_per_owner_is_flat_in_context_and_far_below_the_gather(self):
        for batch in (1, 32):
            per_owner = per_owner_bytes(GLM5_FP8, 8, batch, "scaled_sum")
            gather_4k = page_gather_bytes(GLM5_FP8, 8, batch * 4096)
            gather_128k = page_gather_bytes(GLM5_FP8, 8, batch * 131072)
            self.assertAlmostEqual(gather_128k / gather_4k, 32.0)
            self.assertLess(per_owner, gather_4k)
        # The documented GLM-5 numbers (docs/runtime.md): 7.0 GB gather for one 128K request at cp 8.
        self.assertAlmostEqual(page_gather_bytes(GLM5_FP8, 8, 131072) / 1e9, 7.05, places=2)
        self.assertAlmostEqual(merge_bytes_per_token_layer(GLM5_FP8, 8, "all_gather"), 460544)
        self.assertAlmostEqual(merge_bytes_per_token_layer(GLM5_FP8, 8, "scaled_sum"), 116480)


    def test_docs_table_is_the_code_output(self):
        """docs/runtime.md shows users the table this module computes (GLM-5, cp 2/8, batch 1/32,
        4K-128K), not numbers typed by hand."""
        table = step_bytes_table()
        self.assertIn("| 8 | 1 x 128K | 7.05 GB | 11.5 GB | 13.6 MB |", table)
        self.assertIn(table, (REPO_ROOT / "docs" / "runtime.md").read_text())


if __name__ == "__main__":
    unittest.main()
