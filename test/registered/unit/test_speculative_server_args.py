"""Startup rules for speculative decoding with ``--enable-nsa-prefill-cp-shared-kv``.

What a user depends on: every speculative setting the shared KV cache cannot serve fails at startup
with a ``ValueError`` that names its flag, and the one setting that can be made to work (EAGLE /
NEXTN, top-k 1, the model's built-in NextN layer, no HiCache) is refused only by the single rule
that says why (the speculative forward modes are not served yet), so lifting that rule is all it
takes once they are.

Planted bugs, each seen failing then reverted: the top-k rule compared ``topk > 2``; the draft-path
rule dropped; the HiCache rule dropped; ``SPECULATIVE_FORWARD_MODES_SERVED`` set to True (EAGLE
accepted with nothing served); NEXTN missing from the supported algorithms (the real ServerArgs
maps it to EAGLE first, so only the namespace case caught it).
"""

import os
import tempfile
import unittest
from types import SimpleNamespace
from unittest import mock

from sglang.srt.server_args import ServerArgs
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv import server_args as cp_server_args
from sglang_cp_shared_kv.server_args import (
    CP_SHARED_KV_ENV,
    CP_SHARED_KV_FLAG,
    speculative_problems,
)
from sglang_cp_shared_kv.testing.server_args_cases import CP_ON as CP_FLAGS
from sglang_cp_shared_kv.testing.server_args_cases import (
    GLM5_LIKE_CONFIG,
    ServerArgsHooksApplied,
    runtime_server_args,
    write_model_dir,
)

register_cpu_ci(est_time=15, suite="stage-a-test-cpu")

MODEL = "/models/glm-5"


def _spec_args(**overrides):
    """What ``speculative_problems`` reads, as ``__post_init__`` leaves it for GLM-5 + NEXTN."""
    args = dict(
        model_path=MODEL,
        speculative_algorithm="EAGLE",
        speculative_eagle_topk=1,
        enable_multi_layer_eagle=False,
        speculative_draft_model_path=MODEL,  # sglang sets it to the model path for GLM-5 / V3.2
        enable_hierarchical_cache=False,
    )
    args.update(overrides)
    return SimpleNamespace(**args)


class TestSpeculativeRules(CustomTestCase):
    def test_no_speculative_decoding_no_problem(self):
        self.assertEqual(speculative_problems(_spec_args(speculative_algorithm=None)), [])

    def test_eagle_with_the_builtin_nextn_layer_is_refused_only_because_modes_are_not_served(self):
        for algorithm in ("EAGLE", "NEXTN"):
            with self.subTest(algorithm=algorithm):
                problems = speculative_problems(_spec_args(speculative_algorithm=algorithm))
                self.assertEqual(len(problems), 1, problems)
                self.assertIn(f"--speculative-algorithm {algorithm}", problems[0])
                self.assertIn("multi-step decode", problems[0])
                with mock.patch.object(cp_server_args, "SPECULATIVE_FORWARD_MODES_SERVED", True):
                    self.assertEqual(
                        speculative_problems(_spec_args(speculative_algorithm=algorithm)), []
                    )

    def test_each_unservable_setting_is_named(self):
        cases = {
            "--speculative-eagle-topk 2": dict(speculative_eagle_topk=2),
            "--speculative-eagle-topk 4": dict(speculative_eagle_topk=4),
            "--enable-multi-layer-eagle": dict(enable_multi_layer_eagle=True),
            "--speculative-algorithm EAGLE3": dict(speculative_algorithm="EAGLE3"),
            "--speculative-algorithm STANDALONE": dict(speculative_algorithm="STANDALONE"),
            "--speculative-algorithm NGRAM": dict(speculative_algorithm="NGRAM"),
            "--speculative-algorithm DFLASH": dict(speculative_algorithm="DFLASH"),
            "--speculative-draft-model-path /models/other-draft": dict(
                speculative_draft_model_path="/models/other-draft"
            ),
        }
        for expected, override in cases.items():
            with self.subTest(expected=expected):
                # The rule holds even once the forward modes are served.
                with mock.patch.object(cp_server_args, "SPECULATIVE_FORWARD_MODES_SERVED", True):
                    problems = speculative_problems(_spec_args(**override))
                self.assertEqual(len(problems), 1, problems)
                self.assertIn(expected, problems[0])
                self.assertIn(CP_SHARED_KV_FLAG, problems[0])

    def test_hicache_with_eagle_is_refused_only_because_modes_are_not_served(self):
        """The CP HiCache controller restores the draft pool with the target's pages
        (mem_cache/test_cp_hicache_draft_round_trip.py), so HiCache adds no refusal of its own."""
        args = _spec_args(enable_hierarchical_cache=True)
        problems = speculative_problems(args)
        self.assertEqual(len(problems), 1, problems)
        self.assertIn("multi-step decode", problems[0])
        self.assertNotIn("--enable-hierarchical-cache", problems[0])
        with mock.patch.object(cp_server_args, "SPECULATIVE_FORWARD_MODES_SERVED", True):
            self.assertEqual(speculative_problems(args), [])

    def test_the_runtime_refuses_what_server_args_refuse(self):
        """``runtime_problems`` (checked again when the runtime attaches) carries the same rules."""
        runtime_args = runtime_server_args(**vars(_spec_args(speculative_eagle_topk=2)))
        reasons = cp_server_args.runtime_problems(runtime_args)
        self.assertTrue(any("--speculative-eagle-topk 2" in r for r in reasons), reasons)
        self.assertTrue(any("multi-step decode" in r for r in reasons), reasons)


