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

A driver with no stock server in its call (the soak, the L3 restart, a PD or serve run without a
reference) judges by the same factors over the largest stock errors recorded so far
(``recorded_tolerance``): a figure of other calls, not a reference of this one.

Per-owner decode rows carry the merge form they ran (``rows_by_merge_form``): a run with the
one-exchange merge asked must have judged rows it merged (replayed ones too, under graphs), and one
without must have none (``merge_form_failures``): the values judged are those of the merge asked.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List, Optional

from sglang_cp_shared_kv.model_executor.per_owner_decode.attention_lse_merge import ONE_EXCHANGE, SCALED_SUM

MAX_FACTOR = 3.0
P99_FACTOR = 2.0
ERROR_FLOOR = 1e-3
# The largest stock errors recorded (docs/measurements.md, 2026-12-04: the served stock references
# of the tiny GLM-5 and of GLM-5's widths, 3,168 to 3,976 rows each, max 0.0108 to 0.0117, p99
# 0.0071 to 0.0081): the tolerance of a run whose call has no stock server.
STOCK_MAX_SEEN = 0.0117
STOCK_P99_SEEN = 0.0081
RECORDED_SOURCE = "recorded stock (2026-12-04 runs)"
# Kinds of forward whose rows must have been checked, where the server ran them.
PREFILL_KIND = "extend"
GRAPH_KIND = "decode_graph"


def totals(run_dir: Path) -> Dict:
    """Every rank's value audit file of ``run_dir`` joined: errors per kind, problems, replays by
    batch size (summed over ranks), ranks found."""
    out: Dict = {"errors": {}, "layers_checked": {}, "problems": {}, "graph_replays_by_bs": {},
                 "rows_by_merge_form": {}, "ranks": 0}  # fmt: skip
    for path in sorted(Path(run_dir).glob("value_audit.rank*.json")):
        data = json.loads(path.read_text())
        out["ranks"] += 1
        for kind, errors in data.get("errors", {}).items():
            out["errors"].setdefault(kind, []).extend(errors)
        for key in ("layers_checked", "problems", "graph_replays_by_bs"):
            for name, value in data.get(key, {}).items():
                out[key][name] = out[key].get(name, 0) + value
        for kind, forms in data.get("rows_by_merge_form", {}).items():
            joined = out["rows_by_merge_form"].setdefault(kind, {})
            for form, rows in forms.items():
                joined[form] = joined.get(form, 0) + rows
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
    out["rows_by_merge_form"] = merged_rows(t.get("rows_by_merge_form", {}))
    return out


def merged_rows(rows_by_merge_form: Dict[str, Dict[str, int]]) -> Dict[str, int]:
    """Checked rows per merge form over every kind of forward (replays included)."""
    out: Dict[str, int] = {}
    for forms in rows_by_merge_form.values():
        for form, rows in forms.items():
            out[form] = out.get(form, 0) + rows
    return dict(sorted(out.items()))


def merge_form_failures(run: Dict, one_exchange_asked: bool) -> List[str]:
    """Why the merge the values were judged on is not the one asked (empty: it is). Asked: some
    checked rows were merged by the one exchange, and under graphs some replayed rows; not asked:
    none was (the scaled sum, the default). Not value failures ("merge form: ..."): a value plant
    counts as caught only by the values themselves."""
    forms = run.get("rows_by_merge_form", {})
    one = merged_rows(forms).get(ONE_EXCHANGE, 0)
    if not one_exchange_asked:
        if one:
            return [f"merge form: {one} checked value-audit rows merged by the one exchange, which was not asked"]
        return []
    if not forms:
        return ["merge form: the one-exchange merge was asked but no checked row was merged per owner"]
    found = []
    if not one:
        scaled = merged_rows(forms).get(SCALED_SUM, 0)
        found.append(f"merge form: the one-exchange merge was asked but all {scaled} merged rows checked "
                     "were merged by the scaled sum")  # fmt: skip
    elif run["errors"].get(GRAPH_KIND) and not forms.get(GRAPH_KIND, {}).get(ONE_EXCHANGE):
        found.append("merge form: the one-exchange merge was asked but no replayed row checked was merged by it")
    return found


