#!/usr/bin/env python3
"""PD smoke: a GLM-5 prefill server with NSA prefill CP, HiCache and shared KV hands every request's KV
to a stock decode server over mooncake, checked byte by byte against the same PD pair with shared KV
off.

The oracle is ``--audit`` (the smoke plugin's KV audits, ``kv_audit``): every finished request's KV
and indexer K are dumped by both servers; what the decode server holds for each prompt position must
equal, byte for byte in every layer, what the prefill server held (transfer audit, every pair); the
shared-KV prefill's dumps are compared with the shared-KV-off prefill's (layer-0 rows of another
token fail) and its read audit checks every gathered row; the value audit checks every server's
attention outputs against fp32 attention over the replicated context, the shared-KV pair's prefill
and decode within the tolerance the stock pair's prefill and decode set (``value_checks``). With
``--audit`` greedy tokens are reported, not judged: stock sglang already answers the same request
with different tokens on this model. ``--plant pd-send-wrong-page`` runs a deliberate page-pairing
bug the transfer audit must catch.

Per mode (shared KV off, on, or both: off first) it launches on 127.0.0.1 the prefill server
(``--tp`` ``--prefill-tp``, ``--disaggregation-mode prefill``, HiCache host caching) on
``--prefill-gpus``, then the stock decode server (``--tp`` ``--decode-tp``, CUDA graphs on) on
``--decode-gpu``, and sends the single-server smoke's request plan (repeated prefixes that force host
backup, device eviction and load-back on the prefill server, see ``sglang_cp_shared_kv_testing/e2e/request_plan.py``)
through the pair, with no router: each request goes to both servers with one bootstrap room
(``sglang_cp_shared_kv_testing/e2e/pd_generate.py``). Reported per request: greedy tokens, tokens the prefill served
from device / host, TTFT and TPOT at the client; per run: HiCache counter deltas of the prefill
server, TTFT of prefixes served from host vs recomputed, median TTFT / TPOT, every error line of
either server's log. Exits 1 on any failure, 2 on bad arguments.

  python scripts/glm5_pd_smoke.py --model-path /tmp/tiny-glm5 --load-format dummy --dry-run
  python scripts/glm5_pd_smoke.py --model-path /tmp/tiny-glm5 --load-format dummy

Both servers of each pair get the single-server smoke's test-only plugin (``scripts/smoke_plugin``)
on their ``PYTHONPATH``, and nothing else does. Through it the shared-KV-off reference prefill runs
stock NSA prefill CP at ``--prefill-tp`` (2 by default), which sglang 0.5.11 refuses below 8
(``tp_size == 8`` assertion; the plugin itself lifts that rule only with its flag):
``SGLANG_CP_SHARED_KV_SMOKE_LIFT_TP_RULE=1`` on that server. With ``--load-format dummy`` it also
gives both servers the unit-gain dummy init (``SGLANG_CP_SHARED_KV_SMOKE_DUMMY_INIT=1``; the decode
computes tokens 2.. with its own weights), unless ``--dummy-init stock``.

``--one-gpu`` (test-only): both servers of a pair and every prefill rank on device 0 of
``CUDA_VISIBLE_DEVICES=0`` (the smoke plugin's one-GPU hook, ``sglang_cp_shared_kv_testing/e2e/one_gpu.py``); the KV
goes from prefill to decode through mooncake over TCP on loopback, as between two GPUs.

``--mtp``: MTP on both servers of each pair (EAGLE with the model's NextN layer, 3/1/4, and the
shared-KV opt-in; the model needs a NextN layer, ``make_tiny_glm5_config.py --nextn``). The stock
decode server receives the draft pool's KV and indexer K with the target's: the transfer audit then
covers the draft rows byte for byte too, and the shared-KV prefill's draft audits and cached-prefix
ledger judge (``smoke_plugin/.../draft_audit.py``); accept lengths (the decode's) are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

SMOKE_PLUGIN_DIR = Path(__file__).resolve().parent / "smoke_plugin"
sys.path.insert(0, str(SMOKE_PLUGIN_DIR))
from cp_shared_kv_smoke_hooks import (  # noqa: E402
    SMOKE_AUDIT_DIR_ENV,
    SMOKE_DUMMY_INIT_ENV,
    SMOKE_LIFT_TP_RULE_ENV,
    SMOKE_PLANT_ENV,
    kv_audit_compare,
    value_audit_compare,
)
from cp_shared_kv_smoke_hooks.planted_bugs import PLANTS  # noqa: E402

DRAFT_PLANTS = ("draft-wrong-owner", "draft-stale-load-back")
from sglang_cp_shared_kv_testing.e2e.one_gpu import one_gpu_env, with_one_gpu_args
from sglang_cp_shared_kv_testing.e2e.pd_generate import generate_greedy_pd, latency_summary
from sglang_cp_shared_kv_testing.e2e.pd_pair import PDPairConfig
from sglang_cp_shared_kv_testing.e2e.request_plan import (
    RequestPlan,
    build_plan,
    check_plan_fits_model,
    longest_request_tokens,
    parse_token_id_range,
)
from sglang_cp_shared_kv_testing.e2e.server_log import parse_capacity_lines, scan_for_errors
from sglang_cp_shared_kv_testing.e2e.server_metrics import HiCacheCounters, parse_metrics
from sglang_cp_shared_kv_testing.e2e.server_process import (
    MAX_SGLANG_PORT,
    ServerError,
    SglangServer,
    free_port,
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
    ttft_summary,
)
from sglang_cp_shared_kv_testing.e2e.tiny_glm5 import check_model_has_nextn

NSA_CUDA_PAGE_SIZE = 64  # sglang 0.5.11 forces it for DSA models on CUDA
SGLANG_NSA_CP_TP_SIZE = 8  # what sglang 0.5.11 requires for NSA prefill CP without the plugin's flag
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True, help="GLM-5 checkpoint dir, or a tiny dir from make_tiny_glm5_config.py")
    p.add_argument("--prefill-tp", type=int, default=2, help="prefill --tp (= CP size of NSA prefill CP)")
    p.add_argument("--decode-tp", type=int, default=1, help="decode --tp")
    p.add_argument("--prefill-gpus", default=None, help="CUDA_VISIBLE_DEVICES of the prefill server (default 0,1; "
                   "0 with --one-gpu)")
    p.add_argument("--decode-gpu", default=None, help="CUDA_VISIBLE_DEVICES of the decode server (default 1; 0 "
                   "with --one-gpu)")
    p.add_argument("--one-gpu", action="store_true",
                   help="test-only: every rank of both servers on device 0 (the smoke plugin's one-GPU hook)")
    p.add_argument("--shared-kv", choices=["on", "off", "both"], default="both",
                   help="prefill with --enable-nsa-prefill-cp-shared-kv, without, or both (off first); compare")
    p.add_argument("--prefill-port", type=int, default=None)
    p.add_argument("--decode-port", type=int, default=None)
    p.add_argument("--bootstrap-port", type=int, default=None, help="prefill --disaggregation-bootstrap-port")
    p.add_argument("--physical-tokens-per-rank", type=int, default=16384,
                   help="prefill --max-total-tokens: device pool rows per rank (multiple of 64)")
    p.add_argument("--decode-max-total-tokens", type=int, default=None,
                   help="decode --max-total-tokens (default: room for twice the longest request)")
    p.add_argument("--hicache-ratio", type=float, default=2.0, help="prefill host pool / device pool, per rank (> 1)")
    p.add_argument("--prefill-mem-fraction-static", type=float, default=0.35)
    p.add_argument("--decode-mem-fraction-static", type=float, default=0.75,
                   help="must exceed the prefill's when the decode shares a GPU with it (launched second)")
    p.add_argument("--load-format", default=None, help="passed to both servers; 'dummy' for the tiny config")
    p.add_argument("--dummy-init", choices=["unit-gain", "stock"], default="unit-gain",
                   help="with --load-format dummy: plugin's unit-gain init (KV matters) or sglang's U(+-1e-3)")
    p.add_argument("--no-mooncake-tcp", action="store_true",
                   help="do not set MC_FORCE_TCP=true (use RDMA where the host has it)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-prefix-tokens", type=int, default=8192)
    p.add_argument("--token-id-range", default="0:256", help="LOW:HIGH, prompt token ids (byte tokens by default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=1800, help="seconds until /health answers (each server)")
    p.add_argument("--request-timeout", type=float, default=600, help="seconds per request")
    p.add_argument("--extra-prefill-args", default="", help="more prefill arguments, one shell-quoted string")
    p.add_argument("--extra-decode-args", default="", help="more decode arguments, one shell-quoted string")
    p.add_argument("--ignore-log-pattern", action="append", default=[], help="regex of log lines not to treat as errors")
    p.add_argument("--out-dir", default=None, help="server logs and report.json (default ./glm5_pd_smoke_<time>)")
    p.add_argument("--audit", action="store_true",
                   help="KV and value audits (the oracle): pool dumps of every finished request on both servers, "
                        "read audit on the shared-KV prefill; the shared-KV pair is judged by its dumps and values "
                        "against the shared-KV-off pair's (this run's with --shared-kv both, else --reference-dir's; "
                        "values without either: the recorded stock tolerance)")
    p.add_argument("--reference-dir", default=None,
                   help="out dir of an earlier --audit run with shared KV off: the reference dumps")
    p.add_argument("--plant", choices=PLANTS, default=None,
                   help="a deliberate bug in the shared-KV prefill (test route): the audits must catch it")
    p.add_argument("--mtp", action="store_true",
                   help="MTP on both servers (EAGLE, NextN layer, 3/1/4); the audits cover the draft pool")
    p.add_argument("--dry-run", action="store_true", help="print the commands and the request plan, launch nothing")
    args = p.parse_args(argv)
    for name in ("prefill_port", "decode_port", "bootstrap_port"):
        port = getattr(args, name)
        if port is not None and not 0 < port <= MAX_SGLANG_PORT:
            p.error(f"--{name.replace('_', '-')} must be in 1..{MAX_SGLANG_PORT}")
    if args.physical_tokens_per_rank % NSA_CUDA_PAGE_SIZE:
        p.error(f"--physical-tokens-per-rank must be a multiple of {NSA_CUDA_PAGE_SIZE}")
    if args.prefill_tp < 2:
        p.error("--prefill-tp must be at least 2 (NSA prefill CP)")
    if args.one_gpu:
        for name in ("prefill_gpus", "decode_gpu"):
            if getattr(args, name) not in (None, "0"):
                p.error(f"--{name.replace('_', '-')} {getattr(args, name)} with --one-gpu: every server runs on device 0")
        args.prefill_gpus = args.decode_gpu = "0"
    args.prefill_gpus = args.prefill_gpus or "0,1"
    args.decode_gpu = args.decode_gpu or "1"
    if (args.plant or args.reference_dir) and not args.audit:
        p.error("--plant and --reference-dir need --audit (the audits are what judges them)")
    if args.plant in DRAFT_PLANTS and not args.mtp:
        p.error(f"--plant {args.plant} needs --mtp (it plants a bug in the draft pool)")
    try:
        args.token_id_range = parse_token_id_range(args.token_id_range)
    except ValueError:
        p.error("--token-id-range must be LOW:HIGH")
    return args


def modes_of(shared_kv: str) -> List[bool]:
    return {"off": [False], "on": [True], "both": [False, True]}[shared_kv]


def mode_name(shared_kv: bool) -> str:
    return "pd-shared-kv-on" if shared_kv else "pd-shared-kv-off"


def logical_device_tokens(args, shared_kv: bool) -> int:
    """The prefill server's logical device capacity: shared KV exposes cp_size x the per-rank pool."""
    return args.physical_tokens_per_rank * (args.prefill_tp if shared_kv else 1)


