"""Client side of the smoke's KV audits (``kv_audit.py`` beside this module), and the row decoding
both sides share.

A run's pool dumps hold, per finished request and rank, the KV and indexer-K bytes of every layer
for the positions that rank stores. ``merge_request`` joins the ranks (every position exactly once)
and ``compare_runs`` checks a run against a reference run (another server, e.g. stock replicated
KV) request by request, at the positions where both saw the same token.

Why a tolerance and why layer 0 decides: layer-0 KV and indexer K are a function of (token id,
position) alone, so two servers agree up to GEMM rounding (batch shapes differ between them). A row
of another token differs by about its own norm (relative error ~1.4 for independent rows), a
rounding difference by ~1e-2 at most: ``WRONG_ROW_RELATIVE_ERROR`` sits between. Deeper layers
depend on attention, whose noise stock sglang already shows between two identical requests: their
errors are reported, not judged.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch

WRONG_ROW_RELATIVE_ERROR = 0.25
KV_LORA_RANK = 512  # fp8 NSA KV row: 512 fp8 latent values, 4 fp32 scales, 64 bf16 rope values


@dataclass
class MergedRequest:
    token_ids: np.ndarray  # [n]
    kv: np.ndarray  # [n, layers, row bytes] uint8
    index: np.ndarray  # [n, layers, token bytes] uint8
    kv_dtype: str
    problems: List[str] = field(default_factory=list)


def finished_dumps(run_dir: Path) -> List[Path]:
    """The dumps a server finished writing: ``kv_audit`` writes ``.<name>`` and renames it, so a dot
    file is one still being written (or cut off by the server's shutdown)."""
    return sorted((Path(run_dir) / "pool").glob("[!.]*.rank*.npz"))


def wait_for_settled_dumps(run_dir: Path, timeout_s: float, quiet_s: float = 3.0) -> bool:
    """Wait until no dump is being written and none has appeared for ``quiet_s`` seconds.

    A request's response can reach the client before its server has dumped its KV, so a runner that
    stops the server right after the last response may cut a dump off. True once settled, False at
    the timeout."""
    pool = Path(run_dir) / "pool"
    deadline = time.monotonic() + timeout_s
    seen, quiet_since = None, time.monotonic()
    while time.monotonic() < deadline:
        names = sorted(p.name for p in pool.glob("*.npz")) if pool.is_dir() else []
        if names != seen:
            seen, quiet_since = names, time.monotonic()
        elif not any(name.startswith(".") for name in names) and time.monotonic() - quiet_since >= quiet_s:
            return True
        time.sleep(0.2)
    return False


def load_dumps(run_dir: Path) -> Dict[str, List[dict]]:
    by_rid: Dict[str, List[dict]] = defaultdict(list)
    for path in finished_dumps(run_dir):
        rid = path.name.rsplit(".rank", 1)[0]
        with np.load(path) as f:
            by_rid[rid].append({k: f[k] for k in f.files})
    return by_rid


def merge_request(rid: str, parts: List[dict]) -> MergedRequest:
    token_ids = parts[0]["token_ids"]
    n = len(token_ids)
    counts = np.zeros(n, dtype=np.int64)
    kv = np.zeros((n,) + parts[0]["kv"].shape[1:], dtype=np.uint8)
    index = np.zeros((n,) + parts[0]["index"].shape[1:], dtype=np.uint8)
    for part in parts:
        positions = part["positions"]
        np.add.at(counts, positions, 1)
        kv[positions] = part["kv"]
        index[positions] = part["index"]
    merged = MergedRequest(token_ids, kv, index, str(parts[0]["kv_dtype"]))
    if (counts == 0).any():
        merged.problems.append(f"{rid}: {int((counts == 0).sum())} of {n} positions stored by no rank")
    if (counts > 1).any():
        merged.problems.append(f"{rid}: {int((counts > 1).sum())} of {n} positions stored by several ranks")
    return merged


def _as_tensor(rows) -> torch.Tensor:
    return rows if isinstance(rows, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(rows))


def kv_values(rows, kv_dtype: str) -> torch.Tensor:
    """``[..., row bytes]`` uint8 -> float values (fp8 rows: latent and rope values, scales left out)."""
    raw = _as_tensor(rows).contiguous()
    if "float8" not in kv_dtype:
        return raw.view(torch.bfloat16).float()
    latent = raw[..., :KV_LORA_RANK].contiguous().view(torch.float8_e4m3fn).float()
    rope = raw[..., KV_LORA_RANK + 16 :].contiguous().view(torch.bfloat16).float()
    return torch.cat([latent, rope], dim=-1)


def index_values(rows) -> torch.Tensor:
    """``[..., head bytes + 4]`` uint8 (fp8 head, fp32 scale) -> dequantized values."""
    raw = _as_tensor(rows).contiguous()
    head = raw[..., :-4].contiguous().view(torch.float8_e4m3fn).float()
    scale = raw[..., -4:].contiguous().view(torch.float32).float()
    return head * scale


def relative_row_errors(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row ``||a - b|| / max(||a||, ||b||)`` (0 for two zero rows)."""
    norm = torch.maximum(a.norm(dim=-1), b.norm(dim=-1)).clamp_min(1e-30)
    return (a - b).norm(dim=-1) / norm


@dataclass
class AuditComparison:
    requests: int = 0
    positions_compared: int = 0
    positions_with_other_tokens: int = 0
    layer0_wrong_kv_rows: int = 0
    layer0_wrong_index_rows: int = 0
    layer0_identical_kv_rows: int = 0
    # Positions whose KV (and indexer K) bytes are equal in every layer: all of them for a copy.
    identical_kv_positions: int = 0
    identical_index_positions: int = 0
    max_error_by_layer: List[float] = field(default_factory=list)
    failures: List[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return dict(self.__dict__)


def compare_runs(run_dir: Path, reference_dir: Path) -> AuditComparison:
    """Pool dumps of ``run_dir`` against ``reference_dir``, request by request (same rids)."""
    result = AuditComparison()
    run, reference = load_dumps(run_dir), load_dumps(reference_dir)
    if not run:
        result.failures.append(f"no pool audit dumps in {run_dir}")
        return result
    for rid in sorted(run):
        merged = merge_request(rid, run[rid])
        result.failures += merged.problems
        if rid not in reference:
            continue
        ref = merge_request(rid, reference[rid])
        result.failures += ref.problems
        n = min(len(merged.token_ids), len(ref.token_ids))
        same = np.nonzero(merged.token_ids[:n] == ref.token_ids[:n])[0]
        result.requests += 1
        result.positions_compared += len(same)
        result.positions_with_other_tokens += n - len(same)
        kv_err = relative_row_errors(
            kv_values(merged.kv[same], merged.kv_dtype), kv_values(ref.kv[same], ref.kv_dtype)
        )  # [positions, layers]
        index_err = relative_row_errors(index_values(merged.index[same]), index_values(ref.index[same]))
        layers = kv_err.shape[1] if kv_err.numel() else 0
        if len(result.max_error_by_layer) < layers:
            result.max_error_by_layer += [0.0] * (layers - len(result.max_error_by_layer))
        for layer in range(layers):
            worst = float(kv_err[:, layer].max())
            result.max_error_by_layer[layer] = max(result.max_error_by_layer[layer], worst)
        if layers:
            wrong_kv = int((kv_err[:, 0] > WRONG_ROW_RELATIVE_ERROR).sum())
            wrong_index = int((index_err[:, 0] > WRONG_ROW_RELATIVE_ERROR).sum())
            result.layer0_wrong_kv_rows += wrong_kv
            result.layer0_wrong_index_rows += wrong_index
            result.layer0_identical_kv_rows += int(
                (merged.kv[same, 0] == ref.kv[same, 0]).all(axis=-1).sum()
            )
            result.identical_kv_positions += int(
                (merged.kv[same] == ref.kv[same]).reshape(len(same), -1).all(axis=-1).sum()
            )
            result.identical_index_positions += int(
                (merged.index[same] == ref.index[same]).reshape(len(same), -1).all(axis=-1).sum()
            )
            if wrong_kv or wrong_index:
                result.failures.append(
                    f"{rid}: layer-0 rows of another token: KV {wrong_kv}, indexer K {wrong_index} "
                    f"of {len(same)} positions"
                )
    if result.requests == 0:
        result.failures.append(f"no request of {run_dir} has a reference dump in {reference_dir}")
    return result


def copy_failures(comparison: AuditComparison, what: str) -> List[str]:
    """For dumps of the same KV on both ends of a copy (a PD transfer: what the decode server holds
    against what the prefill server held): every compared position must be equal in every byte."""
    failures = list(comparison.failures)
    for kind in ("kv", "index"):
        identical = getattr(comparison, f"identical_{kind}_positions")
        if identical != comparison.positions_compared:
            failures.append(
                f"{what}: {comparison.positions_compared - identical} of "
                f"{comparison.positions_compared} positions differ in some {kind} byte"
            )
    return failures


def read_audit_totals(run_dir: Path) -> Dict[str, int]:
    totals: Dict[str, int] = defaultdict(int)
    for path in sorted(Path(run_dir).glob("read_audit.rank*.json")):
        for key, value in json.loads(path.read_text()).items():
            totals[key] += value
        totals["ranks"] += 1
    return dict(totals)


def read_audit_failures(totals: Dict[str, int]) -> List[str]:
    """Rows of another token and references to never-allocated locs fail; rows that differ only in
    rounding (a rank's own decode KV against the owner's copy of the same token) are reported."""
    if not totals.get("ranks"):
        return ["read audit: no rank reported"]
    failures = []
    for kind in ("kv", "index"):
        if not totals.get(f"{kind}_rows"):
            failures.append(f"read audit: no {kind} rows were checked")
        if totals.get(f"{kind}_wrong"):
            failures.append(
                f"read audit: {totals[f'{kind}_wrong']} of {totals[f'{kind}_rows']} {kind} rows read "
                "through the scratch hold another token than their owner's rows"
            )
    if totals.get("dummy_refs"):
        failures.append(
            f"read audit: {totals['dummy_refs']} referenced positions point into never-allocated "
            "logical pages (the dummy pages)"
        )
    return failures