def limits(reference_max: float, reference_p99: float, source: str, reference_rows: Optional[int] = None) -> Dict:
    """The limits of a run whose stock errors were ``reference_max`` / ``reference_p99``."""
    return {
        "max": max(MAX_FACTOR * reference_max, ERROR_FLOOR),
        "p99": max(P99_FACTOR * reference_p99, ERROR_FLOOR),
        "source": source,
        "reference_rows": reference_rows,
        "reference_max": reference_max,
        "reference_p99": reference_p99,
    }


def tolerance(reference: Dict) -> Optional[Dict]:
    """The limits a run is judged by, from the stock reference's own errors (None without any)."""
    errors = all_errors(reference)
    if not errors:
        return None
    return limits(max(errors), quantile(errors, 0.99), "stock", len(errors))


def recorded_tolerance() -> Dict:
    """The limits of a run whose call has no stock server: over the recorded stock figures."""
    return limits(STOCK_MAX_SEEN, STOCK_P99_SEEN, RECORDED_SOURCE)


def failures(run: Dict, reference: Optional[Dict], expect_graph_replays: bool = False,
             expect_prefill: bool = True) -> List[str]:  # fmt: skip
    """Why the run's values are wrong (empty: right), judged against the reference's tolerance."""
    bounds = tolerance(reference) if reference is not None else None
    return failures_within(run, bounds, expect_graph_replays, expect_prefill)


def failures_within(run: Dict, bounds: Optional[Dict], expect_graph_replays: bool = False,
                    expect_prefill: bool = True) -> List[str]:  # fmt: skip
    """Why the run's values are wrong (empty: right), judged by ``bounds`` (``tolerance`` or
    ``recorded_tolerance``; None: no stock errors to judge by, itself a failure)."""
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
    if bounds is None:
        found.append("value audit: no reference errors to derive the tolerance from (the stock run's value audit)")
        return found
    rows = f" over {bounds['reference_rows']} rows" if bounds["reference_rows"] else ""
    for kind, kind_errors in sorted(run["errors"].items()):
        s = summary(kind_errors)
        if s["max"] > bounds["max"]:
            bad = sum(1 for e in kind_errors if e > bounds["max"])
            found.append(
                f"value audit ({kind}): {bad} of {s['rows']} rows off by more than {bounds['max']:.4g} "
                f"(max {s['max']:.4g}; {bounds['source']} max {bounds['reference_max']:.4g}{rows})"
            )
        elif s["p99"] > bounds["p99"]:
            found.append(
                f"value audit ({kind}): p99 relative error {s['p99']:.4g} above {bounds['p99']:.4g} "
                f"({bounds['source']} p99 {bounds['reference_p99']:.4g})"
            )
    return found


def verdict_text(shown: Dict, bounds: Optional[Dict]) -> str:
    """A verdict line's part from ``report``'s figures: the rows checked, their max and p99, the
    limit and where it came from."""
    every = shown["all"]
    if not every["rows"]:
        return "values: no row checked"
    limit = f" (tolerance {bounds['max']:.2g}, {bounds['source']})" if bounds else " (no tolerance)"
    return f"values {every['rows']} rows, max rel err {every['max']:.2g}, p99 {every['p99']:.2g}{limit}{merge_text(shown)}"


def merge_text(shown: Dict) -> str:
    """``report``'s merged rows by form, for a verdict line ('' where nothing was merged per owner)."""
    forms = shown.get("rows_by_merge_form") or {}
    if not forms:
        return ""
    return "; merged rows: " + ", ".join(f"{rows} by {form}" for form, rows in forms.items())
