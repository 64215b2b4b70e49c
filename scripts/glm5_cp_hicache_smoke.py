#!/usr/bin/env python3
"""End-to-end smoke: GLM-5 on ``sglang serve`` with NSA prefill CP, shared KV and HiCache host caching.

Launches ``sglang serve`` on 127.0.0.1 once per mode (shared KV off, on, or both), sends a planned
sequence of repeated-prefix greedy requests that forces host backup, device eviction and host
load-back (see ``sglang_cp_shared_kv_testing.e2e.request_plan``), and reports per request the
greedy tokens, the tokens served from device / host and the HiCache metric deltas; per run the
capacity figures, the TTFT of long prefixes served from host vs recomputed, and every error line
of the server log. Greedy outputs are reported, not judged (stock sglang's NSA kernels are not
run-to-run deterministic); with ``--audit`` the KV audits judge the bytes (docs/e2e-smoke.md). Exits 1
on any failure, 2 on bad arguments.

``--decode per-owner`` / ``per-owner-graphs`` runs the shared-KV server's decode per owner (eagerly,
or under CUDA graphs), ``--prefetch-slot-tokens auto`` turns its layer-ahead prefetch on, and
``--one-gpu`` puts every rank of every server on device 0 (test-only: ``sglang_cp_shared_kv_testing/e2e/one_gpu.py``).

``--mtp`` serves both servers with MTP (EAGLE with the model's NextN layer, 3 steps, top-k 1, 4 draft
tokens; the model needs a NextN layer: ``make_tiny_glm5_config.py --nextn``) and the shared-KV
server's MTP opt-in; the audits then cover the draft pool too (``smoke_plugin/.../draft_audit.py``
says what is judged) and the mean accept length on and off is reported, not judged.

  python scripts/glm5_cp_hicache_smoke.py --model-path /models/GLM-5 --dry-run
  python scripts/glm5_cp_hicache_smoke.py --model-path /tmp/tiny-glm5 --load-format dummy
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

SMOKE_PLUGIN_DIR = Path(__file__).resolve().parent / "smoke_plugin"
sys.path.insert(0, str(SMOKE_PLUGIN_DIR))
from cp_shared_kv_smoke_hooks import SMOKE_AUDIT_DIR_ENV, SMOKE_AUDIT_LAYERS_ENV, SMOKE_DUMMY_INIT_ENV  # noqa: E402
from cp_shared_kv_smoke_hooks import (  # noqa: E402
    SMOKE_LIFT_TP_RULE_ENV,
    SMOKE_PLANT_ENV,
)
from cp_shared_kv_smoke_hooks import decode_read_audit, kv_audit_compare, value_audit_compare  # noqa: E402
from cp_shared_kv_smoke_hooks.planted_bugs import PLANTS  # noqa: E402
from sglang_cp_shared_kv_testing.e2e.request_plan import (
    RequestPlan,
    build_plan,
    check_plan_fits_model,
    parse_token_id_range,
)
from sglang_cp_shared_kv_testing.e2e.server_log import parse_capacity_lines, scan_for_errors
from sglang_cp_shared_kv_testing.e2e.server_metrics import HiCacheCounters, parse_metrics
from sglang_cp_shared_kv_testing.e2e.server_process import (
    MAX_SGLANG_PORT,
    MTP_OPT_IN_ENV,
    SERVER_DEFAULT_DECODE,
    ServeConfig,
    ServerError,
    SglangServer,
    free_port,
    generate_greedy,
)
from sglang_cp_shared_kv_testing.e2e.smoke_report import (
    RequestRecord,
    RunReport,
    accept_length_summary,
    capacity_failures,
    capacity_figures,
    compare_runs,
    hicache_activity,
    hicache_failures,
    log_failures,
    request_failures,
    scratch_share_failures,
    ttft_summary,
)
from sglang_cp_shared_kv.settings import DECODE_PATH_ENV, GATHER, GRAPH_DECODE_ENV, PER_OWNER
from sglang_cp_shared_kv.settings import MERGE_ONE_EXCHANGE_ENV, PREFETCH_SLOT_TOKENS_ENV, parse_settings
from sglang_cp_shared_kv_testing.e2e import teacher_forced
from sglang_cp_shared_kv_testing.e2e.one_gpu import one_gpu_env, with_one_gpu_args
from sglang_cp_shared_kv_testing.e2e.tiny_glm5 import check_model_has_nextn

# sglang 0.5.11 forces page_size 64 for DSA models on CUDA (server_args.py).
NSA_CUDA_PAGE_SIZE = 64
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
SERVE_PLANTS = tuple(p for p in PLANTS if p != "pd-send-wrong-page")
DRAFT_PLANTS = ("draft-wrong-owner", "draft-stale-load-back")
# --decode: the shared-KV server's decode path (the stock server keeps its own, eager like it);
# server-default names no decode setting and keeps sglang's CUDA graphs, as a user's launch does.
DECODE_CHOICES = ("gather", "per-owner", "per-owner-graphs", SERVER_DEFAULT_DECODE)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True, help="GLM-5 checkpoint dir, or a tiny dir from make_tiny_glm5_config.py")
    p.add_argument("--tp", type=int, default=8,
                   help="tensor parallel size = CP size (2, 4 or 8 with shared KV); the shared-KV-off reference "
                   "runs stock NSA prefill CP at the same size, the smoke plugin lifting sglang's --tp 8 rule for it")
    p.add_argument("--shared-kv", choices=["on", "off", "both"], default="both",
                   help="run with --enable-nsa-prefill-cp-shared-kv, without, or both (off first) and compare")
    p.add_argument("--port", type=int, default=None, help="server port on 127.0.0.1 (default: a free one)")
    p.add_argument("--physical-tokens-per-rank", type=int, default=16384,
                   help="--max-total-tokens given to sglang: device pool rows per rank (multiple of 64)")
    p.add_argument("--hicache-ratio", type=float, default=2.0, help="host pool / device pool, per rank (> 1)")
    p.add_argument("--no-hicache", action="store_true", help="radix cache only (no --enable-hierarchical-cache)")
    p.add_argument("--mem-fraction-static", type=float, default=None, help="passed to sglang if set")
    p.add_argument("--load-format", default=None, help="passed to sglang; 'dummy' for the tiny config")
    p.add_argument("--dummy-init", choices=["unit-gain", "stock"], default="unit-gain",
                   help="with --load-format dummy: plugin's unit-gain init (KV matters) or sglang's U(+-1e-3)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-prefix-tokens", type=int, default=8192)
    p.add_argument("--token-id-range", default="0:256", help="LOW:HIGH, prompt token ids (byte tokens by default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=1800, help="seconds until /health answers")
    p.add_argument("--request-timeout", type=float, default=600, help="seconds per request")
    p.add_argument("--extra-server-args", default="", help="more sglang serve arguments, one shell-quoted string")
    p.add_argument("--ignore-log-pattern", action="append", default=[], help="regex of log lines not to treat as errors")
    p.add_argument("--out-dir", default=None, help="server logs and report.json (default ./glm5_smoke_<time>)")
    p.add_argument("--audit", action="store_true",
                   help="the audits (the oracle): pool dumps of every finished request, the value audit of the "
                        "audited layers' attention, teacher-forced scoring; the read audits under shared KV")
    p.add_argument("--teacher-forced-texts", type=int, default=4,
                   help="with --audit: texts each server scores twice (a served prefix + a fixed continuation, "
                        "input logprobs); the shared-KV run is judged against the stock run's pass-to-pass spread")
    p.add_argument("--audit-layers", type=int, default=0,
                   help="leading layers the audits cover on both servers (0: all, or the inherited "
                        f"{SMOKE_AUDIT_LAYERS_ENV}). Layer 0 judges the pool audit; every layer the read "
                        "audit covers all-gathers that layer's whole pool in every forward")
    p.add_argument("--reference-dir", default=None,
                   help="out dir of a reference run (shared KV off, --audit): compare this run's pool dumps with it")
    p.add_argument("--plant", default=None, choices=SERVE_PLANTS,
                   help="plant a bug in the shared-KV servers (to show the oracle catches it); the draft-* "
                        "plants need --mtp")
    p.add_argument("--mtp", action="store_true",
                   help="MTP on both servers (EAGLE, NextN layer, 3/1/4) with the shared-KV opt-in; the audits "
                        "cover the draft pool; the model needs a NextN layer (make_tiny_glm5_config.py --nextn)")
    p.add_argument("--decode", choices=DECODE_CHOICES, default="gather",
                   help=f"shared-KV server only, always named in its environment: decode through the page "
                        f"gather (default here; {DECODE_PATH_ENV}={GATHER}), per owner ({DECODE_PATH_ENV}={PER_OWNER}, "
                        f"{GRAPH_DECODE_ENV}=0), per owner under CUDA graphs ({GRAPH_DECODE_ENV}=1, "
                        f"no --disable-cuda-graph), or {SERVER_DEFAULT_DECODE}: neither set, no "
                        "--disable-cuda-graph, sglang's own capture list unless --extra-server-args names one "
                        "(the server's default path, as a user launches it)")
    p.add_argument("--stock-cuda-graphs", action="store_true",
                   help="stock server only: decode CUDA graphs (no --disable-cuda-graph) with sglang's own "
                        "capture list unless --extra-server-args names one; tells a stock padded-replay "
                        "failure from a shared-KV one")
    p.add_argument("--prefetch-slot-tokens", default=None,
                   help=f"shared-KV server only: {PREFETCH_SLOT_TOKENS_ENV} (e.g. auto: the layer-ahead prefetch on)")
    p.add_argument("--merge-one-exchange-max-extra-bytes", default=None, metavar="BYTES|off",
                   help=f"shared-KV server only: {MERGE_ONE_EXCHANGE_ENV} (per-owner decode's one-exchange merge, "
                        "opt-in); the value audit then requires checked rows merged by it, replayed ones too "
                        "under graphs, and without it none")
    p.add_argument("--server-env", action="append", default=[], type=env_assignment, metavar="KEY=VALUE",
                   help="one more environment variable of the shared-KV server (e.g. CUDA_LAUNCH_BLOCKING=1)")
    p.add_argument("--one-gpu", action="store_true",
                   help="test-only: every rank of every server on device 0 (the smoke plugin's one-GPU hook)")
    p.add_argument("--burst", type=int, default=0,
                   help="after the plan, N concurrent requests sharing a prefix, of different lengths")
    p.add_argument("--tpot-contexts", default="",
                   help="comma-separated context lengths: one fresh request each, TPOT over 64 new tokens")
    p.add_argument("--dry-run", action="store_true", help="print the commands and the request plan, launch nothing")
    args = p.parse_args(argv)
    args.tpot_contexts = [int(x) for x in args.tpot_contexts.split(",") if x.strip()]
    if args.port is not None and not 0 < args.port <= MAX_SGLANG_PORT:
        p.error(f"--port must be in 1..{MAX_SGLANG_PORT} (sglang also uses port + 10000)")
    if args.physical_tokens_per_rank % NSA_CUDA_PAGE_SIZE:
        p.error(f"--physical-tokens-per-rank must be a multiple of {NSA_CUDA_PAGE_SIZE}")
    if args.plant in DRAFT_PLANTS and not args.mtp:
        p.error(f"--plant {args.plant} needs --mtp (it plants a bug in the draft pool)")
    if args.decode == SERVER_DEFAULT_DECODE and args.mtp:
        p.error(f"--decode {args.decode} with --mtp: under MTP the server's default gathers, which needs "
                "--disable-cuda-graph (--decode gather)")
    if args.decode != "gather" and args.mtp:
        p.error(f"--decode {args.decode} with --mtp: the shared-KV server refuses MTP with per-owner decode")
    if args.audit_layers < 0:
        p.error("--audit-layers must be 0 (all) or more")
    if args.stock_cuda_graphs and args.shared_kv != "off":
        p.error("--stock-cuda-graphs needs --shared-kv off (the shared-KV server's graphs: --decode per-owner-graphs)")
    if args.decode != "gather" and args.shared_kv == "off":
        p.error(f"--decode {args.decode} needs --shared-kv on or both (it sets the shared-KV server's decode)")
    if args.merge_one_exchange_max_extra_bytes is not None:
        _, problems = parse_settings({MERGE_ONE_EXCHANGE_ENV: args.merge_one_exchange_max_extra_bytes})
        if problems:
            p.error(f"--merge-one-exchange-max-extra-bytes: {problems[0]}")
        if args.shared_kv == "off":
            p.error("--merge-one-exchange-max-extra-bytes needs --shared-kv on or both (it sets the shared-KV server's merge)")
    try:
        args.token_id_range = parse_token_id_range(args.token_id_range)
    except ValueError:
        p.error("--token-id-range must be LOW:HIGH")
    return args


def modes_of(shared_kv: str) -> List[bool]:
    return {"off": [False], "on": [True], "both": [False, True]}[shared_kv]


def mode_name(shared_kv: bool) -> str:
    return "shared-kv-on" if shared_kv else "shared-kv-off"


def logical_device_tokens(args, shared_kv: bool) -> int:
    """sglang caps each rank's pool at --max-total-tokens; shared KV then exposes cp_size x that."""
    return args.physical_tokens_per_rank * (args.tp if shared_kv else 1)


