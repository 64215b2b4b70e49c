"""The plugin's settings (``settings.py``): one boolean rule, every bad value named and listed at once
while ``ServerArgs`` is built (before any weight loads), and today's defaults.

Planted once: the startup validation leaving out the environment's problems (so a bad prefetch
slot surfaced only where the runtime attaches, after the weights) failed
``test_bad_values_stop_server_args_naming_each``.
"""

import os
import unittest
from unittest import mock

from sglang.srt.server_args import ServerArgs
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv import settings as s
from sglang_cp_shared_kv_testing.server_args_cases import CP_ON, ServerArgsHooksApplied

register_cpu_ci(est_time=3, suite="stage-a-test-cpu")

BOOLEANS = (s.GRAPH_DECODE_ENV, s.MTP_ENV, s.REQ_TO_PAGE_MIRROR_CHECK_ENV, s.ALL_CP_RANKS_ENV)
FIELDS = {
    s.GRAPH_DECODE_ENV: "decode_cuda_graph",
    s.MTP_ENV: "mtp",
    s.REQ_TO_PAGE_MIRROR_CHECK_ENV: "check_page_mirror",
    s.ALL_CP_RANKS_ENV: "all_cp_ranks_transfer",
}


class TestParse(CustomTestCase):
    def test_defaults(self):
        """Unset means what served clean sets: the decode path picked by impl (auto) under CUDA
        graphs; MTP and the prefetch slot stay opt-in."""
        settings, problems = s.parse_settings({})
        self.assertEqual(problems, [])
        self.assertEqual(settings, s.CpSharedKVSettings())
        self.assertEqual(settings.decode_path, "auto")
        self.assertTrue(settings.decode_cuda_graph)
        self.assertFalse(settings.mtp or settings.prefetch_slot_auto)
        self.assertEqual((settings.prefetch_slot_tokens, settings.prefill_scratch_tokens), (0, None))

    def test_one_boolean_rule_for_every_boolean(self):
        for name in BOOLEANS:
            default = getattr(s.CpSharedKVSettings(), FIELDS[name])
            for raw, expected in (("1", True), ("TRUE", True), ("y", True), ("no", False), ("", default),
                                  (" ", default)):  # fmt: skip
                with self.subTest(name=name, raw=raw):
                    settings, problems = s.parse_settings({name: raw})
                    self.assertEqual(problems, [])
                    self.assertIs(getattr(settings, FIELDS[name]), expected)
            # Blanks around a value are refused: sglang's EnvBool (which reads
            # SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER in the PD manager) takes "1 " for its
            # default, off. Seen failing when the rule stripped them ("1 ", " true" read as on).
            for raw in ("on", "2", "enabled", "1 ", " true"):
                with self.subTest(name=name, raw=raw):
                    _, problems = s.parse_settings({name: raw})
                    self.assertEqual(len(problems), 1)
                    self.assertIn(name, problems[0])
                    self.assertIn(repr(raw), problems[0])

    def test_booleans_read_as_sglangs_envbool_reads_them(self):
        """Every value the rule accepts, sglang's ``EnvBool`` reads the same (the PD manager reads
        SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER itself, after the weights load)."""
        from sglang.srt.environ import envs

        for raw in ("1", "TRUE", "Yes", "n", "0", "false", "1 ", " true"):
            with self.subTest(raw=raw), mock.patch.dict(os.environ, {s.ALL_CP_RANKS_ENV: raw}):
                settings, problems = s.parse_settings({s.ALL_CP_RANKS_ENV: raw})
                if not problems:
                    self.assertEqual(settings.all_cp_ranks_transfer,
                                     envs.SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER.get())  # fmt: skip

    def test_token_counts_and_decode_path(self):
        settings, problems = s.parse_settings(
            {s.PREFETCH_SLOT_TOKENS_ENV: "auto", s.PREFILL_SCRATCH_TOKENS_ENV: "4096", s.DECODE_PATH_ENV: "Per_Owner"}
        )
        self.assertEqual(problems, [])
        self.assertTrue(settings.prefetch_slot_auto)
        self.assertEqual((settings.prefill_scratch_tokens, settings.decode_path), (4096, "per_owner"))
        bad = {
            s.PREFETCH_SLOT_TOKENS_ENV: "-5",
            s.PREFILL_SCRATCH_TOKENS_ENV: "0",
            s.DECODE_PATH_ENV: "replicated",
        }
        settings, problems = s.parse_settings(bad)
        self.assertEqual(sorted(p.split(" ")[0] for p in problems), sorted(bad))
        self.assertEqual(settings, s.CpSharedKVSettings())  # bad values judged at their defaults

    def test_merge_one_exchange_bytes(self):
        """The one-exchange merge's byte budget: a byte count >= 0 or ``off`` (None: every merge by
        the scaled sum); unset is off, the served merge, until the one exchange is timed and served
        (the modeled value is opt-in). Seen failing before the setting existed, and with the modeled
        value as the default."""
        name = s.MERGE_ONE_EXCHANGE_ENV
        self.assertEqual(name, "SGLANG_CP_SHARED_KV_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES")
        self.assertIsNone(s.CpSharedKVSettings().merge_one_exchange_max_extra_bytes)
        for raw, expected in (("", None), ("0", 0), (" 123456 ", 123456), ("OFF", None), ("off", None),
                              (str(s.MODELED_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES), 3_000_000)):  # fmt: skip
            with self.subTest(raw=raw):
                settings, problems = s.parse_settings({name: raw})
                self.assertEqual(problems, [])
                self.assertEqual(settings.merge_one_exchange_max_extra_bytes, expected)
        for raw in ("-1", "1.5", "3MB", "on"):
            with self.subTest(raw=raw):
                settings, problems = s.parse_settings({name: raw})
                self.assertEqual(len(problems), 1)
                self.assertIn(f"{name} must be a byte count >= 0 or 'off', got {raw!r}", problems[0])
                self.assertIsNone(settings.merge_one_exchange_max_extra_bytes)
        self.assertIn("one-exchange merge=off", s.CpSharedKVSettings().describe())

    def test_strict_read_raises_listing_every_bad_value(self):
        env = {s.MTP_ENV: "on", s.PREFETCH_SLOT_TOKENS_ENV: "lots"}
        with mock.patch.dict(os.environ, env):
            with self.assertRaises(s.SettingsError) as raised:
                s.current_settings()
        self.assertEqual(len(raised.exception.problems), 2)
        for name in env:
            self.assertIn(name, str(raised.exception))


