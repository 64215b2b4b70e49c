"""The host mirror of req_to_token stays equal to the device table through sglang's EAGLE writers.

sglang's own speculative functions run on small batches over a real radix cache / chunk cache and
our allocator, with the mirror hooks applied (``sglang_cp_shared_kv_testing/spec_scheduler_writes.py``): spec v1's
``_draft_preprocess_decode``, ``prepare_for_verify`` and ``verify`` (acceptance through the
target's logits, the accepted tokens' rewrite, the frees of rejected draft pages, a request
finishing inside it), and spec v2's ``prepare_for_decode`` with the reads of its draft steps and
verify. Their Triton kernels run on Triton's CPU interpreter, which must be switched on before
Triton is imported: the story runs in a subprocess.

Planted bugs, each caught (``test_each_writer_left_out_is_caught``): each writer's hook left out of
the registration (``_draft_preprocess_decode``, ``prepare_for_verify``, spec v2's
``prepare_for_decode``). The radix scenarios run on the tree an EAGLE server builds (bigram keys);
with tree value pages looked up by raw tokens (main before the bigram fix) both raised "radix node N
has no host page ids" at the first prompt longer than one page.
"""

import subprocess
import unittest
from types import SimpleNamespace

import torch

from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.mem_cache import req_to_page_mirror_spec_writers as spec_writers
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror import ReqToPageMirror
from sglang_cp_shared_kv_testing import sgl_kernel_cpu_shim, spec_scheduler_writes
from sglang_cp_shared_kv_testing.triton_interpreted import run_interpreted

register_cpu_ci(est_time=90, suite="stage-a-test-cpu")

TIMEOUT_S = 600


def _run_story() -> dict:
    return run_interpreted(["-m", spec_scheduler_writes.__name__, "--plants"], TIMEOUT_S)


class TestMirrorFollowsSglangsSpeculativeWriters(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.report = _run_story()

    def test_every_scenario_keeps_the_mirror_exact(self):
        clean = self.report["clean"]
        self.assertEqual(sorted(clean), sorted(spec_scheduler_writes.SCENARIOS))
        for name, result in clean.items():
            with self.subTest(scenario=name):
                self.assertEqual(result["problems"], [])
                self.assertEqual(result["rounds"], 40)
                # Draft tokens opened pages (new pages for the mirror to follow).
                self.assertGreater(result["pages_opened_by_drafts"], 0)

    def test_a_later_request_matches_the_bigram_keyed_prefix(self):
        # The radix scenarios build the tree an EAGLE server builds (bigram keys): the request
        # admitted midway matches the 2 pages of the finished request's 2 * PAGE + 1 prompt tokens
        # (2 * PAGE bigrams), and its extend writes their pages (the story checks the mirror).
        for name in ("radix-v1", "radix-v2"):
            with self.subTest(scenario=name):
                self.assertEqual(self.report["clean"][name]["prefix_matched"], 2 * spec_scheduler_writes.PAGE)

    def test_spec_v1_frees_rejected_pages_and_finishes_inside_verify(self):
        # The scenarios reach the frees and the finished-request branch of sglang's verify.
        for name in ("radix-v1", "chunk-v1"):
            with self.subTest(scenario=name):
                self.assertGreater(self.report["clean"][name]["pages_freed_by_verify"], 0)
                self.assertGreater(self.report["clean"][name]["finished_in_verify"], 0)

    def test_each_writer_left_out_is_caught(self):
        for hook, scenarios in spec_scheduler_writes.SCENARIOS_OF_HOOK.items():
            for name in scenarios:
                with self.subTest(hook=hook, scenario=name):
                    problems = self.report[f"without {hook}"][name]["problems"]
                    self.assertGreater(len(problems), 0)
                    self.assertIn("positions differ", problems[0])


class TestDraftTreesAreRefused(CustomTestCase):
    """With top-k > 1 sglang moves accepted locs by a device-only index: the hooks refuse (the
    startup rules refuse top-k > 1 first); without a mirror (flag off) they only call sglang."""

    def test_top_k_above_one(self):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        pool = ReqToTokenPool(2, 256, "cpu", False)
        batch = SimpleNamespace(req_to_token_pool=pool, forward_mode=ForwardMode.DECODE)
        calls = []
        original = lambda owner, batch, *args: calls.append(args) or "ran"  # noqa: E731
        tree = SimpleNamespace(topk=2)
        writers = (spec_writers.verify, spec_writers.prepare_for_verify, spec_writers.draft_preprocess_decode)
        for writer in writers:
            self.assertEqual(writer(original, tree, batch, 64), "ran")  # no mirror: sglang only
        ReqToPageMirror.attach(pool, 64)
        for writer in writers:
            with self.subTest(writer=writer.__name__):
                with self.assertRaisesRegex(ValueError, "--speculative-eagle-topk 2"):
                    writer(original, tree, batch, 64)
        self.assertEqual(len(calls), len(writers))  # refused before sglang writes anything
        self.assertEqual(spec_writers.verify(original, SimpleNamespace(topk=1), batch, 64), "ran")


class TestSpecWriterHookTargets(CustomTestCase):
    def test_every_target_resolves_in_sglang(self):
        import pkgutil

        sgl_kernel_cpu_shim.install()
        registered = []

        class Registry:
            @staticmethod
            def register(target, hook, kind):
                registered.append(target)

        spec_writers.register_hooks(Registry)
        self.assertEqual(len(registered), len(set(registered)))
        self.assertEqual(len(registered), 4)
        for target in registered:
            owner, name = target.rsplit(".", 1)
            self.assertTrue(callable(getattr(pkgutil.resolve_name(owner), name)), target)


if __name__ == "__main__":
    unittest.main()