def make_plan(args) -> RequestPlan:
    # Both capacities whatever runs here: runs of one mode each (and their KV audits) must send the
    # same requests to be compared.
    plan = build_plan(
        [logical_device_tokens(args, s) for s in (False, True)],
        hicache_ratio=args.hicache_ratio,
        page_size=NSA_CUDA_PAGE_SIZE,
        max_prefix_tokens=args.max_prefix_tokens,
        max_new_tokens=args.max_new_tokens,
        token_id_range=args.token_id_range,
        seed=args.seed,
    )
    check_plan_fits_model(plan, args.model_path)
    return plan


def serve_configs(args, port: int) -> List[ServeConfig]:
    extra = shlex.split(args.extra_server_args)
    if args.one_gpu:
        extra = with_one_gpu_args(extra)
    return [
        ServeConfig(
            model_path=args.model_path,
            tp_size=args.tp,
            shared_kv=shared_kv,
            port=port,
            physical_tokens_per_rank=args.physical_tokens_per_rank,
            hicache_ratio=None if args.no_hicache else args.hicache_ratio,
            mem_fraction_static=args.mem_fraction_static,
            load_format=args.load_format,
            extra_args=extra,
            mtp=args.mtp,
            cuda_graphs=(shared_kv and args.decode in ("per-owner-graphs", SERVER_DEFAULT_DECODE))
            or (not shared_kv and args.stock_cuda_graphs),
            decode_path=serve_decode_path(args, shared_kv),
        )
        for shared_kv in modes_of(args.shared_kv)
    ]


