"""Multi-rank CP HiCache simulation on the CPU: every rank of a CP group, checked after every step.

``run_simulation(cp_size, scenarios)`` starts ``cp_size`` processes joined by a gloo group
(``multi_rank.launch``). Each builds its real stack (``build_cp_hicache_stack``: ``CpHiRadixCache``, the CP allocator, an NSA device pool and
sglang's KV + indexer host pools, io backend "direct", small enough that device eviction and host
pressure happen all the time) and, per scenario, drives it with the seeded workload
(``cp_hicache_simulation_workload``): the same operations on every rank. After every operation each rank
runs its local checks and the group all-gathers a digest of the state that must be identical
(``cp_hicache_simulation_invariants``). Every collective, the cache's own all-reduces included, goes
through ``_CollectiveTrace``, so ranks that reach different collectives are reported at once. Any
violation stops the run; every rank raises the same ``SimulationViolation`` naming the invariant, seed,
step, rank and operation, and ``run_simulation`` re-raises it in the caller. An exception inside an
operation is reported the same way (invariant ``exception``).

Processes are forked from a forkserver that imported this module once: importing sglang costs far
more than a simulation step, and a forkserver does not inherit the caller's state (for example a
process group another test initialised).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import random
import sys
import time
import traceback
import zlib
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from sglang_cp_shared_kv_testing.cp_hicache_simulation_invariants import (
    RankInvariants,
    digest,
    first_difference,
    shared_state,
)
from sglang_cp_shared_kv_testing.completion_skew import skew_completions
from sglang_cp_shared_kv_testing.cp_hicache_simulation_workload import CpHiCacheWorkload
from sglang_cp_shared_kv_testing.cp_hicache_stack import (
    NSA_PAGE_SIZE,
    HiCacheStack,
    build_cp_hicache_stack,
)
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang_cp_shared_kv.mem_cache import req_to_page_mirror_writers
from sglang_cp_shared_kv.mem_cache.cp_hiradix_rank_agreement import FINISHED_COLLECTIVE
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror import ReqToPageMirror
from sglang_cp_shared_kv_testing.multi_rank import RanksFailed, launch

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclasses.dataclass(frozen=True)
class SimulationScenario:
    """One seeded run on a fresh stack. Pools are per rank and deliberately tiny."""

    seed: int
    num_ops: int
    write_policy: str = "write_through"
    eviction_policy: str = "lru"
    physical_pages: int = 8  # device pages per rank, besides sglang's dummy page 0
    hicache_ratio: float = 1.5  # host pool = ratio x physical device pool, per rank
    max_running_requests: int = 4
    # An MTP draft pool of this many layers (0: none), registered with HiCache as the scheduler does;
    # its bytes are written with the target's and checked like them (draft-device/host-bytes).
    draft_layers: int = 0
    # The tree keys its children by token bigrams (``is_eagle``), as the scheduler builds it for
    # ``--speculative-algorithm EAGLE / NEXTN`` (an MTP server: use it with ``draft_layers``).
    eagle_keys: bool = False
    # Per-rank completion skew (``completion_skew.py``): each rank's write and load acks report finished
    # up to this many queries late, drawn per ack and rank, so ranks' copies finish at different checks.
    completion_skew: int = 0
    # Probability that an admitted request is declined right after its ``init_load_back`` (stock's
    # PrefillAdder can): the load's lock is then the node's only one until the load is acknowledged.
    decline_after_load: float = 0.0
    # HiCache L3 storage: a file-backend directory shared by every rank (None: no storage tier).
    # Prefetch on admission, write at host-write acks, and a "restart" operation (see the workload).
    storage_dir: Optional[str] = None
    # Called as plant(stack, cp_rank) on every rank before the run: lets a test plant a deliberate
    # bug and check that the harness reports it. Must be picklable (a module-level function).
    plant: Optional[Callable[[HiCacheStack, int], None]] = None

    def describe(self) -> str:
        return (
            f"seed={self.seed} write_policy={self.write_policy} eviction={self.eviction_policy} "
            f"physical_pages={self.physical_pages} hicache_ratio={self.hicache_ratio}"
            + (f" draft_layers={self.draft_layers}" if self.draft_layers else "")
            + (" eagle_keys" if self.eagle_keys else "")
            + (f" completion_skew={self.completion_skew}" if self.completion_skew else "")
            + (f" decline_after_load={self.decline_after_load}" if self.decline_after_load else "")
            + (" storage=file" if self.storage_dir else "")
        )


class SimulationViolation(AssertionError):
    """An invariant broken (or an exception raised) at one step of a scenario, on one rank."""

    def __init__(self, invariant: str, seed: int, step: int, rank: int, op: str, detail: str,
                 scenario: str = ""):  # fmt: skip
        self.invariant, self.seed, self.step, self.rank = invariant, seed, step, rank
        self.op, self.detail, self.scenario = op, detail, scenario
        super().__init__(
            f"CP HiCache simulation: invariant={invariant} seed={seed} step={step} rank={rank} "
            f"[{scenario}] after op ({op}): {detail}"
        )

    def __reduce__(self):
        fields = (self.invariant, self.seed, self.step, self.rank, self.op, self.detail)
        return (SimulationViolation, fields + (self.scenario,))


@dataclasses.dataclass
class ScenarioResult:
    scenario: SimulationScenario
    ops_executed: int
    wall_s: float
    # Decisions (identical on every rank) and, summed over ranks, what single ranks did.
    stats: Dict[str, int]
    local_stats: Dict[str, int]


@dataclasses.dataclass
class SimulationReport:
    cp_size: int
    results: List[ScenarioResult]
    wall_s: float

    @property
    def ops_executed(self) -> int:
        return sum(r.ops_executed for r in self.results)

    def total_stats(self) -> collections.Counter:
        total = collections.Counter()
        for result in self.results:
            total.update(result.stats)
            total.update(result.local_stats)
        return total


def run_simulation(
    cp_size: int, scenarios: Sequence[SimulationScenario], timeout_s: float = 120.0
) -> SimulationReport:
    """Run ``scenarios`` one after the other on a fresh group of ``cp_size`` processes.

    Raises ``SimulationViolation`` for the first violation (the run stops there). ``timeout_s`` bounds
    every collective: a rank that dies or hangs fails the run instead of blocking it.
    """
    start = time.monotonic()
    preload = [__name__]
    if any(scenario.draft_layers for scenario in scenarios):
        # The draft registers through sglang's scheduler method (a heavy import).
        preload.append("sglang.srt.managers.scheduler")
    ranks = launch(
        _rank, cp_size, (list(scenarios),), start_method="forkserver", preload=preload,
        timeout_s=timeout_s,
    )  # fmt: skip
    # A rank returns a violation the group detected together, and raises one from inside an
    # operation (invariant "exception"); anything else (a crash, the deadline) is the launcher's.
    violations = []
    for r in ranks:
        if isinstance(r.error, SimulationViolation):
            violations.append(r.error)
        elif not r.ok:
            raise RanksFailed(ranks)
        elif r.value["violation"] is not None:
            violations.append(r.value["violation"])
    violation = _root_cause(violations)
    if violation is not None:
        raise violation
    outcomes = [r.value for r in ranks]
    results = []
    for index, result in enumerate(outcomes[0]["results"]):
        local = collections.Counter()
        for outcome in outcomes:
            local.update(outcome["results"][index].local_stats)
        results.append(dataclasses.replace(result, local_stats=dict(local)))
    return SimulationReport(cp_size=cp_size, results=results, wall_s=time.monotonic() - start)


def _root_cause(violations: List[SimulationViolation]) -> Optional[SimulationViolation]:
    """A detected violation is reported identically by every rank. An exception on one rank makes its
    peers fail inside a collective later; report the exception that is not such a peer failure."""
    if not violations:
        return None
    for violation in violations:
        if not violation.detail.startswith(_PEER_FAILURE):
            return violation
    return violations[0]


_PEER_FAILURE = "collective failed (a peer rank died or diverged)"


def _rank(rank: int, cp_size: int, scenarios) -> dict:
    # A process of its own (forked from the forkserver): the writer hooks apply process-wide.
    HookRegistry.reset()
    req_to_page_mirror_writers.register_hooks(HookRegistry)
    HookRegistry.apply_hooks()
    outcome = {"results": [], "violation": None}
    try:
        for scenario in scenarios:
            outcome["results"].append(_RankRun(rank, cp_size, scenario, dist.group.WORLD).run())
    except SimulationViolation as violation:
        if violation.invariant == "exception":
            # Peers may be blocked in a collective: raising makes the launcher leave without another
            # one, so their collective fails as this process's sockets close.
            raise
        outcome["violation"] = violation
    return outcome


class _RankRun:
    """One scenario on one rank: build the stack, step the workload, check after every step."""

    def __init__(self, rank: int, cp_size: int, scenario: SimulationScenario, group):
        self.rank, self.cp_size, self.scenario, self.group = rank, cp_size, scenario, group
        self.step, self.op = -1, "building the stack"

    def run(self) -> ScenarioResult:
        scenario = self.scenario
        start = time.monotonic()
        try:
            workload = self._build()
            invariants = RankInvariants(workload)
            self.collectives = _CollectiveTrace(self.group, self.cp_size)
            workload.cache._all_reduce_attn_groups = self.collectives.all_reduce
            workload.cache._start_all_reduce_attn_groups = self.collectives.start_all_reduce
            for self.step in range(scenario.num_ops):
                operation = workload.next_operation()
                self.op = f"{operation}, interrupted"
                self.op = workload.run(operation)
                self._check(workload, invariants)
            self.step, self.op = scenario.num_ops, "final drain"
            workload.drain()
            self._check(workload, invariants)
        except SimulationViolation:
            raise
        except _CollectiveMismatch as mismatch:
            raise self._violation("collective-sequence", mismatch.rank, mismatch.detail) from None
        except Exception as error:
            raise self._violation("exception", self.rank, _describe_exception(error)) from error
        return ScenarioResult(
            scenario=scenario,
            ops_executed=scenario.num_ops + 1,
            wall_s=time.monotonic() - start,
            stats=dict(workload.stats),
            local_stats=dict(workload.finish_local_stats()),
        )

    def _build(self) -> CpHiCacheWorkload:
        scenario = self.scenario
        logical_tokens = self.cp_size * scenario.physical_pages * NSA_PAGE_SIZE
        # A request may grow to 45% of the logical pool: several running requests overflow it.
        max_request_tokens = max(4 * NSA_PAGE_SIZE, logical_tokens * 45 // 100)
        stack = build_cp_hicache_stack(
            cp_size=self.cp_size,
            cp_rank=self.rank,
            group=self.group,
            physical_pages=scenario.physical_pages,
            write_policy=scenario.write_policy,
            hicache_ratio=scenario.hicache_ratio,
            eviction_policy=scenario.eviction_policy,
            max_running_requests=scenario.max_running_requests,
            max_context_len=max_request_tokens + NSA_PAGE_SIZE,
            draft_layers=scenario.draft_layers,
            is_eagle=scenario.eagle_keys,
            **storage_options(scenario.storage_dir),
        )
        # The host mirror of req_to_token the peer-page plan reads, fed by the writer hooks (applied
        # in _rank); checked against the table after every step (invariant "req-to-token-mirror").
        ReqToPageMirror.attach(stack.req_to_token_pool, NSA_PAGE_SIZE)
        if scenario.completion_skew:
            skew_rng = random.Random(f"completion skew {scenario.seed} {self.rank}")
            skew_completions(stack.controller, skew_rng, scenario.completion_skew)
        if scenario.plant is not None:
            scenario.plant(stack, self.rank)
        return CpHiCacheWorkload(
            stack,
            seed=scenario.seed,
            max_running_requests=scenario.max_running_requests,
            max_request_tokens=max_request_tokens,
            decline_after_load=scenario.decline_after_load,
        )

    def _check(self, workload: CpHiCacheWorkload, invariants: RankInvariants) -> None:
        """Collective: every rank checks itself, then the group compares shared-state digests.

        One traced exchange per step ("found something" flag + digest); details travel only when
        something was found.
        """
        local = invariants.violations()
        if workload.at_baseline:
            local += invariants.baseline_violations()
        state = shared_state(workload)
        state_digest = torch.frombuffer(bytearray(digest(state)), dtype=torch.int64).tolist()
        gathered = self.collectives.exchange("step check", [int(bool(local))] + state_digest)
        if bool(gathered[:, 0].any()):
            found = [None] * self.cp_size
            dist.all_gather_object(found, local, group=self.group)
            rank = next(r for r, f in enumerate(found) if f)
            invariant, detail = found[rank][0]
            everything = [f"rank {r} {name}" for r, f in enumerate(found) for name, _ in f]
            if len(everything) > 1:
                detail += f" (all at this step: {', '.join(everything)})"
            raise self._violation(invariant, rank, detail)
        digests = [tuple(row[1:].tolist()) for row in gathered]
        if len(set(digests)) > 1:
            states = [None] * self.cp_size
            dist.all_gather_object(states, state, group=self.group)
            rank = next(r for r, d in enumerate(digests) if d != digests[0])
            raise self._violation("rank-agreement", rank, first_difference(states[rank], states[0]))

    def _violation(self, invariant: str, rank: int, detail: str) -> SimulationViolation:
        return SimulationViolation(
            invariant,
            self.scenario.seed,
            self.step,
            rank,
            self.op,
            detail,
            scenario=f"cp_size={self.cp_size} {self.scenario.describe()}",
        )


class _CollectiveMismatch(Exception):
    def __init__(self, rank: int, detail: str):
        super().__init__(detail)
        self.rank, self.detail = rank, detail


class _CollectiveTrace:
    """Every collective of a simulated rank, the cache's all-reduces included, as one fixed-size
    all-gather that carries (sequence number, call site) next to the payload.

    Ranks that reach different collectives (a rank that skipped one, or took another branch) then meet
    in the same all-gather, see different headers and report it at once, naming both call sites,
    instead of blocking until the gloo timeout or exchanging mismatched buffers. The cache's
    all-reduces (``_all_reduce_attn_groups``: agreement flags, eviction counts, write acks) reduce a
    scalar, so the gathered values are reduced here with the same operation.
    """

    WIDTH = 8  # int64 words: sequence, site, payload

    def __init__(self, group, cp_size: int):
        self.group, self.cp_size = group, cp_size
        self.sequence = 0

    def exchange(self, site: str, payload: List[int]) -> torch.Tensor:
        """All-gather ``payload`` (at most WIDTH - 2 ints); returns ``[cp_size, WIDTH - 2]``."""
        words = [self.sequence, zlib.crc32(site.encode())] + payload
        mine = torch.tensor(words + [0] * (self.WIDTH - len(words)), dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(self.cp_size)]
        dist.all_gather(gathered, mine, group=self.group)
        table = torch.stack(gathered)
        if bool((table[:, :2] != table[0, :2]).any()):
            sites = [None] * self.cp_size
            dist.all_gather_object(sites, (site, self.sequence), group=self.group)
            rank = next(r for r in range(self.cp_size) if not torch.equal(table[r, :2], table[0, :2]))
            where = ", ".join(f"rank {r} in {n} (collective #{q})" for r, (n, q) in enumerate(sites))
            raise _CollectiveMismatch(rank, f"ranks are in different collectives: {where}")
        self.sequence += 1
        return table[:, 2:]

    def all_reduce(self, tensor: torch.Tensor, op) -> None:
        """Drop-in for ``HiRadixCache._all_reduce_attn_groups`` on a one-element tensor."""
        self._reduce(sys._getframe(1).f_code.co_name, tensor, op)

    def start_all_reduce(self, tensor: torch.Tensor, op):
        """Drop-in for ``CpHiRadixCache._start_all_reduce_attn_groups``: traced where it starts (the
        point every rank must reach in the same order), so it runs at once; a finished handle."""
        self._reduce(sys._getframe(1).f_code.co_name, tensor, op)
        return FINISHED_COLLECTIVE

    def _reduce(self, site: str, tensor: torch.Tensor, op) -> None:
        values = self.exchange(site, [int(tensor.item())])[:, 0]
        reduce = {dist.ReduceOp.MIN: torch.min, dist.ReduceOp.MAX: torch.max}[op]
        tensor.fill_(int(reduce(values)))


def storage_options(storage_dir: Optional[str]) -> dict:
    """``build_cp_hicache_stack`` options of the storage tier: the file backend over ``storage_dir``
    (shared by every rank: keys are owner-free), prefetching from one page on."""
    if storage_dir is None:
        return {}
    extra = {"file_path": storage_dir, "prefetch_threshold": NSA_PAGE_SIZE}
    return {"storage_backend": "file", "storage_extra_config": json.dumps(extra)}


def _describe_exception(error: Exception) -> str:
    if isinstance(error, dist.DistBackendError) or "gloo" in str(error).lower():
        return f"{_PEER_FAILURE}: {type(error).__name__}: {str(error).splitlines()[0]}"
    frames = traceback.extract_tb(error.__traceback__)[-4:]
    where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))
    return f"{type(error).__name__}: {error} (at {where})"
