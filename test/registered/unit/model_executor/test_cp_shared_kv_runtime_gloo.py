"""CP shared KV runtime across real processes: shards + gather reproduce a replicated pool bit-exactly.

2 and 4 ranks joined by a gloo group each hold a CPU ``NSATokenToKVPool`` shard, run sglang's own
stores with our hooks (Triton kernels swapped for torch) through prefill, chunked prefill on a
cached prefix, and decode, and compare every read and every stored row with a replicated pool
(``sglang_cp_shared_kv_testing.runtime_check``).

The layer-ahead prefetch runs on a second gloo group over the same ranks (two scratch slots), on
4 layers of which layer 2 skips the indexer (``skip_topk``), with the cached prefix page loaded
back layer by layer as HiCache does. Each planted bug of ``runtime_check.PLANTS`` that can show on
CPU makes the same run report mismatches (``TestPlantedBugsAreCaught``): the check sees them.
"""

import unittest

import torch
import torch.distributed as dist

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.model_executor.peer_page_prefetch import create_prefetch_group
from sglang_cp_shared_kv_testing import runtime_check
from sglang_cp_shared_kv_testing.multi_rank import run_ranks
from sglang_cp_shared_kv_testing.nsa_cpu_kernels import act_quant_torch, cpu_kernels

register_cpu_ci(est_time=140, suite="stage-a-test-cpu")

TIMEOUT_S = 120


def _rank(rank, world_size, dtype_name, prefetch, options):
    runtime_check.apply_hooks()  # this rank's process only
    # Every rank creates the second group (dist.new_group is entered by the whole world).
    prefetch_group = dist.new_group(list(range(world_size))) if prefetch else None
    with cpu_kernels():
        result = runtime_check.run_rank(
            rank, world_size, dist.group.WORLD, device="cpu", dtype_name=dtype_name,
            act_quant=act_quant_torch, seed=world_size, prefetch_group=prefetch_group, **options,
        )
    return (
        rank, result.rows_compared, result.mismatches, result.prefetch_forwards,
        result.exact_layout_forwards, result.draft_steps,
    )


def _group_rank(rank, world_size):
    """Two CP groups {0, 2} and {1, 3} (attention TP 2 x CP 2); each rank knows only its own."""
    own = [rank % 2, rank % 2 + 2]
    group = create_prefetch_group(own, coordination_group=dist.group.WORLD, backend="gloo")
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value, group=group)
    return dist.get_process_group_ranks(group), float(value)


PREFETCH_STORY = dict(num_layers=4, skip_index_layers=(2,), hicache=True)


class _GlooCase(CustomTestCase):
    def _run_group(self, world_size, dtype_name, prefetch=False, **options):
        # Ranks fork from a server that imported sglang and this check once.
        rows = run_ranks(
            _rank,
            world_size,
            (dtype_name, prefetch, options),
            start_method="forkserver",
            preload=[runtime_check.__name__],
            timeout_s=TIMEOUT_S,
            deadline_s=TIMEOUT_S,
        )
        self.assertEqual([r[0] for r in rows], list(range(world_size)))
        compared = {r[1] for r in rows}
        self.assertEqual(len(compared), 1)  # every rank checked the same reads
        self.assertGreater(compared.pop(), 1000)
        return rows


class TestRuntimeAcrossRanks(_GlooCase):
    def _clean(self, world_size, dtype_name, **kwargs):
        rows = self._run_group(world_size, dtype_name, **kwargs)
        self.assertEqual([r[2] for r in rows], [0] * world_size)
        return rows

    def test_two_ranks_bf16(self):
        self._clean(2, "bf16")

    def test_two_ranks_fp8(self):
        self._clean(2, "fp8")

    def test_four_ranks_fp8(self):
        self._clean(4, "fp8")

    def test_prefetch_two_ranks_bf16(self):
        rows = self._clean(2, "bf16", prefetch=True, **PREFETCH_STORY)
        # The chunk over a cached prefix prefetched; fresh prefill and decode ran serially.
        self.assertEqual([r[3] for r in rows], [1, 1])

    def test_prefetch_four_ranks_fp8(self):
        # At cp 4 the forward gathers two pages: two ranks own none and still join every collective.
        rows = self._clean(4, "fp8", prefetch=True, **PREFETCH_STORY)
        self.assertEqual([r[3] for r in rows], [1] * 4)

    def test_forward_larger_than_the_second_slot_runs_serially(self):
        rows = self._clean(
            2, "fp8", prefetch=True, prefetch_slot_tokens=2 * 64, **PREFETCH_STORY
        )
        self.assertEqual([r[3] for r in rows], [0, 0])


