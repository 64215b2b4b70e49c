"""The served L3 restart check: prompts, the storage-hit reading of a response, and the verdict.

Three shared-KV servers of one CP size, all with HiCache (``scripts/glm5_cp_l3_restart_smoke.py``
runs them):

  write      ``--hicache-storage-backend file`` on a fresh directory: serves ``prefixes`` prompts of
             ``prefix_tokens`` each (rids ``l3-write-<k>``); each rank stores the pages it owns
             when their host copy is acknowledged. Stopped once the directory holds them.
  restart    a fresh server on the same directory: each prefix again with a new suffix (rids
             ``l3-read-<k>``). The prefix must come from L3: every page restored into host slots by
             the synchronous prefetch, then loaded back to device.
  recompute  a fresh server without storage: the same ``l3-read-<k>`` prompts, recomputed. Its
             pool dumps are the reference of the restart server's (same rids), its TTFT the
             recomputed side of the comparison.

Prefix 0 is a warm-up on both the restart and the recompute server (first-use compilation of the
load-back and storage paths lands there); prefixes 1.. are timed. All counts are logical tokens.

Where sglang 0.5.11 reports an L3 hit: ``meta_info["cached_tokens_details"]["storage"]`` of the
response (``Scheduler._get_cached_tokens_details``: the tokens ``pop_prefetch_loaded_tokens``
returned for the request, which our prefetch sets to the restored length), and the tokenizer's
``sglang:cached_tokens_total`` counter with a ``cache_source`` label ``storage_<backend>`` (reported
as a cross-check, not judged). Timings in the one-GPU mode are of a time-sliced GPU with socket
collectives: labelled so, never the cost of L3 or of shared KV.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

WRITE, RESTART, RECOMPUTE = "write", "restart", "recompute"
TIMING_LABEL = "one GPU, time-sliced"


@dataclass(frozen=True)
class L3RestartPlan:
    """The prompts of the three servers (deterministic from ``seed``)."""

    prefixes: int  # prefix 0 is the warm-up; at least one more is timed
    prefix_tokens: int  # a multiple of the page size: every prefix page is whole, hence stored
    suffix_tokens: int
    page_size: int
    max_new_tokens: int = 8
    token_id_range: tuple = (0, 256)
    seed: int = 0

    def __post_init__(self):
        if self.prefixes < 2:
            raise ValueError(f"--prefixes {self.prefixes}: need a warm-up prefix and at least one timed one")
        if self.prefix_tokens <= 0 or self.prefix_tokens % self.page_size:
            raise ValueError(
                f"--prefix-tokens {self.prefix_tokens}: need a positive multiple of the page size {self.page_size}"
            )
        if self.suffix_tokens <= 0:
            raise ValueError(f"--suffix-tokens {self.suffix_tokens}: need at least one new token")

    def _tokens(self, stream: int, count: int) -> List[int]:
        low, high = self.token_id_range
        rng = random.Random(self.seed * 1_000_003 + stream)
        return [rng.randrange(low, high) for _ in range(count)]

    def write_prompt(self, k: int) -> List[int]:
        return self._tokens(2 * k, self.prefix_tokens)

    def read_prompt(self, k: int) -> List[int]:
        """Prefix ``k`` plus a suffix the write server never saw."""
        return self.write_prompt(k) + self._tokens(2 * k + 1, self.suffix_tokens)

    @staticmethod
    def write_rid(k: int) -> str:
        return f"l3-write-{k}"

    @staticmethod
    def read_rid(k: int) -> str:
        return f"l3-read-{k}"

    def timed(self) -> range:
        return range(1, self.prefixes)

    def stored_pages(self) -> int:
        """Pages every rank together must find in storage before the write server stops."""
        return self.prefixes * self.prefix_tokens // self.page_size

    def describe(self) -> List[str]:
        return [
            f"write:     {self.prefixes} prompts of {self.prefix_tokens} tokens (rids l3-write-0..{self.prefixes - 1})",
            f"restart:   the same prefixes + {self.suffix_tokens} new tokens each (rids l3-read-*), "
            f"expected from L3: {self.prefix_tokens} tokens each",
            f"recompute: the same l3-read-* prompts on a server without storage (reference and TTFT)",
            f"timed: prefixes {list(self.timed())} (prefix 0 warms up both servers)",
        ]


def storage_tokens(meta_info: Dict[str, Any]) -> Optional[int]:
    """Prompt tokens sglang says came from L3 (None: the response carries no storage figure)."""
    details = meta_info.get("cached_tokens_details") or {}
    value = details.get("storage")
    return None if value is None else int(value)


def storage_counter_total(samples: Sequence[tuple]) -> float:
    """``sglang:cached_tokens_total`` summed over its ``cache_source="storage_*"`` series
    (``samples``: (labels, value) pairs as ``MetricsSnapshot.samples`` holds them)."""
    return sum(value for labels, value in samples if str(labels.get("cache_source", "")).startswith("storage"))


@dataclass
class ServedRequest:
    """What the verdict needs of one response."""

    server: str
    rid: str
    prompt_tokens: int
    cached_tokens: int
    storage_tokens: Optional[int]
    ttft_ms: Optional[float]
    error: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        return dict(self.__dict__)


def hit_failures(plan: L3RestartPlan, requests: Sequence[ServedRequest]) -> List[str]:
    """L3 must serve every restart prompt's whole prefix and nothing on the other two servers:
    a fresh directory has nothing, and the recompute server has no storage."""
    failures = [f"{r.server} {r.rid}: {r.error}" for r in requests if r.error]
    by = {(r.server, r.rid): r for r in requests}
    for k in range(plan.prefixes):
        read = by.get((RESTART, plan.read_rid(k)))
        if read is None:
            failures.append(f"restart {plan.read_rid(k)}: no response")
        elif not read.error and (read.storage_tokens or 0) != plan.prefix_tokens:
            failures.append(
                f"restart {read.rid}: {read.storage_tokens or 0} tokens served from L3, expected the whole "
                f"prefix of {plan.prefix_tokens} (cached {read.cached_tokens} in all)"
            )
        write = by.get((WRITE, plan.write_rid(k)))
        if write is None:
            failures.append(f"write {plan.write_rid(k)}: no response")
        elif write.storage_tokens:
            failures.append(f"write {write.rid}: {write.storage_tokens} tokens from L3 on a fresh directory")
        ref = by.get((RECOMPUTE, plan.read_rid(k)))
        if ref is None:
            failures.append(f"recompute {plan.read_rid(k)}: no response")
        elif not ref.error and ref.cached_tokens:
            failures.append(f"recompute {ref.rid}: {ref.cached_tokens} cached tokens on a fresh server, expected 0")
    return failures


def stored_object_failures(plan: L3RestartPlan, objects_after_write: int) -> List[str]:
    """Two objects per page (KV and the indexer page), each stored once, by its owner."""
    expected = 2 * plan.stored_pages()
    if objects_after_write < expected:
        return [f"storage: {objects_after_write} objects after the write server, expected at least {expected} "
                f"(KV + indexer of {plan.stored_pages()} pages)"]  # fmt: skip
    return []


def ttft_comparison(plan: L3RestartPlan, requests: Sequence[ServedRequest]) -> Dict[str, Any]:
    """Median TTFT over the timed prefixes: prefix from L3 (restart) vs recomputed (no storage)."""
    by = {(r.server, r.rid): r for r in requests}

    def median_of(server: str) -> Optional[float]:
        values = [by[(server, plan.read_rid(k))].ttft_ms for k in plan.timed() if (server, plan.read_rid(k)) in by]
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 2) if values else None

    from_l3, recomputed = median_of(RESTART), median_of(RECOMPUTE)
    return {
        "label": TIMING_LABEL,
        "prefix_tokens": plan.prefix_tokens,
        "suffix_tokens": plan.suffix_tokens,
        "timed_prefixes": len(plan.timed()),
        "from_l3_ttft_ms": from_l3,
        "recomputed_ttft_ms": recomputed,
        "from_l3_over_recomputed": round(from_l3 / recomputed, 3) if from_l3 and recomputed else None,
    }


def decode_text(decode: Dict[str, Any]) -> str:
    """The decode the servers logged (``ServedDecode.describe`` by server name, in the order given; one
    description when they agree) and the one asked for."""
    served = decode.get("served") or {}
    if len(set(served.values())) == 1:
        text = next(iter(served.values()))
    else:
        text = ", ".join(f"{name}: {description}" for name, description in served.items())
    return f"decode {text or 'not logged'} (asked: {decode.get('asked', '?')})"


def verdict_line(cp_size: int, failures: Sequence[str], figures: Dict[str, Any]) -> str:
    """One line for a reader of a GPU call's tail, naming the decode that served."""
    ttft = figures.get("ttft", {})
    timing = (f"TTFT ({ttft.get('label')}) from L3 {ttft.get('from_l3_ttft_ms')} ms vs recomputed "
              f"{ttft.get('recomputed_ttft_ms')} ms")  # fmt: skip
    restored = figures.get("restored_rows", {})
    audits = (f"restored rows {restored.get('positions_differing', '?')} differing / "
              f"{restored.get('positions_checked', '?')}; pool {figures.get('pool_audit_wrong_rows', '?')} wrong rows / "
              f"{figures.get('pool_audit_positions', '?')}")  # fmt: skip
    if figures.get("values"):
        audits += f"; {figures['values']}"
    decode = decode_text(figures.get("decode", {}))
    if failures:
        return f"FAILED l3_restart_cp{cp_size}, {decode}: {len(failures)} failures, first: {failures[0][:300]}"
    return f"PASSED l3_restart_cp{cp_size}, {decode}: L3 tokens {figures.get('l3_tokens')}; {audits}; {timing}"