def make_plan(args) -> RequestPlan:
    plan = build_plan(
        [logical_device_tokens(args, s) for s in modes_of(args.shared_kv)],
        hicache_ratio=args.hicache_ratio,
        page_size=NSA_CUDA_PAGE_SIZE,
        max_prefix_tokens=args.max_prefix_tokens,
        max_new_tokens=args.max_new_tokens,
        token_id_range=args.token_id_range,
        seed=args.seed,
    )
    check_plan_fits_model(plan, args.model_path)
    return plan


def decode_max_total_tokens(args, plan: RequestPlan) -> int:
    """Requests run one at a time and the decode server frees a request's KV when it finishes."""
    if args.decode_max_total_tokens is not None:
        return args.decode_max_total_tokens
    pages = -(-2 * longest_request_tokens(plan) // NSA_CUDA_PAGE_SIZE)
    return (pages + 1) * NSA_CUDA_PAGE_SIZE


def common_env(args) -> Dict[str, str]:
    """Both servers: the smoke's test plugin (``scripts/smoke_plugin``) reaches them, and only them,
    through ``PYTHONPATH``; what it does is chosen by the variables set here and in ``prefill_only_env``."""
    inherited = os.environ.get("PYTHONPATH")
    env = dict(OFFLINE_ENV)
    env["PYTHONPATH"] = str(SMOKE_PLUGIN_DIR) + (os.pathsep + inherited if inherited else "")
    if args.load_format == "dummy" and args.dummy_init == "unit-gain":
        env[SMOKE_DUMMY_INIT_ENV] = "1"  # both servers: the decode computes tokens 2.. with its weights
    if args.one_gpu:
        env.update(one_gpu_env())
    return env


def prefill_only_env(args, shared_kv: bool) -> Dict[str, str]:
    """The stock reference prefill (shared KV off) runs NSA prefill CP at ``--prefill-tp``: the smoke
    plugin lifts sglang's ``tp_size == 8`` rule for it (with the flag on the product does)."""
    if shared_kv:
        return {}
    if args.prefill_tp == SGLANG_NSA_CP_TP_SIZE:
        return {}
    return {SMOKE_LIFT_TP_RULE_ENV: "1"}


def audit_dir(out_dir: Path, shared_kv: bool, side: str) -> Path:
    return Path(out_dir) / f"audit_{mode_name(shared_kv)}_{side}"


def audit_env(args, out_dir: Path, shared_kv: bool, side: str) -> Dict[str, str]:
    """Each server's own dump dir; a planted bug on the shared-KV prefill only."""
    env = {}
    if args.audit:
        env[SMOKE_AUDIT_DIR_ENV] = str(audit_dir(out_dir, shared_kv, side))
    if args.plant and shared_kv and side == "prefill":
        env[SMOKE_PLANT_ENV] = args.plant
    return env


def rid_of(index: int, name: str) -> str:
    """One request id on both servers of a pair and in both pairs: it names the audit dumps."""
    return f"pd-{index}-{name.replace('/', '-')}"


def pair_configs(args, plan: RequestPlan, ports: Dict[str, int], out_dir: Path) -> List[PDPairConfig]:
    return [
        PDPairConfig(
            model_path=args.model_path,
            shared_kv=shared_kv,
            prefill_tp=args.prefill_tp,
            decode_tp=args.decode_tp,
            prefill_port=ports["prefill"],
            decode_port=ports["decode"],
            bootstrap_port=ports["bootstrap"],
            prefill_gpus=args.prefill_gpus,
            decode_gpu=args.decode_gpu,
            physical_tokens_per_rank=args.physical_tokens_per_rank,
            decode_max_total_tokens=decode_max_total_tokens(args, plan),
            hicache_ratio=args.hicache_ratio,
            prefill_mem_fraction_static=args.prefill_mem_fraction_static,
            decode_mem_fraction_static=args.decode_mem_fraction_static,
            load_format=args.load_format,
            mooncake_tcp=not args.no_mooncake_tcp,
            prefill_extra_args=one_gpu_args(args, args.extra_prefill_args),
            decode_extra_args=one_gpu_args(args, args.extra_decode_args),
            common_env=common_env(args),
            prefill_only_env={**prefill_only_env(args, shared_kv), **audit_env(args, out_dir, shared_kv, "prefill")},
            decode_only_env=audit_env(args, out_dir, shared_kv, "decode"),
            mtp=args.mtp,
        )
        for shared_kv in modes_of(args.shared_kv)
    ]


def one_gpu_args(args, extra: str) -> List[str]:
    return with_one_gpu_args(shlex.split(extra)) if args.one_gpu else shlex.split(extra)


def pick_ports(args) -> Dict[str, int]:
    ports: Dict[str, int] = {}
    for name in ("prefill", "decode", "bootstrap"):
        port = getattr(args, f"{name}_port")
        while port is None or port in ports.values():
            port = free_port()
        ports[name] = port
    return ports


def describe_pair(config: PDPairConfig) -> List[str]:
    def env_text(env):
        return " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))

    mode = mode_name(config.shared_kv)
    return [
        f"[{mode}] prefill: {env_text(config.prefill_env())} {shlex.join(config.prefill_command())}",
        f"[{mode}] decode:  {env_text(config.decode_env())} {shlex.join(config.decode_command())}",
    ]


def run_pair(args, config: PDPairConfig, plan: RequestPlan, out_dir: Path) -> RunReport:
    mode = mode_name(config.shared_kv)
    prefill_log, decode_log = out_dir / f"prefill_{mode}.log", out_dir / f"decode_{mode}.log"
    report = RunReport(mode=mode, command=config.prefill_command(), log_path=str(prefill_log),
                       tp_size=config.prefill_tp)  # fmt: skip
    report.figures["decode_command"] = config.decode_command()
    report.figures["decode_log_path"] = str(decode_log)
    prefill = SglangServer(config.prefill_command(), config.prefill_port, prefill_log,
                           {**os.environ, **config.prefill_env()})  # fmt: skip
    decode = SglangServer(config.decode_command(), config.decode_port, decode_log,
                          {**os.environ, **config.decode_env()})  # fmt: skip
    rng = random.Random(args.seed)
    tpots: List[Optional[float]] = []
    host_totals: Dict[str, float] = {}
    server_info: Dict = {}
    with prefill:
        try:
            for line in describe_pair(config):
                print(line, flush=True)
            prefill.wait_ready(args.startup_timeout)
            with decode:
                decode.wait_ready(args.startup_timeout)
                server_info = prefill.get_json("/server_info")
                counters = HiCacheCounters.of(parse_metrics(prefill.get_text("/metrics")))
                for planned in plan.requests:
                    result = generate_greedy_pd(
                        config.prefill_url, config.decode_url, config.bootstrap_port,
                        plan.input_ids(planned), plan.max_new_tokens, args.request_timeout, rng,
                        rid=rid_of(planned.index, planned.name),
                    )  # fmt: skip
                    after = HiCacheCounters.of(parse_metrics(prefill.get_text("/metrics")))
                    record = RequestRecord.from_response(
                        planned.index, planned.name, planned.prompt_tokens, result, after.minus(counters)
                    ).with_spec_counts(result.decode_meta_info)
                    counters = after
                    report.records.append(record)
                    tpots.append(result.tpot_s)
                    print_request(mode, config.prefill_tp, record, result.tpot_s)
                    if record.error and not (prefill.alive() and decode.alive()):
                        break
                host_totals = counters.host_total_tokens_by_rank
                for side in ("prefill", "decode") if args.audit else ():
                    if not kv_audit_compare.wait_for_settled_dumps(
                        audit_dir(out_dir, config.shared_kv, side), timeout_s=60
                    ):
                        report.failures.append(f"audit: the {side} server was still writing pool dumps after 60 s")
        except (ServerError, OSError, ValueError) as e:
            report.failures.append(f"server: {e}")
    prefill_lines = prefill.log_lines_before_stop()
    decode_lines = decode.log_lines_before_stop() if decode.process is not None else []
    report.findings = scan_for_errors(prefill_lines, args.ignore_log_pattern)
    decode_findings = scan_for_errors(decode_lines, args.ignore_log_pattern)
    report.figures.update(capacity_figures(server_info, parse_capacity_lines(prefill_lines), host_totals))
    activity = hicache_activity(report.records)
    report.figures["hicache_activity"] = activity
    report.figures["ttft"] = ttft_summary(plan, report.records)
    report.figures["latency"] = latency_summary([r.ttft_s for r in report.records], tpots)
    report.figures["decode_log_findings"] = [f"{f.line_no}: {f.text[:300]}" for f in decode_findings]
    # With the audits, greedy tokens are reported, not judged (stock sglang's NSA kernels are not
    # run-to-run deterministic on this model: docs/e2e-smoke.md); the bytes are the oracle.
    report.failures += request_failures(plan, report.records, judge_replays=not args.audit)
    report.failures += hicache_failures(activity)
    report.failures += log_failures(report.findings)
    report.failures += [f"decode {line}" for line in log_failures(decode_findings)]
    report.failures += capacity_failures(config.shared_kv, config.prefill_tp, report.figures)
    if args.mtp:
        report.figures["mtp_accept_length"] = accept_length_summary(report.records)
    if args.audit:
        audit_checks(args, config, out_dir, report)
    return report


def audit_checks(args, config: PDPairConfig, out_dir: Path, report: RunReport) -> None:
    """The oracle, from the servers' pool dumps (``kv_audit``) and value audits (``value_checks``).

    * transfer audit, every pair: what the decode server holds for each prompt position equals, in
      every byte of every layer, what the prefill server held (merged over its CP ranks);
    * shared-KV pair: the prefill's read audit, and its dumps against the shared-KV-off pair's
      (layer-0 rows depend only on (token, position): another token's row fails, rounding passes).
    * MTP: the transfer audit covers the draft rows (a stock decode server with MTP receives a
      complete draft pool); the shared-KV prefill's draft write and read audits and its
      cached-prefix ledger judge; the stock prefill's ledger is reported.
    """
    shared_kv = config.shared_kv
    value_checks(args, config, out_dir, report)
    transfer = kv_audit_compare.compare_runs(
        audit_dir(out_dir, shared_kv, "decode"), audit_dir(out_dir, shared_kv, "prefill")
    )
    report.figures["transfer_audit"] = transfer.to_json()
    report.failures += kv_audit_compare.copy_failures(transfer, "transfer audit", with_draft=args.mtp)
    if args.mtp:
        prefill_dir = audit_dir(out_dir, shared_kv, "prefill")
        # MTP servers run EAGLE / NEXTN: their radix trees key pages by token bigrams.
        ledger = kv_audit_compare.cached_row_ledger(prefill_dir, NSA_CUDA_PAGE_SIZE, bigram_keys=True)
        report.figures["cached_prefix_ledger"] = ledger.to_json()
        if shared_kv:
            totals = kv_audit_compare.draft_audit_totals(prefill_dir)
            report.figures.update(totals)
            report.failures += [f"prefill {f}" for f in kv_audit_compare.draft_audit_failures(totals)]
            report.failures += [f"prefill {f}" for f in ledger.draft_failures()]
    if not shared_kv:
        return
    totals = kv_audit_compare.read_audit_totals(audit_dir(out_dir, True, "prefill"))
    report.figures["read_audit"] = totals
    report.failures += kv_audit_compare.read_audit_failures(totals)
    reference_root = stock_pair_root(args, out_dir)
    if reference_root is None:
        return
    prefill = kv_audit_compare.compare_runs(
        audit_dir(out_dir, True, "prefill"), audit_dir(reference_root, False, "prefill")
    )
    report.figures["pool_audit_prefill"] = prefill.to_json()
    report.failures += [f"prefill pool audit: {f}" for f in prefill.failures]


def stock_pair_root(args, out_dir: Path) -> Optional[Path]:
    """The out dir holding the stock pair's audits: this call's with ``--shared-kv both``, else
    ``--reference-dir``'s, else none."""
    if args.reference_dir:
        return Path(args.reference_dir)
    return out_dir if args.shared_kv == "both" else None


def value_checks(args, config: PDPairConfig, out_dir: Path, report: RunReport) -> None:
    """The value audit of both servers of the pair (``value_audit_compare``).

    The stock pair's servers are the tolerance's source: each must have checked rows of its own. The
    shared-KV pair's prefill is judged by the stock prefill's errors, its decode (a stock server in
    both pairs: a difference means the transferred pages give other values) by the stock decode's;
    without a stock pair in this call or ``--reference-dir``, by the recorded stock figures
    (``recorded_tolerance``). The prefill server runs prefill forwards only; the decode server no
    prefill (its requests arrive prebuilt), and under CUDA graphs its replayed decodes must have been
    checked (not with MTP, whose replays are verify and draft forwards, as in the serve smoke).
    """
    expected = {
        "prefill": {"expect_prefill": True},
        "decode": {"expect_prefill": False, "expect_graph_replays": config.decode_cuda_graphs and not args.mtp},
    }
    reference_root = stock_pair_root(args, out_dir)
    for side, expect in expected.items():
        values = value_audit_compare.totals(audit_dir(out_dir, config.shared_kv, side))
        if not config.shared_kv:
            bounds = value_audit_compare.tolerance(values)
        elif reference_root is not None:
            bounds = value_audit_compare.tolerance(value_audit_compare.totals(audit_dir(reference_root, False, side)))
        else:
            bounds = value_audit_compare.recorded_tolerance()
        shown = value_audit_compare.report(values)
        report.figures[f"value_audit_{side}"] = shown
        report.figures[f"value_tolerance_{side}"] = bounds
        report.figures[f"values_{side}"] = value_audit_compare.verdict_text(shown, bounds)
        report.failures += [f"{side} {f}" for f in value_audit_compare.failures_within(values, bounds, **expect)]


def print_request(mode: str, prefill_tp: int, r: RequestRecord, tpot_s: Optional[float]) -> None:
    d = r.metric_deltas
    ttft = f"{r.ttft_s * 1e3:8.1f}" if r.ttft_s is not None else "       -"
    tpot = f"{tpot_s * 1e3:6.2f}" if tpot_s is not None else "     -"
    print(
        f"[{mode}] #{r.index:<3} {r.name:<22} prompt={r.prompt_tokens:<6} prefill cached dev/host="
        f"{r.cached_device_tokens}/{r.cached_host_tokens} ttft_ms={ttft} tpot_ms={tpot} "
        f"evicted={d.get('evicted_tokens', 0) / prefill_tp:.0f} loaded_back={d.get('load_back_tokens', 0) / prefill_tp:.0f} "
        f"out={r.output_ids[:6]}" + (f" ERROR {r.error}" if r.error else ""),
        flush=True,
    )


def print_summary(reports: List[RunReport], comparison: List[str], args_audit: bool) -> None:
    for report in reports:
        c = report.figures
        print(f"\n== {report.mode}")
        print(f"prefill logical device tokens: {c.get('logical_device_tokens_per_cp_group')}")
        print(f"prefill physical tokens/rank:  {c.get('physical_device_tokens_per_rank')}")
        print(f"hicache activity:              {c.get('hicache_activity')}")
        print(f"latency (client, PD pair):     {c.get('latency')}")
        for key in ("transfer_audit", "read_audit", "pool_audit_prefill", "draft_read_audit", "draft_write_audit",
                    "cached_prefix_ledger", "mtp_accept_length"):
            if key in c:
                print(f"{key}: {json.dumps(c[key])[:600]}")
        for side in ("prefill", "decode"):
            if f"values_{side}" in c:
                print(f"{side} {c[f'values_{side}']}")
        for row in c.get("ttft", []):
            print(f"  prefix {row['prefix_tokens']}: recomputed {row['recomputed_ttft_ms']} ms, "
                  f"from host {row['from_host_ttft_ms']} ms")  # fmt: skip
        for f in report.findings:
            print(f"prefill log {'ERROR' if f.fatal else 'notice'} line {f.line_no}: {f.text[:200]}")
        for line in c.get("decode_log_findings", []):
            print(f"decode log line {line}")
        for failure in report.failures:
            print(f"FAIL {failure}")
    for failure in comparison:
        print(f"{'greedy difference' if args_audit else 'FAIL'} {failure}")


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
    out_dir = Path(args.out_dir or f"glm5_pd_smoke_{time.strftime('%Y%m%d_%H%M%S')}")
    configs = pair_configs(args, plan, pick_ports(args), out_dir)
    if args.dry_run:
        for config in configs:
            print("\n".join(describe_pair(config)))
        print("\n".join(plan.describe()))
        return 0

    signal.signal(signal.SIGTERM, _raise_on_sigterm)  # so the servers are stopped on SIGTERM too
    out_dir.mkdir(parents=True, exist_ok=True)
    reports = [run_pair(args, config, plan, out_dir) for config in configs]
    comparison = compare_runs(plan, reports[0], reports[1]) if len(reports) == 2 else []
    print_summary(reports, comparison, args.audit)
    (out_dir / "report.json").write_text(
        json.dumps(
            {
                "plan": plan.describe(),
                "runs": [r.to_json() for r in reports],
                "greedy_differences" if args.audit else "comparison_failures": comparison,
            },
            indent=1,
        )
    )
    failed = (comparison and not args.audit) or any(r.failures for r in reports)
    print(f"\n{'FAILED' if failed else 'PASSED'}; report: {out_dir / 'report.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
