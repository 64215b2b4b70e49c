"""Client side of the smoke's KV audits (``kv_audit.py`` beside this module), and the row decoding
both sides share.

A run's pool dumps hold, per finished request and rank, the KV and indexer-K bytes of every layer
for the positions that rank stores. ``merge_request`` joins the ranks (every position exactly once)
and ``compare_runs`` checks a run against a reference run (another server, e.g. stock replicated
KV) request by request, at the positions where both saw the same token. Without a reference server (the
soak), ``layer0_self_consistency`` checks a run's dumps against themselves.

Why a tolerance and why layer 0 decides: layer-0 KV and indexer K are a function of (token id,
position) alone, so two servers agree up to GEMM rounding (batch shapes differ between them). A row
of another token differs by about its own norm (relative error ~1.4 for independent rows), a
rounding difference by ~1e-2 at most: ``WRONG_ROW_RELATIVE_ERROR`` sits between. Deeper layers
depend on attention, whose noise stock sglang already shows between two identical requests: their
errors are reported, not judged.

The MTP draft pool (dumps with ``draft_*`` arrays, ``draft_audit``): its rows are merged the same way
(every position exactly once: judged) and compared with the reference's, reported only (a draft
row is a function of the target's last hidden state: attention noise, as a deep layer). What judges
the draft: the draft's write and read audits (``draft_audit_failures``), the cached-prefix ledger
(``cached_row_ledger``: rows of positions served from the cache equal, bit for bit, those of the
request that stored them) and, between the two servers of a PD pair, the copy rule
(``copy_failures``).
"""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

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
    # The MTP draft pool's rows (one layer), None when the server ran no draft.
    draft_kv: Optional[np.ndarray] = None
    draft_index: Optional[np.ndarray] = None
    cached_tokens: int = 0  # prompt tokens the request got from the cache (device or host)


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


def _merge_rows(what: str, n: int, parts: List[dict], positions_key: str, keys: Tuple[str, ...]):
    """The ranks' rows of ``keys`` joined by position, and the positions stored by no or several ranks."""
    counts = np.zeros(n, dtype=np.int64)
    rows = {key: np.zeros((n,) + parts[0][key].shape[1:], dtype=np.uint8) for key in keys}
    for part in parts:
        positions = part[positions_key]
        np.add.at(counts, positions, 1)
        for key in keys:
            rows[key][positions] = part[key]
    problems = []
    if (counts == 0).any():
        problems.append(f"{what}: {int((counts == 0).sum())} of {n} positions stored by no rank")
    if (counts > 1).any():
        problems.append(f"{what}: {int((counts > 1).sum())} of {n} positions stored by several ranks")
    return rows, problems


