"""Per-rank HiCache backup / load-back cost with CP shared KV vs stock sglang 0.5.11 (replicated KV).

GLM-5-shaped pools (78 layers, page 64, NSA rows: bf16 576 x 2 B or fp8 656 B, indexer 132 B per token
per layer) and logical prefixes of 8K / 32K / 128K tokens, one node each. Three ways to move them:

* CP: rank 0 of a cp_size-rank group (simulated in one process, ``build_cp_hicache_stack``)
  backs up and loads back only the pages it owns (about 1/cp_size) through ``CpHiRadixCache`` and our
  ``CpHybridCacheController``;
* stock: sglang's ``HiRadixCache`` on a pool holding every token, as stock CP keeps it on each rank;
* ceiling: a plain ``copy_`` between a pinned host buffer and the device of the same byte count as CP.

For each, the time from the cache call to the end of the copies (``write_backup``; ``load_back`` +
``ready_to_load_host_cache``), median of --repeats after one warm-up, and GB/s over the bytes moved
(KV + indexer). Verdicts: ``cp / (stock / cp_size)`` (target <= 1.25: sharding must not cost more than
a quarter over a perfect 1/cp_size split) and CP's fraction of the ceiling. Then the CPU-side time of the
same calls (until they return, before waiting for the copies): CP over stock (target <= 1.5). In the
one-process simulation CP's agreement all-reduces run over a 1-process gloo group, so their
cross-rank latency is not in these numbers.

Both stacks are built with KV host rows as wide as the device rows (``host_rows_as_wide_as_device_rows``):
sglang 0.5.11 builds 576-byte host rows for fp8's 656-byte device rows, which loses data (docs/cp-hicache.md).

    python3 benchmark/bench_cp_hicache_transfer.py            # GPU (after scripts/gpu/remote_env.sh)
    python3 benchmark/bench_cp_hicache_transfer.py --quick    # CPU dry run, direct backend, ~1 min
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from sglang_cp_shared_kv_testing.cp_hicache_stack import (
    NSA_PAGE_SIZE as PAGE_SIZE,
    build_cp_hicache_stack,
    build_stock_hicache_stack,
    glm5_nsa,
    host_rows_as_wide_as_device_rows,
)
from sglang_cp_shared_kv_testing.multi_rank import single_process_group

TARGET_TIME_RATIO = 1.25
TARGET_CPU_RATIO = 1.5


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU dry run: small, direct backend")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--layers", type=int, default=78)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--kv-formats", nargs="+", default=["bf16", "fp8"])
    parser.add_argument("--cp-size", type=int, default=8)
    parser.add_argument("--io-backend", default="kernel")
    parser.add_argument("--host-layout", default="layer_first")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.quick:
        args.device, args.layers, args.tokens, args.repeats = "cpu", 4, [8192, 32768], 2
        args.io_backend, args.host_layout = "direct", "layer_first"
    return args


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def fill_random(stack, device):
    """Random bytes in every device row: copies are timed on real data, never on zeros."""
    generator = torch.Generator(device=device).manual_seed(0)
    for layer in range(stack.kv_pool.layer_num):
        for buffer in (stack.kv_pool.kv_buffer[layer], stack.kv_pool.index_k_with_scale_buffer[layer]):
            raw = buffer.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=device, generator=generator))
    sync(device)


class CacheTimer:
    """Backs up and loads back one node of ``tokens`` tokens through a cache, timing each call."""

    def __init__(self, stack, device):
        self.stack, self.device = stack, device
        self.next_token = 0

    def _fresh_key(self, tokens):
        from sglang.srt.mem_cache.radix_cache import RadixKey

        key = RadixKey(list(range(self.next_token, self.next_token + tokens)))
        self.next_token += tokens
        return key

    def once(self, tokens):
        """(backup s, backup CPU s, load s, load CPU s, bytes moved by this rank)."""
        from sglang.srt.mem_cache.base_prefix_cache import (
            EvictParams,
            InsertParams,
            MatchPrefixParams,
        )

        cache, allocator = self.stack.cache, self.stack.allocator
        key = self._fresh_key(tokens)
        locs = allocator.alloc(tokens)
        if locs is None:
            raise RuntimeError(f"device pool too small for {tokens} tokens")
        cache.insert(InsertParams(key=key, value=locs))
        node = cache.match_prefix(MatchPrefixParams(key=key)).last_device_node
        sync(self.device)

        start = time.perf_counter()
        if not cache.write_backup(node, write_back=True):
            raise RuntimeError("write_backup backed up nothing (host pool too small?)")
        backup_cpu = time.perf_counter() - start
        cache.cache_controller.ack_write_queue[-1].finish_event.synchronize()
        sync(self.device)
        backup = time.perf_counter() - start
        cache.writing_check(write_back=True)

        cache.evict(EvictParams(num_tokens=tokens))
        host_node = cache.match_prefix(MatchPrefixParams(key=key)).last_host_node
        start = time.perf_counter()
        if cache.load_back(host_node) is None:
            raise RuntimeError("load_back failed")
        cache.ready_to_load_host_cache()
        load_cpu = time.perf_counter() - start
        cache.cache_controller.ack_load_queue[-1].finish_event.synchronize()
        sync(self.device)
        load = time.perf_counter() - start
        cache.loading_check()

        moved = self._bytes_moved(node, tokens)
        cache.evict(EvictParams(num_tokens=tokens))  # back to host only, then off the host too
        cache.evict_host(cache.cache_controller.mem_pool_host.size)
        return backup, backup_cpu, load, load_cpu, moved

    def _bytes_moved(self, node, tokens):
        owned = tokens if self.stack.layout is None else node.cp_hicache.num_owned
        per_token = self.stack.kv_row_bytes() + self.stack.index_page_bytes() // PAGE_SIZE
        return owned * per_token * self.stack.kv_pool.layer_num


def copy_ceiling(num_bytes, device, repeats):
    """Median seconds of a pinned host -> device and device -> host ``copy_`` of ``num_bytes``."""
    if device != "cuda":
        return float("nan"), float("nan")
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 256)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    times = {"h2d": [], "d2h": []}
    for i in range(repeats + 1):
        for direction, (dst, src) in (("h2d", (dev, host)), ("d2h", (host, dev))):
            sync(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync(device)
            if i:
                times[direction].append(time.perf_counter() - start)
    return statistics.median(times["d2h"]), statistics.median(times["h2d"])


def measure(timer, tokens, repeats):
    runs = [timer.once(tokens) for _ in range(repeats + 1)][1:]  # the first is a warm-up
    median = lambda i: statistics.median(run[i] for run in runs)  # noqa: E731
    return {
        "backup": median(0),
        "backup_cpu": median(1),
        "load": median(2),
        "load_cpu": median(3),
        "bytes": runs[0][4],
    }


def build_stock_and_cp_stacks(max_pages: int, cp_size: int, kv_format: str, layers: int, **common):
    """Stock (replicated) and CP rank-0 stacks for nodes of up to ``max_pages`` logical pages, both with
    KV host rows as wide as the device rows (see the module docstring)."""
    shape = glm5_nsa(kv_format, layers)
    with host_rows_as_wide_as_device_rows():
        stock = build_stock_hicache_stack(pages=max_pages + 4, shape=shape, **common)
        # Rank 0 owns about 1/cp_size of the pages; the allocator may place a page or two more.
        cp = build_cp_hicache_stack(
            cp_size=cp_size,
            cp_rank=0,
            physical_pages=max_pages // cp_size + 8,
            shape=shape,
            **common,
        )
    return stock, cp


def gbps(num_bytes, seconds):
    return num_bytes / seconds / 1e9


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --quick (or --device cpu) for a CPU dry run")
    group = single_process_group()
    rows = []
    for kv_format in args.kv_formats:
        max_pages = max(args.tokens) // PAGE_SIZE
        common = dict(
            device=args.device,
            kv_format=kv_format,
            io_backend=args.io_backend,
            host_layout=args.host_layout,
            group=group,
            layers=args.layers,
            write_policy="write_back",  # backups only when the benchmark asks for them
            hicache_ratio=1.2,
        )
        stock, cp = build_stock_and_cp_stacks(max_pages, args.cp_size, **common)
        for stack in (stock, cp):
            fill_random(stack, args.device)
        stock_timer, cp_timer = CacheTimer(stock, args.device), CacheTimer(cp, args.device)
        for tokens in args.tokens:
            s = measure(stock_timer, tokens, args.repeats)
            c = measure(cp_timer, tokens, args.repeats)
            d2h, h2d = copy_ceiling(c["bytes"], args.device, args.repeats)
            rows.append((kv_format, tokens, s, c, d2h, h2d))
            print(f"measured {kv_format} {tokens} tokens", file=sys.stderr, flush=True)
    print_tables(args, rows)
    return 0


def print_tables(args, rows):
    n = args.cp_size
    print(
        f"\n### HiCache transfer per rank: CP shared KV (rank 0 of {n}) vs stock (replicated), "
        f"{args.layers} layers, io {args.io_backend}, host {args.host_layout}, {args.device}\n"
    )
    print(
        "| KV | tokens | op | stock ms (GB/s) | CP ms (GB/s) | CP MB | CP/(stock/"
        f"{n}) (<= {TARGET_TIME_RATIO}) | CP / ceiling GB/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for kv_format, tokens, s, c, d2h, h2d in rows:
        for op, ceiling in (("backup", d2h), ("load", h2d)):
            ratio = c[op] / (s[op] / n)
            cp_rate = gbps(c["bytes"], c[op])
            fraction = "n/a" if ceiling != ceiling else f"{cp_rate / gbps(c['bytes'], ceiling):.2f} of {gbps(c['bytes'], ceiling):.1f}"
            print(
                f"| {kv_format} | {tokens // 1024}K | {op} | {s[op] * 1e3:.2f} "
                f"({gbps(s['bytes'], s[op]):.1f}) | {c[op] * 1e3:.2f} ({cp_rate:.1f}) | "
                f"{c['bytes'] / 1e6:.0f} | {ratio:.2f} {'ok' if ratio <= TARGET_TIME_RATIO else 'MISS'} | "
                f"{fraction} |"
            )
    print(f"\n### CPU-side time per call (until it returns), CP over stock (target <= {TARGET_CPU_RATIO})\n")
    print("| KV | tokens | write_backup stock / CP us | x | load_back stock / CP us | x |")
    print("|---|---|---|---|---|---|")
    for kv_format, tokens, s, c, _, _ in rows:
        cells = []
        for op in ("backup_cpu", "load_cpu"):
            ratio = c[op] / s[op]
            cells.append(
                f"{s[op] * 1e6:.0f} / {c[op] * 1e6:.0f} | {ratio:.2f} "
                f"{'ok' if ratio <= TARGET_CPU_RATIO else 'MISS'}"
            )
        print(f"| {kv_format} | {tokens // 1024}K | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    sys.exit(main())
