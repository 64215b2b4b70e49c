"""The shared-KV metrics, scraped in prometheus' text format after a real CP HiCache round trip on one
rank's view (cp 2, rank 1): device pages in use, host backups, host slots in use and load-backs
carry that rank's label and the values the stack's own bookkeeping shows.

Planted once: counting the node's logical pages instead of this rank's host slots in
``write_reserved`` failed ``test_round_trip_is_scraped_per_rank`` (6 backed-up pages, not 3).

The gathered-bytes counter on a path that moves bytes: two gloo ranks run the runtime check's
forwards (prefill, chunked prefill on a cached prefix, decode; ``sglang_cp_shared_kv_testing/runtime_check.py``) with the
metrics installed, and each rank's scraped ``peer_page_gathered_bytes_total`` must equal the bytes
its gather collectives actually received from the other rank (counted at the collectives, not from
the plan's arithmetic). Planted: ``received_bytes`` returning 0 (the counter then stays 0 while
pages move) and counting the rank's own slice too; both failed ``test_gathered_bytes_are_the_bytes_received``.

The exchange counter on per-owner decode (``sglang_cp_shared_kv_testing/per_owner_decode_hooked.py``, two gloo ranks, two
steps of three layers, the middle one reusing the top-k): one exchange per top-k selection and one
per output merge, on every rank. Planted: the merge not counted (4 instead of 10): caught.
"""

import unittest
from unittest import mock

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv.observability import cp_shared_kv_metrics
from sglang_cp_shared_kv_testing.cp_hicache_stack import (
    build_cp_hicache_stack,
    settle_write_acks,
    write_owned_pattern,
)
from sglang_cp_shared_kv_testing.multi_rank import run_ranks, single_process_group

register_cpu_ci(est_time=50, suite="stage-a-test-cpu")

PAGE = 64
SEQ = list(range(6 * PAGE))


def _forget_metrics() -> None:
    """Start this process over without metrics (the runtime installs them once per process)."""
    cp_shared_kv_metrics._process_metrics = None


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
        _forget_metrics()
        self.addCleanup(_forget_metrics)
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


class TestLabelsAndGraphReplay(CustomTestCase):
    """Issue 45: the series carry sglang's own scheduler labels (model name, engine type, the
    rank labels, ``--extra-metric-labels``) beside ``cp_rank``, so a dashboard joins them with
    sglang's; and the usage gauges are sampled when a decode CUDA graph replays, not only on the
    eager paths. Seen failing before: the series had ``cp_rank`` only (``install`` took no
    labels), and the gauge stayed 0 through two replays with 3 and then 5 of this rank's pages in
    use."""

    def setUp(self):
        self.registry = CollectorRegistry()
        _forget_metrics()
        self.addCleanup(_forget_metrics)

    def test_sglangs_labels_and_the_cp_rank(self):
        from types import SimpleNamespace

        server_args = SimpleNamespace(
            served_model_name="zai-org/GLM-5", disaggregation_mode="prefill",
            extra_metric_labels={"cluster": "a"},
        )  # fmt: skip
        model_runner = SimpleNamespace(server_args=server_args, tp_rank=3, pp_rank=0, moe_ep_rank=0)
        labels = cp_shared_kv_metrics.sglang_metric_labels(model_runner)
        self.assertEqual(labels, {"model_name": "zai-org/GLM-5", "engine_type": "prefill", "tp_rank": 3,
                                  "pp_rank": 0, "moe_ep_rank": 0, "cluster": "a"})  # fmt: skip
        metrics = cp_shared_kv_metrics.install(cp_rank=3, registry=self.registry, labels=labels)
        metrics.host_backup_pages.inc(2)
        text = generate_latest(self.registry).decode()
        [sample] = [
            sample
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "sglang_cp_shared_kv:host_backup_pages_total"
        ]
        self.assertEqual(sample.labels, {"model_name": "zai-org/GLM-5", "engine_type": "prefill",
                                         "tp_rank": "3", "pp_rank": "0", "moe_ep_rank": "0",
                                         "cluster": "a", "cp_rank": "3"})  # fmt: skip
        self.assertEqual(sample.value, 2)

    def test_usage_gauges_follow_graph_replays(self):
        import torch
        from types import SimpleNamespace

        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang_cp_shared_kv.model_executor.per_owner_decode import cuda_graphs as graphs
        from sglang_cp_shared_kv.model_executor.per_owner_decode.decode_forward import _STATE_ATTR
        from sglang_cp_shared_kv_testing.shared_kv_state import per_owner_pool_state

        view = build_cp_hicache_stack(cp_size=2, cp_rank=1, group=single_process_group(), physical_pages=12)
        metrics = cp_shared_kv_metrics.install(cp_rank=1, registry=self.registry)
        metrics.watch(allocator=view.allocator)
        state = per_owner_pool_state(view.layout)
        backend = SimpleNamespace(
            decode_cuda_graph_metadata={"page_table": torch.zeros(2, 4 * PAGE, dtype=torch.int32)},
            real_page_size=PAGE, forward_metadata=None,
        )  # fmt: skip
        setattr(backend, _STATE_ATTR, state.per_owner)
        setattr(backend, graphs._BOUND_ATTR, state)
        graphs.init_cuda_graph_state_after(None, backend, 2, 2)

        allocated = []

        def run(seq_lens, capture=False):
            locs = view.allocator.alloc(sum(seq_lens))  # pages in use while the graph replays
            allocated.append(locs)
            pages = locs[::PAGE].view(len(seq_lens), -1) // PAGE
            backend.forward_metadata = SimpleNamespace(
                real_page_table=torch.nn.functional.pad(pages.to(torch.int32), (0, 4 - pages.shape[1])),
                cache_seqlens_int32=torch.tensor(seq_lens, dtype=torch.int32),
                paged_mqa_schedule_metadata=None,
            )
            if capture:
                graphs.capture_metadata_after(None, backend, 2, 2, None, None, None, ForwardMode.DECODE, None)
            else:
                graphs.replay_metadata_after(None, backend, 2)

        def owned_pages():  # this rank's pages of everything allocated, by the layout
            return int(view.layout.owned_by_this_rank(torch.cat(allocated)[::PAGE]).sum())

        run([PAGE, PAGE], capture=True)
        used, expected = [], []
        for seq_lens in ([2 * PAGE, 2 * PAGE], [2 * PAGE, 2 * PAGE]):
            run(seq_lens)
            used.append(scrape(self.registry)[("sglang_cp_shared_kv:device_pages_used", "1")])
            expected.append(owned_pages())
        self.assertEqual(used, expected)
        self.assertLess(expected[0], expected[1])


