"""Read the HiCache counters and gauges that sglang 0.5.11 serves on ``/metrics`` (``--enable-metrics``).

Names are those of ``sglang/srt/observability/metrics_collector.py``:
  * ``sglang:evicted_tokens_total`` / ``sglang:load_back_tokens_total`` (``RadixCacheMetricsCollector``,
    label ``cache_type``): tokens evicted from device and loaded back from host. Every scheduler
    process (every TP rank) counts its own tree, and Prometheus multiprocess mode sums counters
    with equal labels, so with CP each logical token shows up once per rank.
  * ``sglang:cached_tokens_total`` (``TokenizerMetricsCollector``, label ``cache_source`` = device /
    host): prompt tokens served from cache; counted once per request by the tokenizer manager.
  * ``sglang:hicache_host_used_tokens`` / ``sglang:hicache_host_total_tokens`` (gauges, label
    ``tp_rank``): host pool slots per rank. They are physical slots of that rank's host pool and
    are refreshed when a rank logs prefill / decode stats, so they lag by up to one batch.
  * ``sglang:max_total_num_tokens`` (gauge, label ``tp_rank``): device capacity as the scheduler sees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

EVICTED_TOKENS = "sglang:evicted_tokens_total"
LOAD_BACK_TOKENS = "sglang:load_back_tokens_total"
CACHED_TOKENS = "sglang:cached_tokens_total"
HOST_USED_TOKENS = "sglang:hicache_host_used_tokens"
HOST_TOTAL_TOKENS = "sglang:hicache_host_total_tokens"
MAX_TOTAL_NUM_TOKENS = "sglang:max_total_num_tokens"


@dataclass
class MetricsSnapshot:
    """Samples by sample name: a list of (labels, value)."""

    samples: Dict[str, List[Tuple[Dict[str, str], float]]] = field(default_factory=dict)

    def total(self, name: str, **label_filter: str) -> float:
        """Sum over every series of ``name`` whose labels match ``label_filter`` (0 if absent)."""
        return sum(value for labels, value in self._matching(name, label_filter))

    def by_label(self, name: str, label: str, **label_filter: str) -> Dict[str, float]:
        """Value per value of ``label`` (e.g. per ``tp_rank``), summed over the other labels."""
        out: Dict[str, float] = {}
        for labels, value in self._matching(name, label_filter):
            key = labels.get(label, "")
            out[key] = out.get(key, 0.0) + value
        return out

    def has(self, name: str) -> bool:
        return bool(self.samples.get(name))

    def _matching(self, name: str, label_filter: Dict[str, str]):
        for labels, value in self.samples.get(name, []):
            if all(labels.get(k) == v for k, v in label_filter.items()):
                yield labels, value


def parse_metrics(text: str) -> MetricsSnapshot:
    """Parse Prometheus text exposition (what ``GET /metrics`` returns)."""
    from prometheus_client.parser import text_string_to_metric_families

    snapshot = MetricsSnapshot()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            snapshot.samples.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return snapshot


@dataclass(frozen=True)
class HiCacheCounters:
    """The HiCache figures of one snapshot (raw sums over ranks, see module docstring)."""

    evicted_tokens: float
    load_back_tokens: float
    cached_device_tokens: float
    cached_host_tokens: float
    host_used_tokens_by_rank: Dict[str, float]
    host_total_tokens_by_rank: Dict[str, float]

    @staticmethod
    def of(snapshot: MetricsSnapshot) -> "HiCacheCounters":
        return HiCacheCounters(
            evicted_tokens=snapshot.total(EVICTED_TOKENS),
            load_back_tokens=snapshot.total(LOAD_BACK_TOKENS),
            cached_device_tokens=snapshot.total(CACHED_TOKENS, cache_source="device"),
            cached_host_tokens=snapshot.total(CACHED_TOKENS, cache_source="host"),
            host_used_tokens_by_rank=snapshot.by_label(HOST_USED_TOKENS, "tp_rank"),
            host_total_tokens_by_rank=snapshot.by_label(HOST_TOTAL_TOKENS, "tp_rank"),
        )

    def minus(self, before: "HiCacheCounters") -> Dict[str, float]:
        """Counter deltas and the change of host slots in use summed over ranks."""
        return {
            "evicted_tokens": self.evicted_tokens - before.evicted_tokens,
            "load_back_tokens": self.load_back_tokens - before.load_back_tokens,
            "cached_device_tokens": self.cached_device_tokens - before.cached_device_tokens,
            "cached_host_tokens": self.cached_host_tokens - before.cached_host_tokens,
            "host_used_tokens": sum(self.host_used_tokens_by_rank.values())
            - sum(before.host_used_tokens_by_rank.values()),
        }


def max_total_num_tokens(snapshot: MetricsSnapshot) -> Optional[int]:
    values = snapshot.by_label(MAX_TOTAL_NUM_TOKENS, "tp_rank")
    return int(max(values.values())) if values else None
