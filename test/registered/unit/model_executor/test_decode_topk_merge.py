"""Per-owner decode top-k: every rank scores only its own pages, and after the candidate exchange
every rank selects the same top-k, equal to a replicated pool's up to ties at the k-th score (the
latitude sglang's own radix top-k has), and attends to exactly its own share of it.

Planted bugs, each made one test here fail (then reverted):
- the global step breaking ties by nothing (every tied candidate kept) -> the tie-rule tests;
- local candidates not masking columns past the owned length -> the garbage columns win;
- ``owned_seq_lens`` counting the partial last page as full -> positions past seq_len selected;
- ``owned_attention_indices`` reading another rank's share of the selection -> indices of the wrong rank;
- owned pages not excluding logical pages below cp_size -> the padded request selects the dummy page;
- the k-th score taken as the largest (``amax``) instead of the smallest of a top-k -> every test
  of the selection;
- ``compact_owned_indices`` sorting without ``stable=True`` -> the compaction test.
"""

import unittest

import torch

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.model_executor.per_owner_decode.decode_topk_merge import (
    compact_owned_indices,
    select_global,
    topk_columns,
)
from sglang_cp_shared_kv_testing.decode_topk_reference import (
    replicated_topk_positions,
    same_selection_up_to_ties,
)
from sglang_cp_shared_kv_testing.per_owner_decode_cases import (
    emulated_local_logits,
    per_owner_topk,
    random_batch,
)

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")


def tied_scores(generator, shape, levels=6):
    """Few distinct values (many exact ties), negative and positive."""
    return (torch.randint(0, levels, shape, generator=generator).float() - 2.0) * 0.75


class TestTopkColumns(CustomTestCase):
    def test_largest_within_each_rows_length_and_padding_for_short_rows(self):
        g = torch.Generator().manual_seed(0)
        scores = torch.randn(4, 300, generator=g)
        scores[:, 250:] = 1e9  # stale columns past every length
        lengths = torch.tensor([250, 40, 0, 200])
        columns = topk_columns(scores, lengths, 64)
        self.assertEqual(columns.dtype, torch.int32)
        for row, n in enumerate(lengths.tolist()):
            valid = columns[row][columns[row] >= 0]
            self.assertEqual(valid.numel(), min(n, 64))
            self.assertTrue((columns[row][valid.numel():] == -1).all())
            if n:
                expected = set(torch.topk(scores[row, :n], min(n, 64)).indices.tolist())
                self.assertEqual(set(valid.tolist()), expected)


class TestGlobalSelectionTieRule(CustomTestCase):
    def test_above_the_kth_score_then_ties_in_candidate_order(self):
        k = 4
        # [cp 2, B 1, k 4]: scores 5, 3 (x4 tied), 1, -inf padding.
        gathered = torch.tensor([[[5.0, 3.0, 3.0, 1.0]], [[3.0, 3.0, float("-inf"), float("-inf")]]])
        chosen = select_global(gathered, k).chosen_mask()
        # 5 above the k-th score 3; of the four 3s the first three in candidate order (rank 0's two,
        # then rank 1's first).
        expected = torch.tensor([[[True, True, True, False], [True, False, False, False]]])
        self.assertTrue(torch.equal(chosen, expected))

    def test_padding_never_selected_and_every_real_candidate_of_a_short_request_is(self):
        inf = float("-inf")
        gathered = torch.tensor([[[2.0, inf, inf]], [[inf, inf, inf]], [[0.5, -7.0, inf]]])
        chosen = select_global(gathered, 3).chosen_mask()
        self.assertTrue(torch.equal(chosen, torch.isfinite(gathered).permute(1, 0, 2)))

    def test_a_function_of_the_gathered_scores_alone(self):
        g = torch.Generator().manual_seed(7)
        gathered = tied_scores(g, (4, 6, 32), levels=3)
        first = select_global(gathered, 32).chosen_mask()
        again = select_global(gathered.clone(), 32).chosen_mask()
        self.assertTrue(torch.equal(first, again))
        self.assertEqual(first.sum(dim=(1, 2)).tolist(), [32] * 6)