class TestDraftPoolAcrossRanks(_GlooCase):
    """An MTP draft pool (one NextN layer, KV and indexer K) sharded by the target's layout, with its
    own runtime sharing the target's scratch: its rows land on their owners and every draft read
    equals a replicated draft pool's, in EXTEND (the draft extend after a prefill, over a cached
    prefix and a mixed page) and DECODE, while the target's reads stay exact. Planted: one page of
    each draft store written by the next rank instead of its owner (caught)."""

    def test_two_ranks_fp8(self):
        rows = self._run_group(2, "fp8", draft=True)
        self.assertEqual([r[2] for r in rows], [0, 0])

    def test_four_ranks_bf16_with_the_target_prefetching(self):
        rows = self._run_group(4, "bf16", prefetch=True, draft=True, **PREFETCH_STORY)
        self.assertEqual([r[2] for r in rows], [0] * 4)
        self.assertEqual([r[3] for r in rows], [1] * 4)  # the target's prefetch ran beside the draft

    def test_more_rows_are_compared_than_without_the_draft(self):
        with_draft = self._run_group(2, "fp8", draft=True)[0][1]
        without = self._run_group(2, "fp8")[0][1]
        self.assertGreater(with_draft, without)

    def test_target_verify_and_draft_extend(self):
        """EAGLE's speculative step after the story: a TARGET_VERIFY forward of the target (draft
        tokens after the committed ones, pages opened for them) and a DRAFT_EXTEND of the draft over
        the accepted tokens, read and stored exactly as a replicated pool (cp 2 fp8, cp 4 bf16).
        Planted in ``planned_lengths``, each caught: verify reading only the committed tokens; draft
        extend taking every read token as new (its old pages never gathered)."""
        for world_size, dtype_name in ((2, "fp8"), (4, "bf16")):
            with self.subTest(world_size=world_size):
                rows = self._run_group(world_size, dtype_name, draft=True, spec=True)
                self.assertEqual([r[2] for r in rows], [0] * world_size)

    def test_target_verify_and_spec_v2_draft_extend(self):
        """Spec v2's step: the TARGET_VERIFY, then DRAFT_EXTEND_V2 of the draft layer over every
        draft token the verify wrote (read up to the committed tokens plus the draft tokens), read
        and stored exactly as a replicated pool (cp 2 fp8, cp 4 bf16). Planted in
        ``planned_lengths``: DRAFT_EXTEND_V2 planned with every read token as new (its old pages
        never gathered) is caught. Not caught here: one written token fewer, since no request's
        draft tokens cross a page in this story, so the pages gathered do not change
        (``TestPlannedLengths`` catches the lengths off by one)."""
        for world_size, dtype_name in ((2, "fp8"), (4, "bf16")):
            with self.subTest(world_size=world_size):
                rows = self._run_group(world_size, dtype_name, draft=True, spec=True, spec_v2=True)
                self.assertEqual([r[2] for r in rows], [0] * world_size)

    def test_a_draft_page_on_the_wrong_owner_is_caught(self):
        rows = self._run_group(2, "fp8", draft=True, plant="draft_page_to_wrong_owner")
        self.assertGreater(sum(r[2] for r in rows), 0)


# EAGLE's draft after the speculative step: 4 steps (3 draft step forwards), top-k 1.
DRAFT_STEPS_STORY = dict(draft=True, spec=True, draft_steps=4, physical_pages=8)


