#!/usr/bin/env python3
"""Served soak: one shared-KV ``sglang serve`` with HiCache under concurrent load, aborts and flushes.

Starts ONE server (the smoke's command, environment and plugin: ``glm5_cp_hicache_smoke.py``) with
the decode a user gets (``--decode server-default``: no decode setting, no ``--disable-cuda-graph``
where the default decodes per owner, sglang's own capture list; ``--decode`` / ``--cuda-graphs`` ask
for another), the KV audits on (the read audits on every forward: the scratch read audit where a
forward gathers pages, the decode read audit where decode runs per owner, graph replays included;
pool dumps of a sample of requests, checked against themselves, since layer-0 rows are a function
of token and position) and the plugin's tree dump, and drives it from ``--clients`` threads on loopback for ``--duration-s`` seconds or
``--max-requests`` items (``sglang_cp_shared_kv_testing/e2e/soak.py`` says what the plan holds: multi-turn conversations
over long prefixes sized from the server's logical pool, so the device evicts, the host backs up,
evicts and loads back; clients that disconnect in prefill or decode; ``/abort_request``;
``/flush_cache`` while requests run, or right after they end). Before each flush and at the end,
``/server_info`` makes every rank dump its tree and host-slot ledger at the same step, and the
dumps are compared.

Verdict (one ``VERDICT:`` line naming the decode the server logged and the values checked, then a
table row for docs/gpu.md): the server logged the decode asked for (graphs captured exactly when
asked), 0 server errors (HTTP 5xx, error lines of the server log), every rank alive
(``/health_generate``, every scheduler process), the read audits clean (the smoke's judgement; under
per-owner decode its decode read audit must have reported, graph replays included), the value audit
within the recorded stock figures' tolerance (no stock server runs here; under graphs replayed rows
checked) and the sampled pool rows consistent, the trees identical across ranks at every checkpoint,
no request lost, nothing left running, and the run did evict and load back. A server that never
answers ``/health`` is a FAIL quoting the error its log ends with. Exit 0 on PASS, 1 on FAIL, 2 on
bad arguments. ``--plant`` plants a bug (the soak must FAIL).

  python scripts/glm5_cp_hicache_soak.py --model-path /tmp/tiny-glm5 --tp 2 --one-gpu --dry-run
  python scripts/glm5_cp_hicache_soak.py --model-path /tmp/tiny-glm5 --tp 2 --one-gpu --load-format dummy \\
      --write-policy write_back --duration-s 240
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional

SCRIPTS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS_DIR))
import glm5_cp_hicache_smoke as smoke  # noqa: E402  (its server_env, plugin path and page size)
from cp_shared_kv_smoke_hooks import (  # noqa: E402
    SMOKE_AUDIT_POOL_ENV,
    decode_read_audit,
    kv_audit_compare,
    value_audit_compare,
)
from sglang_cp_shared_kv_testing.e2e import soak  # noqa: E402
from sglang_cp_shared_kv_testing.e2e.request_plan import model_context_len, parse_token_id_range  # noqa: E402
from sglang_cp_shared_kv_testing.e2e.server_log import ServedDecode, scan_for_errors, served_decode  # noqa: E402
from sglang_cp_shared_kv_testing.e2e.server_metrics import HiCacheCounters, parse_metrics  # noqa: E402
from sglang_cp_shared_kv_testing.e2e.server_process import (  # noqa: E402
    MAX_SGLANG_PORT,
    SERVER_DEFAULT_DECODE,
    ServeConfig,
    ServerError,
    ServerStartError,
    SglangServer,
    add_decode_options,
    decode_asked,
    decode_setup,
    free_port,
    served_decode_failures,
    shared_kv_serve_config,
)
from sglang_cp_shared_kv_testing.e2e.smoke_report import hicache_failures, log_failures  # noqa: E402

SOAK_PLANTS = ("skip-load-ack", "load-back-wrong-page", "read-wrong-owner")
# Log lines our own faults cause: sglang logs a client's disconnect as an http_server error.
FAULT_LOG_PATTERNS = (r"Request is disconnected from the client side",)
FAKE_SERVER = [sys.executable, "-m", "sglang_cp_shared_kv_testing.e2e.fake_sglang_server"]
CHECK_TIMEOUT_S = 30  # each check after the load: a hung server must not eat the call's budget


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True, help="a tiny GLM-5 dir from make_tiny_glm5_config.py")
    p.add_argument("--tp", type=int, default=2, help="tensor parallel size = CP size (2, 4 or 8)")
    p.add_argument("--write-policy", choices=["write_through", "write_back"], default="write_through",
                   help="--hicache-write-policy")
    p.add_argument("--duration-s", type=float, default=240, help="stop taking new items after this many seconds")
    p.add_argument("--max-requests", type=int, default=3000, help="items of the plan (requests and flushes)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients")
    p.add_argument("--max-new-tokens", type=int, default=16, help="new tokens of a request without a fault")
    p.add_argument("--fault-fraction", type=float, default=0.15, help="share of requests aborted (3 kinds)")
    p.add_argument("--flush-every", type=int, default=50, help="every Nth item is a /flush_cache")
    p.add_argument("--physical-tokens-per-rank", type=int, default=16384, help="--max-total-tokens (multiple of 64)")
    p.add_argument("--hicache-ratio", type=float, default=2.0)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--load-format", default=None, help="'dummy' for the tiny config")
    p.add_argument("--dummy-init", choices=["unit-gain", "stock"], default="unit-gain")
    p.add_argument("--token-id-range", default="0:256")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--request-timeout", type=float, default=60, help="seconds per request")
    p.add_argument("--extra-server-args", default="", help="more sglang serve arguments, one shell-quoted string")
    p.add_argument("--ignore-log-pattern", action="append", default=[], help="regex of log lines not errors")
    p.add_argument("--audit-layers", type=int, default=1,
                   help="layers the scratch read audit checks and the pool audit dumps (0: all). Layer 0 judges "
                        "the pool audit, and a forward's page plan is the same in every layer; every layer audited "
                        "costs an all-gather of the layer's pool per forward that gathers pages (prefill; decode "
                        "too under --decode gather), which slows the load")
    p.add_argument("--plant", default=None, choices=SOAK_PLANTS, help="plant a bug (the soak must FAIL)")
    add_decode_options(p)
    p.add_argument("--one-gpu", action="store_true", help="test-only: every rank on device 0")
    p.add_argument("--name", default=None, help="the run's name in the table row (default from the settings)")
    p.add_argument("--out-dir", default=None, help="server log, audits, tree dumps, report.json")
    p.add_argument("--dry-run", action="store_true", help="print the server command and the plan, start nothing")
    p.add_argument("--fake-server", action="store_true",
                   help="test-only: drive sglang_cp_shared_kv_testing/e2e/fake_sglang_server.py instead (no audits, no tree dumps)")
    args = p.parse_args(argv)
    if args.port is not None and not 0 < args.port <= MAX_SGLANG_PORT:
        p.error(f"--port must be in 1..{MAX_SGLANG_PORT} (sglang also uses port + 10000)")
    if args.physical_tokens_per_rank % smoke.NSA_CUDA_PAGE_SIZE:
        p.error(f"--physical-tokens-per-rank must be a multiple of {smoke.NSA_CUDA_PAGE_SIZE}")
    if args.tp < 2:
        p.error("--tp must be at least 2 (shared KV needs a CP group)")
    if args.duration_s <= 0:
        p.error("--duration-s must be positive")
    if args.audit_layers < 0:
        p.error("--audit-layers must be 0 (all) or more")
    try:
        decode_setup(args.decode, args.cuda_graphs, shlex.split(args.extra_server_args))
    except ValueError as e:
        p.error(str(e))
    try:
        args.token_id_range = parse_token_id_range(args.token_id_range)
    except ValueError:
        p.error("--token-id-range must be LOW:HIGH")
    args.name = args.name or f"cp{args.tp}_{args.write_policy}" + (f"_plant_{args.plant}" if args.plant else "")
    return args


def make_plan(args, logical_device_tokens: int) -> soak.SoakPlan:
    plan = soak.build_soak_plan(
        logical_device_tokens, args.hicache_ratio, page_size=smoke.NSA_CUDA_PAGE_SIZE, clients=args.clients,
        max_items=args.max_requests, max_new_tokens=args.max_new_tokens, fault_fraction=args.fault_fraction,
        flush_every=args.flush_every, token_id_range=args.token_id_range, seed=args.seed,
    )  # fmt: skip
    context = model_context_len(args.model_path)
    longest = max((i.prompt_tokens + i.max_new_tokens for i in plan.items), default=0)
    if context is not None and longest > context:
        raise ValueError(f"the soak needs {longest} tokens of context, the model has {context}")
    return plan


def serve_config(args, port: int) -> ServeConfig:
    extra = shlex.split(args.extra_server_args) + ["--hicache-write-policy", args.write_policy]
    return shared_kv_serve_config(args, port, extra)


def server_env(args, out_dir: Path, config: ServeConfig) -> dict:
    """The smoke's environment for a shared-KV server with its audits on, pool dumps of the sample
    only, and the decode settings of ``config`` (none for the server's default)."""
    smoke_args = argparse.Namespace(
        load_format=args.load_format, dummy_init=args.dummy_init, audit=not args.fake_server, plant=args.plant,
        mtp=False, decode=SERVER_DEFAULT_DECODE, prefetch_slot_tokens=None, one_gpu=args.one_gpu,
        audit_layers=args.audit_layers,
    )  # fmt: skip  (the smoke's decode: named by config.env() alone)
    env = smoke.server_env(smoke_args, True, out_dir)
    env[SMOKE_AUDIT_POOL_ENV] = soak.AUDITED_RID_PATTERN
    return {**env, **config.env()}


def audit_dir(out_dir: Path) -> Path:
    return smoke.audit_dir(out_dir, True)


class Checkpoints:
    """``/server_info`` makes every rank dump its tree (the plugin's ``tree_dump``); wait for the files."""

    def __init__(self, server: SglangServer, tree_dir: Path, ranks: int, enabled: bool):
        self.server, self.tree_dir, self.ranks, self.enabled = server, tree_dir, ranks, enabled
        self.lock = threading.Lock()  # one checkpoint at a time: each is one dump number on every rank
        self.missed: List[str] = []

    def take(self) -> dict:
        with self.lock:
            seq = soak.next_tree_dump_seq(self.tree_dir)
            try:
                info = self.server.get_json("/server_info", timeout_s=CHECK_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001
                self.missed.append(f"tree dump {seq}: /server_info failed: {type(e).__name__}: {e}"[:300])
                raise
            if self.enabled and not soak.wait_for_tree_dump(self.tree_dir, self.ranks, seq, CHECK_TIMEOUT_S):
                self.missed.append(f"tree dump {seq}: not every rank wrote it within {CHECK_TIMEOUT_S} s")
            return info

    def take_quietly(self) -> bool:
        """From a client thread, or after the load: a failure is recorded (``missed``), never raised;
        False when the server did not answer."""
        try:
            self.take()
            return True
        except Exception:  # noqa: BLE001 (a hung or dead server: judged by the checks after the load)
            return False


def final_flush_failures(server: SglangServer) -> List[str]:
    """The last flush waits (``?timeout=``) until the scheduler has no request running or queued, and
    then flushes: refused at the timeout means a request never ended. (sglang's running-request
    gauges cannot tell: an idle scheduler stops refreshing them.)"""
    import requests

    try:
        response = requests.post(f"{server.base_url}/flush_cache?timeout={CHECK_TIMEOUT_S}",
                                 timeout=CHECK_TIMEOUT_S + 15)  # fmt: skip
    except requests.RequestException as e:
        return [f"final /flush_cache failed: {type(e).__name__}: {e}"[:300]]
    if response.status_code != 200:
        return [f"final /flush_cache: HTTP {response.status_code} ({response.text.strip()[:200]}): "
                f"requests still running or queued {CHECK_TIMEOUT_S} s after the load"]  # fmt: skip
    return []


def health_ok(server: SglangServer) -> bool:
    import requests

    try:
        return requests.get(server.base_url + "/health_generate", timeout=CHECK_TIMEOUT_S).status_code == 200
    except requests.RequestException:
        return False


def schedulers_alive(server: SglangServer) -> int:
    """Scheduler processes (``sglang::scheduler...``) of the server still running."""
    import psutil

    try:
        children = psutil.Process(server.process.pid).children(recursive=True)
    except psutil.Error:
        return 0
    alive = 0
    for child in children:
        try:
            # setproctitle: the command line reads sglang::scheduler_TP<r>..., the 15-byte comm name
            # sglang::schedul.
            if child.name().startswith("sglang::sched") or any("sglang::scheduler" in a for a in child.cmdline()):
                alive += child.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            continue
    return alive


def hicache_counters(server: SglangServer) -> Optional[HiCacheCounters]:
    try:
        return HiCacheCounters.of(parse_metrics(server.get_text("/metrics", timeout_s=CHECK_TIMEOUT_S)))
    except Exception:  # noqa: BLE001
        return None


def audit_failures(out_dir: Path, served: ServedDecode) -> tuple:
    """(figures, failures): the smoke's judgement of the shared-KV read audits (the decode read audit
    required where the server decoded per owner), the value audit (``value_failures``), and the
    sampled pool dumps against themselves (no reference server here)."""
    run_dir = audit_dir(out_dir)
    value_figures, failures_of_values = value_failures(run_dir, served)
    totals = kv_audit_compare.read_audit_totals(run_dir)
    failures = kv_audit_compare.read_audit_failures(totals)
    decode_totals = decode_read_audit.totals(run_dir)
    failures += decode_read_audit.failures(decode_totals) + served.unaudited(decode_totals) + failures_of_values
    if not kv_audit_compare.wait_for_settled_dumps(run_dir, timeout_s=CHECK_TIMEOUT_S):
        failures.append(f"pool audit: dumps still being written {CHECK_TIMEOUT_S} s after the load")
    pool = kv_audit_compare.layer0_self_consistency(run_dir)
    failures += pool.failures
    pool_figures = {k: v for k, v in pool.to_json().items() if k != "failures"}
    figures = {"read_audit": totals, "decode_read_audit": decode_totals, "pool_self_consistency": pool_figures}
    return {**figures, **value_figures}, failures


def value_failures(run_dir: Path, served: ServedDecode) -> tuple:
    """(figures, failures) of the value audit. No stock server runs beside the soak: its tolerance is
    the recorded stock figures' (``value_audit_compare.recorded_tolerance``), not a reference of this
    call. Where the server captured decode CUDA graphs their replays must have been checked."""
    values = value_audit_compare.totals(run_dir)
    bounds = value_audit_compare.recorded_tolerance()
    failures = value_audit_compare.failures_within(values, bounds, expect_graph_replays=served.graphs)
    return {"value_audit": value_audit_compare.report(values), "value_tolerance": bounds}, failures


def run(args, plan_for_capacity, out_dir: Path) -> dict:
    port = args.port or free_port()
    config = serve_config(args, port)
    command = config.command()
    if args.fake_server:
        command = FAKE_SERVER + command[2:]
    env = {**os.environ, **server_env(args, out_dir, config)}
    log_path = out_dir / "server.log"
    server = SglangServer(command, port, log_path, env)
    tree_dir = audit_dir(out_dir) / "tree"
    checkpoints = Checkpoints(server, tree_dir, args.tp, enabled=not args.fake_server)
    report: dict = {"name": args.name, "command": command, "failures": [], "decode": {"asked": decode_asked(config)}}
    load = None
    evidence_parts: dict = {"health_ok": False, "schedulers_alive": 0, "idle_failures": [], "hicache_failures": []}
    with server:
        print(f"[{args.name}] starting: {shlex.join(command)}", flush=True)
        try:
            server.wait_started(args.startup_timeout)
        except ServerStartError as e:
            server.stop()
            return not_started_report(args, report, str(e), served_decode(server.log_lines_before_stop()))
        try:
            info = checkpoints.take()
            logical = int(info["max_total_num_tokens"])
            plan = plan_for_capacity(logical)
            report["plan"] = plan.describe()
            print("\n".join(plan.describe()), flush=True)
            before = hicache_counters(server)
            load = soak.SoakLoad(server.base_url, plan, args.duration_s, args.request_timeout,
                                 checkpoint=checkpoints.take_quietly).run()  # fmt: skip
            # The trees right after the load (requests may still be ending). A server that does not
            # answer is hung or dead: the later checks would only spend the call's budget waiting.
            if not checkpoints.take_quietly():
                raise ServerError("the server stopped answering /server_info after the load")
            after = hicache_counters(server)
            if before is not None and after is not None:
                deltas = after.minus(before)
                report["hicache"] = {k: v / args.tp for k, v in deltas.items() if k != "host_used_tokens"}
            evidence_parts["idle_failures"] = final_flush_failures(server)
            evidence_parts["health_ok"] = health_ok(server)
            checkpoints.take_quietly()  # and after the final flush
        except (ServerError, OSError, ValueError, KeyError) as e:
            report["failures"].append(f"server: {type(e).__name__}: {e}")
        evidence_parts["schedulers_alive"] = args.tp if args.fake_server else schedulers_alive(server)
    lines = server.log_lines_before_stop()
    served = served_decode(lines)
    report["decode"].update(served=served.describe(), per_owner_impls=served.per_owner_impls,
                            gather_reasons=served.gather_reasons)  # fmt: skip
    report["failures"] += served_decode_failures(config, served)
    findings = scan_for_errors(lines, list(FAULT_LOG_PATTERNS) + args.ignore_log_pattern)
    outcomes = load.outcomes if load else []
    summary = soak.load_summary(outcomes, load.flushes if load else {}, load.max_in_flight if load else 0,
                                load.elapsed_s if load else 0.0)  # fmt: skip
    summary.update({k: report.get("hicache", {}).get(k, 0.0) for k in ("evicted_tokens", "load_back_tokens")})
    summary["flushes_quiesced"] = load.flushes_quiesced if load else 0
    skipped = ["kv audits", "tree dumps", "schedulers", "hicache activity"] if args.fake_server else []
    audits, audit_fail = ({}, []) if args.fake_server else audit_failures(out_dir, served)
    checkpoints_compared, tree_fail = (0, []) if args.fake_server else soak.compare_tree_dumps(tree_dir, args.tp)
    if not args.fake_server:
        activity = {"evicted_tokens": summary["evicted_tokens"], "load_back_tokens": summary["load_back_tokens"],
                    "requests_with_host_hits": summary["requests_with_host_hits"]}  # fmt: skip
        evidence_parts["hicache_failures"] = hicache_failures(activity)
    evidence = soak.SoakEvidence(
        summary=summary, outcomes=outcomes, log_failures=log_failures(findings),
        health_ok=evidence_parts["health_ok"],
        schedulers_alive=evidence_parts["schedulers_alive"],
        schedulers_expected=args.tp, audit_failures=audit_fail, tree_checkpoints=checkpoints_compared,
        tree_failures=checkpoints.missed + tree_fail, idle_failures=evidence_parts["idle_failures"],
        hicache_failures=evidence_parts["hicache_failures"], skipped=skipped,
    )  # fmt: skip
    failures = report["failures"] + soak.soak_failures(evidence)
    report.update(summary=summary, audits=audits, evidence=evidence.to_json(), failures=failures,
                  table_row=soak.table_row(args.name, summary, checkpoints_compared, served.describe(), failures))  # fmt: skip
    return report


def not_started_report(args, report: dict, error: str, served: ServedDecode) -> dict:
    """The report of a server that never answered ``/health``: its error is the one failure (every
    other check would only fail for the same reason); the decode it logged before, if any."""
    summary = soak.load_summary([], {}, 0, 0.0)
    summary.update(evicted_tokens=0.0, load_back_tokens=0.0, flushes_quiesced=0)
    failures = [error]
    report["decode"]["served"] = served.describe()
    report.update(summary=summary, audits={}, evidence={"tree_checkpoints": 0, "skipped": []}, failures=failures,
                  table_row=soak.table_row(args.name, summary, 0, served.describe(), failures))  # fmt: skip
    return report


def print_report(args, report: dict) -> None:
    s = report["summary"]
    print(f"\n== {args.name}: load held")
    print(f"requests sent {s['requests_sent']}: finished {s['finished']}, aborted {s['aborted']}, lost {s['error']}; "
          f"faults {s['faults']} (aborted {s['aborted_by_fault']}); flushes {s['flushes']}, "
          f"{s['flushes_quiesced']} of them after the requests ended")  # fmt: skip
    print(f"prompt tokens {s['prompt_tokens_sent']}, output tokens {s['output_tokens_received']}, max concurrency "
          f"{s['max_concurrency']}, {s['elapsed_s']} s; host hits {s['requests_with_host_hits']} requests / "
          f"{s['host_hit_tokens']} tokens; evicted {s['evicted_tokens']:.0f}, loaded back {s['load_back_tokens']:.0f} "
          "logical tokens")  # fmt: skip
    for key, value in report.get("audits", {}).items():
        print(f"{key}: {json.dumps(value)}")
    print(f"tree checkpoints compared across ranks: {report['evidence']['tree_checkpoints']}"
          + (f" (skipped: {', '.join(report['evidence']['skipped'])})" if report["evidence"]["skipped"] else ""))
    for failure in report["failures"]:
        print(f"FAIL {failure}")
    print(soak.TABLE_HEADER)
    print(report["table_row"])
    verdict = "FAIL" if report["failures"] else "PASS"
    first = f": {report['failures'][0][:300]}" if report["failures"] else ""
    decode = f"decode {report['decode']['served']} (asked: {report['decode']['asked']})"
    audits = report.get("audits", {})
    values = ""
    if "value_audit" in audits:
        values = "; " + value_audit_compare.verdict_text(audits["value_audit"], audits["value_tolerance"])
    print(f"VERDICT: {verdict} soak {args.name}{' (plant ' + args.plant + ')' if args.plant else ''}, {decode}"
          f"{values}{first}")


def _raise_on_sigterm(signum, frame):
    raise SystemExit(f"terminated by signal {signum}")


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)

    def plan_for_capacity(logical: int) -> soak.SoakPlan:
        return make_plan(args, logical)

    out_dir = Path(args.out_dir or f"glm5_soak_{time.strftime('%Y%m%d_%H%M%S')}")
    # Bad settings fail here, before a server starts: the plan for the logical pool shared KV promises
    # (cp_size x the cap). The run plans again from the pool the server reports.
    try:
        plan = plan_for_capacity(args.physical_tokens_per_rank * args.tp)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        port = args.port or free_port()
        config = serve_config(args, port)
        env = " ".join(f"{k}={v}" for k, v in server_env(args, out_dir, config).items())
        print(f"[{args.name}] {env} {shlex.join(config.command())}")
        print("\n".join(plan.describe()))
        return 0
    signal.signal(signal.SIGTERM, _raise_on_sigterm)  # so the server is stopped on SIGTERM too
    out_dir.mkdir(parents=True, exist_ok=True)
    report = run(args, plan_for_capacity, out_dir)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1, default=str))
    print_report(args, report)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
