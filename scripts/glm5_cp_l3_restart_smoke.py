#!/usr/bin/env python3
"""Served L3 restart: a prefix stored by one shared-KV server is served from storage by a fresh one.

At one CP size (``--tp``), three shared-KV servers with HiCache and the decode a user gets
(``--decode server-default``: no decode setting, no ``--disable-cuda-graph`` where the default
decodes per owner; ``--decode`` / ``--cuda-graphs`` ask for another; ``sglang_cp_shared_kv_testing/e2e/l3_restart.py``
says what each serves and what is judged):

  1. ``write`` (``--hicache-storage-backend file`` on ``<out>/storage``, empty) and ``recompute`` (no
     storage) start together; ``write`` serves the prefixes and stops once the directory holds every
     page's KV and indexer objects;
  2. ``restart`` starts on the same directory; each prefix plus a new suffix goes to ``restart``, then
     to ``recompute``, in turn (prefix 0 warms both up).

Judged: every restart prompt's whole prefix served from L3 (``meta_info.cached_tokens_details
.storage``); the restored rows equal, byte for byte in every layer, the rows the write server
dumped (the KV audit's pool dumps); the restart server's layer-0 rows against the recompute
server's (the smoke's pool audit); the read audits of every server (the decode read audit where it
decoded per owner); every server's value audit within the recorded stock figures' tolerance (no
stock server runs here: ``value_audit_compare.recorded_tolerance``; under graphs replayed rows
checked); every server logged the decode asked for; no error line in any log. Reported:
TTFT of the prefix from L3 vs recomputed, labelled "one GPU, time-sliced" with ``--one-gpu``. The
verdict line names the decode the servers logged; a server that never answers ``/health`` makes it
FAILED quoting that server's error. Exits 1 on a failure, 2 on bad arguments.

The Mooncake backend is not served here: Mooncake Store keeps objects in the memory segments its
clients contribute, so a writing server that mounts one drops what it stored when it stops; a store
that outlives its writers needs a holder (scripts/glm5_cp_l3_shared_store_smoke.py,
docs/hicache-storage.md "Several servers, one Mooncake Store").

  python scripts/glm5_cp_l3_restart_smoke.py --model-path /tmp/tiny-glm5 --tp 2 --one-gpu --dry-run
  python scripts/glm5_cp_l3_restart_smoke.py --model-path /tmp/tiny-glm5 --tp 2 --one-gpu --load-format dummy
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from sglang_cp_shared_kv_testing.e2e import l3_restart, l3_servers
from sglang_cp_shared_kv_testing.e2e.l3_restart import RECOMPUTE, RESTART, WRITE, L3RestartPlan, ServedRequest
from sglang_cp_shared_kv_testing.e2e.l3_servers import kv_audit_compare, value_audit_compare
from sglang_cp_shared_kv_testing.e2e.request_plan import parse_token_id_range
from sglang_cp_shared_kv_testing.e2e.server_log import served_decode
from sglang_cp_shared_kv_testing.e2e.server_metrics import CACHED_TOKENS, parse_metrics
from sglang_cp_shared_kv_testing.e2e.server_process import (
    ServeConfig,
    ServerError,
    ServerStartError,
    SglangServer,
    decode_asked,
    decode_setup,
    shared_kv_serve_config,
)

NSA_CUDA_PAGE_SIZE = 64  # sglang 0.5.11 forces it for DSA models on CUDA
SERVERS = (WRITE, RECOMPUTE, RESTART)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True, help="a model dir, e.g. the tiny GLM-5 (make_tiny_glm5_config.py)")
    p.add_argument("--tp", type=int, default=2, help="--tp of every server (= CP size: 2, 4 or 8)")
    l3_servers.add_server_options(p, suffix_on="the restart")
    p.add_argument("--startup-timeout", type=float, default=420)
    p.add_argument("--request-timeout", type=float, default=300)
    p.add_argument("--storage-wait-s", type=float, default=60,
                   help="seconds the write server gets to store every page after its last response")
    p.add_argument("--out-dir", default=None, help="logs, pool dumps, storage dir, report.json")
    p.add_argument("--dry-run", action="store_true", help="print the servers' commands and the plan, launch nothing")
    p.add_argument("--fake-server", action="store_true",
                   help="test-only: launch sglang_cp_shared_kv_testing/e2e/fake_sglang_server.py instead (it stores nothing: only "
                        "its start and the verdict's form mean anything)")
    args = p.parse_args(argv)
    try:
        args.token_id_range = parse_token_id_range(args.token_id_range)
        args.plan = L3RestartPlan(
            prefixes=args.prefixes, prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens,
            page_size=NSA_CUDA_PAGE_SIZE, max_new_tokens=args.max_new_tokens,
            token_id_range=args.token_id_range, seed=args.seed,
        )  # fmt: skip
    except ValueError as e:
        p.error(str(e))
    if args.physical_tokens_per_rank % NSA_CUDA_PAGE_SIZE:
        p.error(f"--physical-tokens-per-rank must be a multiple of {NSA_CUDA_PAGE_SIZE}")
    try:
        decode_setup(args.decode, args.cuda_graphs, shlex.split(args.extra_server_args))
    except ValueError as e:
        p.error(str(e))
    return args


def storage_dir(out_dir: Path) -> Path:
    return out_dir / "storage"


def audit_dir(out_dir: Path, server: str) -> Path:
    return out_dir / f"audit_{server}"


def serve_config(args, server: str, port: int, out_dir: Path) -> ServeConfig:
    extra = shlex.split(args.extra_server_args)
    if server in (WRITE, RESTART):
        extra += ["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
                  json.dumps({"file_path": str(storage_dir(out_dir).resolve())})]  # fmt: skip
    return shared_kv_serve_config(args, port, extra)


def server_env(args, server: str, out_dir: Path) -> Dict[str, str]:
    return l3_servers.smoke_env(args, audit_dir(out_dir, server))


def decode_config(args, out_dir: Path) -> ServeConfig:
    """What every server is asked to decode with (the three differ in storage only)."""
    return serve_config(args, RECOMPUTE, 0, out_dir)


def start(args, server: str, out_dir: Path) -> SglangServer:
    config = serve_config(args, server, 0, out_dir)
    return l3_servers.start(args, server, config, server_env(args, server, out_dir), out_dir / f"server_{server}.log")


def send(args, server_name: str, server: SglangServer, rid: str, prompt: List[int]) -> ServedRequest:
    return l3_servers.send(args, server_name, server.base_url, rid, prompt)


def stored_objects(out_dir: Path) -> int:
    directory = storage_dir(out_dir)
    return sum(1 for p in directory.iterdir() if p.suffix == ".bin") if directory.is_dir() else 0


def wait_for_storage(args, server: SglangServer, out_dir: Path) -> int:
    """Until the directory holds every page's two objects (or the wait ends). The ranks store a
    node's pages when its host copy is acknowledged, in the scheduler loop; a one-page request
    every few seconds keeps that loop turning."""
    expected = 2 * args.plan.stored_pages()
    deadline, nudges = time.monotonic() + args.storage_wait_s, 0
    while stored_objects(out_dir) < expected and time.monotonic() < deadline:
        time.sleep(3)
        l3_servers.nudge(server, nudges)
        nudges += 1
    return stored_objects(out_dir)


def stop(server: Optional[SglangServer], out_dir: Path, name: str, logs: Dict[str, List[str]]) -> None:
    l3_servers.stop(server, audit_dir(out_dir, name), name, logs)


def serve(args, out_dir: Path, requests: List[ServedRequest], logs: Dict[str, List[str]], figures: Dict) -> None:
    plan = args.plan
    servers: Dict[str, Optional[SglangServer]] = {name: None for name in SERVERS}
    try:
        servers[WRITE], servers[RECOMPUTE] = start(args, WRITE, out_dir), start(args, RECOMPUTE, out_dir)
        l3_servers.wait_started(args, WRITE, servers[WRITE])
        l3_servers.wait_started(args, RECOMPUTE, servers[RECOMPUTE])
        for k in range(plan.prefixes):
            requests.append(send(args, WRITE, servers[WRITE], plan.write_rid(k), plan.write_prompt(k)))
        figures["objects_after_write"] = wait_for_storage(args, servers[WRITE], out_dir)
        stop(servers.pop(WRITE), out_dir, WRITE, logs)
        servers[RESTART] = start(args, RESTART, out_dir)
        l3_servers.wait_started(args, RESTART, servers[RESTART])
        for k in range(plan.prefixes):
            for name in (RESTART, RECOMPUTE):
                requests.append(send(args, name, servers[name], plan.read_rid(k), plan.read_prompt(k)))
        metrics = parse_metrics(servers[RESTART].get_text("/metrics"))
        figures["storage_counter_tokens"] = l3_restart.storage_counter_total(metrics.samples.get(CACHED_TOKENS, []))
    finally:
        for name, server in servers.items():
            stop(server, out_dir, name, logs)


def judge(args, out_dir: Path, requests: List[ServedRequest], logs: Dict[str, List[str]], figures: Dict) -> List[str]:
    plan = args.plan
    failures = l3_restart.hit_failures(plan, requests)
    failures += l3_restart.stored_object_failures(plan, figures.get("objects_after_write", 0))
    restart_hits = [r.storage_tokens or 0 for r in requests if r.server == RESTART]
    figures["l3_tokens"] = restart_hits
    restored = kv_audit_compare.restored_row_check(
        audit_dir(out_dir, WRITE), audit_dir(out_dir, RESTART),
        [(plan.write_rid(k), plan.read_rid(k), plan.prefix_tokens) for k in range(plan.prefixes)],
    )  # fmt: skip
    figures["restored_rows"] = {k: v for k, v in restored.items() if k != "failures"}
    failures += restored["failures"]
    pool = kv_audit_compare.compare_runs(audit_dir(out_dir, RESTART), audit_dir(out_dir, RECOMPUTE))
    figures["pool_audit"] = pool.to_json()
    figures["pool_audit_wrong_rows"] = pool.layer0_wrong_kv_rows + pool.layer0_wrong_index_rows
    figures["pool_audit_positions"] = pool.positions_compared
    failures += pool.failures
    asked = decode_config(args, out_dir)
    for name in SERVERS:
        failures += l3_servers.shared_kv_server_failures(name, audit_dir(out_dir, name), logs, asked,
                                                         args.ignore_log_pattern, figures)  # fmt: skip
    # No stock server runs here: every server's values are judged by the recorded stock figures.
    audit_dirs = {name: audit_dir(out_dir, name) for name in SERVERS}
    bounds = value_audit_compare.recorded_tolerance()
    failures += l3_servers.value_failures(audit_dirs, bounds, asked.cuda_graphs, figures)
    figures["ttft"] = l3_restart.ttft_comparison(plan, requests)
    return failures


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir or f"l3_restart_cp{args.tp}_{time.strftime('%Y%m%d_%H%M%S')}")
    if args.dry_run:
        for name in SERVERS:
            print(f"[{name}] {l3_servers.launch_line(serve_config(args, name, 30000, out_dir), server_env(args, name, out_dir))}")
        print("\n".join(args.plan.describe()))
        return 0
    if stored_objects(out_dir):
        print(f"error: {storage_dir(out_dir)} already holds objects; give a fresh --out-dir", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, l3_servers.raise_on_sigterm)  # so the servers are stopped on SIGTERM too
    out_dir.mkdir(parents=True, exist_ok=True)
    requests: List[ServedRequest] = []
    logs: Dict[str, List[str]] = {}
    figures: Dict = {}
    failures: List[str] = []
    not_started = None
    try:
        serve(args, out_dir, requests, logs, figures)
    except ServerStartError as e:
        not_started = str(e)  # every other check would fail for this reason alone
    except (ServerError, OSError, ValueError) as e:
        failures.append(f"server: {type(e).__name__}: {e}")
    figures["decode"] = {"asked": decode_asked(decode_config(args, out_dir)),
                         "served": {name: served_decode(logs[name]).describe() for name in SERVERS if name in logs}}  # fmt: skip
    failures = [not_started] if not_started else failures + judge(args, out_dir, requests, logs, figures)
    (out_dir / "report.json").write_text(json.dumps(
        {"tp": args.tp, "plan": args.plan.describe(), "requests": [r.to_json() for r in requests],
         "figures": figures, "failures": failures}, indent=1))  # fmt: skip
    for failure in failures:
        print(f"FAIL {failure}")
    print(l3_restart.verdict_line(args.tp, failures, figures), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