def merge_request(rid: str, parts: List[dict]) -> MergedRequest:
    token_ids = parts[0]["token_ids"]
    n = len(token_ids)
    rows, problems = _merge_rows(rid, n, parts, "positions", ("kv", "index"))
    merged = MergedRequest(token_ids, rows["kv"], rows["index"], str(parts[0]["kv_dtype"]), problems)
    if "cached_tokens" in parts[0]:
        merged.cached_tokens = int(parts[0]["cached_tokens"])
    with_draft = ["draft_kv" in part for part in parts]
    if any(with_draft) and not all(with_draft):
        merged.problems.append(f"{rid}: {with_draft.count(False)} of {len(parts)} ranks dumped no draft rows")
    elif all(with_draft):
        draft, draft_problems = _merge_rows(f"{rid} (draft)", n, parts, "draft_positions", ("draft_kv", "draft_index"))
        merged.draft_kv, merged.draft_index = draft["draft_kv"], draft["draft_index"]
        merged.problems += draft_problems
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
    # The MTP draft pool's rows, where both dumps have them: reported, not judged (module doc).
    draft_requests: int = 0
    draft_identical_kv_positions: int = 0
    draft_identical_index_positions: int = 0
    draft_max_kv_error: float = 0.0
    draft_max_index_error: float = 0.0
    draft_kv_rows_above_wrong_row_error: int = 0
    draft_index_rows_above_wrong_row_error: int = 0
    draft_requests_without_reference_draft: int = 0
    failures: List[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return dict(self.__dict__)

    def compare_draft(self, merged: MergedRequest, ref: MergedRequest, same: np.ndarray) -> None:
        if merged.draft_kv is None:
            return
        if ref.draft_kv is None:
            self.draft_requests_without_reference_draft += 1
            return
        self.draft_requests += 1
        kv_err = relative_row_errors(
            kv_values(merged.draft_kv[same], merged.kv_dtype), kv_values(ref.draft_kv[same], ref.kv_dtype)
        )
        index_err = relative_row_errors(index_values(merged.draft_index[same]), index_values(ref.draft_index[same]))
        if kv_err.numel():
            self.draft_max_kv_error = max(self.draft_max_kv_error, float(kv_err.max()))
            self.draft_max_index_error = max(self.draft_max_index_error, float(index_err.max()))
        self.draft_kv_rows_above_wrong_row_error += int((kv_err > WRONG_ROW_RELATIVE_ERROR).sum())
        self.draft_index_rows_above_wrong_row_error += int((index_err > WRONG_ROW_RELATIVE_ERROR).sum())
        flat = len(same), -1
        self.draft_identical_kv_positions += int((merged.draft_kv[same] == ref.draft_kv[same]).reshape(flat).all(axis=-1).sum())
        self.draft_identical_index_positions += int(
            (merged.draft_index[same] == ref.draft_index[same]).reshape(flat).all(axis=-1).sum()
        )


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
        result.compare_draft(merged, ref, same)
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


def copy_failures(comparison: AuditComparison, what: str, with_draft: bool = False) -> List[str]:
    """For dumps of the same KV on both ends of a copy (a PD transfer: what the decode server holds
    against what the prefill server held): every compared position must be equal in every byte.
    ``with_draft`` (MTP on both servers): the draft pool's rows too, in every compared request."""
    failures = list(comparison.failures)
    for kind in ("kv", "index"):
        identical = getattr(comparison, f"identical_{kind}_positions")
        if identical != comparison.positions_compared:
            failures.append(
                f"{what}: {comparison.positions_compared - identical} of "
                f"{comparison.positions_compared} positions differ in some {kind} byte"
            )
    if not with_draft:
        return failures
    if comparison.draft_requests != comparison.requests:
        failures.append(
            f"{what}: draft rows compared in {comparison.draft_requests} of {comparison.requests} requests "
            f"({comparison.draft_requests_without_reference_draft} without the other side's draft rows)"
        )
    for kind in ("kv", "index"):
        identical = getattr(comparison, f"draft_identical_{kind}_positions")
        if comparison.draft_requests == comparison.requests and identical != comparison.positions_compared:
            failures.append(
                f"{what}: {comparison.positions_compared - identical} of {comparison.positions_compared} "
                f"positions differ in some draft {kind} byte"
            )
    return failures


# ---------------------------------------------------------------- cached-prefix ledger

_PLAN_RID = re.compile(r"^(?:smoke|pd)-(\d+)-")


@dataclass
class CachedRowLedger:
    """Rows of positions served from the cache against the rows of the request that stored them.

    A position below a request's ``cached_tokens`` came from the radix tree (device, or host through a
    load-back) and is not written again by any forward of that request: the target's extend and the
    draft's extend both start at the first uncached token. So its rows, target and draft, must equal
    bit for bit the rows the last earlier request sharing that position's tree page dumped when it
    finished (that request stored or itself reused them). Two requests share a page when the radix
    tree's page-aligned key match covers it (``shared_prefix_tokens``): with EAGLE's bigram keys (every
    MTP server) a page is shared only if the token after it matches too, so two requests with the
    same first 8,064 tokens share 8,000 positions (pages 0-124) and the second computes its own copy of page 125.
    Requests are taken in the plan's order (``smoke-<index>-...`` / ``pd-<index>-...`` request ids);
    requests run concurrently (the burst) are left out, since two of them may both compute a prefix
    while only one copy stays in the tree."""

    requests_with_cached_tokens: int = 0
    positions_checked: int = 0
    positions_without_source: int = 0
    target_kv_rows_changed: int = 0
    target_index_rows_changed: int = 0
    draft_positions_checked: int = 0
    draft_kv_rows_changed: int = 0
    draft_index_rows_changed: int = 0
    changed_by_request: Dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return dict(self.__dict__)

    def draft_failures(self, what: str = "cached-prefix ledger") -> List[str]:
        """What the ledger judges: the draft's rows (the target's layer 0 is judged against the
        reference; its ledger counts are reported)."""
        if not self.draft_positions_checked:
            return [f"{what}: no position served from the cache had draft rows to check"]
        changed = self.draft_kv_rows_changed + self.draft_index_rows_changed
        if not changed:
            return []
        worst = sorted(self.changed_by_request.items(), key=lambda item: -item[1])[:3]
        return [
            f"{what}: {self.draft_kv_rows_changed} draft KV and {self.draft_index_rows_changed} draft indexer-K rows "
            f"of {self.draft_positions_checked} cached positions differ from the rows of the request that "
            f"stored them (most: {worst})"
        ]


def _common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.nonzero(a[:n] != b[:n])[0]
    return int(differ[0]) if len(differ) else n


def _rows_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a != b).reshape(len(a), -1).any(axis=-1)


