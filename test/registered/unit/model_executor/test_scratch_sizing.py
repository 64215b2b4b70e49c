"""Slot 0 of the gather scratch sized for prefill only when decode runs per owner.

* ``scratch_sizing``: which servers get a prefill-sized slot 0 and of what size (server args and
  environment only, so every rank decides the same); every server whose decode may gather keeps
  the logical capacity.
* the bound admission enforces (``1 +`` each request's ``request_scratch_pages``) really bounds the
  plan, whatever the owners of the batch's pages (a plan on a scratch of exactly the bound never raises).

Plants seen failing (then reverted): sizing slot 0 for prefill while ``SGLANG_CP_SHARED_KV_DECODE``
is ``gather`` (``test_gathering_decode_keeps_the_logical_capacity``); the plan keeping the padded
layout when it does not fit (``test_bound_holds_for_any_owners``: RuntimeError); a bound of the
referenced pages without the dummy page 0 (same test).
"""

import random
import unittest
from types import SimpleNamespace
from unittest import mock

import numpy as np

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.settings import DECODE_PATH_ENV
from sglang_cp_shared_kv.model_executor.gather_scratch import (
    create_gather_scratch,
    slot0_scratch_tokens,
)
from sglang_cp_shared_kv.model_executor.peer_page_plan import build_peer_page_plan
from sglang_cp_shared_kv.model_executor.scratch_sizing import request_scratch_pages
from sglang_cp_shared_kv.settings import PREFILL_SCRATCH_TOKENS_ENV
from sglang_cp_shared_kv.startup_rules import scratch_sizing
from sglang_cp_shared_kv_testing.runtime_check import make_nsa_pool
from sglang_cp_shared_kv_testing.server_args_cases import decided_now

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

PAGE = 64


def prefill_batch_scratch_pages(context_tokens, page_size: int) -> int:
    """The scratch pages admission lets an extend batch take: the dummy page 0 and every request's
    whole context (``prefill_scratch_admission``); shared prefix pages only make the real need smaller."""
    return 1 + sum(request_scratch_pages(t, page_size) for t in context_tokens)
CONTEXT_LEN = 131072


def _server_args(**overrides):
    args = dict(
        nsa_decode_backend="flashmla_kv",
        enable_mixed_chunk=False,
        chunked_prefill_size=8192,
        max_prefill_tokens=16384,
        disaggregation_mode="null",
        speculative_algorithm=None,
    )
    args.update(overrides)
    return SimpleNamespace(**args)


def _sizing(env=None, opt_in=True, **overrides):
    """``opt_in``: decode per owner (``SGLANG_CP_SHARED_KV_DECODE=per_owner``) unless ``env`` sets it."""
    with mock.patch.dict("os.environ", clear=False) as environ:
        for name in (DECODE_PATH_ENV, PREFILL_SCRATCH_TOKENS_ENV):
            environ.pop(name, None)
        if opt_in:
            environ[DECODE_PATH_ENV] = "per_owner"
        environ.update(env or {})
        args = _server_args(**overrides)
        return scratch_sizing(args, *decided_now(args), CONTEXT_LEN)


