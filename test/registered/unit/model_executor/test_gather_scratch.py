"""Gather scratch budget: the bytes reserved before pool sizing always hold both slots allocated after."""

import random
import unittest
from types import SimpleNamespace
from unittest import mock

import torch

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.model_executor.gather_scratch import create_gather_scratch, create_prefetch_slot, index_k_bytes_per_token, prefetch_slot_tokens, reserve_scratch_bytes, scratch_bytes, slot0_scratch_tokens
from sglang_cp_shared_kv.settings import PREFETCH_SLOT_TOKENS_ENV, current_settings
from sglang_cp_shared_kv.startup_rules import configured_prefetch_slot_tokens
from sglang_cp_shared_kv.model_executor import cp_shared_kv_capacity as capacity
from sglang_cp_shared_kv_testing.runtime_check import KV_DIMS, make_nsa_pool
from sglang_cp_shared_kv_testing.server_args_cases import runtime_server_args

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

PAGE = 64


def _kv_row_bytes(dtype_name):
    dtype, kv_cache_dim = KV_DIMS[dtype_name]
    return kv_cache_dim * dtype.itemsize


def _pool_tokens(available_bytes, cell_bytes):
    """What sglang's DefaultPoolConfigurator gives the pool for ``available_bytes``."""
    return available_bytes // cell_bytes // PAGE * PAGE