def shared_prefix_tokens(common_tokens: int, page_size: int, bigram_keys: bool) -> int:
    """Positions two requests with ``common_tokens`` equal first tokens share in the radix tree: its
    key match rounded down to pages, counted in bigrams (``common_tokens - 1``) under EAGLE keys."""
    units = max(common_tokens - 1, 0) if bigram_keys else common_tokens
    return units // page_size * page_size


def cached_row_ledger(run_dir: Path, page_size: int, bigram_keys: bool) -> CachedRowLedger:
    """The ledger (see ``CachedRowLedger``) of one run's pool dumps; ``bigram_keys``: the server's
    tree keys are EAGLE bigrams (speculative decoding with EAGLE / NEXTN)."""
    ledger = CachedRowLedger()
    dumps = load_dumps(run_dir)
    ordered = sorted((int(m.group(1)), rid) for rid in dumps for m in [_PLAN_RID.match(rid)] if m)
    earlier: List[Tuple[str, MergedRequest]] = []
    for _, rid in ordered:
        merged = merge_request(rid, dumps[rid])
        cached = min(merged.cached_tokens, len(merged.token_ids))
        if cached:
            ledger.requests_with_cached_tokens += 1
            unsourced = np.ones(cached, dtype=bool)
            changed = 0
            for _, source in reversed(earlier):  # the latest request holding each position's prefix
                common = _common_prefix_length(merged.token_ids, source.token_ids)
                covered = min(cached, shared_prefix_tokens(common, page_size, bigram_keys))
                take = np.nonzero(unsourced[:covered])[0]
                if not len(take):
                    continue
                unsourced[take] = False
                ledger.positions_checked += len(take)
                kv, index = _rows_differ(merged.kv[take], source.kv[take]), _rows_differ(merged.index[take], source.index[take])
                ledger.target_kv_rows_changed += int(kv.sum())
                ledger.target_index_rows_changed += int(index.sum())
                if merged.draft_kv is not None and source.draft_kv is not None:
                    ledger.draft_positions_checked += len(take)
                    draft_kv = _rows_differ(merged.draft_kv[take], source.draft_kv[take])
                    draft_index = _rows_differ(merged.draft_index[take], source.draft_index[take])
                    ledger.draft_kv_rows_changed += int(draft_kv.sum())
                    ledger.draft_index_rows_changed += int(draft_index.sum())
                    changed += int((draft_kv | draft_index).sum())
            ledger.positions_without_source += int(unsourced.sum())
            if changed:
                ledger.changed_by_request[rid] = changed
        earlier.append((rid, merged))
    return ledger


