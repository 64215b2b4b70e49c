"""Per-layer work of the shared-KV prefill path on one device, with GLM-5's per-layer widths.

One CP rank's work for one layer of an 8K-token chunk over a cached prefix (0 / 32K / 128K tokens)
at cp 2 / 4 / 8, KV rows of 656 B (fp8) or 1152 B (bf16), 132 B of indexer K per token, page 64:

* ``store 2x``: the former store, sglang's setters twice (pool at physical locs, scratch at the
  fill locs): fp8 quantize / act-quant twice;
* ``store 1x``: the store now, setters once into the scratch slot (``remap_token_locs``) plus the
  raw-byte copy of the rows to the pool (``copy_kv_rows`` / ``copy_index_k_rows``);
* ``copy``: that raw-byte copy alone; ``maps``: the per-layer map kernels the former path ran
  (``physical_locs_or_dummy`` + the fill locs through the plan's former fill table), now once
  per forward;
* ``pack``: this rank's ``n`` planned pages into its slice (``index_select``), KV + indexer;
* ``recv``: the ``(cp - 1) * n`` pages the all-gather writes into the other slices, emulated by
  device copies from a buffer standing in for the peers (single-process emulation of one rank: the
  transport between GPUs is not measured here, that needs two GPUs and NCCL);
* ``overlap``: a stand-in for one layer's compute (a bf16 GEMM of the chunk by a 6144 x 6144
  weight, repeated) alone, then with ``pack + recv`` of the next layer on a side stream, i.e. how
  much of the gather hides behind compute when it runs one layer ahead (copies only; with NCCL the
  gather also takes SMs).

Indexer K is stored through ``act_quant`` + ``set_index_k_scale_buffer`` (sglang's non-fused
branch; the fused JIT store does the same quantize once per call). Times are medians of CUDA-event
timed repeats, per layer, in microseconds.

    python3 benchmark/bench_peer_page_gather.py                    # one GPU, ~1 min
    python3 benchmark/bench_peer_page_gather.py --quick --device cpu   # dry run, torch stand-ins
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import numpy as np
import torch

PAGE = 64
CHUNK_TOKENS = 8192
HIDDEN = 6144


def _timer(device, repeats, warmup):
    def run(fn):
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(repeats):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(samples)

    return run


def _case(cp_size, prefix_tokens, dtype_name, chunk_tokens, device, timed, act_quant):
    from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
    from sglang_cp_shared_kv.model_executor.gather_scratch import SCRATCH_LAYER
    from sglang_cp_shared_kv.model_executor.peer_page_gather import as_pages
    from sglang_cp_shared_kv.model_executor.peer_page_plan import build_peer_page_plan
    from sglang_cp_shared_kv.model_executor.scratch_rows import (
        batch_row_maps,
        copy_index_k_rows,
        copy_kv_rows,
    )
    from sglang_cp_shared_kv_testing.peer_page_plan_fills import fills_only
    from sglang_cp_shared_kv_testing.runtime_check import make_nsa_pool

    layout = CpSharedKVLayout(cp_size, 0, PAGE)
    total_pages = (prefix_tokens + chunk_tokens) // PAGE
    physical_pages = -(-total_pages // cp_size) + 1
    pool = make_nsa_pool(physical_pages * PAGE, dtype_name, 1, device)
    slot = make_nsa_pool(cp_size * physical_pages * PAGE, dtype_name, 1, device)
    # Logical pages cp_size, cp_size + 1, ...: owners round-robin, as the allocator keeps them.
    seq_len = prefix_tokens + chunk_tokens
    req_to_token = torch.zeros((2, seq_len), dtype=torch.int32, device=device)
    positions = torch.arange(seq_len, device=device)
    req_to_token[1] = ((cp_size + positions // PAGE) * PAGE + positions % PAGE).int()
    request_pages = cp_size + np.arange(-(-seq_len // PAGE))  # the logical pages of req_to_token[1]
    plan = build_peer_page_plan(
        layout=layout,
        request_pages=[request_pages],
        old_page_counts=[-(-prefix_tokens // PAGE)],
        num_logical_pages=cp_size * (physical_pages + 1),
        scratch_num_pages=cp_size * physical_pages + 1,
        device=device,
    )
    locs = req_to_token[1, prefix_tokens:].long()
    maps = batch_row_maps(plan, layout, locs)
    fill_plan = fills_only(plan)  # the former per-layer path wrote through the fill table
    nope = torch.randn(chunk_tokens, 1, 512, device=device, dtype=torch.bfloat16)
    rope = torch.randn(chunk_tokens, 1, 64, device=device, dtype=torch.bfloat16)
    key = torch.randn(chunk_tokens, 128, device=device, dtype=torch.bfloat16)
    layer = SCRATCH_LAYER  # layer 0 of both one-layer pools

    def store_index(target, target_locs):
        index_k, scale = act_quant(key, 128, None)
        target.set_index_k_scale_buffer(0, target_locs, index_k, scale)

    def store_twice():
        physical = layout.physical_locs_or_dummy(locs)
        fill = fill_plan.remap_token_locs(locs)
        pool.set_mla_kv_buffer(layer, physical, nope, rope)
        slot.set_mla_kv_buffer(layer, fill, nope, rope)
        store_index(pool, physical)
        store_index(slot, fill)

    def copy_rows():
        copy_kv_rows(slot.kv_buffer[0], pool.kv_buffer[0], maps)
        copy_index_k_rows(
            slot.index_k_with_scale_buffer[0], pool.index_k_with_scale_buffer[0], maps, PAGE, 128
        )

    def store_once():
        slot.set_mla_kv_buffer(layer, maps.scratch_locs, nope, rope)
        store_index(slot, maps.scratch_locs)
        copy_rows()

    def per_layer_maps():
        layout.physical_locs_or_dummy(locs)
        fill_plan.remap_token_locs(locs)

    n = plan.gather_pages_per_rank
    buffers = [
        (as_pages(pool.kv_buffer[0], PAGE), as_pages(slot.kv_buffer[0], PAGE)),
        (pool.index_k_with_scale_buffer[0], slot.index_k_with_scale_buffer[0]),
    ]
    peers = [torch.empty_like(s[1 : 1 + cp_size * n]) for _, s in buffers]

    def pack():
        for physical_pages_view, scratch in buffers:
            own = scratch[1 : 1 + n]
            torch.index_select(physical_pages_view, 0, plan.send_physical_pages, out=own)

    def recv():
        for (_, scratch), peer in zip(buffers, peers):
            scratch[1 + n : 1 + cp_size * n].copy_(peer[n:])

    def gather():
        pack()
        recv()

    row = dict(
        cp=cp_size,
        prefix=prefix_tokens,
        dtype=dtype_name,
        gathered_pages=cp_size * n,
        n=n,
        store_2x=timed(store_twice),
        store_1x=timed(store_once),
        copy=timed(copy_rows),
        maps=timed(per_layer_maps),
        pack=timed(pack) if n else 0.0,
        recv=timed(recv) if n else 0.0,
    )
    row["bytes_recv_MB"] = (cp_size - 1) * n * PAGE * (pool.kv_buffer[0].shape[-1] * pool.kv_buffer[0].element_size() + 132) / 1e6
    if device == "cuda" and n:
        weight = torch.randn(HIDDEN, HIDDEN, device=device, dtype=torch.bfloat16)
        hidden = torch.randn(chunk_tokens, HIDDEN, device=device, dtype=torch.bfloat16)
        side = torch.cuda.Stream()

        def compute():
            for _ in range(4):
                torch.matmul(hidden, weight)

        def compute_with_gather_ahead():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                gather()
            compute()
            torch.cuda.current_stream().wait_stream(side)

        row["compute"] = timed(compute)
        row["compute+gather_serial"] = timed(lambda: (compute(), gather()))
        row["compute+gather_ahead"] = timed(compute_with_gather_ahead)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (dry run)")
    parser.add_argument("--cp-sizes", default="2,4,8")
    parser.add_argument("--prefixes", default="0,32768,131072", help="cached prefix tokens")
    parser.add_argument("--dtypes", default="fp8,bf16")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    cp_sizes = [int(x) for x in args.cp_sizes.split(",")]
    prefixes = [int(x) for x in args.prefixes.split(",")]
    chunk, repeats, warmup = CHUNK_TOKENS, args.repeats, 3
    if args.quick:
        prefixes, chunk, repeats, warmup = [p // 64 for p in prefixes], CHUNK_TOKENS // 64, 1, 0

    context = contextlib.nullcontext()
    if args.device == "cuda":
        from sglang.srt.layers.attention.nsa.triton_kernel import act_quant

        torch.cuda.set_device(0)
    else:
        from sglang_cp_shared_kv_testing.nsa_cpu_kernels import act_quant_torch as act_quant
        from sglang_cp_shared_kv_testing.nsa_cpu_kernels import cpu_kernels

        context = cpu_kernels()
    timed = _timer(args.device, repeats, warmup)
    start = time.time()
    rows = []
    with context:
        for dtype_name in args.dtypes.split(","):
            for cp_size in cp_sizes:
                for prefix in prefixes:
                    rows.append(_case(cp_size, prefix, dtype_name, chunk, args.device, timed, act_quant))
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
    columns = [
        "dtype", "cp", "prefix", "gathered_pages", "bytes_recv_MB", "store_2x", "store_1x", "copy",
        "maps", "pack", "recv", "compute", "compute+gather_serial", "compute+gather_ahead",
    ]
    print(f"chunk {chunk} tokens, device {args.device}; times in us per layer (median of {repeats})")
    print(" | ".join(columns))
    for row in rows:
        cells = []
        for column in columns:
            value = row.get(column, "")
            cells.append(f"{value:.1f}" if isinstance(value, float) else str(value))
        print(" | ".join(cells))
    print(f"done in {time.time() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
