"""Scan an ``sglang serve`` log: error lines, and the capacity lines sglang 0.5.11 prints at startup.

sglang formats every process's log as ``[<time><prefix>] <message>`` (``configure_logger``); a
scheduler's prefix names its ranks, e.g. `` ATTN_CP3 TP3``. The level is not printed, so errors
are recognised by content. Capacity lines (one per rank):
  * ``KV Cache is allocated. #tokens: N, KV size: X GB``: the device pool of that rank, in
    *physical* rows (``KVCache._finalize_allocation_log``);
  * ``Allocating X GB host memory for hierarchical KV cache.`` and ``Allocating X GB host memory for
    NSA indexer (layout=...)``: that rank's HiCache host pools (``memory_pool_host.py``);
  * ``max_total_num_tokens=N, ...``: the scheduler's device capacity, printed by TP0 only; under
    shared KV this is the *logical* capacity of the CP group.

Also read from a log: the decode path a shared-KV server served and whether it captured decode CUDA
graphs (``served_decode``), and what a server that never started says went wrong (``startup_error``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

# A finding of one of these kinds fails the smoke.
ERROR_PATTERNS = (
    ("scheduler exception", re.compile(r"Scheduler hit an exception")),
    ("traceback", re.compile(r"Traceback \(most recent call last\)")),
    ("assertion", re.compile(r"\bAssertionError\b")),
    ("exception", re.compile(r"\b(RuntimeError|ValueError|IndexError|KeyError|TypeError)\b")),
    ("cuda error", re.compile(r"CUDA error|illegal memory access|device-side assert")),
    ("nccl error", re.compile(r"NCCL (error|WARN .*timeout)|Watchdog caught collective operation timeout")),
    ("http error", re.compile(r"\[http_server\] Error")),
    ("fatal", re.compile(r"Fatal Python error|Segmentation fault|core dumped|Killed\b")),
)
# Reported, but a server may legitimately print them (sglang falls back to recomputing).
NOTICE_PATTERNS = (
    ("load-back failed", re.compile(r"load_back: FAILED to load")),
    ("retract", re.compile(r"KV cache pool is full\. Retract requests")),
)

_PREFIX = re.compile(r"^\[[^\]]*?(?P<prefix>(?: [A-Z_]+\d+)+)\]")
_TP = re.compile(r"\bTP(\d+)\b")
_KV_POOL = re.compile(r"KV Cache is allocated\. #tokens: (\d+), KV size: ([0-9.]+) GB")
_HOST_KV = re.compile(r"Allocating ([0-9.]+) GB host memory for hierarchical KV cache")
_HOST_INDEXER = re.compile(r"Allocating ([0-9.]+) GB host memory for NSA indexer")
_MAX_TOTAL = re.compile(r"max_total_num_tokens=(\d+)")
_SCRATCH_SLOT0 = re.compile(r"CP shared KV gather scratch slot 0: (\d+) logical tokens x 1 layer")
# The decode path every rank of a shared-KV server logs when per-owner decode attaches, or not
# (``per_owner_decode.decode_forward.attach``), and sglang's line once it captured decode CUDA graphs
# (``ModelRunner.init_device_graphs``).
_DECODE_PER_OWNER = re.compile(r"CP shared KV: decode per owner with (\S+)")
_DECODE_GATHER = re.compile(r"CP shared KV: decode uses the page gather: (.+?)\s*$")
_GRAPHS_CAPTURED = re.compile(r"Capture cuda graph end\b")


@dataclass(frozen=True)
class LogFinding:
    line_no: int  # 1-based
    kind: str
    fatal: bool
    tp_rank: Optional[int]
    text: str


@dataclass
class CapacityLines:
    """Startup figures per TP rank (``None`` key: a line without a rank prefix)."""

    device_pool_tokens: Dict[Optional[int], int] = field(default_factory=dict)  # physical rows
    device_pool_gb: Dict[Optional[int], float] = field(default_factory=dict)
    host_kv_gb: Dict[Optional[int], float] = field(default_factory=dict)
    host_indexer_gb: Dict[Optional[int], float] = field(default_factory=dict)
    scheduler_max_total_num_tokens: Optional[int] = None  # logical, from TP0's line
    # Tokens of the gather scratch's slot 0 (shared KV only).
    scratch_slot0_tokens: Dict[Optional[int], int] = field(default_factory=dict)


@dataclass(frozen=True)
class ServedDecode:
    """How a shared-KV server decoded, as its log says: the decode lines of its ranks and whether
    sglang captured decode CUDA graphs (meaningful once the server has started)."""

    per_owner_impls: Tuple[str, ...] = ()  # NSA decode impls of "decode per owner with <impl>" lines
    gather_reasons: Tuple[str, ...] = ()  # reasons of "decode uses the page gather: <reason>" lines
    graphs: bool = False

    @property
    def logged(self) -> bool:
        return bool(self.per_owner_impls or self.gather_reasons)

    @property
    def per_owner(self) -> bool:
        """Every rank that logged its decode path decodes per owner."""
        return bool(self.per_owner_impls) and not self.gather_reasons

    def describe(self) -> str:
        """For a verdict line: ``per owner (fa3), graphs on``, ``gather, graphs off``, or ``not logged``."""
        if not self.logged:
            return "not logged"
        paths = [f"per owner ({', '.join(self.per_owner_impls)})"] if self.per_owner_impls else []
        paths += ["gather"] if self.gather_reasons else []
        return f"{' and '.join(paths)}, graphs {'on' if self.graphs else 'off'}"

    def unaudited(self, decode_audit: Dict[str, int]) -> List[str]:
        """What the smoke plugin's decode read audit (its ``totals``) must have checked on a server that
        decoded as this one did: its ranks, and their graph replays under graphs. The audit judges only
        what it saw, and the scratch read audit sees no per-owner decode forward."""
        if not self.per_owner_impls:
            return []  # decode gathers: the scratch read audit checks its forwards
        if not decode_audit.get("ranks"):
            return ["decode read audit: the server decoded per owner but no rank reported"]
        if self.graphs and not decode_audit.get("graph_replays"):
            return ["decode read audit: the server decoded per owner under CUDA graphs but no graph replay was checked"]
        return []


def served_decode(lines: Sequence[str]) -> ServedDecode:
    impls: Dict[str, None] = {}  # distinct, in the order logged
    reasons: Dict[str, None] = {}
    graphs = False
    for line in lines:
        if m := _DECODE_PER_OWNER.search(line):
            impls[m.group(1)] = None
        elif m := _DECODE_GATHER.search(line):
            reasons[m.group(1)] = None
        elif _GRAPHS_CAPTURED.search(line):
            graphs = True
    return ServedDecode(tuple(impls), tuple(reasons), graphs)


def tp_rank_of(line: str) -> Optional[int]:
    match = _PREFIX.match(line)
    if not match:
        return None
    tp = _TP.search(match.group("prefix"))
    return int(tp.group(1)) if tp else None


def scan_for_errors(
    lines: Sequence[str], ignore: Iterable[str] = ()
) -> List[LogFinding]:
    """Every line matching an error or notice pattern, unless it matches one of ``ignore`` (regexes)."""
    ignore_res = [re.compile(p) for p in ignore]
    findings = []
    for no, line in enumerate(lines, start=1):
        if any(r.search(line) for r in ignore_res):
            continue
        for patterns, fatal in ((ERROR_PATTERNS, True), (NOTICE_PATTERNS, False)):
            hit = next((kind for kind, regex in patterns if regex.search(line)), None)
            if hit:
                findings.append(LogFinding(no, hit, fatal, tp_rank_of(line), line.rstrip("\n")))
                break
    return findings


def parse_capacity_lines(lines: Sequence[str]) -> CapacityLines:
    out = CapacityLines()
    for line in lines:
        rank = tp_rank_of(line)
        if m := _KV_POOL.search(line):
            # First per rank: under shared KV the gather scratch logs the same line afterwards.
            out.device_pool_tokens.setdefault(rank, int(m.group(1)))
            out.device_pool_gb.setdefault(rank, float(m.group(2)))
        elif m := _HOST_KV.search(line):
            out.host_kv_gb[rank] = float(m.group(1))
        elif m := _HOST_INDEXER.search(line):
            out.host_indexer_gb[rank] = float(m.group(1))
        elif m := _SCRATCH_SLOT0.search(line):
            out.scratch_slot0_tokens[rank] = int(m.group(1))
        elif (m := _MAX_TOTAL.search(line)) and "chunked_prefill_size=" in line:
            out.scheduler_max_total_num_tokens = int(m.group(1))
    return out


# ---------------------------------------------------------------- a server that did not start

_TRACEBACK = ERROR_PATTERNS[1][1]
_QUOTE_CHARS = 300


def traceback_exceptions(lines: Sequence[str]) -> List[str]:
    """The exception line each Python traceback of the log ends with (the first line after its
    frames that is neither indented nor another process's prefixed log line), distinct, in order."""
    found: List[str] = []
    for no, line in enumerate(lines):
        if not _TRACEBACK.search(line):
            continue
        for after in lines[no + 1:]:
            if not after.strip() or after[0].isspace() or _PREFIX.match(after):
                continue
            text = after.rstrip()[:_QUOTE_CHARS]
            if text not in found:
                found.append(text)
            break
    return found


def startup_error(lines: Sequence[str], limit: int = 3) -> str:
    """What a server that never answered ``/health`` says went wrong, in one line: the exceptions its
    tracebacks end with (the first is the cause; sglang's parent then reports its child's failure),
    else its last error lines (``scan_for_errors``), else its last line."""
    exceptions = traceback_exceptions(lines)
    if exceptions:
        return " | ".join(exceptions[:limit])
    errors = [f.text.strip()[:_QUOTE_CHARS] for f in scan_for_errors(lines) if f.fatal]
    if errors:
        return " | ".join(errors[-limit:])
    last = next((line.strip() for line in reversed(lines) if line.strip()), None)
    return f"no error line in its log; its last line: {last[:_QUOTE_CHARS]}" if last else "its log is empty"
