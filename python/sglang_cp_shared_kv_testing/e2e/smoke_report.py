"""What one smoke run observed, the checks it must pass, and the comparison between runs.

Checks of one run (each failure is one line of text; any failure makes the smoke exit non-zero):
  * every planned request returned ``max_new_tokens`` greedy tokens without error;
  * a replayed request reproduced its original's output token for token;
  * the run evicted from device, served prompt tokens from host and loaded back
    (``evicted_tokens`` / ``load_back_tokens`` counters and per-request ``cached_tokens_details``);
  * the server log holds no error line (see ``server_log.ERROR_PATTERNS``).
Between runs (shared KV off vs on), greedy outputs must be equal request by request.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from sglang_cp_shared_kv_testing.e2e.request_plan import RequestPlan, round_pairs
from sglang_cp_shared_kv_testing.e2e.server_log import CapacityLines, LogFinding


@dataclass
class RequestRecord:
    index: int
    name: str
    prompt_tokens: int
    output_ids: List[int]
    cached_tokens: int
    cached_device_tokens: int
    cached_host_tokens: int
    ttft_s: Optional[float]
    e2e_s: float
    # Metric deltas around this request; counters are summed over ranks (server_metrics docstring).
    metric_deltas: Dict[str, float] = field(default_factory=dict)
    error: Optional[str] = None
    # MTP (sglang's meta_info with speculative decoding on): verify forwards and output tokens.
    spec_verify_ct: Optional[int] = None
    completion_tokens: Optional[int] = None

    @staticmethod
    def from_response(index, name, prompt_tokens, result, metric_deltas) -> "RequestRecord":
        meta = result.meta_info or {}
        details = meta.get("cached_tokens_details") or {}
        return RequestRecord(
            index=index,
            name=name,
            prompt_tokens=prompt_tokens,
            output_ids=list(result.output_ids),
            cached_tokens=int(meta.get("cached_tokens", 0) or 0),
            cached_device_tokens=int(details.get("device", 0) or 0),
            cached_host_tokens=int(details.get("host", 0) or 0),
            ttft_s=result.ttft_s,
            e2e_s=result.e2e_s,
            metric_deltas=dict(metric_deltas),
            error=result.error,
        ).with_spec_counts(meta)

    def with_spec_counts(self, meta_info: Optional[Dict[str, Any]]) -> "RequestRecord":
        """Take ``spec_verify_ct`` / ``completion_tokens`` from a response's meta_info (sglang sets
        the first only with speculative decoding on and at least one verify)."""
        meta = meta_info or {}
        if meta.get("spec_verify_ct"):
            self.spec_verify_ct = int(meta["spec_verify_ct"])
            self.completion_tokens = int(meta.get("completion_tokens") or len(self.output_ids))
        return self


def accept_length_summary(records: Sequence["RequestRecord"]) -> Dict[str, Any]:
    """Mean MTP accept length (output tokens per verify forward, sglang's ``spec_accept_length``,
    the bonus token included) over the requests that report it: pooled and per request. Dummy
    weights make it noise: reported, never judged."""
    spec = [r for r in records if r.spec_verify_ct]
    if not spec:
        return {"requests": 0}
    per_request = [r.completion_tokens / r.spec_verify_ct for r in spec]
    from_host = [r.completion_tokens / r.spec_verify_ct for r in spec if r.cached_host_tokens]
    return {
        "requests": len(spec),
        "tokens_per_verify": round(sum(r.completion_tokens for r in spec) / sum(r.spec_verify_ct for r in spec), 4),
        "mean_per_request": round(sum(per_request) / len(per_request), 4),
        # Requests whose prompt came partly from host: where a stale draft would show.
        "mean_prefix_from_host": round(sum(from_host) / len(from_host), 4) if from_host else None,
    }


@dataclass
class RunReport:
    """One server launch: mode, per-request records, log findings, figures (capacity, HiCache
    activity, TTFT) and failures."""

    mode: str  # "shared-kv-off" / "shared-kv-on"
    command: List[str]
    log_path: str
    tp_size: int
    records: List[RequestRecord] = field(default_factory=list)
    findings: List[LogFinding] = field(default_factory=list)
    figures: Dict[str, Any] = field(default_factory=dict)
    failures: List[str] = field(default_factory=list)

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)


def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first differing token (or the shorter length if one is a prefix), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def request_failures(
    plan: RequestPlan, records: Sequence[RequestRecord], judge_replays: bool = True
) -> List[str]:
    """Errors, short outputs and (``judge_replays``) replays whose greedy output changed. The smoke
    reports replays without judging them: stock sglang's NSA kernels are not run-to-run
    deterministic, so greedy tokens are no oracle there (its KV audits are)."""
    if not records:
        return [f"none of the {len(plan.requests)} planned requests ran"]
    failures = []
    by_index = {r.index: r for r in records}
    for planned in plan.requests:
        record = by_index.get(planned.index)
        if record is None:
            failures.append(f"#{planned.index} {planned.name}: not run")
        elif record.error:
            failures.append(f"#{planned.index} {planned.name}: {record.error}")
        elif len(record.output_ids) != plan.max_new_tokens:
            failures.append(
                f"#{planned.index} {planned.name}: {len(record.output_ids)} output tokens, "
                f"expected {plan.max_new_tokens}"
            )
    for planned in plan.requests if judge_replays else ():
        if planned.replay_of is None:
            continue
        original, replay = by_index.get(planned.replay_of), by_index.get(planned.index)
        if not original or not replay or original.error or replay.error:
            continue
        diff = first_difference(original.output_ids, replay.output_ids)
        if diff is not None:
            failures.append(
                f"#{planned.index} {planned.name}: replay of #{planned.replay_of} differs at output "
                f"token {diff} (cached {replay.cached_tokens}, from host {replay.cached_host_tokens})"
            )
    return failures


def hicache_activity(records: Sequence[RequestRecord]) -> Dict[str, float]:
    totals: Dict[str, float] = {}
    for r in records:
        for key, value in r.metric_deltas.items():
            totals[key] = totals.get(key, 0.0) + value
    totals["requests_with_host_hits"] = sum(1 for r in records if r.cached_host_tokens > 0)
    totals["host_hit_tokens_from_responses"] = sum(r.cached_host_tokens for r in records)
    return totals


def hicache_failures(activity: Dict[str, float]) -> List[str]:
    failures = []
    if activity.get("evicted_tokens", 0) <= 0:
        failures.append("no device eviction observed (sglang:evicted_tokens_total did not grow)")
    if activity.get("load_back_tokens", 0) <= 0:
        failures.append("no host load-back observed (sglang:load_back_tokens_total did not grow)")
    if activity.get("requests_with_host_hits", 0) <= 0:
        failures.append("no request was served from host (meta_info.cached_tokens_details.host)")
    return failures


def log_failures(findings: Sequence[LogFinding]) -> List[str]:
    return [f"server log line {f.line_no} ({f.kind}): {f.text[:300]}" for f in findings if f.fatal]


def compare_runs(plan: RequestPlan, reference: RunReport, candidate: RunReport) -> List[str]:
    """Request-by-request greedy equality of ``candidate`` against ``reference``."""
    if not reference.records or not candidate.records:
        return [f"cannot compare {candidate.mode} with {reference.mode}: a run has no outputs"]
    ref = {r.index: r for r in reference.records}
    cand = {r.index: r for r in candidate.records}
    failures = []
    for planned in plan.requests:
        a, b = ref.get(planned.index), cand.get(planned.index)
        if a is None or b is None or a.error or b.error:
            failures.append(f"#{planned.index} {planned.name}: missing in one run, cannot compare")
            continue
        diff = first_difference(a.output_ids, b.output_ids)
        if diff is not None:
            failures.append(
                f"#{planned.index} {planned.name}: {candidate.mode} differs from {reference.mode} at "
                f"output token {diff}: {a.output_ids[diff:diff + 4]} vs {b.output_ids[diff:diff + 4]}"
            )
    return failures


def capacity_figures(
    server_info: Dict[str, Any], lines: CapacityLines, host_total_tokens_by_rank: Dict[str, float]
) -> Dict[str, Any]:
    """Logical device capacity of the CP group, physical pool per rank, host memory per rank."""
    logical = server_info.get("max_total_num_tokens", lines.scheduler_max_total_num_tokens)
    physical = sorted(set(v for k, v in lines.device_pool_tokens.items() if k is not None))
    host_gb = {
        str(rank): round(lines.host_kv_gb.get(rank, 0.0) + lines.host_indexer_gb.get(rank, 0.0), 3)
        for rank in sorted(set(lines.host_kv_gb) | set(lines.host_indexer_gb), key=lambda r: (r is None, r))
    }
    figures: Dict[str, Any] = {
        "logical_device_tokens_per_cp_group": logical,
        "physical_device_tokens_per_rank": physical,
        "device_pool_gb_per_rank": sorted(set(v for k, v in lines.device_pool_gb.items() if k is not None)),
        "host_memory_gb_per_rank": host_gb,
        "host_pool_tokens_per_rank": {k: int(v) for k, v in sorted(host_total_tokens_by_rank.items())},
    }
    slot0 = sorted(set(v for k, v in lines.scratch_slot0_tokens.items() if k is not None))
    if slot0:
        figures["scratch_slot0_tokens_per_rank"] = slot0
    if logical is not None and len(physical) == 1:
        figures["logical_over_physical"] = round(logical / physical[0], 3)
    return figures


def capacity_failures(shared_kv: bool, tp_size: int, figures: Dict[str, Any]) -> List[str]:
    """Shared KV must expose cp_size x the physical pool as logical capacity; without it, 1 x. The
    ranks must agree on their pool (sglang sizes it from the minimum over ranks; where its
    memory-imbalance check is off, as on one GPU, nothing else would notice)."""
    physical = figures.get("physical_device_tokens_per_rank") or []
    if len(physical) > 1:
        return [f"the ranks' device pools differ: {physical} tokens (one size expected)"]
    ratio = figures.get("logical_over_physical")
    if ratio is None:
        return []
    expected = tp_size if shared_kv else 1  # round-robin NSA prefill CP: cp_size == tp_size
    if abs(ratio - expected) > 1e-6:
        return [f"logical capacity is {ratio} x the physical pool per rank, expected {expected}"]
    return []


def ttft_summary(plan: RequestPlan, records: Sequence[RequestRecord]) -> List[Dict[str, Any]]:
    """Per prefix: TTFT of the cold round-1 prefill vs the round-2 request whose prefix came from host."""
    by_index = {r.index: r for r in records}
    rows = []
    for cold, reuse in round_pairs(plan):
        a, b = by_index.get(cold.index), by_index.get(reuse.index)
        if not a or not b or a.ttft_s is None or b.ttft_s is None or b.cached_host_tokens <= 0:
            continue
        rows.append(
            {
                "prefix_tokens": cold.prefix_tokens,
                "recomputed_request": a.name,
                "recomputed_ttft_ms": round(a.ttft_s * 1e3, 2),
                "from_host_request": b.name,
                "from_host_ttft_ms": round(b.ttft_s * 1e3, 2),
                "host_tokens": b.cached_host_tokens,
                "device_tokens": b.cached_device_tokens,
            }
        )
    return rows


def shared_physical_bounds(
    stock_physical_tokens: int,
    cap_tokens: Optional[int],
    cp_size: int,
    kv_bytes_per_token: int,
    kv_row_bytes: int,
    page_size: int,
    slot0_tokens: Optional[int] = None,
) -> Tuple[int, int]:
    """Pages per rank a shared-KV server may get beside a stock server with the same flags.

    The runtime reserves ``scratch_bytes(slot 0)`` of the KV budget before sglang sizes the pool
    (docs/runtime.md, "Scratch budget"): slot 0 is ``cp_size * P0`` when decode gathers, ``P0``
    being stock's pool from that budget (capped by ``--max-total-tokens``), or a fixed,
    prefill-sized ``slot0_tokens`` (what the server logged, when below its logical capacity). The
    shared-KV pool is ``P0`` less the scratch's share, page-rounded: ``kv_bytes_per_token`` is one
    token of every layer (KV row + indexer row). Where stock's pool was capped, its budget is
    unknown and the pool may still reach the cap.
    """
    from sglang_cp_shared_kv.model_executor.gather_scratch import scratch_bytes

    reserved = cp_size * stock_physical_tokens
    if slot0_tokens is not None:
        reserved = min(slot0_tokens, reserved)
    share_tokens = scratch_bytes(reserved, kv_row_bytes, page_size) / kv_bytes_per_token
    # Stock's budget is P0 .. P0 + one page of tokens, so the pool is known to within one page.
    low = int((stock_physical_tokens - share_tokens) // page_size) * page_size
    capped = cap_tokens is not None and stock_physical_tokens >= cap_tokens
    high = cap_tokens if capped else int((stock_physical_tokens + page_size - share_tokens) // page_size) * page_size
    if cap_tokens is not None:
        high = min(high, cap_tokens)
    return max(low, 0), high


def scratch_share_failures(
    shared_figures: Dict[str, Any],
    stock_figures: Dict[str, Any],
    cap_tokens: Optional[int],
    cp_size: int,
    kv_bytes_per_token: int,
    kv_row_bytes: int,
    page_size: int,
    budget_tolerance_tokens: int = 0,
) -> List[str]:
    """The shared-KV server's physical pool per rank is stock's less the scratch's documented share,
    to the page, or within ``budget_tolerance_tokens`` where the two servers' budgets were measured
    on a shared GPU (``one_gpu.ONE_GPU_BUDGET_TOLERANCE``)."""
    shared = shared_figures.get("physical_device_tokens_per_rank") or []
    stock = stock_figures.get("physical_device_tokens_per_rank") or []
    if len(shared) != 1 or len(stock) != 1:
        return [] if not shared or not stock else [f"pools differ between ranks: {shared} / {stock}"]
    slot0 = shared_figures.get("scratch_slot0_tokens_per_rank") or []
    # Slot 0 below cp_size x the pool: prefill-sized, a fixed reservation (else the logical capacity).
    prefill_slot0 = slot0[0] if len(slot0) == 1 and slot0[0] < cp_size * shared[0] else None
    low, high = shared_physical_bounds(
        stock[0], cap_tokens, cp_size, kv_bytes_per_token, kv_row_bytes, page_size, prefill_slot0
    )
    low, high = max(low - budget_tolerance_tokens, 0), high + budget_tolerance_tokens
    if not low <= shared[0] <= high:
        within = f" (budgets within {budget_tolerance_tokens} tokens)" if budget_tolerance_tokens else ""
        return [
            f"physical pool per rank is {shared[0]} tokens; stock's {stock[0]} less the scratch's "
            f"share gives {low}..{high}{within}"
        ]
    return []
