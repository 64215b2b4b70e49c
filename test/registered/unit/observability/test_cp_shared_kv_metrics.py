"""The shared-KV metrics, scraped in prometheus' text format after a real CP HiCache round trip on one
rank's view (cp 2, rank 1): device pages in use, host backups, host slots in use and load-backs
carry that rank's label and the values the stack's own bookkeeping shows.

Planted once: counting the node's logical pages instead of this rank's host slots in
``write_reserved`` failed ``test_round_trip_is_scraped_per_rank`` (6 backed-up pages, not 3).
"""

import unittest

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv.observability import cp_shared_kv_metrics
from sglang_cp_shared_kv.testing.cp_hicache_stack import (
    build_cp_hicache_stack,
    settle_write_acks,
    write_owned_pattern,
)
from sglang_cp_shared_kv.testing.multi_rank import single_process_group

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

PAGE = 64
SEQ = list(range(6 * PAGE))


def scrape(registry) -> dict:
    """``{(sample name, cp_rank): value}`` from the exposition text, as /metrics serves it."""
    text = generate_latest(registry).decode()
    return {
        (sample.name, sample.labels.get("cp_rank")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("sglang_cp_shared_kv:") and not sample.name.endswith("_created")
    }


class TestCpSharedKVMetrics(CustomTestCase):
    def setUp(self):
        self.registry = CollectorRegistry()
        cp_shared_kv_metrics.uninstall()
        self.addCleanup(cp_shared_kv_metrics.uninstall)
        self.metrics = cp_shared_kv_metrics.install(cp_rank=1, registry=self.registry)

    def test_round_trip_is_scraped_per_rank(self):
        view = build_cp_hicache_stack(
            cp_size=2, cp_rank=1, group=single_process_group(), physical_pages=12
        )
        self.assertIs(self.metrics.controller, view.controller)  # watched when the controller is adopted
        self.metrics.watch(allocator=view.allocator)  # what the startup attach does
        cache, allocator = view.cache, view.allocator

        locs = allocator.alloc(len(SEQ))
        write_owned_pattern(view, locs, seed=1)
        owned_pages = int(view.layout.owned_by_this_rank(locs[::PAGE]).sum())
        self.assertEqual(owned_pages, 3)
        cache.insert(InsertParams(key=RadixKey(SEQ), value=locs))  # write_through: backed up now
        settle_write_acks(cache)
        self.metrics.observe_usage()  # once per forward on a server
        values = scrape(self.registry)
        self.assertEqual(values[("sglang_cp_shared_kv:device_pages_used", "1")], owned_pages)
        self.assertEqual(values[("sglang_cp_shared_kv:host_backup_pages_total", "1")], owned_pages)
        self.assertEqual(
            values[("sglang_cp_shared_kv:host_slots_used", "1")], view.controller.physical_host_slots_used()
        )
        self.assertEqual(values[("sglang_cp_shared_kv:host_slots_used", "1")], owned_pages * PAGE)
        self.assertEqual(values[("sglang_cp_shared_kv:host_load_back_pages_total", "1")], 0)

        cache.evict(EvictParams(num_tokens=len(SEQ)))
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(SEQ)))
        cache.load_back(match.last_host_node)
        cache.ready_to_load_host_cache()
        cache.loading_check()
        self.metrics.observe_usage()
        values = scrape(self.registry)
        self.assertEqual(values[("sglang_cp_shared_kv:host_load_back_pages_total", "1")], owned_pages)
        self.assertEqual(values[("sglang_cp_shared_kv:device_pages_used", "1")], owned_pages)
        self.assertEqual(values[("sglang_cp_shared_kv:peer_page_gathered_bytes_total", "1")], 0)
        self.assertEqual(values[("sglang_cp_shared_kv:per_owner_decode_exchanges_total", "1")], 0)


if __name__ == "__main__":
    unittest.main()