class TestPerOwnerSelection(CustomTestCase):
    def _check(self, batch, logits, k, exact=False):
        """Every rank's selection is the same, equal to the replicated selection up to ties (exactly
        when no scores tie), and the ranks' indices partition it."""
        expected = replicated_topk_positions(logits, batch.seq_lens, k)
        ranks = per_owner_topk(batch, emulated_local_logits(batch, logits), k)
        ours = ranks[0].positions
        for rank in ranks:  # every rank selects the same
            self.assertTrue(torch.equal(rank.positions, ours))
        self.assertTrue(same_selection_up_to_ties(ours, expected, logits, batch.seq_lens, k).all())
        if exact:
            width = ours.shape[1]
            pad = lambda p: torch.nn.functional.pad(p.long(), (0, width - p.shape[1]), value=-1)  # noqa: E731
            self.assertTrue(torch.equal(ours.long().sort(dim=1).values, pad(expected).sort(dim=1).values))
        locs = batch.token_locs()
        selected = torch.where(ours >= 0, locs.gather(1, ours.clamp(min=0).long()), -1)
        for row in range(ours.shape[0]):
            attended = []
            for rank_id, rank in enumerate(ranks):
                idx = rank.attention_indices[row]
                attended += batch.shard_rows(rank_id)[idx[idx >= 0].long()].tolist()
            self.assertEqual(sorted(attended), sorted(selected[row][selected[row] >= 0].tolist()))
        return ours, ranks

    def test_random_batches_with_ties_short_requests_and_stale_columns(self):
        g = torch.Generator().manual_seed(1)
        for trial in range(12):
            cp_size = [1, 2, 3, 4, 8][trial % 5]
            page_size = [4, 16, 64][trial % 3]
            k = [8, 32, 100][trial % 3]
            seq_lens = torch.randint(1, 6 * k, (5,), generator=g).tolist()
            seq_lens[0] = k  # exactly k
            seq_lens[1] = max(1, k // 3)  # shorter than k
            batch = random_batch(g, cp_size, page_size, seq_lens)
            width = batch.page_table.shape[1] * page_size
            for name, scores in (("ties", tied_scores(g, (5, width))), ("distinct", torch.randn(5, width, generator=g))):
                with self.subTest(cp_size=cp_size, page_size=page_size, k=k, scores=name):
                    ours, _ = self._check(batch, scores, k, exact=name == "distinct")
                    self.assertEqual((ours >= 0).sum(dim=1).tolist(), [min(s, k) for s in seq_lens])

    def test_real_top_k_width(self):
        g = torch.Generator().manual_seed(2)
        batch = random_batch(g, 4, 64, [5000, 2048, 700, 2049])
        self._check(batch, tied_scores(g, (4, batch.page_table.shape[1] * 64), levels=50), 2048)

    def test_a_rank_owning_none_of_the_selection_attends_to_nothing(self):
        g = torch.Generator().manual_seed(3)
        batch = random_batch(g, 2, 16, [400])
        scores = torch.zeros((1, batch.page_table.shape[1] * 16))
        owner = batch.token_locs() // 16 % 2
        scores = torch.where(owner == 0, 1.0 + scores, scores)  # rank 0's tokens win
        self.assertGreaterEqual(int((owner[0, :400] == 0).sum()), 32)
        _, ranks = self._check(batch, scores, 32)
        self.assertTrue((ranks[1].attention_indices == -1).all())
        self.assertEqual(int((ranks[0].attention_indices >= 0).sum()), 32)

    def test_padded_requests_select_nothing_on_any_rank(self):
        g = torch.Generator().manual_seed(4)
        batch = random_batch(g, 4, 16, [300, 1, 1], padded=[False, True, True])
        scores = tied_scores(g, (3, batch.page_table.shape[1] * 16))
        ranks = per_owner_topk(batch, emulated_local_logits(batch, scores), 32)
        for rank in ranks:
            self.assertTrue((rank.attention_indices[1:] == -1).all())
            self.assertTrue((rank.positions[1:] == -1).all())
            self.assertEqual(int(rank.tables.owned_seq_lens[1:].sum()), 0)
        expected = replicated_topk_positions(scores[:1], batch.seq_lens[:1], 32)
        self.assertTrue(
            same_selection_up_to_ties(ranks[0].positions[:1], expected, scores[:1], batch.seq_lens[:1], 32).all()
        )


class TestCompactOwnedIndices(CustomTestCase):
    def test_valid_first_in_order_with_counts(self):
        g = torch.Generator().manual_seed(6)
        indices = torch.randint(0, 1000, (7, 64), generator=g, dtype=torch.int32)
        indices[torch.rand(7, 64, generator=g) < 0.6] = -1
        indices[3] = -1  # a rank owning none of a token's selection
        compacted, counts = compact_owned_indices(indices)
        for row in range(7):
            valid = indices[row][indices[row] >= 0]
            n = int(counts[row])
            self.assertEqual(n, valid.numel())
            self.assertTrue(torch.equal(compacted[row, :n], valid))
            self.assertTrue((compacted[row, n:] == -1).all())


class TestSameSelectionUpToTies(CustomTestCase):
    def test_other_tie_orders_agree_and_a_wrong_token_does_not(self):
        g = torch.Generator().manual_seed(5)
        scores = tied_scores(g, (6, 300))
        seq_lens = torch.tensor([300, 250, 40, 8, 299, 120])
        k = 32
        ours = replicated_topk_positions(scores, seq_lens, k)
        # The same scores with positions reversed: ties now broken by position descending.
        reversed_positions = replicated_topk_positions(scores.flip(1), seq_lens * 0 + 300, k)
        theirs = torch.where(reversed_positions >= 0, 299 - reversed_positions, -1)
        theirs[:, :] = torch.where(seq_lens[:, None] == 300, theirs, ours)
        self.assertFalse(torch.equal(ours[0].sort().values, theirs[0].sort().values))
        self.assertTrue(same_selection_up_to_ties(ours, theirs, scores, seq_lens, k).all())
        wrong = ours.clone()
        lowest = scores[0].argmin()
        wrong[0, 0] = lowest  # replaces the best token by the worst
        agree = same_selection_up_to_ties(ours, wrong, scores, seq_lens, k)
        self.assertEqual(agree.tolist(), [False] + [True] * 5)
        short = ours.clone()
        short[2, 0] = -1  # a request of 40 tokens must keep 32
        self.assertFalse(same_selection_up_to_ties(ours, short, scores, seq_lens, k)[2])


if __name__ == "__main__":
    unittest.main()
