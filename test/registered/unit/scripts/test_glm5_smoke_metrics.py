"""The smoke reads HiCache figures from /metrics exactly as sglang 0.5.11 renders them for a TP server.

Scheduler ranks and the tokenizer manager record through sglang's own collectors in Prometheus
multiprocess mode (as ``sglang serve`` runs), and the text is served by sglang's own
``add_prometheus_middleware``; the parser must recover every figure, summing counters over ranks.
"""

import multiprocessing
import os
import tempfile
import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

# Per rank: (evicted tokens, loaded-back tokens, host slots used, host slots total)
RANKS = {0: (4096, 1024, 2112, 4160), 1: (4096, 1024, 2048, 4160)}
MAX_TOTAL_NUM_TOKENS = 131072
CACHED = {"device": 640, "host": 8064}


def record_as_sglang_processes(multiproc_dir: str) -> None:
    """What every scheduler rank and the tokenizer manager of a server record, through sglang's code.

    One process stands for all ranks to keep the test cheap: multiprocess mode sums a counter's
    per-process files exactly as it sums repeated increments, and gauges differ by ``tp_rank``.
    """
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = multiproc_dir
    from sglang.srt.observability.metrics_collector import (
        RadixCacheMetricsCollector,
        SchedulerMetricsCollector,
        SchedulerStats,
        TokenizerMetricsCollector,
    )
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path="dummy", device="cpu")
    scheduler = radix = None
    for tp_rank, (evicted, loaded, host_used, host_total) in RANKS.items():
        # Labels as SchedulerMetricsMixin.init_metrics / BasePrefixCache.init_metrics_collector build them.
        labels = {"model_name": "glm5", "engine_type": "unified", "tp_rank": tp_rank, "pp_rank": 0, "moe_ep_rank": 0}
        if scheduler is None:
            scheduler = SchedulerMetricsCollector(labels=labels, enable_hierarchical_cache=True, server_args=server_args)
            radix = RadixCacheMetricsCollector(labels={"cache_type": "HiRadixCache"})
        scheduler.labels = labels
        stats = SchedulerStats()
        stats.hicache_host_used_tokens, stats.hicache_host_total_tokens = host_used, host_total
        scheduler.log_stats(stats)
        scheduler.emit_constants(
            max_total_num_tokens=MAX_TOTAL_NUM_TOKENS, max_running_requests_under_SLO=None,
            engine_startup_time=0.0, engine_load_weights_time=0.0, page_size=64,
            num_pages=MAX_TOTAL_NUM_TOKENS // 64, context_len=32768, startup_available_gpu_memory_gb=1.0,
        )  # fmt: skip
        radix.increment_eviction_num_tokens(evicted)
        radix.increment_load_back_num_tokens(loaded)
    tokenizer = TokenizerMetricsCollector(server_args=server_args, labels={"model_name": "glm5"})
    tokenizer.observe_one_finished_request(
        labels={"model_name": "glm5"}, prompt_tokens=8128, generation_tokens=16,
        cached_tokens=sum(CACHED.values()), e2e_latency=0.5, has_grammar=False,
        cached_tokens_details=dict(CACHED),
    )  # fmt: skip


class TestSmokeMetrics(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        from starlette.applications import Starlette
        from starlette.testclient import TestClient

        from sglang.srt.utils.common import add_prometheus_middleware

        cls.tmp = tempfile.TemporaryDirectory()
        # A fresh process: prometheus_client fixes its value storage at import, and this one has
        # already imported it without PROMETHEUS_MULTIPROC_DIR.
        proc = multiprocessing.get_context("spawn").Process(target=record_as_sglang_processes, args=(cls.tmp.name,))
        proc.start()
        proc.join(timeout=120)
        assert proc.exitcode == 0, f"recording process failed: {proc.exitcode}"
        saved = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = cls.tmp.name
        try:
            app = Starlette()
            add_prometheus_middleware(app)
            cls.text = TestClient(app).get("/metrics").text
        finally:
            if saved is None:
                del os.environ["PROMETHEUS_MULTIPROC_DIR"]
            else:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = saved

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_counters_sum_over_ranks_and_gauges_stay_per_rank(self):
        from sglang_cp_shared_kv_testing.e2e.server_metrics import (
            HiCacheCounters,
            max_total_num_tokens,
            parse_metrics,
        )

        snapshot = parse_metrics(self.text)
        counters = HiCacheCounters.of(snapshot)
        self.assertEqual(counters.evicted_tokens, sum(v[0] for v in RANKS.values()))
        self.assertEqual(counters.load_back_tokens, sum(v[1] for v in RANKS.values()))
        self.assertEqual(counters.host_used_tokens_by_rank, {str(r): float(v[2]) for r, v in RANKS.items()})
        self.assertEqual(counters.host_total_tokens_by_rank, {str(r): float(v[3]) for r, v in RANKS.items()})
        self.assertEqual(counters.cached_host_tokens, CACHED["host"])
        self.assertEqual(counters.cached_device_tokens, CACHED["device"])
        self.assertEqual(max_total_num_tokens(snapshot), MAX_TOTAL_NUM_TOKENS)

    def test_deltas_between_two_scrapes(self):
        from sglang_cp_shared_kv_testing.e2e.server_metrics import HiCacheCounters, parse_metrics

        after = HiCacheCounters.of(parse_metrics(self.text))
        before = HiCacheCounters.of(parse_metrics(""))  # a fresh server exposes no samples yet
        delta = after.minus(before)
        self.assertEqual(delta["evicted_tokens"], 8192)
        self.assertEqual(delta["load_back_tokens"], 2048)
        self.assertEqual(delta["cached_host_tokens"], CACHED["host"])
        self.assertEqual(delta["host_used_tokens"], 2112 + 2048)
        self.assertEqual(after.minus(after)["evicted_tokens"], 0)


if __name__ == "__main__":
    unittest.main()
