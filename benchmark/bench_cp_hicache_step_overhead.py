"""Per-scheduler-step HiCache overhead with writes in flight: stock HiRadixCache vs CpHiRadixCache at cp
1/2/4 over gloo on the CPU, in ms per step and collectives per step.

One simulated scheduler step, on every rank of the group (one process per rank, testing/multi_rank.py):

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

    python3 benchmark/bench_cp_hicache_step_overhead.py
    python3 benchmark/bench_cp_hicache_step_overhead.py --cp 2 --steps 200
"""

from __future__ import annotations

import argparse
import dataclasses
import time

PAGES = 48  # physical device pages per rank (ours); stock: PAGES * cp
PREFIX_PAGES, OWN_PAGES = 4, 2
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier", "all_to_all")


def _count_collectives(counter: dict) -> None:
    import torch.distributed as dist

    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counted(*args, _original=original, **kwargs):
            counter["n"] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


def build_stack(kind, cp_size, cp_rank, group):
    """The benchmark's stack for one rank: stock (a pool as large as the group's) or ours."""
    from sglang_cp_shared_kv.testing.cp_hicache_stack import (
        TINY_NSA,
        build_cp_hicache_stack,
        build_stock_hicache_stack,
    )

    shape = dataclasses.replace(TINY_NSA, layer_num=1)
    if kind == "stock":
        return build_stock_hicache_stack(
            pages=PAGES * cp_size, group=group, shape=shape, hicache_ratio=1.5
        )
    return build_cp_hicache_stack(
        cp_size=cp_size, cp_rank=cp_rank, group=group, physical_pages=PAGES, shape=shape,
        hicache_ratio=1.5,
    )  # fmt: skip


def make_step(stack):
    """Insert and lock the shared prefix; return ``step(i)``, one simulated scheduler step."""
    import torch

    from sglang_cp_shared_kv.testing.cp_hicache_stack import NSA_PAGE_SIZE as PAGE
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


def _rank(rank, world_size, kind, steps, warmup):
    import torch.distributed as dist

    step = make_step(build_stack(kind, world_size, rank, dist.group.WORLD))
    for i in range(warmup):
        step(i)
    counter = {"n": 0}
    _count_collectives(counter)
    dist.barrier()
    counter["n"] = 0
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(i)
    elapsed = time.perf_counter() - start
    return {"ms_per_step": elapsed / steps * 1e3, "collectives_per_step": counter["n"] / steps}


def main(argv=None):
    from sglang_cp_shared_kv.testing.multi_rank import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=60)
    args = parser.parse_args(argv)
    print("| cp | cache | ms per step (slowest rank) | collectives per step |")
    print("|---|---|---|---|")
    for cp in args.cp:
        for kind in ("stock", "ours"):
            results = run_ranks(_rank, cp, (kind, args.steps, args.warmup), timeout_s=600)
            ms = max(r["ms_per_step"] for r in results)
            counts = {r["collectives_per_step"] for r in results}
            assert len(counts) == 1, f"ranks entered different numbers of collectives: {counts}"
            print(f"| {cp} | {kind} | {ms:.3f} | {counts.pop():.2f} |", flush=True)


if __name__ == "__main__":
    main()
