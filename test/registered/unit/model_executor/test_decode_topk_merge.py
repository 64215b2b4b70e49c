"""Per-owner decode top-k: every rank scores only its own pages, and after the candidate exchange
every rank selects exactly what a replicated pool selects (tie rule: score desc, position asc), and
attends to exactly its own share of it.

Planted bugs, each made one test here fail (then reverted):
- candidate keys ordering ties by position descending (``_LOW_32 + positions``) -> the tie tests;
- local candidates not masking columns past the owned length -> the garbage columns win;
- ``owned_seq_lens`` counting the partial last page as full -> positions past seq_len selected;
- owner of a global slot computed as ``columns % k`` -> indices of the wrong rank;
- owned pages not excluding logical pages below cp_size -> the padded request selects the dummy page;
- ``compact_owned_indices`` sorting without ``stable=True`` -> the compaction test.
"""

import math
import unittest

import torch

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.model_executor.decode_topk_merge import (
    PAD_KEY,
    candidate_keys,
    compact_owned_indices,
    position_of_key,
    replicated_topk_positions,
    same_selection_up_to_ties,
    score_of_key,
)
from sglang_cp_shared_kv.testing.per_owner_decode_cases import (
    emulated_local_logits,
    per_owner_topk,
    random_batch,
)

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")


def tied_scores(generator, shape, levels=6):
    """Few distinct values (many exact ties), negative and positive."""
    return (torch.randint(0, levels, shape, generator=generator).float() - 2.0) * 0.75


class TestCandidateKeys(CustomTestCase):
    def test_keys_sort_by_score_desc_then_position_asc_and_round_trip(self):
        g = torch.Generator().manual_seed(0)
        scores = torch.cat([tied_scores(g, (200,)), torch.randn(200, generator=g) * 1e3])
        scores[:3] = torch.tensor([float("-inf"), -0.0, 3.4e38])
        positions = torch.randperm(400, generator=g).to(torch.int32)
        keys = candidate_keys(scores, positions, torch.ones(400, dtype=torch.bool))
        order = torch.argsort(keys, descending=True).tolist()
        # -0.0 sorts below +0.0 (distinct keys), then position ascending.
        negative_zero = lambda x: x == 0 and math.copysign(1.0, x) < 0  # noqa: E731
        expected = sorted(
            range(400),
            key=lambda i: (-scores[i].item(), negative_zero(scores[i].item()), positions[i].item()),
        )
        self.assertEqual([positions[i].item() for i in order], [positions[i].item() for i in expected])
        self.assertTrue(torch.equal(position_of_key(keys), positions))
        self.assertTrue(torch.equal(score_of_key(keys).view(torch.int32), scores.view(torch.int32)))

    def test_padding_is_below_every_real_key_and_decodes_as_empty(self):
        scores = torch.tensor([float("-inf"), -3.0e38, 0.0])
        keys = candidate_keys(scores, torch.tensor([2**31 - 1, 0, 5]), torch.tensor([True, True, False]))
        self.assertEqual(keys[2].item(), PAD_KEY)
        self.assertTrue((keys[:2] > PAD_KEY).all())
        self.assertEqual(position_of_key(keys)[2].item(), -1)
        self.assertEqual(score_of_key(keys)[2].item(), float("-inf"))


class TestPerOwnerSelection(CustomTestCase):
    def _check(self, batch, logits, k):
        """Per-owner selection == replicated selection, and the ranks' indices partition it."""
        expected = replicated_topk_positions(logits, batch.seq_lens, k)
        ranks = per_owner_topk(batch, emulated_local_logits(batch, logits), k)
        for rank in ranks:  # every rank selects the same, equal to the replicated pool
            self.assertTrue(torch.equal(rank.selection.positions, expected))
        locs = batch.token_locs()
        expected_locs = torch.where(expected >= 0, locs.gather(1, expected.clamp(min=0).long()), -1)
        covered = torch.zeros_like(expected, dtype=torch.int64)
        for rank_id, rank in enumerate(ranks):
            owned = rank.attention_indices >= 0
            covered += owned.long()
            logical = batch.shard_rows(rank_id)[rank.attention_indices.clamp(min=0).long()]
            self.assertTrue(torch.equal(logical[owned], expected_locs[owned]))
        self.assertTrue(torch.equal(covered, (expected >= 0).long()))
        return expected, ranks

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
            scores = tied_scores(g, (5, batch.page_table.shape[1] * page_size))
            with self.subTest(cp_size=cp_size, page_size=page_size, k=k):
                expected, _ = self._check(batch, scores, k)
                valid = (expected >= 0).sum(dim=1)
                self.assertEqual(valid.tolist(), [min(s, k) for s in seq_lens])

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
            self.assertTrue((rank.selection.positions[1:] == -1).all())
            self.assertEqual(int(rank.tables.owned_seq_lens[1:].sum()), 0)
        expected = replicated_topk_positions(scores[:1], batch.seq_lens[:1], 32)
        self.assertTrue(torch.equal(ranks[0].selection.positions[:1], expected))


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
