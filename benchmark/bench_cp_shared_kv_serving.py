#!/usr/bin/env python3
"""Serving benchmark: what turning shared KV on buys and costs, with the servers started here.

One ``sglang serve`` at a time, shared KV off then on, the same flags otherwise (NSA prefill CP
at ``--tp``, HiCache write-through, ``--chunked-prefill-size``, ``--max-total-tokens`` per rank).
Reported, off vs on:

* ``headline``: agents re-reading long shared documents in multi-turn conversations
  (``sglang_cp_shared_kv_testing/e2e/serving_workload.py``), with a working set sized from the reported pools:
  phase ``device`` larger than the stock device pool and within the shared-KV logical pool,
  phase ``host`` larger than both, within the shared-KV host pool. Cache hit rate (device, host;
  from each request's ``meta_info`` and, as a cross-check, from ``/metrics``), mean / p99 TTFT,
  output and request throughput; a progress line while it runs.
* ``single``: TTFT of one ``--chunk-tokens`` chunk on 0 / 32K / 128K cached tokens from device
  and from host; TPOT at 4K / 16K / 64K / 128K context, batch 1 and 32 (a row that does not fit a
  pool says so).
  With ``--stock-cuda-graphs`` a stock server with CUDA graphs joins them (the baseline users
  run); with ``--per-owner-decode`` two shared-KV servers whose decode runs per owner, eagerly and
  under CUDA graphs (``SGLANG_CP_SHARED_KV_DECODE=per_owner``, ``SGLANG_CP_SHARED_KV_DECODE_CUDA_GRAPH``
  0 or 1). With ``--servers eager`` (the default) both servers run without CUDA graphs and the
  ``on`` server gathers (``SGLANG_CP_SHARED_KV_DECODE=gather``); with ``--servers as-launched``
  stock keeps its CUDA graphs and the ``on`` server runs its own default decode.
* ``pd``: TTFT / TPOT of fresh prompts through a PD pair: the shared-KV prefill server with a
  stock decode server, against the stock pair with all-CP-ranks transfer on both.
* ``capacity``: each server with its pool sized by the memory budget alone (no ``--max-total-tokens``
  cap, no HiCache): logical capacity off vs on, judged against ``cp_size`` x the physical pool per
  rank and the physical pool against stock's less the scratch's share.

Writes ``results.json`` under ``--out-dir`` and a markdown page (``--doc-out``) with the tables,
the commit, the command and one plot (hit rate and TTFT over the run, off vs on; PNG with
matplotlib, else SVG). ``--dry-run`` runs everything against ``fake_sglang_server`` on loopback
instead of sglang (seconds, CPU only). ``--report-from A.json B.json`` writes the page from the
results of separate runs (e.g. ``--shared-kv off`` and ``--shared-kv on`` in two calls).

  python benchmark/bench_cp_shared_kv_serving.py --model-path /tmp/glm5-width --tp 2 --load-format dummy
  python benchmark/bench_cp_shared_kv_serving.py --model-path /tmp/m --dry-run --out-dir /tmp/b
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
SMOKE_PLUGIN_DIR = REPO_ROOT / "scripts" / "smoke_plugin"
sys.path.insert(0, str(SMOKE_PLUGIN_DIR))
from cp_shared_kv_smoke_hooks import SMOKE_LIFT_TP_RULE_ENV  # noqa: E402

from sglang_cp_shared_kv.settings import DECODE_PATH_ENV
from sglang_cp_shared_kv_testing.e2e.one_gpu import ONE_GPU_BUDGET_TOLERANCE, one_gpu_env, with_one_gpu_args
from sglang_cp_shared_kv_testing.e2e.pd_generate import generate_greedy_pd, latency_summary
from sglang_cp_shared_kv_testing.e2e.pd_pair import PDPairConfig
from sglang_cp_shared_kv_testing.e2e.serving_workload import (
    POOL_HEADROOM,
    RequestSample,
    phase_summary,
    progress_line,
    size_workloads,
)
from sglang_cp_shared_kv_testing.e2e.server_metrics import CACHED_TOKENS, parse_metrics
from sglang_cp_shared_kv_testing.e2e.server_process import (
    SERVER_DEFAULT_DECODE,
    ServeConfig,
    ServerError,
    SglangServer,
    default_decode_is_per_owner,
    free_port,
    generate_greedy,
)

PAGE_SIZE = 64  # sglang 0.5.11 forces it for DSA models on CUDA
PROMPT_TOKENS = "sglang:prompt_tokens_total"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
FAKE_SERVER = [sys.executable, "-m", "sglang_cp_shared_kv_testing.e2e.fake_sglang_server"]
MODES = {"off": False, "on": True}
PARTS = ("headline", "single", "ttft", "tpot", "pd", "capacity")  # single = ttft + tpot
SERVER_SETUPS = ("eager", "as-launched")
# --max-total-tokens of the capacity part: far above any budget, so the memory budget sizes the pool.
UNCAPPED_TOKENS = 1 << 30


def int_list(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="model dir (e.g. make_tiny_glm5_config.py --glm5-width)")
    p.add_argument("--tp", type=int, default=2, help="--tp of every server (= CP size)")
    p.add_argument("--shared-kv", choices=["off", "on", "both"], default="both")
    p.add_argument("--parts", default="headline,single", help=f"comma-separated, of {','.join(PARTS)}")
    p.add_argument("--physical-tokens-per-rank", type=int, default=163840,
                   help="--max-total-tokens: device pool rows per rank (multiple of 64), same on both servers")
    p.add_argument("--hicache-ratio", type=float, default=2.0, help="host pool / device pool (> 1)")
    p.add_argument("--chunk-tokens", type=int, default=8192, help="--chunked-prefill-size, and the TTFT chunk")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--load-format", default=None, help="'dummy' for a config-only model dir")
    p.add_argument("--stock-cuda-graphs", action="store_true",
                   help="also a stock server with CUDA graphs (single-request costs only): the baseline users run")
    p.add_argument("--per-owner-decode", action="store_true",
                   help="also shared-KV servers with decode per owner, eagerly and under CUDA graphs "
                        "(single-request costs only; SGLANG_CP_SHARED_KV_DECODE=per_owner, "
                        "SGLANG_CP_SHARED_KV_DECODE_CUDA_GRAPH 0 and 1)")
    p.add_argument("--servers", choices=SERVER_SETUPS, default="eager",
                   help="the off and on servers: eager (both --disable-cuda-graph, the on server's decode "
                        "gathering, named) or as-launched (stock with sglang's CUDA graphs; shared KV with no "
                        "decode setting, its default: per owner under CUDA graphs with bf16 KV, the gather "
                        "and --disable-cuda-graph where the default gathers, e.g. fp8 KV)")
    p.add_argument("--extra-server-args", default="", help="more sglang serve arguments (both servers)")
    p.add_argument("--capacity-decode", choices=["gather", "per_owner"], default="gather",
                   help="capacity part: the shared-KV server's decode path (per_owner: the gather scratch "
                        "sized for prefill only, SGLANG_CP_SHARED_KV_DECODE=per_owner)")
    p.add_argument("--one-gpu", action="store_true",
                   help="test-only: every rank of every server on device 0 (the smoke plugin's one-GPU hook, "
                        "testing/e2e/one_gpu.py); timings are then of a time-sliced GPU, not of shared KV")
    # headline
    p.add_argument("--document-tokens", type=int, default=16384)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3, help="times every document is re-read")
    p.add_argument("--concurrency", type=int, default=8, help="conversations in flight")
    p.add_argument("--max-new-tokens", type=int, default=32)
    # single
    p.add_argument("--cached-prefixes", type=int_list, default=int_list("0,32768,131072"))
    p.add_argument("--tpot-contexts", type=int_list, default=int_list("4096,16384,65536,131072"))
    p.add_argument("--tpot-batches", type=int_list, default=int_list("1,32"))
    p.add_argument("--tpot-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per single-request row (median)")
    # pd
    p.add_argument("--pd-model-path", default=None, help="model of the PD pair (default --model-path)")
    p.add_argument("--pd-prefill-gpus", default="0,1")
    p.add_argument("--pd-decode-gpus", default="0,1")
    p.add_argument("--pd-decode-tp", type=int, default=2)
    p.add_argument("--pd-prefill-mem-fraction-static", type=float, default=0.4)
    p.add_argument("--pd-decode-mem-fraction-static", type=float, default=0.85)
    p.add_argument("--pd-prompts", type=int, default=8)
    p.add_argument("--pd-prompt-tokens", type=int, default=8192)
    # run
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None, help="results.json and server logs (default ./bench_serving_<time>)")
    p.add_argument("--doc-out", default=None, help="markdown page to write (default <out-dir>/serving.md)")
    p.add_argument("--report-from", nargs="+", default=None, help="results.json files to merge into the page")
    p.add_argument("--dry-run", action="store_true", help="fake sglang servers on loopback (CPU): the whole flow")
    args = p.parse_args(argv)
    args.parts = [x for x in args.parts.split(",") if x]
    if any(x not in PARTS for x in args.parts):
        p.error(f"--parts: one of {PARTS}")
    if args.report_from is None and not args.model_path:
        p.error("--model-path is required")
    if args.physical_tokens_per_rank % PAGE_SIZE:
        p.error(f"--physical-tokens-per-rank must be a multiple of {PAGE_SIZE}")
    if args.hicache_ratio <= 1:
        p.error("--hicache-ratio must be > 1 (sglang requires the host pool to be larger than the device pool)")
    if args.servers == "as-launched" and (args.stock_cuda_graphs or args.per_owner_decode):
        p.error("--servers as-launched already runs stock with CUDA graphs and shared KV with its default decode: "
                "--stock-cuda-graphs and --per-owner-decode add the eager setup's extra servers")
    if args.one_gpu and "pd" in args.parts:
        p.error("--parts pd with --one-gpu: the PD pair on one GPU is scripts/gpu/pd_smoke_runs.sh with SMOKE_ONE_GPU=1")
    if args.one_gpu:
        args.extra_server_args = shlex.join(with_one_gpu_args(shlex.split(args.extra_server_args)))
    args.out_dir = Path(args.out_dir or f"bench_serving_{time.strftime('%Y%m%d_%H%M%S')}")
    args.doc_out = Path(args.doc_out or args.out_dir / "serving.md")
    return args


def modes_of(args) -> List[str]:
    return ["off", "on"] if args.shared_kv == "both" else [args.shared_kv]


def server_setup(args, shared_kv: bool) -> Dict[str, Any]:
    """run_server's cuda_graphs and decode_path for the off / on server of ``--servers``."""
    if args.servers == "eager":
        return {"cuda_graphs": False, "decode_path": "gather"}
    if not shared_kv:
        return {"cuda_graphs": True, "decode_path": "gather"}
    extra = shlex.split(args.extra_server_args)
    return {"cuda_graphs": default_decode_is_per_owner(extra), "decode_path": SERVER_DEFAULT_DECODE}