class _CountingCollectives:
    """``torch.distributed`` as ``peer_page_gather`` sees it, counting the bytes each gather
    collective brings from other ranks (the all-gather's output less this rank's input; a broadcast
    from another rank: its tensor)."""

    def __init__(self, dist):
        self._dist, self.received_bytes, self.calls = dist, 0, 0

    def __getattr__(self, name):
        return getattr(self._dist, name)

    def all_gather_into_tensor(self, output, input, group=None, **kwargs):
        self.calls += 1
        self.received_bytes += (output.numel() - input.numel()) * output.element_size()
        return self._dist.all_gather_into_tensor(output, input, group=group, **kwargs)

    def broadcast(self, tensor, group=None, group_src=None, **kwargs):
        self.calls += 1
        if group_src != self._dist.get_rank(group):
            self.received_bytes += tensor.numel() * tensor.element_size()
        return self._dist.broadcast(tensor, group=group, group_src=group_src, **kwargs)


def _gather_rank(rank, world_size):
    import torch.distributed as dist

    from sglang_cp_shared_kv.model_executor import peer_page_gather
    from sglang_cp_shared_kv_testing import runtime_check
    from sglang_cp_shared_kv_testing.nsa_cpu_kernels import act_quant_torch, cpu_kernels

    registry = CollectorRegistry()
    _forget_metrics()
    cp_shared_kv_metrics.install(cp_rank=rank, registry=registry)
    counting = _CountingCollectives(dist)
    runtime_check.apply_hooks()
    with cpu_kernels(), mock.patch.object(peer_page_gather, "dist", counting):
        result = runtime_check.run_rank(
            rank, world_size, dist.group.WORLD, device="cpu", dtype_name="bf16", act_quant=act_quant_torch, seed=3
        )
    scraped = scrape(registry)[("sglang_cp_shared_kv:peer_page_gathered_bytes_total", str(rank))]
    return rank, scraped, counting.received_bytes, counting.calls, result.mismatches


class TestGatheredBytes(CustomTestCase):
    def test_gathered_bytes_are_the_bytes_received(self):
        rows = run_ranks(_gather_rank, 2, (), start_method="forkserver", timeout_s=120, deadline_s=120)
        for rank, scraped, received, calls, mismatches in rows:
            with self.subTest(rank=rank):
                self.assertEqual(mismatches, 0)
                self.assertGreater(calls, 0)
                self.assertGreater(received, 0)
                self.assertEqual(scraped, received)


# Two decode steps over (top-k, reuse, top-k) layers: per step 2 selections and 3 merges.
PER_OWNER_LAYERS, PER_OWNER_STEPS = ("topk", "skip", "topk"), 2


def _per_owner_rank(rank, world_size):
    from sglang_cp_shared_kv_testing import per_owner_decode_hooked as hooked

    registry = CollectorRegistry()
    _forget_metrics()
    cp_shared_kv_metrics.install(cp_rank=rank, registry=registry)
    scenario = hooked.Scenario(seq_lens=(300, 70), topk=128, kv_dtype="bf16", decode_impl="flashmla_sparse",
                               layers=PER_OWNER_LAYERS, steps=PER_OWNER_STEPS)  # fmt: skip
    hooked.run_rank(rank, world_size, scenario, "cpu")
    return rank, scrape(registry)[("sglang_cp_shared_kv:per_owner_decode_exchanges_total", str(rank))]


class TestPerOwnerExchanges(CustomTestCase):
    def test_one_exchange_per_selection_and_per_merge(self):
        selections = sum(layer == "topk" for layer in PER_OWNER_LAYERS)
        expected = PER_OWNER_STEPS * (selections + len(PER_OWNER_LAYERS))
        rows = run_ranks(_per_owner_rank, 2, (), timeout_s=120, deadline_s=120)
        self.assertEqual(sorted(rows), [(0, expected), (1, expected)])


if __name__ == "__main__":
    unittest.main()
