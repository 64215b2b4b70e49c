"""Long randomized CP HiCache simulations on the CPU (see docs/simulation.md).

For every CP size, one group of processes runs every (seed, write policy, eviction policy) scenario in
turn; each rank holds the real CpHiRadixCache, CP allocator and NSA device / host pools, and the group
checks every invariant after every operation. Prints one line per scenario and a summary; exits 1 if any
group reported a violation (the message names invariant, seed, step, rank and operation).

    python scripts/simulate_cp_hicache.py --cp-sizes 2 4 8 --seeds 0 1 2 --ops 2000
    python scripts/simulate_cp_hicache.py --storage     # with an L3 file-backend tier, shared by ranks
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time

from sglang_cp_shared_kv_testing.cp_hicache_simulation import (
    WRITE_POLICIES,
    SimulationScenario,
    SimulationViolation,
    run_simulation,
)


def host_to_device_ratio(text: str) -> float:
    """``--hicache-ratio``: at least 1. sglang's host pool is ``int(device * ratio)`` rounded down to
    whole pages plus one page and must be larger than the device pool (``HostKVCache`` asserts it when
    HiCache is built), which holds exactly from 1 on: a smaller ratio cannot start, so there is nothing
    to simulate."""
    ratio = float(text)
    if not ratio >= 1:
        raise argparse.ArgumentTypeError(
            f"{text}: must be at least 1 (sglang's HiCache asserts a host pool larger than the device pool)"
        )
    return ratio


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--ops", type=int, default=2000, help="operations per scenario")
    parser.add_argument("--write-policies", nargs="+", default=list(WRITE_POLICIES),
                        choices=WRITE_POLICIES)  # fmt: skip
    parser.add_argument(
        "--eviction-policies",
        nargs="+",
        default=["lru"],
        help="sglang eviction policies (lru, lfu, fifo, mru, filo, priority, slru)",
    )
    parser.add_argument("--physical-pages", type=int, default=8, help="device pages per rank")
    parser.add_argument("--hicache-ratio", type=host_to_device_ratio, default=1.5,
                        help="host / device, per rank; at least 1")  # fmt: skip
    parser.add_argument(
        "--eagle-keys", action="store_true",
        help="the tree of an MTP server (--speculative-algorithm EAGLE / NEXTN): children keyed by "
        "token bigrams",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per collective")
    parser.add_argument(
        "--storage", action="store_true",
        help="give every rank an L3 file-backend tier in one shared temporary directory (kept across "
        "scenarios and cp sizes: a later group restores what an earlier one stored)",
    )  # fmt: skip
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    storage_dir = tempfile.mkdtemp(prefix="cp-hicache-sim-l3-") if args.storage else None
    try:
        return _run(args, storage_dir)
    finally:
        if storage_dir is not None:
            shutil.rmtree(storage_dir, ignore_errors=True)


def _run(args, storage_dir) -> int:
    start = time.monotonic()
    ops_executed, violations = 0, []
    for cp_size in args.cp_sizes:
        scenarios = [
            SimulationScenario(
                seed=seed,
                num_ops=args.ops,
                write_policy=write_policy,
                eviction_policy=eviction_policy,
                physical_pages=args.physical_pages,
                hicache_ratio=args.hicache_ratio,
                eagle_keys=args.eagle_keys,
                storage_dir=storage_dir,
            )
            for seed in args.seeds
            for write_policy in args.write_policies
            for eviction_policy in args.eviction_policies
        ]
        try:
            report = run_simulation(cp_size, scenarios, timeout_s=args.timeout)
        except SimulationViolation as violation:
            print(f"cp_size={cp_size}: VIOLATION {violation}", flush=True)
            violations.append(violation)
            continue
        for result in report.results:
            stats = result.stats
            print(
                f"cp_size={cp_size} ranks={cp_size} {result.scenario.describe()}: "
                f"{result.ops_executed} ops in {result.wall_s:.1f}s, 0 violations; "
                f"load-backs {stats.get('load-backs done', 0)}, "
                f"host writes {stats.get('host writes committed', 0)} "
                f"(refused {stats.get('host writes refused', 0)}), "
                f"host evictions {stats.get('host evictions', 0)} "
                f"(+{stats.get('host evictions for a write', 0)} for a write), "
                f"splits {stats.get('node splits', 0) + stats.get('node splits on host', 0)}, "
                f"injected device allocation failures fired "
                f"{result.local_stats.get('injected device allocation failures fired', 0)}"
                + (f", storage prefetches {stats.get('storage prefetches restored', 0)} "
                   f"({stats.get('storage tokens restored', 0)} tokens), restarts "
                   f"{stats.get('restarts', 0)}" if storage_dir else ""),  # fmt: skip
                flush=True,
            )
        ops_executed += report.ops_executed
        print(
            f"cp_size={cp_size}: {report.ops_executed} ops, {len(report.results)} scenarios, "
            f"{report.wall_s:.1f}s wall",
            flush=True,
        )
    print(
        f"total: {ops_executed} ops without violation, cp sizes {args.cp_sizes}, seeds {args.seeds}, "
        f"{len(violations)} violations, {time.monotonic() - start:.1f}s wall"
    )
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
