"""Per-scheduler-step HiCache overhead with writes in flight: stock HiRadixCache vs CpHiRadixCache at cp
1/2/4 over gloo on the CPU, in ms per step and collectives per step.

One simulated scheduler step, on every rank of the group (one process per rank, sglang_cp_shared_kv_testing/multi_rank.py):

1. ``check_hicache_events`` (write acks of the previous step's write-through, load acks);
2. ``match_prefix`` of a request: a shared 4-page prefix (locked, like a long-lived system prompt) plus
   2 pages of its own;
3. the finished request is cached: device locs for its own pages (evicting device nodes when the
   allocator is short, which moves backed-up nodes to host and evicts host-only ones when host is
   short), then ``insert``, whose write-through starts the host write acknowledged at the next step.

Stock gets a pool as large as the CP group's logical pool (it holds every page on every rank); ours
gets ``PAGES`` physical pages per rank. Collectives are counted by wrapping ``torch.distributed``'s
collective functions in every rank; the count includes the ones sglang would skip at cp 1 (none are
entered there: a one-rank group reduces nothing). The host copies are real (CPU pools, 1 layer).

Both caches run in the same processes, in alternating blocks of steps (``--rounds`` x ``--block``), so
outside load lands on both; the ratio is the median over rounds of ours / stock.

    python3 benchmark/bench_cp_hicache_step_overhead.py
    python3 benchmark/bench_cp_hicache_step_overhead.py --cp 2 --rounds 20 --block 50
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

PAGES = 48  # physical device pages per rank (ours); stock: PAGES * cp
PREFIX_PAGES, OWN_PAGES = 4, 2
KINDS = ("stock", "ours")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier", "all_to_all")


def _count_collectives(counter: dict) -> None:
    import torch.distributed as dist

    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counted(*args, _original=original, **kwargs):
            counter["n"] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


def build_stack(kind, cp_size, cp_rank, group, pages=PAGES):
    """The benchmark's stack for one rank: stock (a pool as large as the group's) or ours."""
    from sglang_cp_shared_kv_testing.cp_hicache_stack import (
        TINY_NSA,
        build_cp_hicache_stack,
        build_stock_hicache_stack,
    )

    shape = dataclasses.replace(TINY_NSA, layer_num=1)
    if kind == "stock":
        return build_stock_hicache_stack(
            pages=pages * cp_size, group=group, shape=shape, hicache_ratio=1.5
        )
    return build_cp_hicache_stack(
        cp_size=cp_size, cp_rank=cp_rank, group=group, physical_pages=pages, shape=shape,
        hicache_ratio=1.5,
    )  # fmt: skip


def make_step(stack):
    """Insert and lock the shared prefix; return ``step(i)``, one simulated scheduler step."""
    import torch

    from sglang_cp_shared_kv_testing.cp_hicache_stack import NSA_PAGE_SIZE as PAGE
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache, allocator = stack.cache, stack.allocator
    prefix = list(range(1, PREFIX_PAGES * PAGE + 1))
    cache.insert(InsertParams(key=RadixKey(prefix), value=allocator.alloc(len(prefix))))
    cache.inc_lock_ref(cache.match_prefix(MatchPrefixParams(key=RadixKey(prefix))).last_device_node)

    def step(i):
        cache.check_hicache_events()
        tokens = prefix + [10**9 + i * OWN_PAGES * PAGE + j for j in range(OWN_PAGES * PAGE)]
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        need = len(tokens) - len(match.device_indices)
        if allocator.available_size() < need:
            cache.evict(EvictParams(num_tokens=need))
        own = allocator.alloc(need)
        assert own is not None, "benchmark pool too small"
        cache.insert(InsertParams(key=RadixKey(tokens), value=torch.cat([match.device_indices, own])))

    return step


def _rank(rank, world_size, rounds, block, warmup, pages):
    """Both caches live in this process; they run in alternating blocks of ``block`` steps, so load
    from outside the benchmark (the machine is shared, and small) lands on both alike."""
    import torch.distributed as dist

    steps = {
        kind: make_step(build_stack(kind, world_size, rank, dist.group.WORLD, pages)) for kind in KINDS
    }
    for kind in KINDS:
        for i in range(warmup):
            steps[kind](i)
    counter = {"n": 0}
    _count_collectives(counter)
    seconds = {kind: [] for kind in KINDS}
    collectives = {kind: 0 for kind in KINDS}
    next_step = warmup
    for _ in range(rounds):
        for kind in KINDS:
            dist.barrier()
            counter["n"] = 0
            start = time.perf_counter()
            for i in range(next_step, next_step + block):
                steps[kind](i)
            seconds[kind].append(time.perf_counter() - start)
            collectives[kind] += counter["n"]
        next_step += block
    return {"seconds": seconds, "collectives": collectives}


def main(argv=None):
    from sglang_cp_shared_kv_testing.multi_rank import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=50, help="steps per block")
    parser.add_argument(
        "--warmup", type=int, default=None,
        help="steps before timing (default: enough to fill the device and host pools)",
    )  # fmt: skip
    parser.add_argument(
        "--pages", type=int, default=PAGES, help="physical device pages per rank (stock: x cp)"
    )
    args = parser.parse_args(argv)
    print(f"{args.pages} physical device pages per rank, host pool 1.5x")
    print(
        "| cp | stock ms/step | ours ms/step | ours / stock (median of rounds) "
        "| collectives per step stock / ours |"
    )
    print("|---|---|---|---|---|")
    for cp in args.cp:
        # Each step adds OWN_PAGES logical pages: the host pool (1.5x the device's) is full after
        # 1.5 * cp * pages / OWN_PAGES steps, and every timed step then evicts on device and host.
        warmup = args.warmup if args.warmup is not None else 60 + 3 * cp * args.pages // (2 * OWN_PAGES)
        results = run_ranks(
            _rank, cp, (args.rounds, args.block, warmup, args.pages), timeout_s=900
        )
        # A round's time is its slowest rank's (the group moves at the slowest rank's pace).
        per_round = {
            kind: [max(r["seconds"][kind][k] for r in results) for k in range(args.rounds)]
            for kind in KINDS
        }
        ms = {kind: sum(per_round[kind]) / (args.rounds * args.block) * 1e3 for kind in KINDS}
        ratio = statistics.median(o / s for s, o in zip(per_round["stock"], per_round["ours"]))
        counts = []
        for kind in KINDS:
            per_rank = {r["collectives"][kind] for r in results}
            assert len(per_rank) == 1, f"{kind}: ranks entered different collectives: {per_rank}"
            counts.append(per_rank.pop() / (args.rounds * args.block))
        print(
            f"| {cp} | {ms['stock']:.3f} | {ms['ours']:.3f} | {ratio:.2f} "
            f"| {counts[0]:.2f} / {counts[1]:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