def logical_device_tokens(args, shared_kv: bool) -> int:
    return args.physical_tokens_per_rank * (args.tp if shared_kv else 1)


def launch_command(args, command: List[str]) -> List[str]:
    """``sglang serve ...`` as given, or the fake server with the same arguments (dry run)."""
    return FAKE_SERVER + command[2:] if args.dry_run else command


def server_env(args, shared_kv: bool) -> Dict[str, str]:
    """The stock server runs NSA prefill CP below --tp 8 through the smoke plugin's test-only lift
    of sglang's ``tp_size == 8`` rule (on its PYTHONPATH only); the shared-KV server needs no lift."""
    inherited = os.environ.get("PYTHONPATH")
    env = dict(OFFLINE_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(SMOKE_PLUGIN_DIR)] + ([inherited] if inherited else []))
    if not shared_kv and args.tp != 8:
        env[SMOKE_LIFT_TP_RULE_ENV] = "1"
    if getattr(args, "one_gpu", False):
        env.update(one_gpu_env())
    return env


def serve_config(args, shared_kv: bool, port: int, cuda_graphs: bool = False, decode_path: str = "gather") -> ServeConfig:
    return ServeConfig(
        model_path=args.model_path,
        tp_size=args.tp,
        shared_kv=shared_kv,
        port=port,
        physical_tokens_per_rank=args.physical_tokens_per_rank,
        hicache_ratio=args.hicache_ratio,
        mem_fraction_static=args.mem_fraction_static,
        load_format=args.load_format,
        extra_args=["--chunked-prefill-size", str(args.chunk_tokens), "--hicache-write-policy", "write_through"]
        + shlex.split(args.extra_server_args),
        cuda_graphs=cuda_graphs,
        decode_path=decode_path,
    )


