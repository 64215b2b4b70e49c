"""Time per ``evict`` / ``evict_host`` call with many evictable leaves: stock HiRadixCache vs CpHiRadixCache.

Stock sglang 0.5.11 heapifies every evictable leaf on every call; CpHiRadixCache keeps its candidates
ordered between calls (``EvictionCandidates``). Both caches get the same tree in the same run: N
one-page leaves, 100 under each one-page inner node, inserted with write-through (so each is backed up on host), on real
CPU pools (1 layer, small latent dims, the real indexer). Then:

* ``evict``: calls that each evict one page (one backed-up leaf, which moves to host);
* ``evict_host``: after every leaf is on host, calls that each free one page of host slots.

The CP cache is a cp 1 stack here, so one call evicts exactly one node in both caches. Goal: <= 1 ms per
call at 100K leaves.

    python3 benchmark/bench_cp_hicache_eviction.py                       # 1K, 10K, 100K leaves
    python3 benchmark/bench_cp_hicache_eviction.py --leaves 1000 --calls 50
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import dataclasses

import torch

from sglang_cp_shared_kv_testing.cp_hicache_stack import settle_write_acks
from sglang_cp_shared_kv_testing.cp_hicache_stack import (
    NSA_INDEX_HEAD_DIM,
    NSA_PAGE_SIZE as PAGE,
    HiCacheServerArgs,
    build_cp_hicache_stack,
    unpinned_host_pools,
    TINY_NSA,
)
from sglang_cp_shared_kv_testing.multi_rank import single_process_group
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang_cp_shared_kv.mem_cache import nsa_host_kv_row_width
from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks

TARGET_MS_AT_100K = 1.0
HICACHE_RATIO = 1.1


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--calls", type=int, default=200, help="timed calls per cache (stock: fewer, see below)")
    parser.add_argument("--stock-budget-s", type=float, default=3.0, help="stock timing budget per size")
    return parser.parse_args(argv)


def build_stock(pages: int, group) -> HiRadixCache:
    pool = NSATokenToKVPool(
        size=pages * PAGE,
        page_size=PAGE,
        kv_lora_rank=16,
        dtype=torch.bfloat16,
        qk_rope_head_dim=8,
        shape=dataclasses.replace(TINY_NSA, layer_num=1),
        device="cpu",
        index_head_dim=NSA_INDEX_HEAD_DIM,
        enable_memory_saver=False,
        kv_cache_dim=24,
    )
    allocator = PagedTokenToKVPoolAllocator(pool.size, PAGE, torch.bfloat16, "cpu", pool, False)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=allocator,
        page_size=PAGE,
        tp_cache_group=group,
        attn_cp_cache_group=group,
    )
    args = HiCacheServerArgs(hicache_ratio=HICACHE_RATIO, enable_nsa_prefill_cp_shared_kv=False)
    with unpinned_host_pools(), applied_hooks(nsa_host_kv_row_width.register_hooks):
        return HiRadixCache(params, args)


def build_ours(pages: int, group):
    stack = build_cp_hicache_stack(
        cp_size=1,
        cp_rank=0,
        group=group,
        physical_pages=pages,
        hicache_ratio=HICACHE_RATIO,
        shape=dataclasses.replace(TINY_NSA, layer_num=1),
        write_policy="write_through",
    )
    return stack.cache


SIBLINGS = 100  # leaves per inner node


def fill(cache, leaves: int) -> None:
    """``leaves`` one-page leaves, ``SIBLINGS`` per one-page inner node, each backed up (write-through).

    Not all under the root: sglang's ``_update_leaf_status`` scans a parent's children on every
    eviction, so 100K siblings would make both caches quadratic. The host pool's copies are skipped
    (bookkeeping kept): only the tree and heap work is timed here.
    """
    host = cache.cache_controller.mem_pool_host
    host.backup_from_device_all_layer = lambda *args, **kwargs: None
    allocator = cache.token_to_kv_pool_allocator
    for i in range(leaves):
        group = i // SIBLINGS
        tokens = list(range(group * PAGE + 1, (group + 1) * PAGE + 1))  # the inner node's page
        tokens += [10**9 + i * PAGE + j for j in range(PAGE)]  # the leaf's own page
        match = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        cached = len(match.device_indices)
        value = torch.cat([match.device_indices, allocator.alloc(len(tokens) - cached)])
        cache.insert(InsertParams(key=RadixKey(tokens), value=value))
        if i % 256 == 255:
            settle_write_acks(cache)
    settle_write_acks(cache)
    assert len(cache.evictable_leaves) == leaves, len(cache.evictable_leaves)


def time_calls(call, calls: int, budget_s: float) -> tuple[float, int]:
    """Median ms per call over up to ``calls`` calls (fewer once ``budget_s`` is spent)."""
    times = []
    deadline = time.perf_counter() + budget_s
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
        if time.perf_counter() > deadline and len(times) >= 3:
            break
    return statistics.median(times) * 1e3, len(times)


def measure(cache, leaves: int, calls: int, budget_s: float) -> dict:
    fill(cache, leaves)
    evict_ms, evict_n = time_calls(lambda: cache.evict(EvictParams(num_tokens=PAGE)), calls, budget_s)
    cache.evict(EvictParams(num_tokens=(leaves + leaves // SIBLINGS) * PAGE))  # every node to host
    assert len(cache.evictable_host_leaves) >= leaves - calls, len(cache.evictable_host_leaves)
    host_ms, host_n = time_calls(lambda: cache.evict_host(PAGE), calls, budget_s)
    return dict(evict_ms=evict_ms, evict_n=evict_n, host_ms=host_ms, host_n=host_n)


def main(argv=None) -> int:
    args = parse_args(argv)
    group = single_process_group()
    rows = []
    for leaves in args.leaves:
        pages = leaves + leaves // SIBLINGS + 8
        stock = build_stock(pages, group)
        s = measure(stock, leaves, args.calls, args.stock_budget_s)
        del stock
        gc.collect()
        ours = build_ours(pages, group)
        o = measure(ours, leaves, args.calls, budget_s=60.0)
        del ours
        gc.collect()
        rows.append((leaves, s, o))
        print(f"measured {leaves} leaves: stock {s}, ours {o}", file=sys.stderr, flush=True)
    print("\n### evict / evict_host per call (CPU, one page per call), stock HiRadixCache vs CpHiRadixCache\n")
    print("| evictable leaves | evict stock ms | evict ours ms | x | evict_host stock ms | evict_host ours ms | x |")
    print("|---|---|---|---|---|---|---|")
    for leaves, s, o in rows:
        print(
            f"| {leaves:,} | {s['evict_ms']:.3f} ({s['evict_n']}) | {o['evict_ms']:.3f} ({o['evict_n']}) | "
            f"{s['evict_ms'] / o['evict_ms']:.0f} | {s['host_ms']:.3f} ({s['host_n']}) | "
            f"{o['host_ms']:.3f} ({o['host_n']}) | {s['host_ms'] / o['host_ms']:.0f} |"
        )
    print(f"\nmedian ms per call (calls timed); goal: ours <= {TARGET_MS_AT_100K} ms at 100K leaves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