class TestScratchSize(CustomTestCase):
    def test_formula_matches_the_allocated_scratch(self):
        for dtype_name in ("bf16", "fp8"):
            pool = make_nsa_pool(5 * PAGE, dtype_name, 3, "cpu")
            scratch = create_gather_scratch(pool, cp_size=3)
            self.assertEqual(scratch.size, 15 * PAGE)
            self.assertEqual(scratch.layer_num, 1)
            self.assertEqual(scratch.kv_cache_dim, pool.kv_cache_dim)
            self.assertEqual(scratch.nsa_kv_cache_store_fp8, pool.nsa_kv_cache_store_fp8)
            self.assertEqual(
                scratch.get_kv_size_bytes(),
                scratch_bytes(15 * PAGE, _kv_row_bytes(dtype_name), PAGE, pool.index_head_dim),
            )

    def test_second_slot_is_page_rounded_and_capped_at_the_logical_capacity(self):
        pool = make_nsa_pool(5 * PAGE, "fp8", 3, "cpu")
        row = _kv_row_bytes("fp8")
        for requested, tokens in ((1, PAGE), (2 * PAGE, 2 * PAGE), (10**6, 15 * PAGE)):
            slot = create_prefetch_slot(pool, 3, requested)
            self.assertEqual(slot.size, tokens)
            self.assertEqual(slot.layer_num, 1)
            self.assertEqual(slot.get_kv_size_bytes(), scratch_bytes(tokens, row, PAGE))
        self.assertIsNone(create_prefetch_slot(pool, 3, 0))

    def test_second_slot_default_and_setting(self):
        with mock.patch.dict("os.environ", {}, clear=False) as env:
            env.pop(PREFETCH_SLOT_TOKENS_ENV, None)
            self.assertEqual(configured_prefetch_slot_tokens(current_settings(), 131072, 8192), 0)  # off by default
            env[PREFETCH_SLOT_TOKENS_ENV] = "auto"
            # context + one chunk, +25% for owner padding; no chunking: two contexts.
            self.assertEqual(configured_prefetch_slot_tokens(current_settings(), 131072, 8192), (131072 + 8192) * 5 // 4)
            self.assertEqual(configured_prefetch_slot_tokens(current_settings(), 1000, -1), 2500)
            env[PREFETCH_SLOT_TOKENS_ENV] = "4096"
            self.assertEqual(configured_prefetch_slot_tokens(current_settings(), 131072, 8192), 4096)
            env[PREFETCH_SLOT_TOKENS_ENV] = "-3"
            with self.assertRaisesRegex(ValueError, PREFETCH_SLOT_TOKENS_ENV):
                configured_prefetch_slot_tokens(current_settings(), 131072, 8192)

    def test_indexer_row_bytes_come_from_the_pool_geometry(self):
        pool = make_nsa_pool(2 * PAGE, "fp8", 1, "cpu")
        page_bytes = pool.index_k_with_scale_buffer[0].shape[1]
        self.assertEqual(index_k_bytes_per_token(pool.index_head_dim), page_bytes // PAGE)
        self.assertEqual(index_k_bytes_per_token(), 128 + 4)  # fp8 values + one fp32 scale


class TestReservation(CustomTestCase):
    def test_pool_sized_from_the_rest_leaves_room_for_both_slots(self):
        rng = random.Random(0)
        for _ in range(500):
            dtype_name = rng.choice(["bf16", "fp8"])
            cp_size = rng.choice([2, 4, 8])
            layers = rng.randrange(4 * cp_size, 80)  # the scratch is up to 2 * cp_size layers' worth
            # sglang's configurator counts 576 latent values per token, even for fp8 656-byte rows.
            cell = layers * (576 * KV_DIMS[dtype_name][0].itemsize + 132)
            available = rng.randrange(cell * PAGE * (2 * cp_size + 2), cell * 10**6)
            unreserved = _pool_tokens(available, cell)
            row = _kv_row_bytes(dtype_name)
            requested = rng.choice([0, rng.randrange(1, 4 * cp_size * unreserved + 2)])
            # Slot 0 at the logical capacity (decode gathers) or prefill-sized (decode per owner).
            prefill = rng.choice([None, rng.randrange(1, 2 * cp_size * unreserved + 2)])
            reserve = reserve_scratch_bytes(
                available, unreserved, cp_size, row, PAGE, requested_prefetch_slot_tokens=requested,
                prefill_slot0_tokens=prefill,
            )
            pool_tokens = _pool_tokens(available - reserve, cell)
            slot1 = prefetch_slot_tokens(requested, cp_size * pool_tokens, PAGE)
            slot0 = slot0_scratch_tokens(prefill, cp_size * pool_tokens, PAGE)
            allocated = scratch_bytes(slot0, row, PAGE)
            allocated += scratch_bytes(slot1, row, PAGE) if slot1 else 0
            self.assertLessEqual(allocated, reserve)
            self.assertGreater(pool_tokens, 0)
            # Exact when the pool gets the unreserved size: the reservation is both slots' bytes.
            slot1 = prefetch_slot_tokens(requested, cp_size * unreserved, PAGE)
            exact = scratch_bytes(slot0_scratch_tokens(prefill, cp_size * unreserved, PAGE), row, PAGE)
            exact += scratch_bytes(slot1, row, PAGE) if slot1 else 0
            self.assertEqual(reserve, exact)

    def test_too_little_memory_names_the_flags(self):
        with self.assertRaisesRegex(ValueError, "enable-nsa-prefill-cp-shared-kv.*mem-fraction-static"):
            reserve_scratch_bytes(10**6, 10**4, 8, 656, PAGE)


class TestReservationHook(CustomTestCase):
    CELL = 78 * (576 + 132)

    CONTEXT_LEN, CHUNK = 131072, 8192
    SLOT1 = (CONTEXT_LEN + CHUNK) * 5 // 4  # a multiple of the page size

    def _model_runner(
        self, max_total_tokens=None, is_draft_worker=False, flag=True, decode_backend="flashmla_kv"
    ):
        """fp8 KV (``flashmla_kv``, which the default ``auto`` decodes through the gather): slot 0
        holds the logical capacity; where decode runs per owner (``SGLANG_CP_SHARED_KV_DECODE=per_owner``)
        slot 0 is sized for prefill."""
        return SimpleNamespace(
            is_draft_worker=is_draft_worker,
            server_args=runtime_server_args(
                page_size=PAGE,
                max_total_tokens=max_total_tokens,
                enable_nsa_prefill_cp_shared_kv=flag,
                chunked_prefill_size=self.CHUNK,
                nsa_decode_backend=decode_backend,
            ),
            model_config=SimpleNamespace(context_len=self.CONTEXT_LEN),
            calculate_mla_kv_cache_dim=lambda: 656,
            kv_cache_dtype=torch.float8_e4m3fn,
        )

    def _run(self, model_runner, available):
        """The reservation as sglang calls it, from inside ``init_memory_pool`` (here: its whole
        body) under the capacity hook, which builds the spec the reservation reads (the capacity's
        own install, after the pool exists, is left out)."""
        configurator = SimpleNamespace(
            calculate_pool_sizes=lambda b, page: SimpleNamespace(
                max_total_num_tokens=_pool_tokens(b, self.CELL)
            )
        )

        def init_memory_pool(runner, *args):
            return capacity.reserve_scratch_before_pool_sizing(available, runner, 0)

        with mock.patch(
            "sglang.srt.model_executor.pool_configurator.create_memory_pool_configurator",
            return_value=configurator,
        ), mock.patch.object(capacity, "get_attention_cp_size", return_value=8), \
            mock.patch.object(capacity, "get_attention_cp_rank", return_value=0), \
            mock.patch.object(capacity, "install_logical_capacity"), \
            mock.patch.dict("os.environ") as env:
            env[PREFETCH_SLOT_TOKENS_ENV] = "auto"
            return capacity.init_memory_pool_with_logical_capacity(init_memory_pool, model_runner)

    def test_returns_the_budget_minus_both_slots_of_the_unreserved_pool(self):
        available = 40 << 30
        left = self._run(self._model_runner(), available)
        slot0 = scratch_bytes(8 * _pool_tokens(available, self.CELL), 656, PAGE)
        self.assertEqual(available - left, slot0 + scratch_bytes(self.SLOT1, 656, PAGE))
        # GLM-5 fp8 shape (78 layers, cp 8): slot 0 is about 11% of the KV budget, slot 1
        # (128K context + 8K chunk) about 0.13 GB.
        self.assertAlmostEqual(slot0 / available, 8 * 788 / self.CELL, delta=0.01)
        self.assertAlmostEqual(scratch_bytes(self.SLOT1, 656, PAGE) / (1 << 30), 0.125, delta=0.01)

    def test_per_owner_decode_reserves_a_prefill_sized_slot_0(self):
        available = 40 << 30
        full = available - self._run(self._model_runner(), available)
        with mock.patch.dict("os.environ", {"SGLANG_CP_SHARED_KV_DECODE": "per_owner"}):
            left = self._run(self._model_runner(decode_backend="flashmla_kv"), available)
        # Slot 0: one 128K request plus one 8K chunk, as slot 1's auto size without the padding.
        slot0 = scratch_bytes(self.CONTEXT_LEN + self.CHUNK, 656, PAGE)
        self.assertEqual(available - left, slot0 + scratch_bytes(self.SLOT1, 656, PAGE))
        # GLM-5 fp8 at cp 8: the full-capacity slot 0 was ~11% of the budget; now ~0.6%.
        self.assertLess((available - left) / available, 0.01)
        self.assertGreater(full / available, 0.1)

    def test_user_token_cap_bounds_the_reservation(self):
        left = self._run(self._model_runner(max_total_tokens=64 * 1000), 40 << 30)
        slot1 = min(self.SLOT1, 8 * 64 * 1000)
        expected = scratch_bytes(8 * 64 * 1000, 656, PAGE) + scratch_bytes(slot1, 656, PAGE)
        self.assertEqual((40 << 30) - left, expected)

    def test_draft_worker_untouched(self):
        self.assertIsNone(self._run(self._model_runner(is_draft_worker=True), 40 << 30))

    def test_flag_off_untouched(self):
        self.assertIsNone(self._run(self._model_runner(flag=False), 40 << 30))


if __name__ == "__main__":
    unittest.main()
