"""Startup rules for speculative decoding with ``--enable-nsa-prefill-cp-shared-kv``.

What a user depends on: every speculative setting the shared KV cache cannot serve fails at startup
with a ``ValueError`` that names its flag; MTP (EAGLE / NEXTN, top-k 1, the model's built-in NextN
layer, HiCache or not) is accepted with ``SGLANG_CP_SHARED_KV_MTP=1`` and refused without it by one
rule that names the variable; the opt-in lifts nothing else (top-k > 1, multi-layer EAGLE, a
separate draft model, other algorithms, CUDA graphs, per-owner decode stay refused), and a value
other than 0 / 1 is refused naming the variable.

Planted bugs, each seen failing then reverted: the top-k rule compared ``topk > 2``; the draft-path
rule dropped; the HiCache rule dropped; the opt-in read as always on (EAGLE accepted without it);
the opt-in also lifting the top-k rule (``topk > 1 and not mtp_opted_in()``:
``test_the_opt_in_lifts_no_other_rule`` failed); the per-owner rule dropped
(``test_mtp_with_per_owner_decode_is_refused_at_startup`` failed); the CUDA-graph rule dropped
(``test_mtp_with_cuda_graphs_is_refused`` and ``..._at_startup`` failed, also with
``--enable-mixed-chunk``, where no other rule refuses graphs); NEXTN missing from the supported algorithms (the real ServerArgs maps it to
EAGLE first, so only the namespace case caught it).
"""

import contextlib
import os
import unittest
from types import SimpleNamespace
from unittest import mock

from sglang.srt.server_args import ServerArgs
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv.settings import DECODE_PATH_ENV, GRAPH_DECODE_ENV
from sglang_cp_shared_kv import startup_rules
from sglang_cp_shared_kv.settings import CP_SHARED_KV_ENV, CP_SHARED_KV_FLAG
from sglang_cp_shared_kv.settings import MTP_ENV
from sglang_cp_shared_kv_testing.server_args_cases import CP_ON as CP_FLAGS
from sglang_cp_shared_kv_testing.server_args_cases import (
    Glm5LikeModelDir,
    ServerArgsHooksApplied,
    decided_now,
    runtime_server_args,
)

register_cpu_ci(est_time=15, suite="stage-a-test-cpu")

MODEL = "/models/glm-5"


def speculative_problems(server_args):
    return startup_rules.speculative_problems(server_args, *decided_now(server_args))


def runtime_problems(server_args):
    return startup_rules.runtime_problems(server_args, *decided_now(server_args))


def _spec_args(**overrides):
    """What ``speculative_problems`` reads, as ``__post_init__`` leaves it for GLM-5 + NEXTN."""
    args = dict(
        model_path=MODEL,
        speculative_algorithm="EAGLE",
        speculative_eagle_topk=1,
        enable_multi_layer_eagle=False,
        speculative_draft_model_path=MODEL,  # sglang sets it to the model path for GLM-5 / V3.2
        enable_hierarchical_cache=False,
        disable_cuda_graph=True,
        enable_mixed_chunk=False,
        nsa_decode_backend="flashmla_kv",
        disaggregation_mode="null",
    )
    args.update(overrides)
    return SimpleNamespace(**args)


@contextlib.contextmanager
def _env(values):
    """The environment with ``values`` set (None: unset) for the block, restored afterwards."""
    with mock.patch.dict(os.environ):
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield


OPTED_IN = {MTP_ENV: "1", DECODE_PATH_ENV: None, GRAPH_DECODE_ENV: None}
NOT_OPTED_IN = {MTP_ENV: None, DECODE_PATH_ENV: None, GRAPH_DECODE_ENV: None}