def serve_decode_path(args, shared_kv: bool) -> str:
    if not shared_kv or args.decode == "gather":
        return "gather"
    return SERVER_DEFAULT_DECODE if args.decode == SERVER_DEFAULT_DECODE else PER_OWNER


def env_assignment(text: str):
    """``KEY=VALUE`` -> (KEY, VALUE); argparse reports anything else as a bad --server-env."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def audit_dir(out_dir: Path, shared_kv: bool) -> Path:
    return out_dir / f"audit_{mode_name(shared_kv)}"


def server_env(args, shared_kv: bool, out_dir: Path) -> Dict[str, str]:
    """The smoke's test plugin (``scripts/smoke_plugin``) reaches these servers, and only these,
    through ``PYTHONPATH``; what it does is chosen here."""
    inherited = os.environ.get("PYTHONPATH")
    extra = dict(OFFLINE_ENV)
    extra["PYTHONPATH"] = str(SMOKE_PLUGIN_DIR) + (os.pathsep + inherited if inherited else "")
    extra[SMOKE_LIFT_TP_RULE_ENV] = "1"  # acts on the reference only (shared KV off, --tp != 8)
    if args.load_format == "dummy" and args.dummy_init == "unit-gain":
        extra[SMOKE_DUMMY_INIT_ENV] = "1"
    if args.audit:
        extra[SMOKE_AUDIT_DIR_ENV] = str(audit_dir(out_dir, shared_kv))
    if args.audit_layers:
        extra[SMOKE_AUDIT_LAYERS_ENV] = str(args.audit_layers)
    if args.plant and shared_kv:
        extra[SMOKE_PLANT_ENV] = args.plant
    if args.mtp:  # the shared-KV server's opt-in; the stock reference runs MTP without it
        extra[MTP_OPT_IN_ENV] = "1"
    if shared_kv and args.decode != SERVER_DEFAULT_DECODE:  # named: the server's default (auto) picks by impl
        extra[DECODE_PATH_ENV] = GATHER if args.decode == "gather" else PER_OWNER
        extra[GRAPH_DECODE_ENV] = "1" if args.decode == "per-owner-graphs" else "0"
    if shared_kv and args.prefetch_slot_tokens is not None:
        extra[PREFETCH_SLOT_TOKENS_ENV] = args.prefetch_slot_tokens
    one_exchange = getattr(args, "merge_one_exchange_max_extra_bytes", None)  # other drivers' args lack it
    if shared_kv and one_exchange is not None:
        extra[MERGE_ONE_EXCHANGE_ENV] = one_exchange
    if args.one_gpu:
        extra.update(one_gpu_env())
    if shared_kv:
        extra.update(dict(getattr(args, "server_env", ())))
    return extra


def rid_of(index: int, name: str) -> str:
    """Request id; it names the KV audit's dump files, so no path separators."""
    return f"smoke-{index}-{name.replace('/', '-')}"


