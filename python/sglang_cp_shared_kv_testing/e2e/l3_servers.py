"""The audited servers of the served L3 checks: launch, request, stop, and each server's own verdict.

The L3 restart (``scripts/glm5_cp_l3_restart_smoke.py``) and the shared Mooncake Store
(``scripts/glm5_cp_l3_shared_store_smoke.py``) drive several servers each, with the smoke plugin's
KV audits on (``scripts/smoke_plugin``: the pool dumps by rid, the read audits, the value audit). What
they share is here: a server's environment, its start (or the stand-in's, ``--fake-server``), one
greedy request read as a ``ServedRequest``, a stop that waits for the audit dumps, and what a server
alone must show (``shared_kv_server_failures``): its read audits clean, the decode asked for logged,
no error line in its log; and the servers' value audits within a tolerance (``value_failures``).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from sglang_cp_shared_kv_testing.repo_scripts import REPO_ROOT

SMOKE_PLUGIN_DIR = REPO_ROOT / "scripts" / "smoke_plugin"
if str(SMOKE_PLUGIN_DIR) not in sys.path:
    sys.path.insert(0, str(SMOKE_PLUGIN_DIR))
from cp_shared_kv_smoke_hooks import SMOKE_AUDIT_DIR_ENV, SMOKE_DUMMY_INIT_ENV  # noqa: E402
from cp_shared_kv_smoke_hooks import decode_read_audit, kv_audit_compare, value_audit_compare  # noqa: E402

from sglang_cp_shared_kv_testing.e2e import l3_restart  # noqa: E402
from sglang_cp_shared_kv_testing.e2e.l3_restart import ServedRequest  # noqa: E402
from sglang_cp_shared_kv_testing.e2e.one_gpu import one_gpu_env  # noqa: E402
from sglang_cp_shared_kv_testing.e2e.server_log import scan_for_errors, served_decode  # noqa: E402
from sglang_cp_shared_kv_testing.e2e.server_process import (  # noqa: E402
    ServeConfig,
    ServerStartError,
    SglangServer,
    add_decode_options,
    free_port,
    generate_greedy,
    served_decode_failures,
)
from sglang_cp_shared_kv_testing.e2e.smoke_report import log_failures  # noqa: E402

FAKE_SERVER = [sys.executable, "-m", "sglang_cp_shared_kv_testing.e2e.fake_sglang_server"]
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def add_server_options(parser, suffix_on: str) -> None:
    """The options both L3 drivers give their servers and requests (the prompts, the pools, the
    model's load, the decode); ``suffix_on`` names the server the suffix is sent to."""
    p = parser
    p.add_argument("--prefix-tokens", type=int, default=8192, help="tokens of each stored prefix (whole pages)")
    p.add_argument("--suffix-tokens", type=int, default=256, help=f"new tokens after the prefix on {suffix_on}")
    p.add_argument("--prefixes", type=int, default=3, help="prefixes (the first warms up, the others are timed)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--physical-tokens-per-rank", type=int, default=16384, help="--max-total-tokens (per rank)")
    p.add_argument("--hicache-ratio", type=float, default=2.0)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--load-format", default=None, help="'dummy' for the tiny config")
    p.add_argument("--dummy-init", choices=["unit-gain", "stock"], default="unit-gain")
    p.add_argument("--token-id-range", default="0:256", help="LOW:HIGH, prompt token ids")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra-server-args", default="", help="more sglang serve arguments (every server)")
    p.add_argument("--ignore-log-pattern", action="append", default=[],
                   help="regex of server log lines not to treat as errors (as the serve smoke's)")
    p.add_argument("--one-gpu", action="store_true", help="test-only: every rank of every server on device 0")
    add_decode_options(p)


def smoke_env(args, audit_dir: Path) -> Dict[str, str]:
    """A smoke server's environment: the smoke plugin (audits into ``audit_dir``, unit-gain dummy
    weights, the one-GPU hook) reaches it through ``PYTHONPATH``, as in the serve smoke."""
    inherited = os.environ.get("PYTHONPATH")
    env = dict(OFFLINE_ENV)
    env["PYTHONPATH"] = str(SMOKE_PLUGIN_DIR) + (os.pathsep + inherited if inherited else "")
    env[SMOKE_AUDIT_DIR_ENV] = str(audit_dir)
    if args.load_format == "dummy" and args.dummy_init == "unit-gain":
        env[SMOKE_DUMMY_INIT_ENV] = "1"
    if args.one_gpu:
        env.update(one_gpu_env())
    return env


def launch_line(config: ServeConfig, env: Dict[str, str]) -> str:
    """The dry run's line of one server: its environment and its command."""
    assignments = " ".join(f"{k}={v}" for k, v in {**env, **config.env()}.items())
    return f"{assignments} {shlex.join(config.command())}"


def start(args, name: str, config: ServeConfig, env: Dict[str, str], log_path: Path) -> SglangServer:
    """Launch ``config`` (the stand-in server with ``args.fake_server``) on a free port it names; the
    caller waits for it (``wait_started``)."""
    config = dataclasses.replace(config, port=free_port())
    command = FAKE_SERVER + config.command()[2:] if args.fake_server else config.command()
    print(f"[{name}] starting: {shlex.join(command)}", flush=True)
    return SglangServer(command, config.port, log_path, {**os.environ, **env, **config.env()}).__enter__()


def wait_started(args, name: str, server: SglangServer) -> None:
    try:
        server.wait_started(args.startup_timeout)
    except ServerStartError as e:
        raise ServerStartError(f"{name} {e}") from e


def send(args, name: str, base_url: str, rid: str, prompt: List[int]) -> ServedRequest:
    """One greedy request of ``args.plan.max_new_tokens`` to ``base_url`` (a server's, or a router's
    in front of it), as the verdict reads it."""
    result = generate_greedy(base_url, prompt, args.plan.max_new_tokens, args.request_timeout, rid)
    served = ServedRequest(
        server=name, rid=rid, prompt_tokens=len(prompt),
        cached_tokens=int(result.meta_info.get("cached_tokens", 0) or 0),
        storage_tokens=l3_restart.storage_tokens(result.meta_info),
        ttft_ms=None if result.ttft_s is None else round(result.ttft_s * 1e3, 2), error=result.error,
    )  # fmt: skip
    print(f"[{name}] {rid} prompt={served.prompt_tokens} cached={served.cached_tokens} "
          f"from_l3={served.storage_tokens} ttft_ms={served.ttft_ms}" + (f" ERROR {served.error}" if served.error else ""),
          flush=True)  # fmt: skip
    return served


def nudge(server: SglangServer, count: int) -> None:
    """A one-token request: the ranks store a node's pages when its host copy is acknowledged, in
    the scheduler loop, which an idle server does not turn."""
    generate_greedy(server.base_url, [1 + count % 200] * 8, 1, 30, f"l3-nudge-{count}")


def stop(server: Optional[SglangServer], audit_dir: Path, name: str, logs: Dict[str, List[str]]) -> None:
    """Stop ``server`` once its pool dumps have settled; its log lines go to ``logs[name]``."""
    if server is None:
        return
    if server.alive():  # a server that exited writes no more dumps
        kv_audit_compare.wait_for_settled_dumps(audit_dir, timeout_s=60)
    server.stop()
    logs[name] = server.log_lines_before_stop()


def shared_kv_server_failures(name: str, audit_dir: Path, logs: Dict[str, List[str]], asked: ServeConfig,
                              ignore_log_patterns: Sequence[str], figures: Dict) -> List[str]:  # fmt: skip
    """What one shared-KV server must show by itself: its read audit clean, its decode read audit
    clean and judging wherever it decoded per owner, the decode asked for logged, no error line in
    its log. The audits' totals go to ``figures``."""
    totals = kv_audit_compare.read_audit_totals(audit_dir)
    figures[f"read_audit_{name}"] = totals
    failures = kv_audit_compare.read_audit_failures(totals)
    served = served_decode(logs.get(name, []))
    decode_totals = decode_read_audit.totals(audit_dir)
    figures[f"decode_read_audit_{name}"] = decode_totals
    failures += decode_read_audit.failures(decode_totals) + served.unaudited(decode_totals)
    if name in logs:
        failures += served_decode_failures(asked, served)
    return [f"{name}: {f}" for f in failures] + log_only_failures(name, logs, ignore_log_patterns)


def value_failures(audit_dirs: Dict[str, Path], bounds: Optional[Dict], expect_graph_replays: bool,
                   figures: Dict) -> List[str]:  # fmt: skip
    """The value audit of each shared-KV server (name: its audit dir) within ``bounds``: a stock
    reference's tolerance, or the recorded stock figures' where the call runs no stock server
    (``value_audit_compare``). Each server's figures, the bounds and a verdict line's text over all
    of them go to ``figures``."""
    failures, every = [], []
    for name, audit_dir in audit_dirs.items():
        values = value_audit_compare.totals(audit_dir)
        figures[f"value_audit_{name}"] = value_audit_compare.report(values)
        every += value_audit_compare.all_errors(values)
        failures += [f"{name}: {f}" for f in value_audit_compare.failures_within(
            values, bounds, expect_graph_replays=expect_graph_replays)]  # fmt: skip
    figures["value_tolerance"] = bounds
    figures["values"] = value_audit_compare.verdict_text({"all": value_audit_compare.summary(every)}, bounds)
    return failures


def log_only_failures(name: str, logs: Dict[str, List[str]], ignore_log_patterns: Sequence[str]) -> List[str]:
    """A server that never started, or error lines in its log."""
    if name not in logs:
        return [f"{name}: the server never started"]
    return [f"{name}: {f}" for f in log_failures(scan_for_errors(logs[name], ignore_log_patterns))]


def raise_on_sigterm(signum, frame):
    """A driver's SIGTERM handler: unwinding stops the servers it started (their ``finally``)."""
    raise SystemExit(f"terminated by signal {signum}")
