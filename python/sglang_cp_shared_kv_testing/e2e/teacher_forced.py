"""Teacher-forced scoring: the smoke's end-to-end verdict over every layer.

The value audit (smoke plugin, ``value_audit``) checks the attention of the layers it covers; this
covers the others, end to end. Each server scores the same texts: a prefix the plan served (so it
comes from the cache, device or host, or from peer pages) followed by a fixed continuation, with
input logprobs from the prefix's last token on (``logprob_start_len``: sglang matches the cached
prefix up to there, page by page, and recomputes the rest). The continuation's logprobs go through
every layer.

Greedy tokens cannot judge this (stock NSA kernels are not run-to-run deterministic), and neither can
one pass: the stock server scores everything twice, and the spread between its two passes is the
noise a shared-KV server's logprobs are judged against:

    mean |shared - stock|  <=  MEAN_FACTOR x mean |stock pass 2 - stock pass 1| + MEAN_FLOOR_NATS
    p99  |shared - stock|  <=  P99_FACTOR  x p99  |stock pass 2 - stock pass 1| + P99_FLOOR_NATS

With dummy weights attention is nearly an average and this verdict is weak (a wrong page moved
logprobs no more than the noise on the tiny model); it is what a real checkpoint is judged by.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

CONTINUATION_TOKENS = 64
PASSES = 2
MEAN_FACTOR, MEAN_FLOOR_NATS = 2.0, 0.05
P99_FACTOR, P99_FLOOR_NATS = 2.0, 0.25


@dataclass(frozen=True)
class ScoredText:
    rid: str
    prefix_tokens: int
    input_ids: List[int]


def scoring_texts(plan, count: int, continuation_tokens: int = CONTINUATION_TOKENS) -> List[ScoredText]:
    """``count`` texts: the prefixes of the plan's last distinct prefix ids (the most likely still
    cached) with one fixed continuation each, drawn from the plan's token range."""
    seen, texts = set(), []
    for request in reversed(plan.requests):
        if request.prefix_id in seen or len(texts) == count:
            continue
        seen.add(request.prefix_id)
        prefix = plan.input_ids(request)[: request.prefix_tokens]
        rng = random.Random(plan.seed * 7919 + request.prefix_id)
        continuation = [rng.randrange(plan.token_id_low, plan.token_id_high) for _ in range(continuation_tokens)]
        texts.append(ScoredText(f"score-p{request.prefix_id}", request.prefix_tokens, prefix + continuation))
    return texts


def score(base_url: str, text: ScoredText, timeout_s: float, rid: Optional[str] = None) -> Dict:
    """One non-streamed ``/generate`` with input logprobs of the continuation: {"logprobs": [...],
    "cached_tokens": n} or {"error": ...}."""
    import requests

    payload = {
        "input_ids": text.input_ids,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 1},
        "return_logprob": True,
        "logprob_start_len": text.prefix_tokens - 1,
        "rid": rid or text.rid,
    }
    try:
        response = requests.post(base_url + "/generate", json=payload, timeout=timeout_s)
    except requests.RequestException as e:
        return {"error": f"{type(e).__name__}: {e}"}
    if response.status_code != 200:
        return {"error": f"HTTP {response.status_code}: {response.text[:300]}"}
    try:
        meta = response.json().get("meta_info", {})
    except ValueError as e:
        return {"error": f"not a JSON answer: {e}"}
    logprobs = [entry[0] for entry in meta.get("input_token_logprobs") or []]
    continuation = len(text.input_ids) - text.prefix_tokens
    logprobs = logprobs[-continuation:]  # the prefix's last token, when scored, comes first
    if len(logprobs) != continuation or any(lp is None for lp in logprobs):
        return {"error": f"{len(logprobs)} input logprobs (want {continuation} numbers): {logprobs[:4]}"}
    return {"logprobs": logprobs, "cached_tokens": meta.get("cached_tokens")}


def run_passes(base_url: str, texts: Sequence[ScoredText], timeout_s: float, passes: int = PASSES) -> Dict:
    """Every text scored ``passes`` times, one request at a time: {"passes": [[logprobs per text]],
    "cached_tokens": [[...]], "errors": [...]}."""
    out: Dict = {"passes": [], "cached_tokens": [], "errors": [], "texts": [t.rid for t in texts]}
    for p in range(passes):
        logprobs, cached = [], []
        for text in texts:
            result = score(base_url, text, timeout_s, rid=f"{text.rid}-pass{p}-{time.monotonic_ns()}")
            if "error" in result:
                out["errors"].append(f"{text.rid} pass {p}: {result['error']}")
                logprobs.append(None)
                cached.append(None)
            else:
                logprobs.append(result["logprobs"])
                cached.append(result["cached_tokens"])
        out["passes"].append(logprobs)
        out["cached_tokens"].append(cached)
    return out


def _differences(a: Sequence[Optional[List[float]]], b: Sequence[Optional[List[float]]]) -> List[float]:
    diffs = []
    for x, y in zip(a, b):
        if x is not None and y is not None:
            diffs += [abs(u - v) for u, v in zip(x, y)]
    return diffs


def _p99(values: List[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(0.99 * len(ordered)) - 1))]


def stats(diffs: List[float]) -> Dict:
    if not diffs:
        return {"tokens": 0, "mean": None, "p99": None, "max": None}
    return {"tokens": len(diffs), "mean": sum(diffs) / len(diffs), "p99": _p99(diffs), "max": max(diffs)}


def verdict(stock: Dict, shared: Dict) -> Dict:
    """Figures and failures of a shared-KV server's scoring against the stock reference's."""
    stock_noise = stats(_differences(stock["passes"][0], stock["passes"][-1])) if len(stock["passes"]) > 1 else stats([])
    against = stats(_differences(shared["passes"][0], stock["passes"][0]))
    own = stats(_differences(shared["passes"][0], shared["passes"][-1])) if len(shared["passes"]) > 1 else stats([])
    failures = [f"teacher-forced: {e}" for e in shared.get("errors", [])]
    if not against["tokens"]:
        failures.append("teacher-forced: no continuation token scored on both servers")
    elif stock_noise["tokens"]:
        mean_limit = MEAN_FACTOR * stock_noise["mean"] + MEAN_FLOOR_NATS
        p99_limit = P99_FACTOR * stock_noise["p99"] + P99_FLOOR_NATS
        if against["mean"] > mean_limit:
            failures.append(f"teacher-forced: mean |logprob shared - stock| {against['mean']:.4f} nats above "
                            f"{mean_limit:.4f} (stock's own pass-to-pass mean {stock_noise['mean']:.4f})")  # fmt: skip
        if against["p99"] > p99_limit:
            failures.append(f"teacher-forced: p99 |logprob shared - stock| {against['p99']:.4f} nats above "
                            f"{p99_limit:.4f} (stock's own p99 {stock_noise['p99']:.4f})")  # fmt: skip
    else:
        failures.append("teacher-forced: the stock reference has no second pass to measure its noise")
    return {"stock_vs_stock": stock_noise, "shared_vs_stock": against, "shared_vs_shared": own, "failures": failures}
