"""Run one function on every rank of a gloo group, one process per rank, and bring back what each returned.

The one launcher of the multi-rank tests, the simulation and the GPU checks; ``single_process_group`` is
its one-rank case, run in the caller's own process (unit tests that simulate every rank's view, the
benchmarks, the GPU smoke).

``run_ranks(fn, world_size, args)`` starts ``world_size`` processes. Each joins the default gloo group
(file rendezvous, every collective bounded by ``timeout_s``), calls ``fn(rank, world_size, *args)`` and
sends its return value back through a file; the parent returns the values in rank order, or raises
``RanksFailed`` carrying every rank's ``RankOutcome`` when a rank raised, died or outlived
``deadline_s``. ``launch`` is the same without the raise, for callers that read the failures themselves.

A rank whose ``fn`` raises leaves at once, without another collective and without tearing its group
down: peers blocked in a collective then fail as its sockets close instead of waiting for the timeout.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist


@dataclasses.dataclass
class RankOutcome:
    rank: int
    value: Any = None
    error: Optional[BaseException] = None  # what ``fn`` raised (re-created if it does not pickle)
    traceback: str = ""
    exitcode: Optional[int] = None  # None: still running at the deadline (then killed)

    @property
    def ok(self) -> bool:
        return self.error is None and self.exitcode == 0


class RanksFailed(RuntimeError):
    def __init__(self, outcomes: List[RankOutcome]):
        self.outcomes = outcomes
        lines = []
        for outcome in outcomes:
            if outcome.ok:
                continue
            if outcome.error is not None:
                lines.append(f"rank {outcome.rank} raised {outcome.error!r}\n{outcome.traceback}")
            elif outcome.exitcode is None:
                lines.append(f"rank {outcome.rank} was still running at the deadline")
            else:
                lines.append(f"rank {outcome.rank} exited with code {outcome.exitcode}")
        super().__init__("multi-rank run failed:\n" + "\n".join(lines))


def run_ranks(fn: Callable, world_size: int, args: Sequence = (), **options) -> List[Any]:
    """``fn``'s return value on every rank, in rank order; ``RanksFailed`` if any rank failed."""
    outcomes = launch(fn, world_size, args, **options)
    if not all(outcome.ok for outcome in outcomes):
        raise RanksFailed(outcomes)
    return [outcome.value for outcome in outcomes]


def launch(
    fn: Callable,
    world_size: int,
    args: Sequence = (),
    *,
    start_method: str = "spawn",
    preload: Sequence[str] = (),
    timeout_s: float = 120.0,
    deadline_s: Optional[float] = None,
    threads_per_rank: Optional[int] = 1,
) -> List[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; one outcome per rank.

    ``fn`` and ``args`` must pickle (``fn`` at module level). ``start_method`` "forkserver" with
    ``preload`` (module names) forks every rank from a server that imported those modules once:
    importing sglang costs far more than most multi-rank tests. "fork" is not offered: a forked rank
    would inherit the caller's process group. ``threads_per_rank`` caps torch's CPU threads per rank
    (``None``: torch's default). ``deadline_s`` bounds the whole run; ranks left then are killed.
    """
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be spawn or forkserver, got {start_method!r}")
    context = multiprocessing.get_context(start_method)
    if preload:
        context.set_forkserver_preload(list(preload))
    out_dir = tempfile.mkdtemp(prefix="multi_rank_")
    try:
        rendezvous = os.path.join(out_dir, "rendezvous")
        processes = [
            context.Process(
                target=_rank_main,
                args=(fn, rank, world_size, tuple(args), rendezvous, out_dir, timeout_s,
                      threads_per_rank),
            )  # fmt: skip
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        for process in processes:
            process.join(None if deadline is None else max(0.1, deadline - time.monotonic()))
        killed = set()
        for rank, process in enumerate(processes):
            if process.is_alive():
                process.kill()
                process.join()
                killed.add(rank)
        return [
            _read_outcome(out_dir, rank, None if rank in killed else process.exitcode)
            for rank, process in enumerate(processes)
        ]
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def single_process_group() -> dist.ProcessGroup:
    """The world group of a one-process gloo job in this process, initialising one if needed."""
    if not dist.is_initialized():
        fd, path = tempfile.mkstemp(prefix="single_rank_gloo_")
        os.close(fd)
        os.unlink(path)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise ValueError("single_process_group() needs a one-process job; pass your own group instead")
    return dist.group.WORLD


def _rank_main(fn, rank, world_size, args, rendezvous, out_dir, timeout_s, threads_per_rank):
    if threads_per_rank is not None:
        torch.set_num_threads(threads_per_rank)
    outcome = RankOutcome(rank=rank)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{rendezvous}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        outcome.value = fn(rank, world_size, *args)
    except BaseException as error:  # noqa: BLE001 - reported to the parent, never swallowed
        outcome.error, outcome.traceback = error, traceback.format_exc()
    _write_outcome(out_dir, outcome)
    sys.stdout.flush()
    sys.stderr.flush()
    if outcome.error is not None:
        os._exit(1)  # no teardown: peers in a collective fail now instead of at the timeout
    dist.destroy_process_group()


def _write_outcome(out_dir: str, outcome: RankOutcome) -> None:
    path = os.path.join(out_dir, f"rank{outcome.rank}.pkl")
    try:
        payload = pickle.dumps(outcome)
    except Exception:  # an unpicklable value or error: keep its text
        error = outcome.error or TypeError("the return value does not pickle")
        payload = pickle.dumps(
            RankOutcome(outcome.rank, error=RuntimeError(repr(error)),
                        traceback=outcome.traceback or traceback.format_exc())
        )  # fmt: skip
    with open(path + ".tmp", "wb") as f:
        f.write(payload)
    os.replace(path + ".tmp", path)


def _read_outcome(out_dir: str, rank: int, exitcode: Optional[int]) -> RankOutcome:
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    if not os.path.exists(path):
        return RankOutcome(rank=rank, exitcode=exitcode)
    with open(path, "rb") as f:
        outcome = pickle.load(f)
    outcome.exitcode = exitcode
    return outcome
