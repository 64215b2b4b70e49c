"""cProfile of the per-step benchmark's step (``bench_cp_hicache_step_overhead.py``) in one process:
stock ``HiRadixCache`` and ``CpHiRadixCache`` as CP rank ``--cp-rank`` of ``--cp`` (a simulated rank
over a one-process gloo group, ``multi_rank.single_process_group``; stock gets the pool of the whole
group). Prints the total profiled seconds of each and the top functions by cumulative and own time.

    python3 benchmark/profile_cp_hicache_step.py --cp 1 --steps 1000
    python3 benchmark/profile_cp_hicache_step.py --cp 2 --cp-rank 0 --kind ours --top 40
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_cp_hicache_step_overhead import build_stack, make_step  # noqa: E402


def profile(kind: str, cp_size: int, cp_rank: int, steps: int, warmup: int, top: int) -> float:
    from sglang_cp_shared_kv_testing.multi_rank import single_process_group

    step = make_step(build_stack(kind, cp_size, cp_rank, single_process_group()))
    for i in range(warmup):
        step(i)
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(warmup, warmup + steps):
        step(i)
    profiler.disable()
    stats = pstats.Stats(profiler)
    print(f"== {kind}, cp {cp_size} rank {cp_rank}: {stats.total_tt:.3f} s for {steps} steps")
    if top:
        stats.sort_stats("cumulative").print_stats(top)
        stats.sort_stats("tottime").print_stats(top)
    return stats.total_tt


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--cp-rank", type=int, default=0)
    parser.add_argument("--kind", choices=("stock", "ours", "both"), default="both")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--top", type=int, default=0, help="functions to list (0: totals only)")
    args = parser.parse_args(argv)
    kinds = ("stock", "ours") if args.kind == "both" else (args.kind,)
    for kind in kinds:
        profile(kind, args.cp, args.cp_rank, args.steps, args.warmup, args.top)


if __name__ == "__main__":
    main()
