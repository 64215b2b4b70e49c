#!/usr/bin/env python3
"""Stock sglang's decode step per GLM-5-width MoE layer, on one GPU: what per-owner decode adds to.

``bench_per_owner_decode.py`` times one decode layer's attention per owner and over a replicated
pool. Whether its extra cost matters depends on what a whole decoder layer costs, which that
benchmark does not run. This one runs sglang's own ``sglang.bench_one_batch`` (stock sglang, no
plugin flag, ``--tp 1``: under NSA prefill CP the attention runs at TP 1 on every rank anyway) on
the GLM-5-width model (``make_tiny_glm5_config.py --glm5-width``: GLM-5's real widths, dummy
weights) with ``L`` and ``L + 2`` layers (3 dense, then MoE), eagerly and with CUDA graphs. The
difference of the two decode latencies over 2 is one MoE layer's decode step, with the fixed
per-step work (embedding, head, sampling) cancelled out.

With ``--per-owner-json`` (the ``--json-out`` of ``bench_per_owner_decode.py``, same machine,
same batch sizes, fp8 KV) it also prints the estimated TPOT of shared KV with per-owner decode
against stock for GLM-5's 78 layers:

    on / off = 1 + (78 * (per owner - replicated) + owner tables) / (78 * layer + fixed)

where ``per owner - replicated`` is the extra attention work per layer as that benchmark measures
it (its exchange emulated: NCCL's latency for the three small collectives per layer is NOT in it),
``layer`` and ``fixed`` come from here. An estimate from one GPU, not a served TPOT.

Caveats, both in stock's favour here: at ``--tp 1`` one rank runs the whole MoE (at tp 8 a rank
runs 1/8 of each expert's matmuls, plus an all-reduce), and the weights are bf16 (GLM-5 ships
fp8), so this layer reads more bytes than a real rank's. bench_one_batch prefills the whole batch in
one forward (no chunking): with 32 x 4K tokens the indexer's logits ran out of memory on an H200
at ``--mem-fraction-static`` 0.8 and 0.6, hence batch 1 by default.

Status: on an H200 the 4-layer model's eager batch-1 run completed (median decode step 9.5-14.7 ms
in two processes, warm-up and timed pass); the whole sweep has not yet run end to end (device time ran out).

    source scripts/gpu/remote_env.sh && python benchmark/bench_stock_decode_layer.py   # H200, ~5 min
    python benchmark/bench_stock_decode_layer.py --dry-run                            # commands only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
GLM5_LAYERS = 78
MODES = ("eager", "graph")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="L: the smaller model (>= 4: 3 dense + MoE)")
    parser.add_argument("--batches", default="1", type=lambda s: [int(x) for x in s.split(",")],
                        help="bench_one_batch prefills the whole batch in one forward: 32 x 4K ran out of "
                        "memory on an H200; pair batch 32 with a shorter --context")
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--kv-dtype", choices=("fp8", "bf16"), default="fp8")
    parser.add_argument("--modes", default="eager,graph", type=lambda s: s.split(","))
    parser.add_argument("--work-dir", default=None, help="model dirs and results (default: a temp dir)")
    parser.add_argument("--per-owner-json", default=None, help="bench_per_owner_decode.py --json-out")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    if args.layers < 4:
        parser.error("--layers must be >= 4 (the GLM-5-width model has 3 dense layers first)")
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}")
    return args


def make_model(out_dir: Path, num_layers: int) -> list:
    return [sys.executable, str(REPO_ROOT / "scripts" / "make_tiny_glm5_config.py"), str(out_dir),
            "--glm5-width", "--num-layers", str(num_layers), "--weights", "bf16", "--no-check"]


def bench_command(args, model_dir: Path, mode: str, result_file: Path) -> list:
    command = [
        sys.executable, "-m", "sglang.bench_one_batch", "--model-path", str(model_dir),
        "--load-format", "dummy", "--tp-size", "1", "--batch-size", *map(str, args.batches),
        "--input-len", str(args.context), "--output-len", str(args.output_len),
        "--mem-fraction-static", "0.6", "--result-filename", str(result_file),
        "--disable-piecewise-cuda-graph",
    ]
    if args.kv_dtype == "fp8":
        command += ["--kv-cache-dtype", "fp8_e4m3"]
    if mode == "eager":
        command.append("--disable-cuda-graph")
    return command


def decode_latency_s(result_file: Path) -> dict:
    """batch size -> median decode latency (s) from bench_one_batch's jsonl results."""
    latencies = {}
    for line in result_file.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            latencies[int(row["batch_size"])] = float(row["median_decode_latency"])
    return latencies