class TestSpeculativeRules(CustomTestCase):
    def test_no_speculative_decoding_no_problem(self):
        with _env(NOT_OPTED_IN):
            self.assertEqual(speculative_problems(_spec_args(speculative_algorithm=None)), [])

    def test_mtp_is_refused_without_the_opt_in_and_accepted_with_it(self):
        for algorithm in ("EAGLE", "NEXTN"):
            args = _spec_args(speculative_algorithm=algorithm)
            with self.subTest(algorithm=algorithm):
                with _env(NOT_OPTED_IN):
                    problems = speculative_problems(args)
                self.assertEqual(len(problems), 1, problems)
                self.assertIn(f"--speculative-algorithm {algorithm}", problems[0])
                self.assertIn(f"{MTP_ENV}=1", problems[0])
                for off in ("0", "false", " "):
                    with _env({**NOT_OPTED_IN, MTP_ENV: off}):
                        self.assertEqual(len(speculative_problems(args)), 1)
                for on in ("1", "true", "YES"):
                    with _env({**OPTED_IN, MTP_ENV: on}):
                        self.assertEqual(speculative_problems(args), [])

    def test_a_value_other_than_on_or_off_is_refused_naming_the_variable(self):
        """Judged by the one boolean rule of ``settings`` (listed first by the startup validation)."""
        from sglang_cp_shared_kv.settings import current_settings_and_problems

        for value in ("2", "on", "per_owner"):
            with self.subTest(value=value), _env({**NOT_OPTED_IN, MTP_ENV: value}):
                _, problems = current_settings_and_problems()
                self.assertEqual(len(problems), 1, problems)
                self.assertIn(MTP_ENV, problems[0])
                self.assertIn(repr(value), problems[0])

    def test_the_opt_in_lifts_no_other_rule(self):
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
            with self.subTest(expected=expected), _env(OPTED_IN):
                problems = speculative_problems(_spec_args(**override))
                self.assertEqual(len(problems), 1, problems)
                self.assertIn(expected, problems[0])
                self.assertIn(CP_SHARED_KV_FLAG, problems[0])

    def test_hicache_with_mtp_adds_no_refusal(self):
        """The CP HiCache controller restores the draft pool with the target's pages
        (mem_cache/test_cp_hicache_draft_round_trip.py), so HiCache adds no refusal of its own."""
        args = _spec_args(enable_hierarchical_cache=True)
        with _env(NOT_OPTED_IN):
            problems = speculative_problems(args)
        self.assertEqual(len(problems), 1, problems)
        self.assertIn(MTP_ENV, problems[0])
        self.assertNotIn("--enable-hierarchical-cache", problems[0])
        with _env(OPTED_IN):
            self.assertEqual(speculative_problems(args), [])

    def test_mtp_with_per_owner_decode_is_refused(self):
        """The draft's decode steps gather; per-owner decode sizes the scratch for prefill only
        (``attach_draft_runtime`` would refuse it once the model loaded)."""
        with _env({**OPTED_IN, DECODE_PATH_ENV: "per_owner"}):
            problems = speculative_problems(_spec_args())
            self.assertEqual(len(problems), 1, problems)
            self.assertIn(f"{DECODE_PATH_ENV}=per_owner", problems[0])
            self.assertIn("--speculative-algorithm EAGLE", problems[0])
            # Where per-owner decode cannot serve the impl, decode gathers: nothing to refuse.
            self.assertEqual(speculative_problems(_spec_args(nsa_decode_backend="tilelang")), [])
            # A PD prefill server runs no decode step, the draft only extends.
            self.assertEqual(speculative_problems(_spec_args(disaggregation_mode="prefill")), [])

    def test_mtp_with_cuda_graphs_is_refused(self):
        # With per-owner decode under graphs and --enable-mixed-chunk (a logical-capacity scratch)
        # no other rule refuses the draft's CUDA graphs.
        env = {**OPTED_IN, DECODE_PATH_ENV: "per_owner", GRAPH_DECODE_ENV: "1"}
        with _env(env):
            problems = speculative_problems(
                _spec_args(disable_cuda_graph=False, enable_mixed_chunk=True)
            )
        self.assertEqual(len(problems), 1, problems)
        self.assertIn("--disable-cuda-graph", problems[0])
        self.assertIn("--speculative-algorithm EAGLE", problems[0])

    def test_the_runtime_refuses_what_server_args_refuse(self):
        """``runtime_problems`` (checked again when the runtime attaches) carries the same rules."""
        spec = {k: v for k, v in vars(_spec_args(speculative_eagle_topk=2)).items()}
        with _env(NOT_OPTED_IN):
            reasons = runtime_problems(runtime_server_args(**spec))
        self.assertTrue(any("--speculative-eagle-topk 2" in r for r in reasons), reasons)
        self.assertTrue(any(MTP_ENV in r for r in reasons), reasons)
        with _env(OPTED_IN):
            reasons = runtime_problems(runtime_server_args(**spec))
        self.assertTrue(any("--speculative-eagle-topk 2" in r for r in reasons), reasons)
        self.assertFalse(any(MTP_ENV in r for r in reasons), reasons)


CP_ON = dict(CP_FLAGS, device="cuda", tp_size=2)
MTP_3_1_4 = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)