class TestDraftDecodeStepsAcrossRanks(_GlooCase):
    """The draft's multi-step decode (``EAGLEWorker.draft``, top-k 1) after the story's speculative
    step: every step's metadata built at once through sglang's multi-step NSA backend, then three
    step forwards of the draft layer, each on its own plan (``draft_decode_steps``), writing its
    token past the committed tokens it reads; seven requests (the last committed token of one alone on
    its page; the draft tokens of one open a page at step 0, of two others at step 2) and a padded
    one. Every draft
    read of every step and, at the end, every draft and target row equal replicated pools' bit for
    bit (cp 2 fp8, cp 4 bf16).

    Planted (``runtime_check.DRAFT_PLANTS``), each caught: a step running on the previous step's
    plan; steps planned by the decode rule (the page the last committed token opened taken as
    filled locally, not gathered); steps planning the committed tokens only (the page a step's token
    opens unplanned). Planted by hand and caught, then reverted: ``peer_page_reads`` asking
    per-owner decode before the draft-step branch (``test_steps_gather_with_per_owner_decode``
    failed: the steps ran per owner and the check's scratch-addressed reads went out of the
    physical shard's range)."""

    def test_draft_steps_two_ranks_fp8_four_ranks_bf16(self):
        for world_size, dtype_name in ((2, "fp8"), (4, "bf16")):
            with self.subTest(world_size=world_size):
                rows = self._run_group(world_size, dtype_name, **DRAFT_STEPS_STORY)
                self.assertEqual([r[2] for r in rows], [0] * world_size)
                self.assertEqual([r[5] for r in rows], [3] * world_size)

    def test_the_steps_add_compared_rows(self):
        with_steps = self._run_group(2, "fp8", **DRAFT_STEPS_STORY)[0][1]
        without = self._run_group(2, "fp8", draft=True, spec=True, physical_pages=8)[0][1]
        self.assertGreater(with_steps, without)

    def test_steps_gather_with_per_owner_decode(self):
        """Per-owner decode attached to the draft's runtime (it would take a DECODE forward of the
        draft pool): the draft steps still take the page gather, bit-exact."""
        rows = self._run_group(2, "fp8", draft_per_owner=True, **DRAFT_STEPS_STORY)
        self.assertEqual([r[2] for r in rows], [0, 0])
        self.assertEqual([r[5] for r in rows], [3, 3])

    def test_planted_draft_step_bugs_are_caught(self):
        for plant in runtime_check.DRAFT_PLANTS[1:]:
            with self.subTest(plant=plant):
                rows = self._run_group(2, "fp8", plant=plant, **DRAFT_STEPS_STORY)
                self.assertGreater(sum(r[2] for r in rows), 0, plant)


class TestPrefillSizedScratch(_GlooCase):
    """Slot 0 sized for prefill only (decode per owner): at cp 4 the chunk over a cached prefix
    gathers 2 pages of 2 owners; padded (1 + 4 x 1 + 1 pages) they exceed a 5-page scratch, so
    the plan packs them exactly and the owners broadcast them, bit-exact against the replica.
    (Plant seen failing: the first owner's broadcast landing one page off.)"""

    def test_exact_layout_four_ranks_fp8(self):
        rows = self._run_group(4, "fp8", scratch_tokens=4 * 64)
        self.assertEqual([r[2] for r in rows], [0] * 4)
        self.assertEqual([r[4] for r in rows], [1] * 4)


class TestPrefetchGroup(CustomTestCase):
    def test_every_rank_creates_every_cp_group_and_keeps_its_own(self):
        rows = run_ranks(_group_rank, 4, (), start_method="forkserver", timeout_s=TIMEOUT_S,
                         deadline_s=TIMEOUT_S)
        self.assertEqual(rows, [([0, 2], 4.0), ([1, 3], 6.0), ([0, 2], 4.0), ([1, 3], 6.0)])


class TestPlantedBugsAreCaught(_GlooCase):
    """Each plant must make the prefetch run report mismatches on at least one rank."""

    def _caught(self, plant, world_size=2):
        rows = self._run_group(world_size, "fp8", prefetch=True, plant=plant, **PREFETCH_STORY)
        self.assertEqual([r[3] for r in rows], [1] * world_size)  # the prefetch path ran
        self.assertGreater(sum(r[2] for r in rows), 0, plant)

    def test_pack_before_load_back(self):
        self._caught("pack_before_load_back")

    def test_prefetch_into_busy_slot(self):
        self._caught("prefetch_into_busy_slot")

    def test_mixed_page_from_prefetch(self):
        self._caught("mixed_page_from_prefetch")


if __name__ == "__main__":
    unittest.main()