def per_layer(small: dict, large: dict) -> dict:
    """batch -> one MoE layer's decode step (us), from the latencies (s) of L and L + 2 layers."""
    return {batch: (large[batch] - small[batch]) / 2 * 1e6 for batch in small}


def estimate_rows(stock: dict, per_owner: list, layers_small: int) -> list:
    """Rows of (mode, cp, batch, extra us per layer, stock TPOT at 78 layers ms, on / off)."""
    rows = []
    for mode in stock:
        for r in per_owner:
            batch = r["batch"]
            if batch not in stock[mode]["layer_us"]:
                continue
            layer_us = stock[mode]["layer_us"][batch]
            small_us = stock[mode]["latency_s"][layers_small][batch] * 1e6
            # fixed = TPOT(L) - L * layer (dense layers counted as MoE layers: an upper bound on them)
            fixed_us = max(0.0, small_us - layers_small * layer_us)
            stock78 = GLM5_LAYERS * layer_us + fixed_us
            key = "" if mode == "eager" else "_graph"
            extra = r[f"per_owner{key}_us"] - r[f"replicated{key}_us"]
            per_step = GLM5_LAYERS * extra + r[f"tables{key}_us"]  # the owner tables: once per step
            rows.append((mode, r["cp"], batch, r["context_k"], extra, stock78 / 1e3, 1 + per_step / stock78))
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="stock_decode_layer_"))
    work.mkdir(parents=True, exist_ok=True)
    # No DeepGEMM precompile: it compiles 16,384 GEMM shapes (over 10 minutes) before the first
    # forward; the shapes a run uses compile on first use instead, before the timed steps.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "SGLANG_JIT_DEEPGEMM_PRECOMPILE": "0"}
    stock = {}
    start = time.monotonic()
    for num_layers in (args.layers, args.layers + 2):
        model_dir = work / f"glm5-width-{num_layers}"
        command = make_model(model_dir, num_layers)
        print("$", " ".join(command), flush=True)
        if not args.dry_run:
            subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
        for mode in args.modes:
            result_file = work / f"result-{num_layers}-{mode}.jsonl"
            result_file.unlink(missing_ok=True)
            command = bench_command(args, model_dir, mode, result_file)
            print("$", " ".join(command), flush=True)
            if args.dry_run:
                continue
            log = work / f"bench-{num_layers}-{mode}.log"
            with open(log, "w") as out:
                done = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT)
            if done.returncode != 0:
                print(f"bench_one_batch failed (exit {done.returncode}); last lines of {log}:")
                print("\n".join(log.read_text().splitlines()[-30:]))
                return 1
            latencies = decode_latency_s(result_file)
            stock.setdefault(mode, {"latency_s": {}})["latency_s"][num_layers] = latencies
            print(f"layers={num_layers} {mode}: median decode latency "
                  + ", ".join(f"batch {b}: {s * 1e3:.2f} ms" for b, s in sorted(latencies.items())), flush=True)
    if args.dry_run:
        return 0
    for mode, entry in stock.items():
        entry["layer_us"] = per_layer(entry["latency_s"][args.layers], entry["latency_s"][args.layers + 2])
    print(f"\nstock sglang, one GLM-5-width MoE layer's decode step (--tp 1, bf16 weights, "
          f"{args.kv_dtype} KV, {args.context}-token context):")
    print("| mode | batch | per MoE layer | TPOT, L layers | TPOT, L + 2 layers |")
    print("|---|---|---|---|---|")
    for mode, entry in stock.items():
        for batch, layer_us in sorted(entry["layer_us"].items()):
            lat = entry["latency_s"]
            print(f"| {mode} | {batch} | {layer_us:.0f} us | {lat[args.layers][batch] * 1e3:.2f} ms "
                  f"| {lat[args.layers + 2][batch] * 1e3:.2f} ms |")
    if args.per_owner_json:
        per_owner = json.loads(Path(args.per_owner_json).read_text())
        print(f"\nestimated TPOT of GLM-5 ({GLM5_LAYERS} layers), shared KV with per-owner decode / stock "
              "(the exchange's NCCL latency not included):")
        print("| mode | cp | batch x context | extra attention per layer | stock TPOT (estimated) | on / off |")
        print("|---|---|---|---|---|---|")
        for mode, cp, batch, context_k, extra, stock_ms, ratio in estimate_rows(stock, per_owner, args.layers):
            print(f"| {mode} | {cp} | {batch} x {context_k}K | {extra:.0f} us | {stock_ms:.1f} ms | {ratio:.2f} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(stock, indent=1))
    print(f"done in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
