"""Client side of the value audit (``value_audit.py`` beside this module): totals and the verdict.

A server's value audit files hold, per kind of forward, the relative errors of the output rows it
checked against attention over a replicated context recomputed in fp32. What a correct server shows
there is its kernels' own deviation from that recomputation: bf16 rounding, fp8 dequantization, an
occasional other token at a near tie of the top-k. That deviation is measured, not assumed: the stock
reference server of the same runner call (replicated KV, stock kernels, no plugin in its path) runs
the same audit, and its errors set the tolerance of the shared-KV run judged against it:

    max error   <= MAX_FACTOR x the reference's max error, and
    p99 error   <= P99_FACTOR x the reference's p99 error    (each at least ERROR_FLOOR),

over every kind of forward the shared-KV run checked (prefill chunks, decode eager and replayed,
MTP's). A value-only bug (a merge weight, a scale, a graph replaying a stale buffer) moves every row
it touches by far more than that; a run in which nothing was checked fails too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List, Optional

MAX_FACTOR = 3.0
P99_FACTOR = 2.0
ERROR_FLOOR = 1e-3
# Kinds of forward whose rows must have been checked, where the server ran them.
PREFILL_KIND = "extend"
GRAPH_KIND = "decode_graph"


def totals(run_dir: Path) -> Dict:
    """Every rank's value audit file of ``run_dir`` joined: errors per kind, problems, replays by
    batch size (summed over ranks), ranks found."""
    out: Dict = {"errors": {}, "layers_checked": {}, "problems": {}, "graph_replays_by_bs": {}, "ranks": 0}
    for path in sorted(Path(run_dir).glob("value_audit.rank*.json")):
        data = json.loads(path.read_text())
        out["ranks"] += 1
        for kind, errors in data.get("errors", {}).items():
            out["errors"].setdefault(kind, []).extend(errors)
        for key in ("layers_checked", "problems", "graph_replays_by_bs"):
            for name, value in data.get(key, {}).items():
                out[key][name] = out[key].get(name, 0) + value
    return out


def quantile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summary(errors: List[float]) -> Dict:
    return {"rows": len(errors), "max": max(errors) if errors else None,
            "p99": quantile(errors, 0.99) if errors else None,
            "median": quantile(errors, 0.5) if errors else None}  # fmt: skip


def all_errors(t: Dict) -> List[float]:
    return [e for errors in t["errors"].values() for e in errors]


def report(t: Dict) -> Dict:
    """What the verdict line and report.json show: per kind and overall, rows / max / p99."""
    out = {kind: summary(errors) for kind, errors in sorted(t["errors"].items())}
    out["all"] = summary(all_errors(t))
    out["problems"] = {k: v for k, v in t["problems"].items() if v}
    out["graph_replays_by_bs"] = dict(sorted(t["graph_replays_by_bs"].items(), key=lambda kv: int(kv[0])))
    return out


def tolerance(reference: Dict) -> Optional[Dict]:
    """The limits a run is judged by, from the stock reference's own errors (None without any)."""
    errors = all_errors(reference)
    if not errors:
        return None
    return {
        "max": max(MAX_FACTOR * max(errors), ERROR_FLOOR),
        "p99": max(P99_FACTOR * quantile(errors, 0.99), ERROR_FLOOR),
        "reference_rows": len(errors),
        "reference_max": max(errors),
        "reference_p99": quantile(errors, 0.99),
    }


def failures(run: Dict, reference: Optional[Dict], expect_graph_replays: bool = False,
             expect_prefill: bool = True) -> List[str]:  # fmt: skip
    """Why the run's values are wrong (empty: right), judged against the reference's tolerance."""
    found = []
    if not run.get("ranks"):
        return ["value audit: no value audit file (the audit did not run)"]
    for key, value in run["problems"].items():
        if value:
            found.append(f"value audit: {value} checks impossible or non-finite ({key})")
    errors = all_errors(run)
    if not errors:
        found.append("value audit: no output row was checked")
        return found
    if expect_prefill and not run["errors"].get(PREFILL_KIND):
        found.append("value audit: no prefill row was checked")
    if expect_graph_replays and not run["errors"].get(GRAPH_KIND):
        found.append("value audit: CUDA-graph replays ran but none of their outputs was checked")
    if reference is None or tolerance(reference) is None:
        found.append("value audit: no reference errors to derive the tolerance from (the stock run's value audit)")
        return found
    limits = tolerance(reference)
    for kind, kind_errors in sorted(run["errors"].items()):
        s = summary(kind_errors)
        if s["max"] > limits["max"]:
            bad = sum(1 for e in kind_errors if e > limits["max"])
            found.append(
                f"value audit ({kind}): {bad} of {s['rows']} rows off by more than {limits['max']:.4g} "
                f"(max {s['max']:.4g}; stock max {limits['reference_max']:.4g} over {limits['reference_rows']} rows)"
            )
        elif s["p99"] > limits["p99"]:
            found.append(
                f"value audit ({kind}): p99 relative error {s['p99']:.4g} above {limits['p99']:.4g} "
                f"(stock p99 {limits['reference_p99']:.4g})"
            )
    return found