def workloads_of(args):
    stock = logical_device_tokens(args, False)
    shared = logical_device_tokens(args, True)
    return size_workloads(
        stock, shared, int(args.hicache_ratio * shared), PAGE_SIZE, args.document_tokens, args.turns,
        args.turn_tokens, args.rounds, args.max_new_tokens, args.seed,
    )  # fmt: skip


def check_reported_pool(info: Dict[str, Any], expected: int, label: str) -> int:
    reported = info.get("max_total_num_tokens")
    if reported != expected:
        raise ServerError(
            f"[{label}] /server_info max_total_num_tokens is {reported}, expected {expected}: the workload "
            f"sizes assume it (lower --physical-tokens-per-rank or raise --mem-fraction-static)"
        )
    return reported


def flush(server: SglangServer) -> None:
    """``/flush_cache`` until it succeeds (sglang refuses while requests run or writes settle)."""
    import requests

    for _ in range(60):
        if requests.post(server.base_url + "/flush_cache", timeout=30).status_code == 200:
            return
        time.sleep(1)
    raise ServerError("/flush_cache kept failing")


def metric_totals(server: SglangServer) -> Dict[str, float]:
    snap = parse_metrics(server.get_text("/metrics"))
    return {
        "device": snap.total(CACHED_TOKENS, cache_source="device"),
        "host": snap.total(CACHED_TOKENS, cache_source="host"),
        "prompt": snap.total(PROMPT_TOKENS),
    }


