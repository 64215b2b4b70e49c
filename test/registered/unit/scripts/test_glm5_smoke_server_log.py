"""The smoke's server-log scan against lines sglang itself prints, formatted by sglang's logger setup.

The capacity lines come from building sglang's real NSA device pool and NSA HiCache host pools on
the CPU inside a scheduler-style logger (``configure_logger`` with a rank prefix); the error lines
from sglang's own exception formatting.
"""

import io
import logging
import sys
import types
import unittest
from unittest import mock

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing import sgl_kernel_cpu_shim

register_cpu_ci(est_time=15, suite="stage-a-test-cpu")

TP_RANK = 3
PREFIX = f" ATTN_CP{TP_RANK} TP{TP_RANK}"  # what configure_scheduler_process builds for CP 8 x TP 8
PAGE = 64
POOL_TOKENS = 64 * PAGE
LAYERS = 8


def sglang_log_lines(emit) -> list:
    """Lines that ``emit()`` logs through sglang's ``configure_logger`` with a scheduler prefix."""
    from sglang.srt.utils.common import configure_logger

    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    buffer, saved_stderr = io.StringIO(), sys.stderr
    sys.stderr = buffer  # basicConfig binds its handler to the current sys.stderr
    try:
        configure_logger(types.SimpleNamespace(log_level="info"), prefix=PREFIX)
    finally:
        sys.stderr = saved_stderr
    try:
        emit()
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    return buffer.getvalue().splitlines()


