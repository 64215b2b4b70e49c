"""Latency of per-owner decode's per-layer exchanges, one GPU per rank over NCCL (GLM-5 shapes).

Per layer, per-owner decode all-gathers the top-k candidates' scores (``[B, 2048]`` float32) and
merges the partial attention outputs (``[B, 64, 512]`` bf16 + ``[B, 64]`` LSE). This times, per
layer and batch size, each exchange as per-owner decode runs it (the candidates' all-gather,
``attention_lse_merge.merge_by_scaled_sum``), the all-gather form it did not choose
(``sglang_cp_shared_kv_testing.lse_merge_reference.merge_by_all_gather``) and the scaled sum moved
after ``o_proj`` (the LSE all-gather plus a bf16 all-reduce of ``[B, 6144]``), next to the bytes
``decode_step_bytes`` counts. Host time per call with a device sync (what a decode step waits for);
median over ``--iters`` calls, rank 0 reported; ``x layers`` projects a 78-layer step.

    python3 benchmark/bench_per_owner_decode_exchange.py --world 2              # 2 GPUs, NCCL
    python3 benchmark/bench_per_owner_decode_exchange.py --device cpu --world 2  # gloo, plumbing only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FORMS = ("candidates", "all_gather", "scaled_sum", "scaled_sum_after_o_proj")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batches", default="1,32", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    return parser.parse_args(argv)


def _rank(rank, args, rendezvous, out_path):
    from sglang_cp_shared_kv.model_executor.per_owner_decode.attention_lse_merge import (
        merge_by_scaled_sum,
        process_group_collectives,
    )
    from sglang_cp_shared_kv_testing.decode_step_bytes import (
        GLM5_FP8,
        candidate_bytes_per_token_layer,
        merge_bytes_per_token_layer,
    )
    from sglang_cp_shared_kv_testing.lse_merge_reference import merge_by_all_gather

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=args.world
    )
    group = dist.group.WORLD
    all_gather, all_reduce_sum = process_group_collectives(group)
    device = f"cuda:{rank}" if cuda else "cpu"
    shapes = GLM5_FP8
    rows = []
    for batch in args.batches:
        g = torch.Generator().manual_seed(rank)
        scores = torch.randn(batch, shapes.index_topk, generator=g).to(device)
        out = torch.randn(batch, shapes.heads, shapes.kv_lora_rank, generator=g).to(device, torch.bfloat16)
        lse = torch.randn(batch, shapes.heads, generator=g).to(device)
        hidden = torch.randn(batch, shapes.hidden, generator=g).to(device, torch.bfloat16)
        calls = {
            "candidates": lambda: all_gather(scores),
            "all_gather": lambda: merge_by_all_gather(out, lse, all_gather),
            "scaled_sum": lambda: merge_by_scaled_sum(out, lse, all_gather, all_reduce_sum),
            "scaled_sum_after_o_proj": lambda: (all_gather(lse), all_reduce_sum(hidden)),
        }
        for form in FORMS:
            times = []
            for i in range(args.warmup + args.iters):
                dist.barrier()
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                calls[form]()
                if cuda:
                    torch.cuda.synchronize()
                if i >= args.warmup:
                    times.append(time.perf_counter() - start)
            if form == "candidates":
                per_token = candidate_bytes_per_token_layer(shapes, args.world)
            else:
                per_token = merge_bytes_per_token_layer(shapes, args.world, form)
            rows.append((batch, form, statistics.median(times) * 1e6, per_token * batch))
    if rank == 0:
        with open(out_path, "w") as f:
            for batch, form, us, nbytes in rows:
                f.write(f"{batch}\t{form}\t{us:.1f}\t{nbytes:.0f}\n")
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        print(f"needs {args.world} GPUs, found {torch.cuda.device_count()}")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous, out_path = os.path.join(tmp, "rendezvous"), os.path.join(tmp, "rows.tsv")
        mp.spawn(_rank, args=(args, rendezvous, out_path), nprocs=args.world, join=True)
        with open(out_path) as f:
            rows = [line.rstrip("\n").split("\t") for line in f]
    layers = 78
    print(f"device={args.device} world={args.world} iters={args.iters} (median host time per layer call)")
    print(f"{'batch':>5} {'exchange':<26} {'us/layer':>9} {'KB/layer':>9} {'ms x78 layers':>13}")
    for batch, form, us, nbytes in rows:
        print(f"{batch:>5} {form:<26} {float(us):>9.1f} {float(nbytes) / 1e3:>9.1f} {float(us) * layers / 1e3:>13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
