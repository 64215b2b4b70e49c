"""The serving benchmark's workloads and the statistics it reports on them.

Headline workload: agents re-reading long shared documents. ``num_documents`` documents of
``document_tokens`` tokens each; a conversation picks one document and asks ``turns`` questions in
turn, each prompt being the document, every earlier question with its (fixed, tool-output-like)
answer, and the new question, so turn ``t``'s prompt extends turn ``t - 1``'s. Conversations visit
the documents cyclically for ``rounds`` rounds. The *working set* (every document with its longest
conversation) is sized from the servers' logical device pools, so whether a re-read hits is decided
by capacity: a cyclic re-read of more tokens than a pool holds misses under LRU, a re-read of fewer
hits. All counts are logical tokens of one CP group (``max_total_num_tokens``).

* phase ``device``: stock pool < working set <= shared-KV logical pool;
* phase ``host``: working set > both device pools, within the shared-KV server's host pool.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

# The working set leaves this share of a pool free: running requests and their outputs need room.
POOL_HEADROOM = 0.9


@dataclass(frozen=True)
class ConversationTurn:
    conversation: int
    turn: int
    document: int
    input_ids: List[int]


@dataclass(frozen=True)
class DocumentWorkload:
    name: str
    document_tokens: int
    num_documents: int
    turns: int
    turn_tokens: int  # question + answer tokens one turn adds
    rounds: int
    max_new_tokens: int
    seed: int
    conditions: List[str] = field(default_factory=list)  # why the sizes hold, for the output

    @property
    def working_set_tokens(self) -> int:
        return self.num_documents * (self.document_tokens + self.turns * self.turn_tokens)

    def conversations(self) -> List[List[ConversationTurn]]:
        """Every conversation's turns, in the order conversations are started."""
        out = []
        for r in range(self.rounds):
            for d in range(self.num_documents):
                c = r * self.num_documents + d
                document = _tokens(self.seed * 7919 + d, self.document_tokens)
                history: List[int] = []
                turns = []
                for t in range(self.turns):
                    question = _tokens(self.seed * 104729 + c * 1000 + t, self.turn_tokens)
                    turns.append(ConversationTurn(c, t, d, document + history + question))
                    history = history + question
                out.append(turns)
        return out

    def num_requests(self) -> int:
        return self.rounds * self.num_documents * self.turns


def _tokens(seed: int, count: int, low: int = 0, high: int = 256) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(low, high) for _ in range(count)]


def size_workloads(
    stock_device_tokens: int,
    shared_device_tokens: int,
    shared_host_tokens: int,
    page_size: int,
    document_tokens: int,
    turns: int,
    turn_tokens: int,
    rounds: int,
    max_new_tokens: int,
    seed: int = 0,
) -> List[DocumentWorkload]:
    """The two phases, sized from the reported pools; ``ValueError`` if a condition cannot hold."""
    if shared_device_tokens <= stock_device_tokens / POOL_HEADROOM:
        raise ValueError(
            f"the shared-KV logical pool ({shared_device_tokens}) is not larger than the stock pool "
            f"({stock_device_tokens}) by the headroom: no working set fits between them"
        )
    document_tokens = min(document_tokens, stock_device_tokens // 4) // page_size * page_size
    per_document = document_tokens + turns * turn_tokens
    if document_tokens <= 0:
        raise ValueError(f"the stock pool ({stock_device_tokens} tokens) is too small for one document")
    workloads = []
    targets = (
        ("device", (stock_device_tokens + POOL_HEADROOM * shared_device_tokens) / 2,
         stock_device_tokens, POOL_HEADROOM * shared_device_tokens),
        ("host", (shared_device_tokens + POOL_HEADROOM * shared_host_tokens) / 2,
         shared_device_tokens, POOL_HEADROOM * shared_host_tokens),
    )  # fmt: skip
    for name, target, above, within in targets:
        num_documents = max(2, round(target / per_document))
        w = DocumentWorkload(name, document_tokens, num_documents, turns, turn_tokens, rounds, max_new_tokens, seed)
        if not above < w.working_set_tokens <= within:
            raise ValueError(
                f"phase {name}: working set {w.working_set_tokens} tokens is not in ({above}, {within:.0f}]; "
                f"use smaller documents (--document-tokens) or larger pools"
            )
        w.conditions.append(
            f"phase {name}: working set {w.working_set_tokens} logical tokens ({num_documents} documents x "
            f"{per_document}) > {above} and <= {within:.0f} "
            + ("(stock device pool < it <= shared-KV logical pool x headroom)" if name == "device"
               else "(shared-KV logical device pool < it <= shared-KV host pool x headroom)")
        )  # fmt: skip
        workloads.append(w)
    return workloads


@dataclass
class RequestSample:
    """One request as the client saw it; ``start_s`` is relative to the phase's start."""

    start_s: float
    ttft_s: Optional[float]
    e2e_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    cached_device_tokens: int
    cached_host_tokens: int
    error: Optional[str] = None

    @staticmethod
    def of(start_s: float, prompt_tokens: int, result) -> "RequestSample":
        meta = result.meta_info or {}
        details = meta.get("cached_tokens_details") or {}
        return RequestSample(
            start_s=start_s,
            ttft_s=result.ttft_s,
            e2e_s=result.e2e_s,
            prompt_tokens=prompt_tokens,
            output_tokens=len(result.output_ids),
            cached_tokens=int(meta.get("cached_tokens", 0) or 0),
            cached_device_tokens=int(details.get("device", 0) or 0),
            cached_host_tokens=int(details.get("host", 0) or 0),
            error=result.error,
        )

    def to_json(self) -> Dict[str, Any]:
        return dict(self.__dict__)


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Nearest-rank percentile (``q`` in 0..100) of ``values``; ``None`` when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def phase_summary(samples: Sequence[RequestSample], wall_s: float) -> Dict[str, Any]:
    """What the table reports for one phase of one server."""
    ok = [s for s in samples if s.error is None]
    prompt = sum(s.prompt_tokens for s in ok)
    ttfts = [s.ttft_s * 1e3 for s in ok if s.ttft_s is not None]
    return {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": sum(s.cached_tokens for s in ok),
        "hit_rate": sum(s.cached_tokens for s in ok) / prompt if prompt else None,
        "device_hit_rate": sum(s.cached_device_tokens for s in ok) / prompt if prompt else None,
        "host_hit_rate": sum(s.cached_host_tokens for s in ok) / prompt if prompt else None,
        "mean_ttft_ms": statistics.fmean(ttfts) if ttfts else None,
        "p99_ttft_ms": percentile(ttfts, 99),
        "output_tokens_per_s": sum(s.output_tokens for s in ok) / wall_s if wall_s > 0 else None,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "wall_s": wall_s,
    }


def progress_line(label: str, samples: Sequence[RequestSample], total: int, elapsed_s: float) -> str:
    s = phase_summary(samples, elapsed_s)
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    return (
        f"[{label}] {len(samples)}/{total} requests, hit {fmt(s['hit_rate'], '.3f')} (device "
        f"{fmt(s['device_hit_rate'], '.3f')}, host {fmt(s['host_hit_rate'], '.3f')}), mean TTFT "
        f"{fmt(s['mean_ttft_ms'], '.1f')} ms, {s['errors']} errors, {elapsed_s:.1f} s"
    )
