"""LSE merge of per-owner partial attention: equal to attention over the union of every rank's rows,
for ranks owning none of a token's rows (empty partials with garbage outputs), LSEs in base 2, and
over a real gloo group in both exchange forms (one all-gather of partial + LSE, the scaled sum),
identically on every rank and equal to each other within the checks' bf16 tolerance.

Planted bugs, each made a test here fail (then reverted):
- ``partial_weight`` without the finiteness guard (an empty +inf partial) -> NaN outputs;
- ``scaled_partial`` reading an empty partial's garbage out (no ``torch.where``) -> NaN;
- ``natural_lse`` of base 2 not multiplied by ln 2 -> the base-2 test;
- ``merge_by_all_gather`` decoding the LSE from the wrong columns -> the gloo test;
- ``unpack_gathered`` reading the LSE from the last two partial values -> the gloo test;
- ``merge_partials`` multiplying an empty partial's garbage by its zero weight (no
  ``scaled_partial``) -> the gloo test (NaN from the garbage partial);
- the scaled sum without the all-reduce (own term only) -> the gloo test.
"""

import math
import unittest

import torch

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.model_executor.per_owner_decode.attention_lse_merge import (
    global_lse,
    merge_by_all_gather,
    merge_by_scaled_sum,
    merge_partials,
    natural_lse,
    process_group_collectives,
)
from sglang_cp_shared_kv_testing.multi_rank import run_ranks
from sglang_cp_shared_kv_testing.nsa_decode_reference import sparse_mla_decode_reference

register_cpu_ci(est_time=80, suite="stage-a-test-cpu")

HEADS, DIM_QK, DIM_V = 8, 96, 64


def split_case(seed, ranks, tokens=6, rows=300, k=40):
    """Queries, rows, each token's selected rows and a random owner per row; per-rank indices hold
    the rows that rank owns (-1 elsewhere). Token 1's rows all belong to rank 0; token 2 selects
    nothing (a padded request)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, HEADS, DIM_QK, generator=g)
    kv = torch.randn(rows, DIM_QK, generator=g) * 1.5
    selected = torch.stack([torch.randperm(rows, generator=g)[:k] for _ in range(tokens)])
    selected[2] = -1
    owner = torch.randint(0, ranks, (rows,), generator=g)
    owner_of = torch.where(selected >= 0, owner[selected.clamp(min=0)], -1)
    owner_of[1] = torch.where(selected[1] >= 0, 0, -1)
    per_rank = [torch.where(owner_of == r, selected, -1) for r in range(ranks)]
    return q, kv, selected, per_rank


def partials(q, kv, per_rank, scale):
    outs, lses = zip(*(sparse_mla_decode_reference(q, kv, idx, scale, DIM_V) for idx in per_rank))
    return torch.stack(outs), torch.stack(lses)


class TestMergePartials(CustomTestCase):
    scale = 1 / math.sqrt(DIM_QK)

    def test_equals_attention_over_the_union(self):
        for ranks in (1, 2, 3, 8):
            q, kv, selected, per_rank = split_case(ranks, ranks)
            ref_out, ref_lse = sparse_mla_decode_reference(q, kv, selected, self.scale, DIM_V)
            outs, lses = partials(q, kv, per_rank, self.scale)
            # Empty partials' outputs are garbage the merge must not read.
            outs = torch.where(torch.isfinite(lses)[..., None], outs, float("nan"))
            out, lse = merge_partials(outs, lses), global_lse(lses)
            with self.subTest(ranks=ranks):
                self.assertFalse(out.isnan().any())
                torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
                real = torch.isfinite(ref_lse)
                torch.testing.assert_close(lse[real], ref_lse[real], rtol=1e-5, atol=1e-5)
                self.assertTrue(torch.equal(out[2], torch.zeros_like(out[2])))
                self.assertTrue((lse[2] == float("-inf")).all())
                self.assertTrue((lses[1:, 1] == float("inf")).all())  # ranks owning none of token 1

    def test_minus_inf_empty_partials_and_base_two_lse(self):
        q, kv, selected, per_rank = split_case(11, 4)
        ref_out, _ = sparse_mla_decode_reference(q, kv, selected, self.scale, DIM_V)
        outs, lses = partials(q, kv, per_rank, self.scale)
        lses_base2 = torch.where(torch.isfinite(lses), lses / math.log(2.0), float("-inf"))
        out = merge_partials(outs, natural_lse(lses_base2, 2))
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        wrong_base = merge_partials(outs, lses_base2)
        self.assertGreater((wrong_base - ref_out).abs().max().item(), 1e-2)

    def test_dropping_one_partial_is_visible(self):
        q, kv, selected, per_rank = split_case(12, 3)
        ref_out, _ = sparse_mla_decode_reference(q, kv, selected, self.scale, DIM_V)
        outs, lses = partials(q, kv, per_rank, self.scale)
        lses[2] = float("-inf")
        out = merge_partials(outs, lses)
        self.assertGreater((out - ref_out).abs().max().item(), 1e-2)

    def test_global_lse_of_all_empty_is_minus_inf(self):
        lses = torch.tensor([[float("inf"), float("-inf")], [float("nan"), float("-inf")]])
        self.assertTrue((global_lse(lses) == float("-inf")).all())


def _merge_on_rank(rank, world_size, seed):
    group = torch.distributed.group.WORLD
    q, kv, _, per_rank = split_case(seed, world_size)
    out_r, lse_r = sparse_mla_decode_reference(q, kv, per_rank[rank], 1 / math.sqrt(DIM_QK), DIM_V)
    all_gather, all_reduce_sum = process_group_collectives(group)
    # An empty partial's output is garbage the merge must never read (either form).
    out_r = torch.where(torch.isfinite(lse_r)[..., None], out_r, float("nan")).to(torch.bfloat16)
    scores = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1) - 0.5
    return (
        merge_by_all_gather(out_r, lse_r, all_gather),
        merge_by_scaled_sum(out_r, lse_r, all_gather, all_reduce_sum),
        all_gather(scores),  # the candidates' exchange, as PerOwnerDecode.select runs it
    )


class TestExchangesOverGloo(CustomTestCase):
    def test_both_forms_match_the_union_and_agree_on_every_rank(self):
        seed, ranks = 21, 3
        q, kv, selected, _ = split_case(seed, ranks)
        ref_out, _ = sparse_mla_decode_reference(q, kv, selected, 1 / math.sqrt(DIM_QK), DIM_V)
        results = run_ranks(_merge_on_rank, ranks, (seed,))
        for form in (0, 1):
            first = results[0][form]
            self.assertEqual(first.dtype, torch.bfloat16)
            self.assertFalse(first.isnan().any())
            for rank_result in results[1:]:
                self.assertTrue(torch.equal(rank_result[form], first))
            torch.testing.assert_close(first.float(), ref_out, rtol=2e-2, atol=2e-2)
            self.assertTrue(torch.equal(first[2], torch.zeros_like(first[2])))  # the padded token
        # one exchange against the scaled sum (today's merge): within the bf16 tolerance
        torch.testing.assert_close(results[0][0].float(), results[0][1].float(), rtol=2e-2, atol=2e-2)
        scores = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        expected = torch.stack([scores * (r + 1) - 0.5 for r in range(ranks)])
        for rank_result in results:  # candidate scores arrive rank-major on every rank
            self.assertTrue(torch.equal(rank_result[2], expected))


if __name__ == "__main__":
    unittest.main()