def run_burst(args, server, plan: RequestPlan) -> List[Dict]:
    """``args.burst`` requests at once: the first plan prefix cut at different page counts, each with
    its own tail, so they share prefixes, differ in length and are all in flight together."""
    from concurrent.futures import ThreadPoolExecutor

    base = plan.input_ids(plan.requests[-1])
    prompts = []
    for k in range(args.burst):
        keep = max(NSA_CUDA_PAGE_SIZE, len(base) - (k * len(base)) // (args.burst + 1))
        tail = [(7 * k + j) % 200 + 32 for j in range(17 + 5 * k)]
        prompts.append(base[:keep] + tail)
    with ThreadPoolExecutor(max_workers=args.burst) as pool:
        futures = [
            pool.submit(generate_greedy, server.base_url, p, plan.max_new_tokens, args.request_timeout, f"burst-{k}")
            for k, p in enumerate(prompts)
        ]
        results = [f.result() for f in futures]
    return [
        {"rid": f"burst-{k}", "prompt_tokens": len(p), "output_ids": r.output_ids, "error": r.error,
         "cached_tokens": r.meta_info.get("cached_tokens"), "e2e_s": r.e2e_s}
        for k, (p, r) in enumerate(zip(prompts, results))
    ]  # fmt: skip


def run_tpot(args, server) -> List[Dict]:
    """One fresh prompt per context length (new token ids, so nothing is cached); TPOT from the stream."""
    rows = []
    for n, context in enumerate(args.tpot_contexts):
        prompt = [(11 * i + 3 * n + 1) % 250 + 1 for i in range(context)]
        new_tokens = 64
        r = generate_greedy(server.base_url, prompt, new_tokens, args.request_timeout, f"tpot-{context}")
        tpot = None
        if not r.error and r.ttft_s is not None and len(r.output_ids) > 1:
            tpot = (r.e2e_s - r.ttft_s) / (len(r.output_ids) - 1)
        rows.append({"context": context, "ttft_ms": None if r.ttft_s is None else r.ttft_s * 1e3,
                     "tpot_ms": None if tpot is None else tpot * 1e3, "error": r.error})  # fmt: skip
    return rows


def run_mode(args, config: ServeConfig, plan: RequestPlan, out_dir: Path) -> RunReport:
    mode = mode_name(config.shared_kv)
    log_path = out_dir / f"server_{mode}.log"
    report = RunReport(mode=mode, command=config.command(), log_path=str(log_path), tp_size=config.tp_size)
    env = {**os.environ, **server_env(args, config.shared_kv, out_dir)}
    server = SglangServer(config.command(), config.port, log_path, env)
    host_totals: Dict[str, float] = {}
    server_info: Dict = {}
    with server:
        try:
            print(f"[{mode}] starting: {shlex.join(config.command())}", flush=True)
            server.wait_ready(args.startup_timeout)
            server_info = server.get_json("/server_info")
            counters = HiCacheCounters.of(parse_metrics(server.get_text("/metrics")))
            for planned in plan.requests:
                result = generate_greedy(
                    server.base_url, plan.input_ids(planned), plan.max_new_tokens, args.request_timeout,
                    rid_of(planned.index, planned.name),
                )
                after = HiCacheCounters.of(parse_metrics(server.get_text("/metrics")))
                record = RequestRecord.from_response(
                    planned.index, planned.name, planned.prompt_tokens, result, after.minus(counters)
                )
                counters = after
                report.records.append(record)
                print_request(mode, config.tp_size, record)
                if record.error and not server.alive():
                    break
            host_totals = counters.host_total_tokens_by_rank
            if args.burst:
                report.figures["burst"] = run_burst(args, server, plan)
                report.failures += [f"burst {b['rid']}: {b['error']}" for b in report.figures["burst"] if b["error"]]
            if args.tpot_contexts:
                report.figures["tpot"] = run_tpot(args, server)
                report.failures += [f"tpot {t['context']}: {t['error']}" for t in report.figures["tpot"] if t["error"]]
            if args.audit and args.teacher_forced_texts:
                texts = teacher_forced.scoring_texts(plan, args.teacher_forced_texts)
                report.figures["teacher_forced"] = teacher_forced.run_passes(server.base_url, texts, args.request_timeout)
            if args.audit and not kv_audit_compare.wait_for_settled_dumps(
                audit_dir(out_dir, config.shared_kv), timeout_s=60
            ):
                report.failures.append("audit: the server was still writing pool dumps after 60 s")
        except (ServerError, OSError, ValueError) as e:  # requests' errors are OSErrors, bad JSON ValueError
            report.failures.append(f"server: {e}")
    lines = server.log_lines_before_stop()  # the with-block stopped the server
    report.findings = scan_for_errors(lines, args.ignore_log_pattern)
    report.figures.update(capacity_figures(server_info, parse_capacity_lines(lines), host_totals))
    activity = hicache_activity(report.records)
    report.figures["hicache_activity"] = activity
    report.figures["ttft"] = ttft_summary(plan, report.records)
    report.failures += request_failures(plan, report.records, judge_replays=False)
    if "--enable-hierarchical-cache" in config.command():
        report.failures += hicache_failures(activity)
    report.failures += log_failures(report.findings)
    report.failures += capacity_failures(config.shared_kv, config.tp_size, report.figures)
    if args.mtp:
        report.figures["mtp_accept_length"] = accept_length_summary(report.records)
    if args.audit:
        audit_checks(args, config, out_dir, report)
    return report


def wait_for_report(run_dir: Path, timeout_s: float) -> None:
    """A reference run launched beside this one (another process) writes report.json when done."""
    deadline = time.monotonic() + timeout_s
    while not (run_dir / "report.json").exists() and time.monotonic() < deadline:
        time.sleep(5)


def audit_checks(args, config: ServeConfig, out_dir: Path, report: RunReport) -> None:
    """The oracle: pool dumps against the reference run's; under shared KV the read audit too."""
    run_dir = audit_dir(out_dir, config.shared_kv)
    values = value_audit_compare.totals(run_dir)
    report.figures["value_audit"] = value_audit_compare.report(values)
    if not config.shared_kv:  # the tolerance's source: it must have checked rows, all of them possible
        report.failures += value_audit_compare.failures(values, values, expect_prefill=True)
    if config.shared_kv:
        totals = kv_audit_compare.read_audit_totals(run_dir)
        report.figures["read_audit"] = totals
        report.failures += kv_audit_compare.read_audit_failures(totals)
        decode_totals = decode_read_audit.totals(run_dir)
        if decode_totals["ranks"]:
            report.figures["decode_read_audit"] = decode_totals
        report.failures += decode_read_audit.failures(decode_totals)
    if args.mtp:
        draft_checks(config.shared_kv, run_dir, report)
    reference = None
    if args.reference_dir:
        reference = audit_dir(Path(args.reference_dir), False)
    elif config.shared_kv and args.shared_kv == "both":
        reference = audit_dir(out_dir, False)
    if reference is not None:
        wait_for_report(reference.parent, args.startup_timeout)
        comparison = kv_audit_compare.compare_runs(run_dir, reference)
        report.figures["pool_audit"] = comparison.to_json()
        report.failures += comparison.failures
    if config.shared_kv:
        reference_values = value_audit_compare.totals(reference) if reference is not None else None
        report.figures["value_tolerance"] = reference_values and value_audit_compare.tolerance(reference_values)
        report.failures += value_audit_compare.failures(
            values, reference_values, expect_graph_replays=config.cuda_graphs and not args.mtp
        )
        report.failures += value_audit_compare.merge_form_failures(values, one_exchange_asked(args, out_dir))


def one_exchange_asked(args, out_dir: Path) -> bool:
    """Whether the shared-KV server's environment (inherited, the flag, ``--server-env``) asks for
    the one-exchange merge, as the server reads it."""
    settings, _ = parse_settings({**os.environ, **server_env(args, True, out_dir)})
    return settings.merge_one_exchange_max_extra_bytes is not None


def draft_checks(shared_kv: bool, run_dir: Path, report: RunReport) -> None:
    """MTP: the draft pool's audits (``draft_audit``). Under shared KV the draft's write and read
    audits and the cached-prefix ledger judge; on the stock reference the ledger is reported (stock
    0.5.11 leaves the draft of a prefix loaded back from host stale)."""
    # MTP servers run EAGLE / NEXTN: their radix trees key pages by token bigrams.
    ledger = kv_audit_compare.cached_row_ledger(run_dir, NSA_CUDA_PAGE_SIZE, bigram_keys=True)
    report.figures["cached_prefix_ledger"] = ledger.to_json()
    if not shared_kv:
        return
    totals = kv_audit_compare.draft_audit_totals(run_dir)
    report.figures.update(totals)
    report.failures += kv_audit_compare.draft_audit_failures(totals)
    report.failures += ledger.draft_failures()


def print_request(mode: str, tp_size: int, r: RequestRecord) -> None:
    """One line per request. Every rank counts the same logical evictions / load-backs in its own
    tree and /metrics sums them, so counter deltas are shown divided by the rank count."""
    d = r.metric_deltas
    ttft = f"{r.ttft_s * 1e3:8.1f}" if r.ttft_s is not None else "       -"
    print(
        f"[{mode}] #{r.index:<3} {r.name:<22} prompt={r.prompt_tokens:<6} cached dev/host="
        f"{r.cached_device_tokens}/{r.cached_host_tokens} ttft_ms={ttft} "
        f"evicted={d.get('evicted_tokens', 0) / tp_size:.0f} loaded_back={d.get('load_back_tokens', 0) / tp_size:.0f} "
        f"host_slots_used_all_ranks={d.get('host_used_tokens', 0):+.0f} out={r.output_ids[:6]}"
        + (f" accept_length={r.completion_tokens / r.spec_verify_ct:.2f}" if r.spec_verify_ct else "")
        + (f" ERROR {r.error}" if r.error else ""),
        flush=True,
    )


def print_summary(reports: List[RunReport], comparison: List[str]) -> None:
    for report in reports:
        c = report.figures
        print(f"\n== {report.mode}")
        print(f"logical device tokens per CP group: {c.get('logical_device_tokens_per_cp_group')}")
        print(f"physical device tokens per rank:    {c.get('physical_device_tokens_per_rank')}")
        print(f"host pool tokens per rank:          {c.get('host_pool_tokens_per_rank')}")
        print(f"host memory GB per rank:            {c.get('host_memory_gb_per_rank')}")
        print(f"hicache activity:                   {c.get('hicache_activity')}")
        rows = c.get("ttft", [])
        if rows:
            recomputed = statistics.median(r["recomputed_ttft_ms"] for r in rows)
            from_host = statistics.median(r["from_host_ttft_ms"] for r in rows)
            print(f"TTFT, median of {len(rows)} prefixes of {rows[0]['prefix_tokens']} tokens: "
                  f"recomputed {recomputed:.1f} ms, prefix from host {from_host:.1f} ms")  # fmt: skip
        for key in ("read_audit", "pool_audit", "value_audit", "value_tolerance", "teacher_forced_verdict",
                    "draft_read_audit", "draft_write_audit", "cached_prefix_ledger", "mtp_accept_length", "burst", "tpot"):
            if key in c:
                print(f"{key}: {json.dumps(c[key])}")
        for f in report.findings:
            print(f"log {'ERROR' if f.fatal else 'notice'} line {f.line_no}: {f.text[:200]}")
        for failure in report.failures:
            print(f"FAIL {failure}")
    for note in comparison:
        print(f"note (greedy tokens, not judged: stock NSA kernels are not run-to-run deterministic): {note}")


def kv_dtype_of(extra_server_args: str) -> str:
    args = shlex.split(extra_server_args)
    dtype = args[args.index("--kv-cache-dtype") + 1] if "--kv-cache-dtype" in args[:-1] else "bfloat16"
    return "fp8" if dtype.startswith("fp8") else "bf16"


def stock_figures_for(args, reports: List[RunReport]) -> Optional[Dict]:
    """Capacity figures of the stock server with the same flags: this run's, else the reference's."""
    for report in reports:
        if report.mode == mode_name(False):
            return report.figures
    if args.reference_dir:
        path = Path(args.reference_dir) / "report.json"
        wait_for_report(path.parent, args.startup_timeout)
        if path.exists():
            for run in json.loads(path.read_text())["runs"]:
                if run["mode"] == mode_name(False):
                    return run["figures"]
    return None


def scratch_share_checks(args, reports: List[RunReport]) -> None:
    """Shared KV's pool per rank = stock's less the gather scratch's share (where a stock run is known)."""
    from sglang_cp_shared_kv_testing.e2e.glm5_width import kv_bytes_per_token_per_layer, kv_row_bytes

    stock = stock_figures_for(args, reports)
    config = Path(args.model_path) / "config.json"
    if stock is None or not config.is_file():
        return
    num_layers = json.loads(config.read_text())["num_hidden_layers"]
    kv_dtype = kv_dtype_of(args.extra_server_args)
    for report in reports:
        if report.mode == mode_name(True):
            report.failures += scratch_share_failures(
                report.figures, stock, args.physical_tokens_per_rank, args.tp,
                num_layers * kv_bytes_per_token_per_layer(kv_dtype), kv_row_bytes(kv_dtype), NSA_CUDA_PAGE_SIZE,
            )  # fmt: skip


def teacher_forced_checks(args, reports: List[RunReport]) -> None:
    """The shared-KV run's scoring against the stock run's (this call's, else the reference's)."""
    stock = stock_figures_for(args, reports)
    for report in reports:
        if report.mode != mode_name(True) or "teacher_forced" not in report.figures:
            continue
        if stock is None or "teacher_forced" not in stock:
            report.failures.append("teacher-forced: no stock scoring to compare with (the reference run's)")
            continue
        result = teacher_forced.verdict(stock["teacher_forced"], report.figures["teacher_forced"])
        report.figures["teacher_forced_verdict"] = {k: v for k, v in result.items() if k != "failures"}
        report.failures += result["failures"]


def _raise_on_sigterm(signum, frame):
    raise SystemExit(f"terminated by signal {signum}")


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        if args.mtp:
            check_model_has_nextn(args.model_path)
        plan = make_plan(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    port = args.port or free_port()
    configs = serve_configs(args, port)
    out_dir = Path(args.out_dir or f"glm5_smoke_{time.strftime('%Y%m%d_%H%M%S')}")
    if args.dry_run:
        for config in configs:
            env = " ".join(f"{k}={v}" for k, v in server_env(args, config.shared_kv, out_dir).items())
            print(f"[{mode_name(config.shared_kv)}] {env} {shlex.join(config.command())}")
        print("\n".join(plan.describe()))
        if args.burst:
            print(f"then a burst of {args.burst} concurrent requests on the last prompt's prefix")
        return 0

    signal.signal(signal.SIGTERM, _raise_on_sigterm)  # so the server is stopped on SIGTERM too
    out_dir.mkdir(parents=True, exist_ok=True)
    reports = [run_mode(args, config, plan, out_dir) for config in configs]
    scratch_share_checks(args, reports)
    teacher_forced_checks(args, reports)
    comparison = compare_runs(plan, reports[0], reports[1]) if len(reports) == 2 else []
    print_summary(reports, comparison)
    (out_dir / "report.json").write_text(
        json.dumps(
            {"plan": plan.describe(), "runs": [r.to_json() for r in reports], "greedy_differences": comparison},
            indent=1,
        )
    )
    failed = any(r.failures for r in reports)
    print(f"\n{'FAILED' if failed else 'PASSED'}; report: {out_dir / 'report.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
