#!/usr/bin/env python3
"""One short line per serve-smoke run of ``serve_smoke_runs.sh``, for a reader of a runner log's tail:
the run's verdict, what its audits checked, for a clean run its median first-token times by prefix
source (reported only), and for a planted bug whether the oracle caught it (a plant must FAIL).
Last line: every run as expected, or which were not.

  python3 scripts/gpu/smoke_verdicts.py RUNS_DIR NAME...
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "smoke_plugin"))
from cp_shared_kv_smoke_hooks import value_audit_compare  # noqa: E402


def audit_text(figures: dict) -> str:
    parts = []
    pool = figures.get("pool_audit")
    if pool:
        parts.append(f"pool {pool['layer0_wrong_kv_rows']}+{pool['layer0_wrong_index_rows']} wrong rows / "
                     f"{pool['positions_compared']} positions")  # fmt: skip
    read = figures.get("read_audit")
    if read:
        parts.append(f"read {read.get('kv_wrong', 0)}+{read.get('index_wrong', 0)} wrong / {read.get('kv_rows', 0)} rows")
    dec = figures.get("decode_read_audit")
    if dec:
        parts.append(f"decode {dec.get('wrong_rows', 0)} wrong rows, {dec.get('wrong_owner', 0)} wrong owner, "
                     f"{dec.get('missing', 0)} missing / {dec.get('layers', 0)} layers + "
                     f"{dec.get('graph_forwards', 0)} graph forwards' tables, {dec.get('graph_replays', 0)} replays "
                     f"({dec.get('graph_layers', 0)} layers) checked"
                     + (f", replays by batch size {dec['replays_by_bs']}" if dec.get("replays_by_bs") else ""))  # fmt: skip
    for key in ("draft_write_audit", "draft_read_audit"):
        if figures.get(key):
            d = figures[key]
            parts.append(f"{key.split('_audit')[0]} {d.get('kv_wrong', 0)}+{d.get('index_wrong', 0)} wrong")
    values = figures.get("value_audit")
    if values and values.get("all", {}).get("rows"):
        every = values["all"]
        replays = values.get("graph_replays_by_bs") or {}
        parts.append(f"values {every['rows']} rows, max rel err {every['max']:.2g}, p99 {every['p99']:.2g}"
                     + (f" (tolerance {figures['value_tolerance']['max']:.2g})" if figures.get("value_tolerance") else "")
                     + (f", graph replays by batch size {replays}" if replays else "")
                     + value_audit_compare.merge_text(values))  # fmt: skip
    forced = figures.get("teacher_forced_verdict")
    if forced and forced["shared_vs_stock"]["tokens"]:
        parts.append(f"teacher-forced |dlogprob| mean {forced['shared_vs_stock']['mean']:.3f} nats "
                     f"(stock vs stock {forced['stock_vs_stock']['mean'] or 0:.3f})")  # fmt: skip
    if figures.get("mtp_accept_length"):
        parts.append(f"accept {figures['mtp_accept_length'].get('tokens_per_verify')}")
    return "; ".join(parts)


def ttft_text(records: List[dict]) -> str:
    """Median time to first token by where the prompt's prefix came from (fresh, host, device),
    the run's first request (a cold server) left out. Reported, never judged: on one GPU these are
    times of a time-sliced GPU."""
    groups = {"fresh": [], "host": [], "device": []}
    for r in records[1:]:
        if r.get("ttft_s") is None or r.get("error"):
            continue
        source = "host" if r.get("cached_host_tokens") else "device" if r.get("cached_device_tokens") else "fresh"
        groups[source].append(r["ttft_s"] * 1000)
    cells = [f"{k} {statistics.median(v):.0f} ms (n={len(v)})" for k, v in groups.items() if v]
    return "first token, median: " + ", ".join(cells) if cells else ""


def first_cuda_error(run_dir: Path) -> str:
    """The first CUDA error line of the run's server logs, with the frame above it (where
    ``CUDA_LAUNCH_BLOCKING=1`` names the faulting call), or ''."""
    for log in sorted(run_dir.glob("server_*.log")):
        lines = log.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if "CUDA error" in line:
                frames = [ln.strip() for ln in lines[max(0, i - 12):i] if ln.strip().startswith("File ")]
                return (frames[-1] + " -> " if frames else "") + line.strip()
    return ""


def verdict(runs: Path, name: str) -> Tuple[str, bool]:
    """(line, as expected). ``diag_*`` runs are diagnoses: reported, never judged."""
    if name.startswith("diag_"):
        return diagnosis(runs, name), True
    plant = name.startswith("plant_")
    run_dir = runs / name
    exit_note = (run_dir / "runner_exit").read_text().split() if (run_dir / "runner_exit").exists() else []
    timing = f" [{exit_note[1]} s]" if len(exit_note) > 1 else ""
    report = run_dir / "report.json"
    if not report.exists():
        rc = exit_note[0] if exit_note else "?"
        if rc == "skipped":
            return f"FAILED {name}: SKIPPED, the call's budget ran out before it could start", False
        return f"FAILED {name}: no report (exit {rc}: killed by the budget, or crashed; see smoke_logs.tgz){timing}", False
    runs_ = json.loads(report.read_text())["runs"]
    failures: List[str] = [f for r in runs_ for f in r["failures"]]
    requests = sum(len(r.get("records", [])) for r in runs_)
    audits = "; ".join(a for a in (audit_text(r["figures"]) for r in runs_) if a)
    if plant and name.startswith(VALUE_PLANT_PREFIX):
        return value_plant_verdict(name, failures, requests, audits, timing)
    if plant:
        if failures:
            return f"FAILED {name} (as it must: the plant was caught): {failures[0][:160]}{timing}", True
        return f"PASSED {name}: PLANT NOT CAUGHT ({requests} requests; {audits}){timing}", False
    if failures:
        return f"FAILED {name}: {len(failures)} failures, first: {failures[0][:200]}{timing}", False
    ttft = "; ".join(t for t in (ttft_text(r.get("records", [])) for r in runs_) if t)
    return f"PASSED {name}: {requests} requests; {audits or 'no audit'}{'; ' + ttft if ttft else ''}{timing}", True


# A value-only plant leaves every row right: as expected only when the value audit catches it and
# nothing else fails but the end-to-end scoring (a row audit failing would mean the plant moved rows).
VALUE_PLANT_PREFIX = "plant_value-"
VALUE_VERDICTS = ("value audit", "teacher-forced")


def value_plant_verdict(name: str, failures: List[str], requests: int, audits: str, timing: str) -> Tuple[str, bool]:
    by_values = [f for f in failures if f.startswith("value audit")]
    others = [f for f in failures if not f.startswith(VALUE_VERDICTS)]
    if others:
        return f"FAILED {name}: not a value-only failure: {others[0][:160]}{timing}", False
    if by_values:
        return f"FAILED {name} (as it must: caught by the value audit alone): {by_values[0][:200]}{timing}", True
    return f"PASSED {name}: PLANT NOT CAUGHT by the value audit ({requests} requests; {audits}){timing}", False


def diagnosis(runs: Path, name: str) -> str:
    run_dir = runs / name
    exit_note = (run_dir / "runner_exit").read_text().split() if (run_dir / "runner_exit").exists() else []
    error = first_cuda_error(run_dir)
    report = run_dir / "report.json"
    if report.exists():
        runs_ = json.loads(report.read_text())["runs"]
        failures = [f for r in runs_ for f in r["failures"]]
        requests = sum(len(r.get("records", [])) for r in runs_)
        outcome = f"{requests} requests, {len(failures)} failures" + (f" (first: {failures[0][:160]})" if failures else "")
    else:
        outcome = f"no report (exit {exit_note[0] if exit_note else '?'})"
    return f"DIAGNOSIS {name} (reported, not judged): {outcome}" + (f"; {error[:400]}" if error else "")


def main(argv: List[str]) -> int:
    runs, names = Path(argv[0]), argv[1:]
    unexpected = []
    for name in names:
        line, expected = verdict(runs, name)
        print(line)
        if not expected:
            unexpected.append(name)
    plants = sum(n.startswith("plant_") for n in names)
    diagnoses = sum(n.startswith("diag_") for n in names)
    if unexpected:
        print(f"VERDICT: UNEXPECTED in {len(unexpected)} of {len(names)} runs: {' '.join(unexpected)}")
    else:
        print(f"VERDICT: all {len(names)} runs as expected ({len(names) - plants - diagnoses} clean runs PASSED, "
              f"{plants} plants caught{f', {diagnoses} diagnoses reported' if diagnoses else ''})")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
