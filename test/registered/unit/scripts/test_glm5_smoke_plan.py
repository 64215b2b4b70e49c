"""The smoke's request plan: sized to overflow the device but not the host, identical for both runs."""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing.e2e.request_plan import (
    REPLAY,
    ROUND1,
    ROUND2,
    WARMUP,
    build_plan,
    round_pairs,
)

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

PAGE = 64


def plan_for(capacities, ratio=2.0, max_prefix=8192, max_new=16, seed=0):
    return build_plan(capacities, ratio, PAGE, max_prefix, max_new, (0, 256), seed=seed)


class TestRequestPlan(CustomTestCase):
    CASES = [
        # (logical device tokens of each run, hicache ratio): off/on of the default smoke, small
        # pools, a tight ratio, and a single run.
        ([16384, 131072], 2.0),
        ([4096, 32768], 2.0),
        ([16384, 131072], 1.5),
        ([8192], 3.0),
    ]

    def test_each_group_overflows_its_device_but_fits_its_host(self):
        for capacities, ratio in self.CASES:
            plan = plan_for(capacities, ratio)
            self.assertEqual([g.logical_device_tokens for g in plan.groups], sorted(capacities))
            for g in plan.groups:
                self.assertEqual(g.logical_host_tokens, int(ratio * g.logical_device_tokens))
                self.assertGreater(g.round1_footprint_tokens, g.logical_device_tokens, (capacities, ratio))
                self.assertLessEqual(g.round1_footprint_tokens, g.logical_host_tokens, (capacities, ratio))
                self.assertEqual(g.prefix_tokens % PAGE, 0)

    def test_every_request_fits_the_smallest_device_with_room(self):
        for capacities, ratio in self.CASES:
            plan = plan_for(capacities, ratio)
            smallest = min(capacities)
            for r in plan.requests:
                self.assertLessEqual(r.prompt_tokens + plan.max_new_tokens, smallest // 2, r.name)
                self.assertEqual(len(plan.input_ids(r)), r.prompt_tokens)
                self.assertTrue(all(0 <= t < 256 for t in plan.input_ids(r)))

    def test_phases_share_prefixes_as_the_cache_test_needs(self):
        plan = plan_for([16384, 131072])
        for gi, g in enumerate(plan.groups):
            phases = [r.phase for r in plan.requests if r.group == gi]
            self.assertEqual(phases, [WARMUP] * 2 + [ROUND1] * g.num_prefixes + [ROUND2] * g.num_prefixes + [REPLAY])
        pairs = round_pairs(plan)
        self.assertEqual(len(pairs), sum(g.num_prefixes for g in plan.groups))
        for cold, reuse in pairs:
            a, b = plan.input_ids(cold), plan.input_ids(reuse)
            # Same prefix, different suffix: round 2 can hit only the prefix.
            self.assertEqual(a[: cold.prefix_tokens], b[: reuse.prefix_tokens])
            self.assertNotEqual(a[cold.prefix_tokens :], b[reuse.prefix_tokens :])
        replays = [r for r in plan.requests if r.replay_of is not None]
        self.assertEqual(len(replays), 2 * len(plan.groups))
        for r in replays:
            self.assertEqual(plan.input_ids(r), plan.input_ids(plan.requests[r.replay_of]))

    def test_distinct_prefixes_differ_in_their_first_page(self):
        plan = plan_for([16384, 131072])
        first_pages = {}
        for r in plan.requests:
            first_pages.setdefault(r.prefix_id, tuple(plan.input_ids(r)[:PAGE]))
        self.assertEqual(len(set(first_pages.values())), len(first_pages))

    def test_prompts_are_deterministic_and_seeded(self):
        a, b, c = plan_for([16384]), plan_for([16384]), plan_for([16384], seed=1)
        self.assertEqual(a.describe(), b.describe())
        for ra, rb, rc in zip(a.requests, b.requests, c.requests):
            self.assertEqual(a.input_ids(ra), b.input_ids(rb))
            self.assertNotEqual(a.input_ids(ra), c.input_ids(rc))

    def test_impossible_capacities_are_refused(self):
        with self.assertRaisesRegex(ValueError, "hicache_ratio must be > 1"):
            plan_for([16384], ratio=1.0)
        with self.assertRaisesRegex(ValueError, "too small"):
            plan_for([128])


if __name__ == "__main__":
    unittest.main()