class TestValidatedWithServerArgs(ServerArgsHooksApplied, CustomTestCase):
    def test_bad_values_stop_server_args_naming_each(self):
        """``ServerArgs`` (what ``sglang serve`` builds before any weight loads) refuses them, each
        named, together with the unrelated refused flag."""
        env = {s.PREFETCH_SLOT_TOKENS_ENV: "lots", s.PREFILL_SCRATCH_TOKENS_ENV: "-5", s.GRAPH_DECODE_ENV: "on"}
        with mock.patch.dict(os.environ, env):
            with self.assertRaises(ValueError) as raised:
                ServerArgs(model_path="dummy", enable_torch_compile=True, **CP_ON)
        message = str(raised.exception)
        for name, raw in env.items():
            self.assertIn(f"{name} must be", message)
            self.assertIn(repr(raw), message)
        self.assertIn("--enable-torch-compile", message)
        self.assertNotEqual(os.environ.get(s.CP_SHARED_KV_ENV), "1")

    def test_good_values_are_accepted(self):
        with mock.patch.dict(os.environ, {s.PREFETCH_SLOT_TOKENS_ENV: "auto", s.MTP_ENV: "0"}):
            args = ServerArgs(model_path="dummy", **CP_ON)
        self.assertTrue(args.enable_nsa_prefill_cp_shared_kv)


if __name__ == "__main__":
    unittest.main()
