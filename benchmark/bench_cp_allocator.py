"""Allocator calls of a scheduler, stock ``PagedTokenToKVPoolAllocator`` vs ours, on the real device:
host time per call of ``alloc_extend`` (new requests), ``alloc_decode`` (one token for every running
request) and ``free`` (finished requests), with the same request stream for both.

Ours keeps its free lists on the host and copies the locs of an allocation to the device once; stock
keeps them on the device and runs a Triton kernel per ``alloc_extend`` / ``alloc_decode``. Ours runs as
CP rank 0 of ``--cp`` (its logical pool is ``cp`` times its physical one); stock gets a pool as large
as that logical pool. Each call is timed on the host (what the scheduler waits for); the device work
both leave queued is drained outside the timers. After the run, every request's locs must be
distinct across the running requests (a check, not timed).

    python3 benchmark/bench_cp_allocator.py                       # CUDA (stock needs Triton)
    python3 benchmark/bench_cp_allocator.py --device cpu --kinds ours
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Dict, List

import torch

OPS = ("alloc_extend", "alloc_decode", "free")


@dataclass
class Request:
    locs: List[torch.Tensor]
    seq_len: int

    @property
    def last_loc(self) -> torch.Tensor:
        return self.locs[-1][-1:]


@dataclass
class Timings:
    seconds: Dict[str, List[float]] = field(default_factory=lambda: {op: [] for op in OPS})

    def timed(self, op, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        self.seconds[op].append(time.perf_counter() - start)
        return out


def build(kind: str, cp_size: int, pages_per_rank: int, page_size: int, device: str):
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    from sglang_cp_shared_kv.mem_cache.allocator import CPSharedPagedTokenToKVPoolAllocator
    from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout

    logical_tokens = cp_size * pages_per_rank * page_size
    if kind == "stock":
        pool = SimpleNamespace(size=logical_tokens)
        return PagedTokenToKVPoolAllocator(
            logical_tokens, page_size, torch.bfloat16, device, pool, False
        )
    pool = SimpleNamespace(size=pages_per_rank * page_size)
    return CPSharedPagedTokenToKVPoolAllocator(
        logical_tokens, page_size, torch.bfloat16, device, pool, False,
        CpSharedKVLayout(cp_size, 0, page_size),
    )


def run(kind: str, args, cp_size: int) -> Timings:
    allocator = build(kind, cp_size, args.pages_per_rank, args.page_size, args.device)
    rng = random.Random(args.seed)
    device = args.device
    timings = Timings()
    running: List[Request] = []

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            timings = Timings()
        # New requests, prefilled in one extend (prefix 0: last_loc -1, as sglang passes it).
        lens = [rng.randint(args.min_prompt, args.max_prompt) for _ in range(args.new_per_step)]
        prefix_cpu = torch.zeros(len(lens), dtype=torch.int64)
        seq_cpu = torch.tensor(lens, dtype=torch.int64)
        prefix, seq = prefix_cpu.to(device), seq_cpu.to(device)
        last = torch.full((len(lens),), -1, dtype=torch.int64, device=device)
        sync()
        out = timings.timed(
            "alloc_extend", allocator.alloc_extend, prefix, prefix_cpu, seq, seq_cpu, last, sum(lens)
        )
        assert out is not None, "pool too small for the request stream"
        sync()
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        running += [Request([out[a:b]], b - a) for a, b in zip(offsets, offsets[1:])]
        # One decode token for every running request.
        seq_cpu = torch.tensor([r.seq_len + 1 for r in running], dtype=torch.int64)
        seq = seq_cpu.to(device)
        last = torch.cat([r.last_loc for r in running])
        sync()
        out = timings.timed("alloc_decode", allocator.alloc_decode, seq, seq_cpu, last)
        assert out is not None, "pool too small for the request stream"
        sync()
        for r, loc in zip(running, out.split(1)):
            r.locs.append(loc)
            r.seq_len += 1
        # The oldest requests finish.
        while len(running) > args.running:
            finished = running.pop(0)
            locs = torch.cat(finished.locs)
            sync()
            timings.timed("free", allocator.free, locs)
            sync()
    held = torch.cat([torch.cat(r.locs) for r in running]).cpu()
    assert len(torch.unique(held)) == len(held), f"{kind}: a loc was handed out twice"
    return timings


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kinds", nargs="+", default=["stock", "ours"])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--pages-per-rank", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--new-per-step", type=int, default=2)
    parser.add_argument("--running", type=int, default=32, help="requests decoding at once")
    parser.add_argument("--min-prompt", type=int, default=100)
    parser.add_argument("--max-prompt", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"device {args.device}, page {args.page_size}, {args.pages_per_rank} pages per rank")
    print("| cp | call | " + " | ".join(f"{k} us (median)" for k in args.kinds) + " | ours / stock |")
    print("|---|---|" + "---|" * len(args.kinds) + "---|")
    for cp in args.cp:
        results = {kind: run(kind, args, cp) for kind in args.kinds}
        for op in OPS:
            medians = {k: statistics.median(results[k].seconds[op]) * 1e6 for k in args.kinds}
            ratio = (
                f"{medians['ours'] / medians['stock']:.2f}"
                if {"ours", "stock"} <= set(medians)
                else "-"
            )
            cells = " | ".join(f"{medians[k]:.1f}" for k in args.kinds)
            print(f"| {cp} | {op} | {cells} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
