"""Logical capacity, shared KV off vs on, across CP sizes: the table of the serving benchmark's
capacity part run once per CP size (``bench_serving_runs.sh both capacity-sweep``).

Each run's ``results.json`` holds, per server (``off``, ``on``), the logical capacity sglang
reports (``max_total_num_tokens`` of ``/server_info``: logical tokens of the CP group) and each
rank's device pool from its startup line ("KV Cache is allocated. #tokens": physical rows), one
entry per distinct size. A row is judged here as the benchmark judges it: every rank the same pool,
and the run's own failures (logical = cp x physical; physical = stock's less the scratch's share).

  python -m sglang_cp_shared_kv_testing.e2e.capacity_sweep RUN_DIR/results.json ...
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence


@dataclass
class CapacityRow:
    cp_size: int
    off_logical_tokens: Optional[int]
    on_logical_tokens: Optional[int]
    off_physical_tokens_per_rank: List[int]
    on_physical_tokens_per_rank: List[int]
    failures: List[str] = field(default_factory=list)

    @property
    def ratio(self) -> Optional[float]:
        if not self.off_logical_tokens or self.on_logical_tokens is None:
            return None
        return round(self.on_logical_tokens / self.off_logical_tokens, 3)


def capacity_row(results: Dict[str, Any]) -> CapacityRow:
    """The row of one benchmark run (its ``results.json``)."""
    capacity = results.get("capacity") or {}
    off, on = capacity.get("off") or {}, capacity.get("on") or {}
    row = CapacityRow(
        cp_size=int(results.get("setup", {}).get("tp") or results.get("tp") or 0),
        off_logical_tokens=off.get("logical_device_tokens_per_cp_group"),
        on_logical_tokens=on.get("logical_device_tokens_per_cp_group"),
        off_physical_tokens_per_rank=list(off.get("physical_device_tokens_per_rank") or []),
        on_physical_tokens_per_rank=list(on.get("physical_device_tokens_per_rank") or []),
        failures=list(capacity.get("failures", [])),
    )
    for mode, physical in (("off", row.off_physical_tokens_per_rank), ("on", row.on_physical_tokens_per_rank)):
        if len(physical) != 1:
            row.failures.append(f"cp {row.cp_size} shared KV {mode}: ranks' device pools {physical}, expected one size")
    for mode, logical in (("off", row.off_logical_tokens), ("on", row.on_logical_tokens)):
        if logical is None or logical <= 0:
            row.failures.append(f"cp {row.cp_size} shared KV {mode}: no logical capacity ({logical})")
    return row


def table(rows: Sequence[CapacityRow], label: str) -> List[str]:
    """Markdown: CP, logical tokens off / on, on / off, physical rows per rank off / on."""
    lines = [f"Logical device tokens of the CP group, pools sized by memory ({label})", "",
             "| CP | off (tokens) | on (tokens) | on / off | physical per rank off / on | ranks agree |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in sorted(rows, key=lambda r: r.cp_size):
        agree = len(r.off_physical_tokens_per_rank) == 1 and len(r.on_physical_tokens_per_rank) == 1
        lines.append(
            f"| {r.cp_size} | {_tokens(r.off_logical_tokens)} | {_tokens(r.on_logical_tokens)} | "
            f"{'-' if r.ratio is None else f'{r.ratio:.2f}'} | "
            f"{'/'.join(map(str, r.off_physical_tokens_per_rank)) or '-'} / "
            f"{'/'.join(map(str, r.on_physical_tokens_per_rank)) or '-'} | {'yes' if agree else 'NO'} |"
        )
    return lines


def _tokens(value: Optional[int]) -> str:
    return "-" if value is None else f"{value:,}"


def main(argv: Sequence[str]) -> int:
    label = "one GPU, each rank 0.85 / CP of its memory"
    if argv and argv[0].startswith("--label="):
        label, argv = argv[0].split("=", 1)[1], argv[1:]
    rows = []
    for path in argv:
        if not Path(path).is_file():
            print(f"FAIL {path}: no results (the run did not finish)")
            continue
        rows.append(capacity_row(json.loads(Path(path).read_text())))
    print("\n".join(table(rows, label)))
    failures = [f for r in rows for f in r.failures] + [f"{p}: missing" for p in argv if not Path(p).is_file()]
    for failure in failures:
        print(f"FAIL {failure}")
    print(f"capacity sweep: {'FAILED' if failures else 'PASSED'} ({len(rows)} CP sizes)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
