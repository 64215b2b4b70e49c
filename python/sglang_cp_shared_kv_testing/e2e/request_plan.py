"""The request sequence that makes a HiCache server back up to host, evict from device and load back.

All quantities are *logical* tokens of one CP group (what the radix tree, the scheduler and
``max_total_num_tokens`` count). Under shared KV each rank stores about 1/cp_size of every node on
device and on host, so both the device and the host hold ``cp_size`` times more logical tokens
than without it; the host still holds ``hicache_ratio`` times the device either way.

One *group* is sized for one device capacity D (host capacity H = ratio x D):
  warm-up  one cold request and its exact repeat, so JIT compilation and first-use costs do not
           land in the timed requests;
  round 1  K distinct prefixes of L tokens, each with suffix "a": cold prefills. Their footprint
           K x (L + suffix) is chosen between D and H, so the early prefixes leave the device
           (they were written through to host) while all of them stay on host;
  round 2  the same prefixes with suffix "b", in the same order: the evicted prefixes are matched
           on host and loaded back;
  replay   the first round-1 request again, token for token: its greedy output must not depend on
           whether its KV was recomputed or came back from host.
A plan holds one group per capacity to exercise (shared KV off and on differ by cp_size), so one
request sequence drives both servers and outputs can be compared request by request.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

# sglang 0.5.11 HiRadixCache.load_back skips loads shorter than this many tokens.
SGLANG_LOAD_BACK_THRESHOLD_TOKENS = 10

WARMUP, ROUND1, ROUND2, REPLAY = "warmup", "round1", "round2", "replay"


@dataclass(frozen=True)
class PrefixGroup:
    """Prefixes sized for one device capacity (all counts logical tokens)."""

    logical_device_tokens: int
    logical_host_tokens: int
    prefix_tokens: int
    num_prefixes: int
    # Tokens one round-1 request leaves in the tree (prefix + suffix; the partial output page is freed).
    tokens_per_request: int

    @property
    def round1_footprint_tokens(self) -> int:
        return self.num_prefixes * self.tokens_per_request


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    group: int
    phase: str
    prefix_id: int  # prompts that share a prefix_id share their first prefix_tokens tokens
    prefix_tokens: int
    suffix: str
    prompt_tokens: int
    replay_of: Optional[int] = None  # index of the request whose output this one must reproduce

    @property
    def name(self) -> str:
        return f"g{self.group}/{self.phase}/p{self.prefix_id}{self.suffix}"


@dataclass(frozen=True)
class RequestPlan:
    page_size: int
    suffix_tokens: int
    max_new_tokens: int
    token_id_low: int
    token_id_high: int
    seed: int
    groups: List[PrefixGroup]
    requests: List[PlannedRequest] = field(default_factory=list)

    def input_ids(self, request: PlannedRequest) -> List[int]:
        """Deterministic prompt: the prefix depends only on prefix_id, the suffix on (prefix_id, suffix)."""
        prefix = self._tokens(self.seed * 1_000_003 + request.prefix_id * 2, request.prefix_tokens)
        suffix_seed = self.seed * 1_000_003 + request.prefix_id * 2 + 1
        suffix = self._tokens(suffix_seed * 131 + ord(request.suffix), self.suffix_tokens)
        return prefix + suffix

    def _tokens(self, seed: int, count: int) -> List[int]:
        rng = random.Random(seed)
        return [rng.randrange(self.token_id_low, self.token_id_high) for _ in range(count)]

    def describe(self) -> List[str]:
        lines = [
            f"page_size={self.page_size} suffix_tokens={self.suffix_tokens} "
            f"max_new_tokens={self.max_new_tokens} token_ids=[{self.token_id_low},{self.token_id_high}) "
            f"seed={self.seed}"
        ]
        for gi, g in enumerate(self.groups):
            lines.append(
                f"group {gi}: device D={g.logical_device_tokens} host H={g.logical_host_tokens} "
                f"logical tokens; {g.num_prefixes} prefixes x {g.prefix_tokens} tokens; round-1 "
                f"footprint {g.round1_footprint_tokens} (D < footprint <= H)"
            )
        for r in self.requests:
            replay = f" replays #{r.replay_of}" if r.replay_of is not None else ""
            lines.append(f"  #{r.index:<3} {r.name:<22} prompt={r.prompt_tokens}{replay}")
        return lines


def _round_down(value: int, multiple: int) -> int:
    return value // multiple * multiple


def plan_group(
    logical_device_tokens: int,
    hicache_ratio: float,
    page_size: int,
    max_prefix_tokens: int,
    suffix_tokens: int,
    max_new_tokens: int,
) -> PrefixGroup:
    """Size K prefixes of L tokens so that D < K x (L + suffix) <= H, aiming at (D + H) / 2.

    L is at most half the device (a request, its output and a load-back must fit together) and a
    multiple of the page, so prefix matches are whole pages.
    """
    device = logical_device_tokens
    host = math.floor(hicache_ratio * device)
    if hicache_ratio <= 1 or host <= device:
        raise ValueError(f"hicache_ratio must be > 1 (sglang requires host > device), got {hicache_ratio}")
    if suffix_tokens % page_size:
        raise ValueError(f"suffix_tokens {suffix_tokens} must be a multiple of page_size {page_size}")
    output_pages = math.ceil(max_new_tokens / page_size) * page_size
    prefix = _round_down(min(max_prefix_tokens, device // 2 - suffix_tokens - output_pages), page_size)
    if prefix < max(page_size, SGLANG_LOAD_BACK_THRESHOLD_TOKENS):
        raise ValueError(
            f"device capacity {device} tokens is too small for page_size {page_size}, "
            f"suffix {suffix_tokens} and {max_new_tokens} new tokens"
        )
    per_request = prefix + suffix_tokens
    target = (device + host) // 2
    num_prefixes = max(2, round(target / per_request))
    while num_prefixes * per_request <= device:
        num_prefixes += 1
    if num_prefixes * per_request > host:
        raise ValueError(
            f"no prefix count fits D={device} < K x {per_request} <= H={host}; "
            f"raise --hicache-ratio or lower --max-prefix-tokens"
        )
    return PrefixGroup(device, host, prefix, num_prefixes, per_request)


def build_plan(
    logical_device_tokens: Sequence[int],
    hicache_ratio: float,
    page_size: int,
    max_prefix_tokens: int,
    max_new_tokens: int,
    token_id_range: tuple[int, int],
    suffix_tokens: Optional[int] = None,
    seed: int = 0,
) -> RequestPlan:
    """One group per distinct capacity, smallest first (see the module docstring)."""
    suffix_tokens = page_size if suffix_tokens is None else suffix_tokens
    low, high = token_id_range
    if not 0 <= low < high:
        raise ValueError(f"bad token id range [{low}, {high})")
    capacities = sorted(set(logical_device_tokens))
    # Every request must also fit the smallest device of the plan: the same sequence runs on each.
    output_pages = math.ceil(max_new_tokens / page_size) * page_size
    max_prefix_tokens = min(max_prefix_tokens, capacities[0] // 2 - suffix_tokens - output_pages)
    groups = [
        plan_group(d, hicache_ratio, page_size, max_prefix_tokens, suffix_tokens, max_new_tokens)
        for d in capacities
    ]
    requests: List[PlannedRequest] = []
    next_prefix_id = 0

    def add(group: int, phase: str, prefix_id: int, prefix_tokens: int, suffix: str, replay_of=None):
        requests.append(
            PlannedRequest(
                index=len(requests),
                group=group,
                phase=phase,
                prefix_id=prefix_id,
                prefix_tokens=prefix_tokens,
                suffix=suffix,
                prompt_tokens=prefix_tokens + suffix_tokens,
                replay_of=replay_of,
            )
        )
        return requests[-1].index

    for gi, g in enumerate(groups):
        warm = next_prefix_id
        next_prefix_id += 1
        first_warmup = add(gi, WARMUP, warm, g.prefix_tokens, "a")
        add(gi, WARMUP, warm, g.prefix_tokens, "a", replay_of=first_warmup)
        prefix_ids = list(range(next_prefix_id, next_prefix_id + g.num_prefixes))
        next_prefix_id += g.num_prefixes
        first_round1 = None
        for p in prefix_ids:
            index = add(gi, ROUND1, p, g.prefix_tokens, "a")
            first_round1 = index if first_round1 is None else first_round1
        for p in prefix_ids:
            add(gi, ROUND2, p, g.prefix_tokens, "b")
        add(gi, REPLAY, prefix_ids[0], g.prefix_tokens, "a", replay_of=first_round1)
    return RequestPlan(
        page_size=page_size,
        suffix_tokens=suffix_tokens,
        max_new_tokens=max_new_tokens,
        token_id_low=low,
        token_id_high=high,
        seed=seed,
        groups=groups,
        requests=requests,
    )


def round_pairs(plan: RequestPlan) -> List[tuple[PlannedRequest, PlannedRequest]]:
    """(round-1, round-2) requests on the same prefix: cold prefill vs the prefix served from cache."""
    round1 = {(r.group, r.prefix_id): r for r in plan.requests if r.phase == ROUND1}
    return [(round1[(r.group, r.prefix_id)], r) for r in plan.requests if r.phase == ROUND2]


def parse_token_id_range(text: str) -> tuple:
    """``"LOW:HIGH"`` of the smokes' ``--token-id-range`` -> ``(LOW, HIGH)``; ``ValueError`` otherwise."""
    low, high = (int(x) for x in text.split(":"))
    return low, high


def model_context_len(model_path: str) -> Optional[int]:
    """``max_position_embeddings`` of a model directory, ``None`` where there is no config.json."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("max_position_embeddings")


def longest_request_tokens(plan: "RequestPlan") -> int:
    return max(r.prompt_tokens for r in plan.requests) + plan.max_new_tokens


def check_plan_fits_model(plan: "RequestPlan", model_path: str) -> None:
    """``ValueError`` if the plan's longest request does not fit the model's context."""
    context_len = model_context_len(model_path)
    longest = longest_request_tokens(plan)
    if context_len is not None and longest > context_len:
        raise ValueError(f"plan needs {longest} tokens of context, the model has {context_len}")