CP_ON = dict(CP_FLAGS, device="cuda", tp_size=2)
MTP_3_1_4 = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)


class TestRealServerArgs(ServerArgsHooksApplied, CustomTestCase):
    """sglang's own ``ServerArgs`` (NEXTN -> EAGLE, draft path defaulted) with our hooks applied."""

    @classmethod
    def setUpClass(cls):
        cls._tmp = tempfile.TemporaryDirectory()
        cls.model_path = write_model_dir(cls._tmp.name, "glm5", GLM5_LIKE_CONFIG)

    @classmethod
    def tearDownClass(cls):
        cls._tmp.cleanup()

    def _problems(self, **kwargs):
        with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
            with self.assertRaises(ValueError) as ctx:
                ServerArgs(model_path=self.model_path, **CP_ON, **kwargs)
        self.assertNotEqual(os.environ.get(CP_SHARED_KV_ENV), "1")
        return str(ctx.exception).split("\n  - ")[1:]

    def test_nextn_mtp_recipe_is_refused_by_the_modes_rule_alone(self):
        problems = self._problems(speculative_algorithm="NEXTN", **MTP_3_1_4)
        self.assertEqual(len(problems), 1, problems)
        self.assertIn("--speculative-algorithm EAGLE", problems[0])
        self.assertIn("not been served", problems[0])

    def test_separate_draft_model_is_named_and_hicache_is_not(self):
        problems = self._problems(
            speculative_algorithm="EAGLE",
            speculative_draft_model_path="/models/some-eagle-draft",
            enable_hierarchical_cache=True,
            **MTP_3_1_4,
        )
        text = "\n".join(problems)
        self.assertIn("--speculative-draft-model-path /models/some-eagle-draft", text)
        self.assertNotIn("--enable-hierarchical-cache", text)

    def test_nextn_mtp_recipe_with_hicache_is_refused_by_the_modes_rule_alone(self):
        problems = self._problems(
            speculative_algorithm="NEXTN", enable_hierarchical_cache=True, **MTP_3_1_4
        )
        self.assertEqual(len(problems), 1, problems)
        self.assertIn("not been served", problems[0])

    def test_eagle3_is_named(self):
        problems = self._problems(
            speculative_algorithm="EAGLE3", speculative_draft_model_path="/models/eagle3", **MTP_3_1_4
        )
        self.assertIn("--speculative-algorithm EAGLE3", "\n".join(problems))


if __name__ == "__main__":
    unittest.main()