class TestSmokeServerLog(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        sgl_kernel_cpu_shim.install()
        import torch

        from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
        from sglang.srt.mem_cache.memory_pool_host import MLATokenToKVPoolHost, NSAIndexerPoolHost
        from sglang.utils import get_exception_traceback

        pools = {}

        def startup_and_failure():
            pools["device"] = NSATokenToKVPool(
                size=POOL_TOKENS, page_size=PAGE, kv_lora_rank=512, dtype=torch.bfloat16,
                qk_rope_head_dim=64, layer_num=LAYERS, device="cpu", index_head_dim=128,
                enable_memory_saver=False, kv_cache_dim=576,
            )  # fmt: skip
            pools["host"] = MLATokenToKVPoolHost(pools["device"], 2.0, 0, PAGE, "layer_first", pin_memory=False)
            pools["indexer"] = NSAIndexerPoolHost(pools["device"], pools["host"], "layer_first", pin_memory=False)
            scheduler_logger = logging.getLogger("sglang.srt.managers.scheduler")
            # The format of Scheduler.__init__'s capacity line (printed by TP0 only).
            scheduler_logger.info(
                "max_total_num_tokens=131072, chunked_prefill_size=8192, max_prefill_tokens=16384, "
                "max_running_requests=48, context_len=32768, available_gpu_mem=40.12 GB"
            )
            logging.getLogger("sglang.srt.mem_cache.hiradix_cache").warning(
                "load_back: FAILED to load %d tokens for node %d even after eviction (evictable_size=%d)",
                8064, 17, 0,
            )  # fmt: skip
            try:
                assert False, "logical loc 70000 out of physical range"
            except AssertionError:
                # As run_scheduler_process reports a crash.
                scheduler_logger.error(f"Scheduler hit an exception: {get_exception_traceback()}")

        cls.lines = sglang_log_lines(startup_and_failure)
        cls.pools = pools

    def test_capacity_lines_give_the_pools_sglang_built(self):
        from sglang_cp_shared_kv_testing.e2e.server_log import parse_capacity_lines

        capacity = parse_capacity_lines(self.lines)
        device, host, indexer = self.pools["device"], self.pools["host"], self.pools["indexer"]
        self.assertEqual(capacity.device_pool_tokens, {TP_RANK: device.size})
        self.assertEqual(capacity.host_kv_gb, {TP_RANK: round(host.size * host.size_per_token / 1e9, 2)})
        self.assertEqual(set(capacity.host_indexer_gb), {TP_RANK})
        self.assertGreater(capacity.host_kv_gb[TP_RANK], 0)
        self.assertEqual(capacity.scheduler_max_total_num_tokens, 131072)
        self.assertGreater(indexer.size_per_token, 0)

    def test_the_shared_kv_scratch_line_after_the_pool_is_not_the_pool(self):
        # The gather scratch is an NSATokenToKVPool too and logs the same line, after the pool.
        import re

        from sglang_cp_shared_kv_testing.e2e.server_log import parse_capacity_lines

        pool_line = next(l for l in self.lines if "KV Cache is allocated" in l)
        scratch_line = re.sub(r"#tokens: \d+", f"#tokens: {2 * self.pools['device'].size}", pool_line)
        capacity = parse_capacity_lines(self.lines + [scratch_line])
        self.assertEqual(capacity.device_pool_tokens, {TP_RANK: self.pools["device"].size})

    def test_errors_are_found_with_their_rank_and_startup_lines_are_not(self):
        from sglang_cp_shared_kv_testing.e2e.server_log import scan_for_errors, tp_rank_of

        findings = scan_for_errors(self.lines)
        fatal = [f for f in findings if f.fatal]
        self.assertEqual(fatal[0].kind, "scheduler exception")
        self.assertEqual(fatal[0].tp_rank, TP_RANK)
        self.assertIn("assertion", {f.kind for f in fatal})  # the traceback's last line
        notices = [f for f in findings if not f.fatal]
        self.assertEqual([f.kind for f in notices], ["load-back failed"])
        flagged = {f.line_no for f in findings}
        for no, line in enumerate(self.lines, start=1):
            if "Allocating" in line or "KV Cache is allocated" in line or "max_total_num_tokens=" in line:
                self.assertNotIn(no, flagged, line)
                self.assertEqual(tp_rank_of(line), TP_RANK)

    def test_ignore_patterns_silence_known_lines(self):
        from sglang_cp_shared_kv_testing.e2e.server_log import scan_for_errors

        ignored = scan_for_errors(self.lines, ignore=[r"load_back: FAILED"])
        self.assertNotIn("load-back failed", {f.kind for f in ignored})
        self.assertTrue(any(f.fatal for f in ignored))


class TestStartupError(CustomTestCase):
    """What a driver quotes when a server never answered ``/health`` (``server_log.startup_error``):
    the cause, from a scheduler's traceback as sglang logs it, before the parent's own complaint.
    Seen failing with the last traceback quoted instead of the first (the parent's "Initialization
    failed"), and with another rank's log line taken for the exception line."""

    def scheduler_crash(self):
        from sglang.utils import get_exception_traceback

        def crash():
            try:
                raise ValueError("--enable-nsa-prefill-cp-shared-kv requires --disable-cuda-graph")
            except ValueError:
                logging.getLogger("sglang.srt.managers.scheduler").error(
                    f"Scheduler hit an exception: {get_exception_traceback()}"
                )

        return sglang_log_lines(crash)

    def test_the_first_traceback_is_the_cause(self):
        from sglang_cp_shared_kv_testing.e2e.server_log import startup_error

        crash = self.scheduler_crash()
        # Another rank logs while the traceback is written; then the parent gives up.
        other_rank = "[2026-12-03 10:00:01 TP0] Load weight end. type=GlmMoeDsaForCausalLM"
        lines = crash[:2] + [other_rank] + crash[2:] + [
            "[2026-12-03 10:00:02] Received sigquit from a child process. It usually means the child failed.",
            "Traceback (most recent call last):",
            '  File "/usr/lib/python3/site-packages/sglang/srt/entrypoints/engine.py", line 1246, in _wait',
            "    raise RuntimeError(",
            "RuntimeError: Initialization failed. Please see the error messages above.",
        ]  # fmt: skip
        quoted = startup_error(lines)
        self.assertTrue(quoted.startswith("ValueError: --enable-nsa-prefill-cp-shared-kv requires"), quoted)
        self.assertIn("| RuntimeError: Initialization failed", quoted)
        self.assertNotIn("Load weight end", quoted)

    def test_without_a_traceback_the_error_lines_or_the_last_line(self):
        from sglang_cp_shared_kv_testing.e2e.server_log import startup_error

        lines = ["[2026-12-03 10:00:00] server_args=...", "[2026-12-03 10:00:09 TP1] NCCL error: unhandled system error",
                 "[2026-12-03 10:00:10] shutting down"]  # fmt: skip
        self.assertEqual(startup_error(lines), lines[1])
        self.assertEqual(startup_error(lines[:1]), f"no error line in its log; its last line: {lines[0]}")
        self.assertEqual(startup_error(["", "  "]), "its log is empty")


class TestServedDecode(CustomTestCase):
    """The decode path the soak and L3 restart verdicts name, read from the line the runtime's own
    ``attach`` logs through sglang's logger (a reworded line fails here, not as "not logged" on a GPU)
    and sglang's end of graph capture. Seen failing with the per-owner pattern not matching the
    logged line (a space where the line has none) and with graphs read from a gather line."""

    def startup_lines(self, impl, gather_reason, graphs):
        from sglang_cp_shared_kv.model_executor.per_owner_decode import decode_forward
        from sglang_cp_shared_kv.startup_rules import DecodePath

        def emit():
            with mock.patch.object(decode_forward, "PerOwnerDecode"), mock.patch.object(
                decode_forward, "_deep_gemm_schedule"
            ):
                decode = DecodePath(impl=impl, gather_reason=gather_reason)
                decode_forward.attach(types.SimpleNamespace(spec=types.SimpleNamespace(decode=decode)))
            if graphs:  # ModelRunner.init_device_graphs, sglang 0.5.11
                logging.getLogger("sglang.srt.model_executor.model_runner").info(
                    "Capture cuda graph end. Time elapsed: 12.34 s. mem usage=0.41 GB. avail mem=60.10 GB."
                )

        return sglang_log_lines(emit)

    def test_per_owner_under_graphs(self):
        from sglang_cp_shared_kv_testing.e2e.server_log import served_decode

        served = served_decode(self.startup_lines("fa3", None, graphs=True) * 2)  # two ranks
        self.assertEqual(served.describe(), "per owner (fa3), graphs on")
        self.assertTrue(served.per_owner and served.logged)

    def test_gather_eager_and_ranks_that_disagree(self):
        from sglang_cp_shared_kv_testing.e2e.server_log import served_decode

        gather = self.startup_lines("flashmla_kv", "SGLANG_CP_SHARED_KV_DECODE=gather", graphs=False)
        served = served_decode(gather)
        self.assertEqual(served.describe(), "gather, graphs off")
        self.assertEqual(served.gather_reasons, ("SGLANG_CP_SHARED_KV_DECODE=gather",))
        self.assertFalse(served.per_owner)
        mixed = served_decode(self.startup_lines("fa3", None, graphs=False) + gather)
        self.assertEqual(mixed.describe(), "per owner (fa3) and gather, graphs off")
        self.assertFalse(mixed.per_owner)
        self.assertEqual(served_decode(["[2026-12-03 10:00:00 TP0] Load weight end."]).describe(), "not logged")


if __name__ == "__main__":
    unittest.main()