def run_headline_phase(args, server: SglangServer, label: str, workload) -> Dict[str, Any]:
    flush(server)
    before = metric_totals(server)
    conversations = workload.conversations()
    total = workload.num_requests()
    samples: List[RequestSample] = []
    lock = threading.Lock()
    start = time.perf_counter()
    every = max(1, total // 20)

    def converse(turns):
        for turn in turns:
            sent = time.perf_counter() - start
            result = generate_greedy(server.base_url, turn.input_ids, workload.max_new_tokens, args.request_timeout)
            with lock:
                samples.append(RequestSample.of(sent, len(turn.input_ids), result))
                if len(samples) % every == 0 or len(samples) == total:
                    print(progress_line(label, samples, total, time.perf_counter() - start), flush=True)

    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        list(pool.map(converse, conversations))
    wall = time.perf_counter() - start
    after = metric_totals(server)
    delta = {k: after[k] - before[k] for k in after}
    summary = phase_summary(samples, wall)
    summary["metrics_hit_rate"] = (delta["device"] + delta["host"]) / delta["prompt"] if delta["prompt"] else None
    summary["metrics_device_hit_rate"] = delta["device"] / delta["prompt"] if delta["prompt"] else None
    summary["metrics_host_hit_rate"] = delta["host"] / delta["prompt"] if delta["prompt"] else None
    summary["working_set_tokens"] = workload.working_set_tokens
    summary["documents"] = workload.num_documents
    summary["document_tokens"] = workload.document_tokens
    samples.sort(key=lambda s: s.start_s)
    return {"summary": summary, "samples": [s.to_json() for s in samples], "conditions": workload.conditions}


class Prompts:
    """Fresh, distinct prompts (nothing of one is a prefix of another's pages)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed * 31 + 17)

    def take(self, n: int) -> List[int]:
        return [self.rng.randrange(0, 256) for _ in range(n)]


def timed(server, ids, new_tokens, args) -> Dict[str, Any]:
    r = generate_greedy(server.base_url, ids, new_tokens, args.request_timeout)
    sample = RequestSample.of(0.0, len(ids), r)
    tpot = (r.e2e_s - r.ttft_s) / (len(r.output_ids) - 1) if r.ttft_s and len(r.output_ids) > 1 else None
    return {**sample.to_json(), "tpot_s": tpot}


def fill_device(server, prompts: Prompts, device_tokens: int, args) -> None:
    """Push everything cached before out of the device pool (written through to host) with fresh prompts."""
    piece = max(PAGE_SIZE, min(args.chunk_tokens * 4, device_tokens // 4) // PAGE_SIZE * PAGE_SIZE)
    for _ in range(-(-int(device_tokens * 1.05) // piece)):
        timed(server, prompts.take(piece), 1, args)


def run_ttft_rows(args, server, device_tokens: int, label: str) -> List[Dict[str, Any]]:
    """TTFT of one fresh ``--chunk-tokens`` chunk on a cached prefix. Each repeat caches its own
    prefix first; ``host``: then fresh prompts push it off the device (it stays on host, written
    through), so the timed request loads it back. The cached tokens the server reported for the
    timed requests are kept with the row: they show where the prefix really came from."""
    rows = []
    prompts = Prompts(args.seed + 1)
    for prefix in args.cached_prefixes:
        need = prefix + args.chunk_tokens + PAGE_SIZE
        for source in ("device", "host") if prefix else ("none",):
            row: Dict[str, Any] = {"cached_prefix": prefix, "source": source}
            if need > POOL_HEADROOM * device_tokens:
                row["skipped"] = f"needs {need} tokens, device pool {device_tokens}"
                rows.append(row)
                continue
            flush(server)
            runs = []
            for _ in range(args.repeats):
                cached = prompts.take(prefix)
                if prefix:
                    timed(server, cached, 1, args)
                if source == "host":
                    fill_device(server, prompts, device_tokens, args)
                runs.append(timed(server, cached + prompts.take(args.chunk_tokens), 1, args))
            ttfts = [r["ttft_s"] * 1e3 for r in runs if r["ttft_s"] is not None and r["error"] is None]
            row.update({
                "ttft_ms": statistics.median(ttfts) if ttfts else None,
                "cached_device_tokens": statistics.median(r["cached_device_tokens"] for r in runs),
                "cached_host_tokens": statistics.median(r["cached_host_tokens"] for r in runs),
                "errors": sum(r["error"] is not None for r in runs),
            })  # fmt: skip
            print(f"[{label}] TTFT, {args.chunk_tokens} new on {prefix} cached ({source}): {_fmt(row['ttft_ms'])} ms "
                  f"(cached device/host {row['cached_device_tokens']}/{row['cached_host_tokens']})", flush=True)  # fmt: skip
            rows.append(row)
    return rows


def run_tpot_rows(args, server, device_tokens: int, label: str) -> List[Dict[str, Any]]:
    """Each batch is prefilled first (one token each), then sent again: its prefix is cached, so the
    timed requests start decoding together and TPOT is decode at that context."""
    rows = []
    prompts = Prompts(args.seed + 2)
    for context in args.tpot_contexts:
        for batch in args.tpot_batches:
            row = {"context": context, "batch": batch}
            need = batch * (context + args.tpot_new_tokens + PAGE_SIZE)
            if need > POOL_HEADROOM * device_tokens:
                row["skipped"] = f"needs {need} tokens, device pool {device_tokens}"
                rows.append(row)
                continue
            flush(server)
            batch_prompts = [prompts.take(context) for _ in range(batch)]
            with ThreadPoolExecutor(max_workers=batch) as pool:
                list(pool.map(lambda ids: timed(server, ids, 1, args), batch_prompts))
                runs = list(pool.map(lambda ids: timed(server, ids, args.tpot_new_tokens, args), batch_prompts))
            tpots = [r["tpot_s"] * 1e3 for r in runs if r["tpot_s"] is not None and r["error"] is None]
            row.update({"tpot_ms": statistics.median(tpots) if tpots else None,
                        "errors": sum(r["error"] is not None for r in runs)})  # fmt: skip
            print(f"[{label}] TPOT at {context} context, batch {batch}: {row['tpot_ms']} ms", flush=True)
            rows.append(row)
    return rows


def run_server(args, mode: str, shared_kv: bool, parts: List[str], workloads, cuda_graphs=False,
               decode_path: str = "gather") -> Dict[str, Any]:
    label = mode + {"gather": "", SERVER_DEFAULT_DECODE: "-default"}.get(decode_path, "-per-owner")
    label += "-graphs" if cuda_graphs else ""
    config = serve_config(args, shared_kv, free_port(), cuda_graphs, decode_path)
    command = launch_command(args, config.command())
    result: Dict[str, Any] = {"mode": label, "command": config.command(), "env": config.env(), "failures": []}
    server = SglangServer(command, config.port, args.out_dir / f"server_{label}.log",
                          {**os.environ, **server_env(args, shared_kv), **config.env()})  # fmt: skip
    print(f"[{label}] starting: {shlex.join(command)}", flush=True)
    with server:
        try:
            server.wait_ready(args.startup_timeout)
            info = server.get_json("/server_info")
            device = check_reported_pool(info, logical_device_tokens(args, shared_kv), label)
            result["max_total_num_tokens"] = device
            print(f"[{label}] max_total_num_tokens {device} (logical tokens of the CP group)", flush=True)
            if "headline" in parts:
                result["headline"] = {}
                for w in workloads:
                    print(f"[{label}] {w.conditions[0]}", flush=True)
                    result["headline"][w.name] = run_headline_phase(args, server, f"{label}/{w.name}", w)
            if "single" in parts or "ttft" in parts:
                result["ttft"] = run_ttft_rows(args, server, device, label)
            if "single" in parts or "tpot" in parts:
                result["tpot"] = run_tpot_rows(args, server, device, label)
        except (ServerError, OSError, ValueError) as e:
            result["failures"].append(f"{type(e).__name__}: {e}")
            print(f"[{label}] FAIL {e}", flush=True)
    return result


def run_capacity(args) -> Dict[str, Any]:
    """Both servers sized by memory alone; the figures and the verdict of the documented formula."""
    from sglang_cp_shared_kv_testing.e2e.glm5_width import kv_bytes_per_token_per_layer, kv_row_bytes
    from sglang_cp_shared_kv_testing.e2e.server_log import parse_capacity_lines
    from sglang_cp_shared_kv_testing.e2e.smoke_report import (
        capacity_failures,
        capacity_figures,
        scratch_share_failures,
    )

    out: Dict[str, Any] = {"failures": []}
    for mode in ("off", "on"):
        config = ServeConfig(
            model_path=args.model_path, tp_size=args.tp, shared_kv=MODES[mode], port=free_port(),
            physical_tokens_per_rank=UNCAPPED_TOKENS, hicache_ratio=None,
            mem_fraction_static=args.mem_fraction_static, load_format=args.load_format,
            extra_args=shlex.split(args.extra_server_args),
            decode_path=args.capacity_decode if MODES[mode] else "gather",
        )  # fmt: skip
        label = f"capacity-{mode}"
        server = SglangServer(launch_command(args, config.command()), config.port, args.out_dir / f"server_{label}.log",
                              {**os.environ, **server_env(args, MODES[mode]), **config.env()})  # fmt: skip
        info: Dict[str, Any] = {}
        with server:
            try:
                server.wait_ready(args.startup_timeout)
                info = server.get_json("/server_info")
            except (ServerError, OSError, ValueError) as e:
                out["failures"].append(f"{label}: {type(e).__name__}: {e}")
        figures = capacity_figures(info, parse_capacity_lines(server.log_lines_before_stop()), {})
        out[mode] = {"command": config.command(), "env": config.env(), **figures}
        out["failures"] += [f"{label}: {f}" for f in capacity_failures(MODES[mode], args.tp, figures)]
        print(f"[{label}] logical {figures.get('logical_device_tokens_per_cp_group')}, physical per rank "
              f"{figures.get('physical_device_tokens_per_rank')}", flush=True)  # fmt: skip
    model_config = Path(args.model_path) / "config.json"
    if "logical_device_tokens_per_cp_group" in out["off"] and model_config.is_file():
        layers = json.loads(model_config.read_text())["num_hidden_layers"]
        extra = shlex.split(args.extra_server_args)
        dtype = "fp8" if "--kv-cache-dtype" in extra and extra[extra.index("--kv-cache-dtype") + 1].startswith("fp8") else "bf16"
        stock_pool = (out["off"].get("physical_device_tokens_per_rank") or [0])[0]
        tolerance = math.ceil(ONE_GPU_BUDGET_TOLERANCE * stock_pool) if args.one_gpu else 0
        out["failures"] += scratch_share_failures(
            out["on"], out["off"], None, args.tp, layers * kv_bytes_per_token_per_layer(dtype),
            kv_row_bytes(dtype), PAGE_SIZE, budget_tolerance_tokens=tolerance,
        )  # fmt: skip
    print("capacity: " + ("; ".join(out["failures"]) or "logical = cp x physical, physical = stock's less the scratch's share"),
          flush=True)  # fmt: skip
    return out


def run_pd(args) -> Dict[str, Any]:
    """Fresh prompts through each pair, one at a time after one warm-up; TTFT / TPOT at the client."""
    out: Dict[str, Any] = {}
    model = args.pd_model_path or args.model_path
    decode_tokens = (2 * (args.pd_prompt_tokens + args.tpot_new_tokens) // PAGE_SIZE + 2) * PAGE_SIZE
    for mode in modes_of(args):
        shared_kv = MODES[mode]
        ports = {}
        for name in ("prefill", "decode", "bootstrap"):
            port = free_port()
            while port in ports.values():
                port = free_port()
            ports[name] = port
        config = PDPairConfig(
            model_path=model, shared_kv=shared_kv, prefill_tp=args.tp, decode_tp=args.pd_decode_tp,
            prefill_port=ports["prefill"], decode_port=ports["decode"], bootstrap_port=ports["bootstrap"],
            prefill_gpus=args.pd_prefill_gpus, decode_gpu=args.pd_decode_gpus,
            physical_tokens_per_rank=args.physical_tokens_per_rank, decode_max_total_tokens=decode_tokens,
            hicache_ratio=args.hicache_ratio, prefill_mem_fraction_static=args.pd_prefill_mem_fraction_static,
            decode_mem_fraction_static=args.pd_decode_mem_fraction_static, load_format=args.load_format,
            prefill_extra_args=["--chunked-prefill-size", str(args.chunk_tokens)] + shlex.split(args.extra_server_args),
            decode_extra_args=["--cuda-graph-max-bs", "8"] + shlex.split(args.extra_server_args),
            common_env=server_env(args, True), prefill_only_env=server_env(args, shared_kv),
            all_cp_ranks_transfer=True,
        )  # fmt: skip
        label = f"pd-{mode}"
        result: Dict[str, Any] = {"prefill_command": config.prefill_command(),
                                  "decode_command": config.decode_command(), "failures": []}  # fmt: skip
        prefill = SglangServer(launch_command(args, config.prefill_command()), config.prefill_port,
                               args.out_dir / f"prefill_{label}.log", {**os.environ, **config.prefill_env()})  # fmt: skip
        decode = SglangServer(launch_command(args, config.decode_command()), config.decode_port,
                              args.out_dir / f"decode_{label}.log", {**os.environ, **config.decode_env()})  # fmt: skip
        print(f"[{label}] prefill: {shlex.join(config.prefill_command())}\n[{label}] decode: "
              f"{shlex.join(config.decode_command())}", flush=True)  # fmt: skip
        prompts = Prompts(args.seed + 3)
        rng = random.Random(args.seed)
        with prefill:
            try:
                prefill.wait_ready(args.startup_timeout)
                with decode:
                    decode.wait_ready(args.startup_timeout)
                    ttfts, tpots, errors = [], [], []
                    for k in range(args.pd_prompts + 1):
                        r = generate_greedy_pd(config.prefill_url, config.decode_url, config.bootstrap_port,
                                               prompts.take(args.pd_prompt_tokens), args.tpot_new_tokens,
                                               args.request_timeout, rng)  # fmt: skip
                        if r.error:
                            errors.append(r.error)
                        elif k:  # the first is the warm-up
                            ttfts.append(r.ttft_s)
                            tpots.append(r.tpot_s)
                    result.update(latency_summary(ttfts, tpots))
                    result["errors"] = errors
                    print(f"[{label}] TTFT median {result['ttft_median_ms']} ms, TPOT median "
                          f"{result['tpot_median_ms']} ms, {len(errors)} errors", flush=True)  # fmt: skip
            except (ServerError, OSError, ValueError) as e:
                result["failures"].append(f"{type(e).__name__}: {e}")
                print(f"[{label}] FAIL {e}", flush=True)
        out[mode] = result
    return out


def git_commit() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
        return rev + ("+uncommitted" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ---------------------------------------------------------------------------------------------- report


def _fmt(value, spec=".1f", none="-") -> str:
    return none if value is None else format(value, spec)


def _ratio(on, off) -> str:
    return "-" if on is None or off in (None, 0) else f"{on / off:.2f}"


def merge_results(results: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One result from runs of separate parts or modes: each server's parts side by side."""
    merged: Dict[str, Any] = {"servers": {}, "pd": {}, "runs": []}
    for r in results:
        if r.get("capacity"):
            merged["capacity"] = r["capacity"]
        for mode, data in r.get("servers", {}).items():
            server = merged["servers"].setdefault(mode, {"failures": []})
            server.update({k: v for k, v in data.items() if k != "failures"})
            server["failures"] += data.get("failures", [])
        merged["pd"].update(r.get("pd", {}))
        merged["runs"].append({"commit": r.get("commit"), "command": r.get("command"), "dry_run": r.get("dry_run")})
        merged.setdefault("setup", r.get("setup"))
    return merged


# Servers of the single-request tables, in column order, and the TPOT ratios shown where both ran:
# shared KV against stock eagerly, against stock with graphs (what users run), and per-owner decode
# eagerly and under graphs against the same baselines.
SERVER_LABELS = ("off", "off-graphs", "on", "on-per-owner", "on-per-owner-graphs")
TPOT_RATIOS = (("on", "off"), ("on", "off-graphs"), ("on-per-owner", "off"),
               ("on-per-owner-graphs", "off-graphs"), ("on-per-owner-graphs", "on"))


def server_description(server: Dict[str, Any]) -> str:
    """How a server ran, from its command and environment: CUDA graphs, and shared KV's decode path."""
    command, env = server.get("command") or [], server.get("env") or {}
    graphs = "CUDA graphs" if "--disable-cuda-graph" not in command else "eager"
    if "--enable-nsa-prefill-cp-shared-kv" not in command:
        return f"stock, {graphs}"
    return f"shared KV, decode {env.get(DECODE_PATH_ENV, 'as the server defaults')}, {graphs}"


def markdown(results: Dict[str, Any], plot_name: Optional[str]) -> str:
    servers, pd = results["servers"], results["pd"]
    off, on = servers.get("off", {}), servers.get("on", {})
    lines = ["# Serving benchmark: shared KV off vs on", ""]
    for run in results["runs"]:
        lines.append(f"- commit `{run['commit']}`{' (DRY RUN: fake servers, numbers are not sglang)' if run['dry_run'] else ''}: "
                     f"`{run['command']}`")  # fmt: skip
    setup = results.get("setup") or {}
    lines += ["", f"Model `{setup.get('model_path')}`, `--tp {setup.get('tp')}`."]
    if servers:
        lines[-1] += (f" `--max-total-tokens {setup.get('physical_tokens_per_rank')}` per rank, HiCache ratio "
                      f"{setup.get('hicache_ratio')}. Reported logical device pool (max_total_num_tokens): off "
                      f"{off.get('max_total_num_tokens')}, on {on.get('max_total_num_tokens')}.")  # fmt: skip
        described = [f"{m}: {server_description(servers[m])}" for m in ("off", "on") if m in servers]
        lines[-1] += " Servers: " + "; ".join(described) + "."
    lines.append("")
    phases = sorted(set(off.get("headline", {})) | set(on.get("headline", {})), key=lambda p: p != "device")
    if phases:
        lines += ["## Headline: agents re-reading shared documents", ""]
        for phase in phases:
            for c in (on.get("headline", {}).get(phase) or off.get("headline", {}).get(phase) or {}).get("conditions", []):
                lines.append(f"- {c}")
        lines += ["", "| phase | metric | off | on | on / off |", "|---|---|---|---|---|"]
        metrics = (("hit_rate", "hit rate", ".3f"), ("device_hit_rate", "device hit rate", ".3f"),
                   ("host_hit_rate", "host hit rate", ".3f"), ("metrics_hit_rate", "hit rate (/metrics)", ".3f"),
                   ("mean_ttft_ms", "mean TTFT (ms)", ".1f"), ("p99_ttft_ms", "p99 TTFT (ms)", ".1f"),
                   ("output_tokens_per_s", "output tokens/s", ".1f"), ("requests_per_s", "requests/s", ".2f"),
                   ("requests", "requests", "d"), ("errors", "errors", "d"))  # fmt: skip
        for phase in phases:
            a = off.get("headline", {}).get(phase, {}).get("summary", {})
            b = on.get("headline", {}).get(phase, {}).get("summary", {})
            for key, name, spec in metrics:
                lines.append(f"| {phase} | {name} | {_fmt(a.get(key), spec)} | {_fmt(b.get(key), spec)} | "
                             f"{_ratio(b.get(key), a.get(key)) if key not in ('requests', 'errors') else ''} |")  # fmt: skip
        if plot_name:
            lines += ["", f"![hit rate and TTFT over the run]({plot_name})"]
        lines.append("")
    labels = [m for m in SERVER_LABELS if servers.get(m, {}).get("ttft") is not None]
    tpot_labels = [m for m in SERVER_LABELS if servers.get(m, {}).get("tpot") is not None]
    if labels or tpot_labels:
        lines += ["## Single-request costs", ""]
    if labels:
        lines += ["| TTFT: new tokens on cached prefix | source | "
                  + " | ".join(labels) + " | on / off |", "|---|---|" + "---|" * (len(labels) + 1)]  # fmt: skip
        keys = [(r["cached_prefix"], r["source"]) for r in servers[labels[0]]["ttft"]]
        for prefix, source in keys:
            cells, values = [], {}
            for m in labels:
                row = next((r for r in servers[m]["ttft"] if (r["cached_prefix"], r["source"]) == (prefix, source)), {})
                values[m] = row.get("ttft_ms")
                cells.append(row.get("skipped") and f"not run: {row['skipped']}" or
                             f"{_fmt(row.get('ttft_ms'))} ms ({row.get('cached_device_tokens')}/{row.get('cached_host_tokens')})")  # fmt: skip
            lines.append(f"| {prefix} | {source} | " + " | ".join(cells) + f" | {_ratio(values.get('on'), values.get('off'))} |")
        lines += ["", "(cached device/host tokens of the timed requests in parentheses)", ""]
    if tpot_labels:
        ratios = [(a, b) for a, b in TPOT_RATIOS if a in tpot_labels and b in tpot_labels]
        lines += ["| TPOT: context | batch | " + " | ".join(tpot_labels) + " | "
                  + " | ".join(f"{a} / {b}" for a, b in ratios) + (" |" if ratios else ""),
                  "|---|---|" + "---|" * (len(tpot_labels) + len(ratios))]  # fmt: skip
        for row0 in servers[tpot_labels[0]]["tpot"]:
            cells, values = [], {}
            for m in tpot_labels:
                row = next((r for r in servers[m].get("tpot", []) if (r["context"], r["batch"]) == (row0["context"], row0["batch"])), {})
                values[m] = row.get("tpot_ms")
                cells.append(row.get("skipped") and f"not run: {row['skipped']}" or f"{_fmt(row.get('tpot_ms'), '.2f')} ms")
            lines.append(f"| {row0['context']} | {row0['batch']} | " + " | ".join(cells) + " |"
                         + "".join(f" {_ratio(values.get(a), values.get(b))} |" for a, b in ratios))  # fmt: skip
        lines.append("")
    if pd:
        lines += ["## PD pair (fresh prompts)", "", "| pair | TTFT median (ms) | TPOT median (ms) | errors |", "|---|---|---|---|"]
        for mode in ("off", "on"):
            if mode in pd:
                r = pd[mode]
                name = "shared-KV prefill + stock decode" if mode == "on" else "stock prefill + stock decode (all-CP-ranks transfer)"
                lines.append(f"| {name} | {_fmt(r.get('ttft_median_ms'))} | {_fmt(r.get('tpot_median_ms'), '.2f')} | "
                             f"{len(r.get('errors', [])) + len(r.get('failures', []))} |")  # fmt: skip
        if "on" in pd and "off" in pd:
            lines.append(f"\nTTFT on / off {_ratio(pd['on'].get('ttft_median_ms'), pd['off'].get('ttft_median_ms'))}, "
                         f"TPOT on / off {_ratio(pd['on'].get('tpot_median_ms'), pd['off'].get('tpot_median_ms'))}.")  # fmt: skip
        lines.append("")
    capacity = results.get("capacity")
    if capacity and "off" in capacity and "on" in capacity:
        off_c, on_c = capacity["off"], capacity["on"]
        lines += ["## Logical capacity (pools sized by memory alone)", "",
                  "| | shared KV off | shared KV on | on / off |", "|---|---|---|---|"]  # fmt: skip
        for key, name in (("logical_device_tokens_per_cp_group", "logical tokens per CP group"),
                          ("physical_device_tokens_per_rank", "physical tokens per rank"),
                          ("logical_over_physical", "logical / physical")):  # fmt: skip
            a, b = off_c.get(key), on_c.get(key)
            first = lambda v: (v[0] if v else None) if isinstance(v, list) else v  # noqa: E731
            ratio = _ratio(first(b), first(a))
            lines.append(f"| {name} | {a} | {b} | {ratio} |")
        lines += ["", "Judged: logical = cp_size x physical; physical = stock's less the scratch's share "
                  f"(to one page; on one GPU within {ONE_GPU_BUDGET_TOLERANCE:.1%} of stock's pool, the budgets' "
                  "measurement race): "
                  + ("; ".join(capacity.get("failures", [])) or "both hold") + ".", ""]  # fmt: skip
    failures = [f"{m}: {f}" for m, s in servers.items() for f in s.get("failures", [])]
    failures += [f"capacity: {f}" for f in (capacity or {}).get("failures", [])]
    failures += [f"pd-{m}: {f}" for m, s in pd.items() for f in s.get("failures", [])]
    if failures:
        lines += ["## Failures", ""] + [f"- {f}" for f in failures] + [""]
    return "\n".join(lines)


def plot_series(results: Dict[str, Any], window: int = 10) -> Dict[str, Dict[str, List[tuple]]]:
    """Per mode: (time s, rolling hit rate over the last ``window`` requests) and (time s, TTFT ms),
    the phases one after another on one time axis."""
    series: Dict[str, Dict[str, List[tuple]]] = {}
    for mode in ("off", "on"):
        headline = results["servers"].get(mode, {}).get("headline", {})
        offset, hits, ttfts, recent = 0.0, [], [], []
        for phase in sorted(headline, key=lambda p: p != "device"):
            phase_samples = headline[phase]["samples"]
            for s in phase_samples:
                t = offset + s["start_s"] + (s["ttft_s"] or 0)
                recent = (recent + [(s["cached_tokens"], s["prompt_tokens"])])[-window:]
                hits.append((t, sum(c for c, _ in recent) / max(1, sum(p for _, p in recent))))
                if s["ttft_s"] is not None:
                    ttfts.append((t, s["ttft_s"] * 1e3))
            offset += headline[phase]["summary"]["wall_s"]
        if hits:
            series[mode] = {"hit_rate": hits, "ttft_ms": ttfts}
    return series


def write_plot(series, path_stem: Path) -> Optional[Path]:
    if not series:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return write_svg_plot(series, path_stem.with_suffix(".svg"))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for mode, s in series.items():
        ax1.plot(*zip(*s["hit_rate"]), label=f"shared KV {mode}")
        ax2.plot(*zip(*s["ttft_ms"]), ".", markersize=3, label=f"shared KV {mode}")
    ax1.set_ylabel("hit rate (last 10 requests)")
    ax2.set_ylabel("TTFT (ms)")
    ax2.set_xlabel("time (s, phases one after another)")
    ax1.legend()
    path = path_stem.with_suffix(".png")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


SVG_COLORS = {"off": "#d62728", "on": "#1f77b4"}


def write_svg_plot(series, path: Path, width: int = 800, height: int = 240) -> Path:
    """Two panels (hit rate, TTFT) as polylines; no dependencies."""
    t_max = max(t for s in series.values() for key in s for t, _ in s[key]) or 1.0
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{2 * height + 40}">']
    for panel, (key, name) in enumerate((("hit_rate", "hit rate (last 10 requests)"), ("ttft_ms", "TTFT (ms)"))):
        y0 = panel * (height + 20) + 10
        v_max = max((v for s in series.values() for _, v in s[key]), default=1.0) or 1.0
        parts.append(f'<rect x="50" y="{y0}" width="{width - 60}" height="{height - 30}" fill="none" stroke="#888"/>')
        parts.append(f'<text x="55" y="{y0 + 14}" font-size="12">{name}, max {v_max:.3g}; x: time, max {t_max:.1f} s</text>')
        for mode, s in series.items():
            pts = " ".join(f"{50 + (width - 60) * t / t_max:.1f},{y0 + (height - 30) * (1 - v / v_max):.1f}" for t, v in s[key])
            parts.append(f'<polyline fill="none" stroke="{SVG_COLORS.get(mode, "#000")}" points="{pts}"/>')
            parts.append(f'<text x="{width - 150}" y="{y0 + 14 + 14 * (mode == "on")}" font-size="12" '
                         f'fill="{SVG_COLORS.get(mode, "#000")}">shared KV {mode}</text>')  # fmt: skip
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")
    return path


def write_report(results: Dict[str, Any], doc_out: Path) -> Path:
    doc_out.parent.mkdir(parents=True, exist_ok=True)
    plot = write_plot(plot_series(results), doc_out.with_name(doc_out.stem + "-plot"))
    doc_out.write_text(markdown(results, plot.name if plot else None))
    return doc_out


def _raise_on_sigterm(signum, frame):
    raise SystemExit(f"terminated by signal {signum}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    command = "python benchmark/bench_cp_shared_kv_serving.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.report_from:
        results = merge_results([json.loads(Path(p).read_text()) for p in args.report_from])
        print(f"wrote {write_report(results, args.doc_out)}")
        return 0
    try:
        workloads = workloads_of(args) if "headline" in args.parts else []
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for w in workloads:
        print(w.conditions[0], flush=True)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results: Dict[str, Any] = {
        "commit": git_commit(), "command": command, "dry_run": args.dry_run, "servers": {}, "pd": {},
        "setup": {"model_path": args.model_path, "tp": args.tp, "physical_tokens_per_rank": args.physical_tokens_per_rank,
                  "hicache_ratio": args.hicache_ratio, "chunk_tokens": args.chunk_tokens},
    }  # fmt: skip
    server_parts = [p for p in args.parts if p not in ("pd", "capacity")]
    if server_parts:
        for mode in modes_of(args):
            results["servers"][mode] = run_server(args, mode, MODES[mode], server_parts, workloads,
                                                  **server_setup(args, MODES[mode]))
        single = [p for p in server_parts if p in ("single", "ttft", "tpot")]
        if args.stock_cuda_graphs and single:
            results["servers"]["off-graphs"] = run_server(args, "off", False, single, [], cuda_graphs=True)
        if args.per_owner_decode and single:
            for graphs in (False, True):
                server = run_server(args, "on", True, single, [], cuda_graphs=graphs, decode_path="per_owner")
                results["servers"][server["mode"]] = server
    if "pd" in args.parts:
        results["pd"] = run_pd(args)
    if "capacity" in args.parts:
        results["capacity"] = run_capacity(args)
    (args.out_dir / "results.json").write_text(json.dumps(results, indent=1))
    doc = write_report(merge_results([results]), args.doc_out)
    failures = [f for s in list(results["servers"].values()) + list(results["pd"].values()) for f in s["failures"]]
    failures += results.get("capacity", {}).get("failures", [])
    print(f"\n{doc.read_text()}\n{'FAILED' if failures else 'DONE'}; results {args.out_dir / 'results.json'}, page {doc}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