class TestRealServerArgs(Glm5LikeModelDir, ServerArgsHooksApplied, CustomTestCase):
    """sglang's own ``ServerArgs`` (NEXTN -> EAGLE, draft path defaulted) with our hooks applied."""

    def _build(self, env, **kwargs):
        """The built ``ServerArgs`` and whether it turned the runtime on (``CP_SHARED_KV_ENV``)."""
        with _env(env), mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
            args = ServerArgs(model_path=self.model_path, **{**CP_ON, **kwargs})
            return args, os.environ.get(CP_SHARED_KV_ENV) == "1"

    def _problems(self, env=NOT_OPTED_IN, **kwargs):
        with self.assertRaises(ValueError) as ctx:
            self._build(env, **kwargs)
        self.assertNotEqual(os.environ.get(CP_SHARED_KV_ENV), "1")
        return str(ctx.exception).split("\n  - ")[1:]

    def test_mtp_recipes_are_accepted_with_the_opt_in(self):
        for algorithm in ("EAGLE", "NEXTN"):
            for hicache in (False, True):
                with self.subTest(algorithm=algorithm, hicache=hicache):
                    args, runtime_on = self._build(
                        OPTED_IN,
                        speculative_algorithm=algorithm,
                        enable_hierarchical_cache=hicache,
                        **MTP_3_1_4,
                    )
                    self.assertEqual(args.speculative_algorithm, "EAGLE")
                    self.assertEqual(args.speculative_draft_model_path, self.model_path)
                    self.assertEqual(
                        (args.speculative_num_steps, args.speculative_eagle_topk), (3, 1)
                    )
                    self.assertEqual(args.speculative_num_draft_tokens, 4)
                    self.assertTrue(runtime_on)
                    # the default decode path (auto) gathers under MTP, even with fa3 (bf16 KV),
                    # which it otherwise decodes per owner: seen failing with that rule dropped
                    self.assertEqual(args.nsa_decode_backend, "fa3")
                    with _env(OPTED_IN):
                        reason = decided_now(args)[1].decode_gather_reason
                    self.assertIn("--speculative-algorithm EAGLE", reason)

    def test_nextn_mtp_recipe_is_refused_without_the_opt_in_naming_it(self):
        for hicache in (False, True):
            with self.subTest(hicache=hicache):
                problems = self._problems(
                    speculative_algorithm="NEXTN", enable_hierarchical_cache=hicache, **MTP_3_1_4
                )
                self.assertEqual(len(problems), 1, problems)
                self.assertIn("--speculative-algorithm EAGLE", problems[0])
                self.assertIn(f"{MTP_ENV}=1", problems[0])
                self.assertIn("served clean at CP 2 only", problems[0])

    def test_mtp_with_per_owner_decode_is_refused_at_startup(self):
        problems = self._problems(
            {**OPTED_IN, DECODE_PATH_ENV: "per_owner"},
            speculative_algorithm="NEXTN",
            nsa_decode_backend="flashmla_kv",
            **MTP_3_1_4,
        )
        self.assertEqual(len(problems), 1, problems)
        self.assertIn(f"{DECODE_PATH_ENV}=per_owner", problems[0])
        self.assertIn("--speculative-algorithm EAGLE", problems[0])

    def test_mtp_with_cuda_graphs_is_refused_at_startup(self):
        for extra in (dict(), dict(enable_mixed_chunk=True)):
            with self.subTest(**extra):
                problems = self._problems(
                    {**OPTED_IN, DECODE_PATH_ENV: "per_owner", GRAPH_DECODE_ENV: "1"},
                    speculative_algorithm="NEXTN",
                    nsa_decode_backend="flashmla_kv",
                    disable_cuda_graph=False,
                    **extra,
                    **MTP_3_1_4,
                )
                text = "\n".join(problems)
                self.assertIn("--speculative-algorithm EAGLE with", text)
                self.assertIn("--disable-cuda-graph", text)

    def test_the_other_rules_still_refuse_with_the_opt_in(self):
        # (sglang itself refuses top-k > 1 at page size 64 on NSA before our rules run.)
        cases = {
            "--speculative-draft-model-path /models/some-eagle-draft": dict(
                speculative_algorithm="EAGLE",
                speculative_draft_model_path="/models/some-eagle-draft",
                **MTP_3_1_4,
            ),
            "--speculative-algorithm EAGLE3": dict(
                speculative_algorithm="EAGLE3", speculative_draft_model_path="/models/eagle3",
                **MTP_3_1_4,
            ),
        }  # fmt: skip
        for expected, kwargs in cases.items():
            with self.subTest(expected=expected):
                text = "\n".join(self._problems(OPTED_IN, **kwargs))
                self.assertIn(expected, text)
                self.assertNotIn(MTP_ENV, text)

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


if __name__ == "__main__":
    unittest.main()