def read_audit_totals(run_dir: Path, name: str = "read_audit") -> Dict[str, int]:
    """Counts summed over ranks of ``<name>.rank<r>.json``: ``read_audit`` (the target's),
    ``read_audit_draft`` (the draft's) or ``draft_write_audit``."""
    totals: Dict[str, int] = defaultdict(int)
    for path in sorted(Path(run_dir).glob(f"{name}.rank*.json")):
        for key, value in json.loads(path.read_text()).items():
            totals[key] += value
        totals["ranks"] += 1
    return dict(totals)


def read_audit_failures(totals: Dict[str, int], what: str = "read audit") -> List[str]:
    """Rows of another token and references to never-allocated locs fail; rows that differ only in
    rounding (a rank's own decode KV against the owner's copy of the same token) are reported."""
    if not totals.get("ranks"):
        return [f"{what}: no rank reported"]
    failures = []
    for kind in ("kv", "index"):
        if not totals.get(f"{kind}_rows"):
            failures.append(f"{what}: no {kind} rows were checked")
        if totals.get(f"{kind}_wrong"):
            failures.append(
                f"{what}: {totals[f'{kind}_wrong']} of {totals[f'{kind}_rows']} {kind} rows read "
                "through the scratch hold another token than their owner's rows"
            )
    if totals.get("dummy_refs"):
        failures.append(
            f"{what}: {totals['dummy_refs']} referenced positions point into never-allocated "
            "logical pages (the dummy pages)"
        )
    return failures


def draft_audit_totals(run_dir: Path) -> Dict[str, Dict[str, int]]:
    return {
        "draft_read_audit": read_audit_totals(run_dir, "read_audit_draft"),
        "draft_write_audit": read_audit_totals(run_dir, "draft_write_audit"),
    }


def draft_audit_failures(totals: Dict[str, Dict[str, int]]) -> List[str]:
    """A shared-KV server with MTP: the draft's read audit as the target's, and its write audit
    (every draft row a forward stored is its owner's row; rounding differences are reported)."""
    failures = read_audit_failures(totals["draft_read_audit"], "draft read audit")
    write = totals["draft_write_audit"]
    if not write.get("ranks"):
        return failures + ["draft write audit: no rank reported"]
    for kind in ("kv", "index"):
        if not write.get(f"{kind}_rows"):
            failures.append(f"draft write audit: no {kind} rows were checked")
        if write.get(f"{kind}_wrong"):
            failures.append(
                f"draft write audit: {write[f'{kind}_wrong']} of {write[f'{kind}_rows']} draft {kind} rows "
                "written by a forward are not on their owner"
            )
    return failures


# ---------------------------------------------------------------- rows restored from L3 storage


def restored_row_check(written_dir: Path, restored_dir: Path, pairs: List[Tuple[str, str, int]]) -> Dict:
    """Rows a server restored from L3 against the rows the server that stored them dumped.

    ``pairs``: (rid on the writing server, rid on the restoring server, tokens restored), the two
    prompts sharing their first ``tokens restored`` tokens. Storage is a copy: every byte of every
    layer of those positions, KV and indexer K, must be equal (no tolerance, unlike the comparison
    with another server's forward)."""
    written, restored = load_dumps(written_dir), load_dumps(restored_dir)
    out: Dict = {"requests": 0, "positions_checked": 0, "positions_differing": 0, "failures": []}
    for written_rid, restored_rid, tokens in pairs:
        if written_rid not in written or restored_rid not in restored:
            out["failures"].append(
                f"restored rows: no pool dump of {written_rid if written_rid not in written else restored_rid}"
            )
            continue
        a, b = merge_request(written_rid, written[written_rid]), merge_request(restored_rid, restored[restored_rid])
        out["failures"] += a.problems + b.problems
        shared = _common_prefix_length(a.token_ids, b.token_ids)
        if shared < tokens:
            out["failures"].append(f"restored rows: {restored_rid} shares {shared} tokens with {written_rid}, not {tokens}")
            tokens = shared
        differ = _rows_differ(a.kv[:tokens], b.kv[:tokens]) | _rows_differ(a.index[:tokens], b.index[:tokens])
        out["requests"] += 1
        out["positions_checked"] += tokens
        out["positions_differing"] += int(differ.sum())
        if differ.any():
            out["failures"].append(
                f"restored rows: {int(differ.sum())} of {tokens} positions of {restored_rid} differ from the "
                f"rows {written_rid} stored (first at position {int(np.nonzero(differ)[0][0])})"
            )
    return out