class TestScratchSizing(CustomTestCase):
    def test_per_owner_decode_sizes_slot_0_for_one_context_and_one_chunk(self):
        sizing = _sizing()
        self.assertTrue(sizing.prefill_only)
        self.assertEqual(sizing.prefill_tokens, CONTEXT_LEN + 8192)

    def test_without_chunked_prefill_the_prefill_budget_is_the_extra(self):
        self.assertEqual(_sizing(chunked_prefill_size=-1).prefill_tokens, CONTEXT_LEN + 16384)

    def test_setting_overrides_the_default(self):
        sizing = _sizing({PREFILL_SCRATCH_TOKENS_ENV: "5000"})
        self.assertEqual(sizing.prefill_tokens, 5000)
        for bad in ("0", "-3", "lots"):
            with self.assertRaisesRegex(ValueError, PREFILL_SCRATCH_TOKENS_ENV):
                _sizing({PREFILL_SCRATCH_TOKENS_ENV: bad})

    def test_gathering_decode_keeps_the_logical_capacity(self):
        cases = {
            "the default with flashmla_kv": dict(opt_in=False),
            "gather set": dict(env={DECODE_PATH_ENV: "gather"}),
            "impl not served": dict(nsa_decode_backend="trtllm"),
            "mixed chunks": dict(enable_mixed_chunk=True),
        }
        for name, case in cases.items():
            with self.subTest(name):
                sizing = _sizing(**case)
                self.assertFalse(sizing.prefill_only)
                self.assertIsNone(sizing.prefill_tokens)
        with mock.patch("sglang.srt.environ.envs.SGLANG_NSA_FUSE_TOPK.get", return_value=False):
            self.assertFalse(_sizing().prefill_only)
        with self.assertRaisesRegex(ValueError, DECODE_PATH_ENV):
            _sizing({DECODE_PATH_ENV: "sometimes"})

    def test_auto_decodes_per_owner_only_where_served_at_every_cp_size(self):
        """The default (auto): per owner with fa3 (served clean at CP 2, 4 and 8), the gather with
        flashmla_kv (CP 2 and 4 only) and under MTP, each gather naming why; an explicit per_owner
        keeps MTP on per owner (refused there by the MTP rules, not moved to the gather).
        Seen failing with auto treated as per_owner (flashmla_kv per owner) and with the MTP
        condition dropped."""
        from sglang_cp_shared_kv.startup_rules import AUTO_PER_OWNER_DECODE_IMPLS

        self.assertEqual(AUTO_PER_OWNER_DECODE_IMPLS, ("fa3",))
        self.assertTrue(_sizing(opt_in=False, nsa_decode_backend="fa3").prefill_only)
        self.assertTrue(_sizing({DECODE_PATH_ENV: "auto"}, nsa_decode_backend="fa3").prefill_only)
        fp8 = _sizing(opt_in=False)
        self.assertFalse(fp8.prefill_only)
        self.assertIn("flashmla_kv", fp8.reason)
        self.assertIn(DECODE_PATH_ENV, fp8.reason)
        mtp = _sizing(opt_in=False, nsa_decode_backend="fa3", speculative_algorithm="EAGLE")
        self.assertFalse(mtp.prefill_only)
        self.assertIn("--speculative-algorithm EAGLE", mtp.reason)
        self.assertTrue(_sizing(nsa_decode_backend="fa3", speculative_algorithm="EAGLE").prefill_only)
        self.assertTrue(_sizing(nsa_decode_backend="flashmla_kv").prefill_only)  # per_owner asks for it

    def test_startup_rule_names_the_impls_per_owner_decode_serves(self):
        # The sizing decides before the runtime exists; it must agree with per_owner_decode.attach.
        from sglang_cp_shared_kv.model_executor.per_owner_decode import (
            decode_forward as per_owner_decode,
        )
        from sglang_cp_shared_kv.startup_rules import PER_OWNER_DECODE_IMPLS

        served = getattr(per_owner_decode, "SERVED_DECODE_IMPLS", None)
        served = (per_owner_decode.SERVED_DECODE_IMPL,) if served is None else tuple(served)
        self.assertEqual(set(PER_OWNER_DECODE_IMPLS), set(served))

    def test_pd_prefill_server_never_decodes(self):
        sizing = _sizing(nsa_decode_backend="fa3", disaggregation_mode="prefill")
        self.assertTrue(sizing.prefill_only)

    def test_slot_0_tokens_are_page_rounded_and_capped_at_the_logical_capacity(self):
        self.assertEqual(slot0_scratch_tokens(None, 640, PAGE), 640)
        self.assertEqual(slot0_scratch_tokens(65, 640, PAGE), 128)
        self.assertEqual(slot0_scratch_tokens(10**6, 640, PAGE), 640)
        pool = make_nsa_pool(5 * PAGE, "fp8", 2, "cpu")
        self.assertEqual(create_gather_scratch(pool, 4).size, 20 * PAGE)
        self.assertEqual(create_gather_scratch(pool, 4, prefill_tokens=130).size, 3 * PAGE)


class TestPrefillBatchBound(CustomTestCase):
    def test_bound_holds_for_any_owners(self):
        """Random batches whose pages sit on arbitrary owners (as after frees, HiCache load-back
        or shared prefixes): the plan fits a scratch of exactly the admission bound."""
        rng = random.Random(0)
        page_size = 4
        for trial in range(300):
            cp_size = rng.choice([2, 4, 8])
            physical_pages = 16
            free = list(range(cp_size, cp_size * (physical_pages + 1)))
            # Skew: most pages from one owner.
            skewed = rng.randrange(cp_size)
            free.sort(key=lambda p: (p % cp_size != skewed, rng.random()))
            request_pages, old_counts, contexts = [], [], []
            for _ in range(rng.randrange(1, 5)):
                tokens = rng.randrange(1, 8 * page_size)
                pages = -(-tokens // page_size)
                if len(free) < pages:
                    break
                request_pages.append(np.array([free.pop(0) for _ in range(pages)]))
                old_counts.append(rng.randrange(0, pages + 1))
                contexts.append(tokens)
            bound = prefill_batch_scratch_pages(contexts, page_size)
            for rank in range(cp_size):
                plan = build_peer_page_plan(
                    layout=CpSharedKVLayout(cp_size, rank, page_size),
                    request_pages=request_pages,
                    old_page_counts=old_counts,
                    num_logical_pages=cp_size * (physical_pages + 1),
                    scratch_num_pages=bound,
                    device="cpu",
                )
                self.assertLessEqual(plan.scratch_pages_used, bound)

    def test_bound_counts_whole_pages_per_request_and_the_dummy_page(self):
        self.assertEqual(prefill_batch_scratch_pages([], PAGE), 1)
        self.assertEqual(prefill_batch_scratch_pages([1, PAGE, PAGE + 1], PAGE), 1 + 1 + 1 + 2)


if __name__ == "__main__":
    unittest.main()
