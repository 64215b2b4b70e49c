"""Latency of per-owner decode's per-layer exchanges, one GPU per rank over NCCL (GLM-5 shapes).

Per layer, per-owner decode all-gathers the top-k candidates' scores (``[B, 2048]`` float32) and
merges the partial attention outputs (``[B, 64, 512]`` bf16 + ``[B, 64]`` LSE) in one of two forms
(``attention_lse_merge``): one all-gather of every rank's partial packed with its LSE
(``merge_by_all_gather``, one collective) or the scaled sum (``merge_by_scaled_sum``: an LSE
all-gather and a bf16 sum all-reduce, two collectives). This times, per batch size, each exchange as
per-owner decode runs it, the scaled sum moved after ``o_proj`` (the LSE all-gather plus a bf16
all-reduce of ``[B, 6144]``; not served), next to the bytes ``decode_step_bytes`` counts and the form
the rule picks with the default setting (``choose_merge_exchange``). Host time per call with a
device sync (what an eager decode step waits for); median over ``--iters`` calls, rank 0 reported;
``x layers`` projects a 78-layer step. Under CUDA graphs the host launch cost goes, NCCL's latency
stays.

The summary line gives the largest batch at which the one exchange was measured faster than the
scaled sum and the extra bytes per layer it received there: the measured counterpart of the
modeled default of ``SGLANG_CP_SHARED_KV_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES``.

    python3 benchmark/bench_per_owner_decode_exchange.py --world 2              # 2 GPUs, NCCL
    python3 benchmark/bench_per_owner_decode_exchange.py --world 4 --batches 1,8,32,128
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
COLLECTIVES = {"candidates": 1, "all_gather": 1, "scaled_sum": 2, "scaled_sum_after_o_proj": 2}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    return parser.parse_args(argv)


def _rank(rank, args, rendezvous, out_path):
    from sglang_cp_shared_kv.model_executor.per_owner_decode.attention_lse_merge import (
        merge_by_all_gather,
        merge_by_scaled_sum,
        process_group_collectives,
    )
    from sglang_cp_shared_kv_testing.decode_step_bytes import (
        GLM5_FP8,
        candidate_bytes_per_token_layer,
        merge_bytes_per_token_layer,
    )

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


def crossover(rows, world: int) -> str:
    """The largest batch at which the one exchange was faster than the scaled sum (and the extra
    bytes it received there), against the largest the rule's default allows."""
    from sglang_cp_shared_kv_testing.decode_step_bytes import GLM5_FP8, served_merge_form

    times = {(batch, form): (us, nbytes) for batch, form, us, nbytes in rows}
    batches = sorted({batch for batch, _, _, _ in rows})
    faster = [b for b in batches if times[(b, "all_gather")][0] < times[(b, "scaled_sum")][0]]
    ruled = [b for b in batches if served_merge_form(GLM5_FP8, world, b) == "all_gather"]
    measured = "at no batch measured"
    if faster:
        largest = max(faster)
        extra = times[(largest, "all_gather")][1] - times[(largest, "scaled_sum")][1]
        measured = f"up to batch {largest} ({extra:,.0f} extra bytes per layer there)"
    allowed = f"batch {max(ruled)}" if ruled else "none"
    return (f"one exchange measured faster {measured}; of the batches measured, the default setting "
            f"(modeled) picks it up to {allowed}")


def main(argv=None) -> int:
    from sglang_cp_shared_kv_testing.decode_step_bytes import GLM5_FP8, served_merge_form

    args = parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        print(f"needs {args.world} GPUs, found {torch.cuda.device_count()}")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous, out_path = os.path.join(tmp, "rendezvous"), os.path.join(tmp, "rows.tsv")
        mp.spawn(_rank, args=(args, rendezvous, out_path), nprocs=args.world, join=True)
        with open(out_path) as f:
            rows = [(int(b), form, float(us), float(n)) for b, form, us, n in (line.rstrip("\n").split("\t") for line in f)]
    layers = 78
    print(f"device={args.device} world={args.world} iters={args.iters} (median host time per layer call)")
    print(f"{'batch':>5} {'exchange':<26} {'collectives':>11} {'us/layer':>9} {'KB/layer':>9} "
          f"{'ms x78 layers':>13} {'rule':>5}")
    for batch, form, us, nbytes in rows:
        picked = "*" if form == served_merge_form(GLM5_FP8, args.world, batch) else ""
        print(f"{batch:>5} {form:<26} {COLLECTIVES[form]:>11} {us:>9.1f} {nbytes / 1e3:>9.1f} "
              f"{us * layers / 1e3:>13.2f} {picked:>5}")
    print(crossover(rows, args.world))
    return 0


if __name__ == "__main__":
    sys.exit(main())