# ---------------------------------------------------------------- self-consistency (no reference run)


@dataclass
class SelfConsistency:
    """One run's pool dumps against themselves (``layer0_self_consistency``)."""

    requests: int = 0
    positions: int = 0
    # Rows compared with the first dumped row of the same (token id, position).
    repeated_positions: int = 0
    layer0_wrong_kv_rows: int = 0
    layer0_wrong_index_rows: int = 0
    wrong_by_request: Dict[str, int] = field(default_factory=dict)
    failures: List[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return dict(self.__dict__)


def layer0_self_consistency(run_dir: Path) -> SelfConsistency:
    """Every dumped layer-0 row of one (token id, position) must match the first one dumped.

    For a run without a reference server (the soak). Layer-0 KV and indexer K are a function of
    (token id, position) alone (module docstring), so requests that share a prefix, e.g. the turns of
    one conversation, some served from device and some loaded back from host, must hold the same
    layer-0 rows there up to rounding; a page written, backed up or loaded back to the wrong place
    holds another token's rows (relative error ~1.4, against ``WRONG_ROW_RELATIVE_ERROR``)."""
    result = SelfConsistency()
    dumps = load_dumps(run_dir)
    if not dumps:
        result.failures.append(f"pool self-consistency: no pool audit dumps in {run_dir}")
        return result
    keys, kv_rows, index_rows, request_of = [], [], [], []
    rids = sorted(dumps)
    kv_dtype = None
    for number, rid in enumerate(rids):
        merged = merge_request(rid, dumps[rid])
        result.failures += merged.problems
        kv_dtype = merged.kv_dtype
        n = len(merged.token_ids)
        keys.append((np.arange(n, dtype=np.int64) << 32) + merged.token_ids.astype(np.int64))
        kv_rows.append(merged.kv[:, 0])
        index_rows.append(merged.index[:, 0])
        request_of.append(np.full(n, number, dtype=np.int64))
    keys_all = np.concatenate(keys)
    _, first, inverse = np.unique(keys_all, return_index=True, return_inverse=True)
    reference = first[inverse]  # row index of the first row of each row's (token, position)
    repeated = reference != np.arange(len(keys_all))
    result.requests, result.positions = len(rids), len(keys_all)
    result.repeated_positions = int(repeated.sum())
    if not result.repeated_positions:
        result.failures.append(f"pool self-consistency: no (token, position) dumped twice in {result.requests} requests")
        return result
    kv_all, index_all = np.concatenate(kv_rows), np.concatenate(index_rows)
    kv_err = relative_row_errors(kv_values(kv_all[repeated], kv_dtype), kv_values(kv_all[reference[repeated]], kv_dtype))
    index_err = relative_row_errors(index_values(index_all[repeated]), index_values(index_all[reference[repeated]]))
    wrong = ((kv_err > WRONG_ROW_RELATIVE_ERROR) | (index_err > WRONG_ROW_RELATIVE_ERROR)).numpy()
    result.layer0_wrong_kv_rows = int((kv_err > WRONG_ROW_RELATIVE_ERROR).sum())
    result.layer0_wrong_index_rows = int((index_err > WRONG_ROW_RELATIVE_ERROR).sum())
    counts = np.bincount(np.concatenate(request_of)[repeated][wrong], minlength=len(rids))
    result.wrong_by_request = {rids[i]: int(c) for i, c in enumerate(counts) if c}
    if result.layer0_wrong_kv_rows or result.layer0_wrong_index_rows:
        worst = sorted(result.wrong_by_request.items(), key=lambda item: -item[1])[:3]
        result.failures.append(
            f"pool self-consistency: {result.layer0_wrong_kv_rows} KV and {result.layer0_wrong_index_rows} "
            f"indexer-K layer-0 rows of {result.repeated_positions} repeated (token, position) pairs hold "
            f"another token than the first dump of that pair (most: {worst})"
        )
    return result
