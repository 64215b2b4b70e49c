"""CPU bookkeeping cost of one HiCache backup / load-back, CP shared KV vs stock, without the copies.

A CPU proxy for the "CPU-side time per call" table of ``bench_cp_hicache_transfer.py`` (the lead's GPU
numbers): the same stacks and the same timed calls (``write_backup``; ``load_back`` +
``ready_to_load_host_cache``), but the host pools' data movers are replaced by no-ops, so what is left
is index bookkeeping: host/device allocation, CP's logical -> physical translation and metadata, queue
merging, events and acks. The copies themselves are what the transfer benchmark measures.

On the CPU a device -> host copy of an index tensor is free, so this proxy does not show the cost of the
sync and transfer such a copy makes on a GPU: it shows the per-token CPU work only.

    python3 benchmark/bench_cp_hicache_cpu_overhead.py                  # 8K / 32K / 128K, cp 8
    python3 benchmark/bench_cp_hicache_cpu_overhead.py --tokens 8192 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_cp_hicache_transfer import (  # noqa: E402
    PAGE_SIZE,
    TARGET_CPU_RATIO,
    CacheTimer,
    build_stock_and_cp_stacks,
)
from sglang_cp_shared_kv_testing.multi_rank import single_process_group  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--kv-formats", nargs="+", default=["bf16", "fp8"])
    parser.add_argument("--cp-size", type=int, default=8)
    # Copies are skipped, so layers only size the pools (and the per-layer loop of a load).
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=21)
    return parser.parse_args(argv)


def skip_copies(stack) -> None:
    """Make the host pool group's device<->host movers no-ops (bookkeeping around them is kept)."""
    host = stack.controller.mem_pool_host
    host.backup_from_device_all_layer = lambda *args, **kwargs: None
    host.load_to_device_per_layer = lambda *args, **kwargs: None


def median_cpu_seconds(timer: CacheTimer, tokens: int, repeats: int) -> tuple[float, float]:
    runs = [timer.once(tokens) for _ in range(repeats + 1)][1:]  # the first is a warm-up
    return statistics.median(r[1] for r in runs), statistics.median(r[3] for r in runs)


def main(argv=None) -> int:
    args = parse_args(argv)
    group = single_process_group()
    print(
        f"### CPU bookkeeping per call without copies (cpu, cp rank 0 of {args.cp_size}), "
        f"CP over stock (target <= {TARGET_CPU_RATIO})\n"
    )
    print("| KV | tokens | write_backup stock / CP us | x | load_back stock / CP us | x |")
    print("|---|---|---|---|---|---|")
    for kv_format in args.kv_formats:
        max_pages = max(args.tokens) // PAGE_SIZE
        common = dict(
            device="cpu",
            kv_format=kv_format,
            io_backend="kernel",  # as on the GPU: no index sort (the direct backend sorts)
            host_layout="layer_first",
            group=group,
            layers=args.layers,
            write_policy="write_back",
            hicache_ratio=1.2,
        )
        stock, cp = build_stock_and_cp_stacks(max_pages, args.cp_size, **common)
        for stack in (stock, cp):
            skip_copies(stack)
        stock_timer, cp_timer = CacheTimer(stock, "cpu"), CacheTimer(cp, "cpu")
        for tokens in args.tokens:
            stock_write, stock_load = median_cpu_seconds(stock_timer, tokens, args.repeats)
            cp_write, cp_load = median_cpu_seconds(cp_timer, tokens, args.repeats)
            print(
                f"| {kv_format} | {tokens // 1024}K | {stock_write * 1e6:.0f} / {cp_write * 1e6:.0f} | "
                f"{cp_write / stock_write:.2f} | {stock_load * 1e6:.0f} / {cp_load * 1e6:.0f} | "
                f"{cp_load / stock_load:.2f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
