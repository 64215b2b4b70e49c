"""Shared-KV metrics on sglang's ``/metrics`` endpoint, labelled as sglang labels its own, plus the CP rank.

sglang serves ``/metrics`` from prometheus_client's multiprocess mode (``--enable-metrics``): every
process writes its samples to ``PROMETHEUS_MULTIPROC_DIR`` and the HTTP server merges them
(``utils.common.add_prometheus_middleware``). Each scheduler process is one CP rank. Every series
here carries the labels sglang 0.5.11's scheduler puts on its own (``sglang_metric_labels``:
``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank``, and
``--extra-metric-labels``), so a dashboard joins them with sglang's, and ``cp_rank``: counters of
different ranks stay apart instead of being summed, gauges use ``mostrecent``.

Everything is counted on the host from values the code already holds (plan sizes, page counts,
free-list lengths): no device tensor is read. Per-owner decode exchanges are counted when its
Python runs, i.e. eager decode; a CUDA-graph replay runs the captured collectives without Python.
The usage gauges are sampled once per forward: in the eager metadata paths and, under decode CUDA
graphs, where a replay's metadata is refreshed (``per_owner_decode.cuda_graphs``).

Names (docs/metrics.md): ``sglang_cp_shared_kv:peer_page_gathered_bytes_total``,
``..:per_owner_decode_exchanges_total``, ``..:device_pages_used``, ``..:host_slots_used``,
``..:host_backup_pages_total``, ``..:host_load_back_pages_total``.
"""

from __future__ import annotations

from typing import Dict, Optional

PREFIX = "sglang_cp_shared_kv:"


class CpSharedKVMetrics:
    """The metrics of one CP rank. ``labels``: sglang's labels of this scheduler
    (``sglang_metric_labels``; ``cp_rank`` is added). ``registry`` None: prometheus_client's default
    registry (what sglang's multiprocess collector reads); tests pass their own."""

    def __init__(self, cp_rank: int, registry=None, labels: Optional[Dict[str, object]] = None):
        # Imported here: prometheus_client must be imported after PROMETHEUS_MULTIPROC_DIR is set.
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = REGISTRY if registry is None else registry
        self.cp_rank = str(cp_rank)
        self.labels = {**{name: str(value) for name, value in (labels or {}).items()}, "cp_rank": self.cp_rank}
        names = list(self.labels)

        def counter(name, doc):
            return Counter(PREFIX + name, doc, names, registry=registry).labels(**self.labels)

        def gauge(name, doc):
            return Gauge(
                PREFIX + name, doc, names, registry=registry, multiprocess_mode="mostrecent"
            ).labels(**self.labels)

        self.gathered_bytes = counter(
            "peer_page_gathered_bytes", "Bytes of peer pages this rank received into its gather scratch."
        )
        self.per_owner_exchanges = counter(
            "per_owner_decode_exchanges",
            "Collective exchanges of per-owner decode (top-k selection and output merge), eager only.",
        )
        self.device_pages_used = gauge(
            "device_pages_used", "Physical KV pages of this rank's device pool in use."
        )
        self.host_slots_used = gauge(
            "host_slots_used", "HiCache host slots (tokens) of this rank in use."
        )
        self.host_backup_pages = counter(
            "host_backup_pages", "Pages this rank copied device -> host (HiCache backups)."
        )
        self.host_load_back_pages = counter(
            "host_load_back_pages", "Pages this rank copied host -> device (HiCache load-backs)."
        )
        self.allocator = None  # set by watch(): sampled by observe_usage()
        self.controller = None

    def watch(self, allocator=None, controller=None) -> None:
        if allocator is not None:
            self.allocator = allocator
        if controller is not None:
            self.controller = controller

    def observe_usage(self) -> None:
        """Sample the gauges (once per forward, eager or replayed; host values only)."""
        allocator = self.allocator
        if allocator is not None:
            rank = allocator.cp_rank
            free_pages = len(allocator.free_pages_by_owner[rank]) + len(allocator.release_pages_by_owner[rank])
            self.device_pages_used.set(allocator.num_physical_pages - free_pages)
        if self.controller is not None:
            self.host_slots_used.set(self.controller.physical_host_slots_used())


def sglang_metric_labels(model_runner) -> Dict[str, object]:
    """The labels sglang 0.5.11's scheduler puts on its own series
    (``SchedulerMetricsMixin.init_metrics``), from the model runner of the same rank. Left out:
    ``dp_rank`` (NSA prefill CP runs with ``--dp 1``, where sglang sets none) and ``priority``
    (sglang sets it to "" with priority scheduling, which Prometheus treats as absent)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    server_args = model_runner.server_args
    labels = {
        "model_name": server_args.served_model_name,
        "engine_type": DisaggregationMode.to_engine_type(server_args.disaggregation_mode),
        "tp_rank": model_runner.tp_rank,
        "pp_rank": model_runner.pp_rank,
        "moe_ep_rank": model_runner.moe_ep_rank,
    }
    labels.update(server_args.extra_metric_labels or {})
    return labels


_process_metrics: Optional[CpSharedKVMetrics] = None


def metrics() -> Optional[CpSharedKVMetrics]:
    """This process's metrics; None unless the server runs with ``--enable-metrics``."""
    return _process_metrics


def install(cp_rank: int, registry=None, labels: Optional[Dict[str, object]] = None) -> CpSharedKVMetrics:
    """Create this process's metrics (once; the runtime attach calls it on every rank)."""
    global _process_metrics
    if _process_metrics is None:
        _process_metrics = CpSharedKVMetrics(cp_rank, registry, labels)
    return _process_metrics
