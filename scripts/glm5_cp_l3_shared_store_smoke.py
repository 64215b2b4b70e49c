#!/usr/bin/env python3
"""Two shared-KV servers, one Mooncake Store: a prefix one server computed is an L3 hit on the other,
while the first is up and after it stopped.

The store: our own ``mooncake_master`` and the holder (the wheel's ``mooncake_client``, mounting
the store's only segment, ``--holder-segment-gb``); the servers mount none, so what they store
lives in the holder and outlives them (docs/hicache-storage.md, "Several servers, one Mooncake
Store"). Three servers with HiCache and the KV audits on, the shared-KV ones with the decode a user
gets (``--decode server-default``; ``--decode`` / ``--cuda-graphs`` ask for another;
``sglang_cp_shared_kv_testing/e2e/shared_store.py`` says what each serves and what is judged):

  1. ``a`` (CP ``--tp-a``, ``--hicache-storage-backend mooncake``, page_first) and ``reference``
     (stock, CP ``--tp-b``, no storage) start; ``a`` serves the prefixes, and every page's KV and
     indexer objects must reach the holder;
  2. ``b`` (CP ``--tp-b``, the same store) starts and serves each prefix plus a suffix, and so does
     ``reference``;
  3. with ``--router``: ``sglang_router`` (round robin) in front of ``a`` and ``b``, new prefixes
     through it, each then with a suffix: the read lands on the other server and must come from L3;
  4. ``a`` stops; its objects must still be in the holder; ``b`` and ``reference`` flush their caches
     and serve each prefix plus another suffix: ``b``'s prefixes from L3 again.

Judged: every ``b`` prompt's whole prefix from L3 (``meta_info.cached_tokens_details.storage``),
with A up and after A stopped; every restored row equal, byte for byte in every layer, to the row
``a`` dumped (the KV audit's pool dumps, ``restored_row_check``); the objects: all of ``a``'s in the
holder's segment and nowhere else, no segment but the holder's mounted, before and after ``a``
stopped; ``b``'s layer-0 rows against stock's (the pool audit); the value audit of ``a`` and ``b``
within the tolerance the reference's own errors set; the read audits and decode read audits; every
shared-KV server logged the decode asked for and the same key namespace; no error line in any log;
through the router, each read on the other server whole from L3. Reported: B's L3 hit rate, TTFT
of the prefix from L3 vs recomputed (labelled "one GPU, time-sliced" with ``--one-gpu``). A server,
the store or the router that does not start makes it FAILED quoting why, nothing else. Exits 1 on
a failure, 2 on bad arguments.

  python scripts/glm5_cp_l3_shared_store_smoke.py --model-path /tmp/tiny-glm5 --tp-b 4 --one-gpu --router --dry-run
  python scripts/glm5_cp_l3_shared_store_smoke.py --model-path /tmp/tiny-glm5 --tp-b 4 --one-gpu --load-format dummy
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from sglang_cp_shared_kv_testing import mooncake_master as store_processes
from sglang_cp_shared_kv_testing.e2e import l3_servers, shared_store
from sglang_cp_shared_kv_testing.e2e.l3_restart import ServedRequest
from sglang_cp_shared_kv_testing.e2e.l3_servers import kv_audit_compare
from sglang_cp_shared_kv_testing.e2e.one_gpu import with_one_gpu_args
from sglang_cp_shared_kv_testing.e2e.request_plan import parse_token_id_range
from sglang_cp_shared_kv_testing.e2e.server_log import served_decode
from sglang_cp_shared_kv_testing.e2e.server_metrics import parse_metrics
from sglang_cp_shared_kv_testing.e2e.server_process import (
    LOOPBACK,
    ServeConfig,
    ServerError,
    ServerStartError,
    SglangServer,
    decode_asked,
    decode_setup,
    free_port,
    shared_kv_serve_config,
)
from sglang_cp_shared_kv_testing.e2e.shared_store import A, B, REFERENCE, SharedStorePlan

sys.path.insert(0, str(l3_servers.SMOKE_PLUGIN_DIR))
from cp_shared_kv_smoke_hooks import SMOKE_LIFT_TP_RULE_ENV, value_audit_compare  # noqa: E402

NSA_CUDA_PAGE_SIZE = 64  # sglang 0.5.11 forces it for DSA models on CUDA
SERVERS = (A, REFERENCE, B)
ROUTER = "router"
PROMPT_TOKENS = "sglang:prompt_tokens_total"
# The dry run's ports (a run takes free ones).
DRY_RUN_PORTS = {"rpc": 50051, "metrics": 50052, "holder": 50060, "router": 30100, A: 30000, REFERENCE: 30001, B: 30002}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True, help="a model dir, e.g. the tiny GLM-5 (make_tiny_glm5_config.py)")
    p.add_argument("--tp-a", type=int, default=2, help="--tp of server a, which computes (= its CP size)")
    p.add_argument("--tp-b", type=int, default=2, help="--tp of server b, which hits, and of the reference (2, 4 or 8)")
    l3_servers.add_server_options(p, suffix_on="b")
    p.add_argument("--holder-segment-gb", type=float, default=4.0,
                   help="host memory the holder mounts for the store (every object lives there)")
    p.add_argument("--router", action="store_true", help="a router phase: sglang_router in front of a and b")
    p.add_argument("--router-prefixes", type=int, default=2, help="new prefixes sent through the router")
    p.add_argument("--startup-timeout", type=float, default=420)
    p.add_argument("--request-timeout", type=float, default=300)
    p.add_argument("--storage-wait-s", type=float, default=60,
                   help="seconds a server gets to store every page of what it computed after its last response")
    p.add_argument("--out-dir", default=None, help="logs, pool dumps, report.json")
    p.add_argument("--dry-run", action="store_true", help="print every process's command and the plan, launch nothing")
    p.add_argument("--fake-server", action="store_true",
                   help="test-only: launch sglang_cp_shared_kv_testing/e2e/fake_sglang_server.py and no store (the "
                        "stand-ins store nothing: only their start and the verdict's form mean anything)")
    args = p.parse_args(argv)
    try:
        args.token_id_range = parse_token_id_range(args.token_id_range)
        args.plan = SharedStorePlan(
            prefixes=args.prefixes, prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens,
            page_size=NSA_CUDA_PAGE_SIZE, max_new_tokens=args.max_new_tokens, token_id_range=args.token_id_range,
            seed=args.seed, router_prefixes=args.router_prefixes if args.router else 0,
        )  # fmt: skip
        decode_setup(args.decode, args.cuda_graphs, shlex.split(args.extra_server_args))
    except ValueError as e:
        p.error(str(e))
    if args.physical_tokens_per_rank % NSA_CUDA_PAGE_SIZE:
        p.error(f"--physical-tokens-per-rank must be a multiple of {NSA_CUDA_PAGE_SIZE}")
    if args.holder_segment_gb <= 0:
        p.error("--holder-segment-gb must be positive: the holder's segment is where every object lives")
    if args.router and not args.dry_run and importlib.util.find_spec("sglang_router") is None:
        p.error("--router needs sglang_router (pip install sglang-router)")
    return args


def audit_dir(out_dir: Path, server: str) -> Path:
    return out_dir / f"audit_{server}"


def storage_args(rpc_port: int) -> List[str]:
    """A shared-KV server's L3 storage: the store's master on loopback, no segment of its own."""
    extra = store_processes.client_extra_config(rpc_port, 0)
    return ["--hicache-mem-layout", "page_first", "--hicache-storage-backend", "mooncake",
            "--hicache-storage-backend-extra-config", extra]  # fmt: skip


def serve_config(args, server: str, rpc_port: int) -> ServeConfig:
    extra = shlex.split(args.extra_server_args)
    if server == REFERENCE:
        return ServeConfig(
            model_path=args.model_path, tp_size=args.tp_b, shared_kv=False, port=0,
            physical_tokens_per_rank=args.physical_tokens_per_rank, hicache_ratio=args.hicache_ratio,
            mem_fraction_static=args.mem_fraction_static, load_format=args.load_format,
            extra_args=with_one_gpu_args(extra) if args.one_gpu else extra,
        )  # fmt: skip
    tp = args.tp_a if server == A else args.tp_b
    return shared_kv_serve_config(argparse.Namespace(**{**vars(args), "tp": tp}), 0, extra + storage_args(rpc_port))


def server_env(args, server: str, out_dir: Path) -> Dict[str, str]:
    env = l3_servers.smoke_env(args, audit_dir(out_dir, server))
    if server == REFERENCE:
        env[SMOKE_LIFT_TP_RULE_ENV] = "1"  # stock NSA prefill CP at --tp-b (stock wants --tp 8)
    return env


def decode_config(args) -> ServeConfig:
    """What a and b are asked to decode with (the same; they differ in CP size only)."""
    return serve_config(args, A, 0)


def router_command(port: int, worker_urls: List[str]) -> List[str]:
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", LOOPBACK, "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", "round_robin", "--log-level", "info"]  # fmt: skip


class Store:
    """The run's Mooncake Store: master and holder, started and asked here (none with
    ``--fake-server``: the stand-ins store nothing)."""

    def __init__(self, args, out_dir: Path, ports: Dict[str, int]):
        self.args, self.out_dir, self.ports = args, out_dir, ports
        self.master = self.holder = self.segment = None

    def commands(self) -> List[List[str]]:
        segment_bytes = int(self.args.holder_segment_gb * (1 << 30))
        return [store_processes.master_command(self.ports["rpc"], self.ports["metrics"]),
                store_processes.holder_command(self.ports["rpc"], self.ports["holder"], segment_bytes)]  # fmt: skip

    def start(self) -> None:
        if self.args.fake_server:
            return
        try:
            self.master = store_processes.start_master(self.ports["rpc"], self.ports["metrics"],
                                                       log=self.out_dir / "mooncake_master.log")  # fmt: skip
            self.holder, self.segment = store_processes.start_holder(
                self.ports["rpc"], self.ports["metrics"], self.ports["holder"],
                int(self.args.holder_segment_gb * (1 << 30)), log=self.out_dir / "mooncake_holder.log",
            )  # fmt: skip
        except RuntimeError as e:
            raise ServerStartError(f"the Mooncake Store did not start: {e}") from e
        print(f"[store] master on 127.0.0.1:{self.ports['rpc']}, holder segment {self.segment}", flush=True)

    def held(self, keys: List[str]) -> Dict[str, List[str]]:
        if self.master is None:
            return {key: [] for key in keys}
        return store_processes.object_endpoints(self.ports["metrics"], keys)

    def failures(self, when: str, keys: List[str], figures: Dict) -> List[str]:
        """``shared_store.store_failures`` now; the count held goes to ``figures``."""
        if self.master is None:
            return [f"store ({when}): no store (stand-in servers)"]
        endpoints = self.held(keys)
        figures[f"objects_held_{when.replace(' ', '_')}"] = sum(1 for key in keys if endpoints[key])
        segments = [s.endpoint for s in store_processes.mounted_segments(self.ports["metrics"])]
        return shared_store.store_failures(when, keys, endpoints, self.segment.endpoint, segments)

    def stop(self) -> None:
        for process in (self.holder, self.master):
            if process is not None:
                store_processes.stop_store_process(process)


def expected_objects(server: SglangServer, prompts: List[List[int]]) -> List[str]:
    """The objects ``prompts``' pages must have in the store, under the namespace ``server`` logged
    (none while it logged none: the verdict says so)."""
    lines = server.log_path.read_bytes().decode("utf-8", errors="replace").splitlines()
    tags = shared_store.namespace_tags(lines)
    if not tags:
        return []
    return [key for prompt in prompts for key in shared_store.page_object_keys(tags[0], prompt, NSA_CUDA_PAGE_SIZE)]


def wait_for_store(args, store: Store, server: SglangServer, keys: List[str]) -> None:
    """Until the store holds every key (or the wait ends), nudging ``server``'s scheduler loop."""
    deadline, nudges = time.monotonic() + args.storage_wait_s, 0
    while keys and not all(store.held(keys).values()) and time.monotonic() < deadline:
        time.sleep(3)
        l3_servers.nudge(server, nudges)
        nudges += 1


def flush(server: SglangServer) -> None:
    """Empty the server's device and host tiers (``/flush_cache`` waits for it to be idle); L3 stays."""
    import requests

    response = requests.post(server.base_url + "/flush_cache", params={"timeout": 60}, timeout=90)
    if response.status_code != 200:
        raise ServerError(f"/flush_cache of {server.base_url}: HTTP {response.status_code} {response.text[:200]}")


def prompt_counters(servers: Dict[str, SglangServer]) -> Dict[str, float]:
    return {name: parse_metrics(servers[name].get_text("/metrics")).total(PROMPT_TOKENS) for name in (A, B)}


def server_of(prompt_tokens: int, before: Dict[str, float], servers: Dict[str, SglangServer]) -> str:
    """The server that counted the request just answered (``shared_store.served_by``), asked until
    one has: a server may count a finished request a moment after its last chunk ("unknown": none
    within 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        name = shared_store.served_by(prompt_tokens, before, prompt_counters(servers))
        if name is not None or time.monotonic() > deadline:
            return name or "unknown"
        time.sleep(0.5)


def start_router(args, out_dir: Path, servers: Dict[str, SglangServer], port: int) -> SglangServer:
    """``sglang_router`` in front of a and b; returns once it lists both as healthy workers."""
    import requests

    command = router_command(port, [servers[A].base_url, servers[B].base_url])
    print(f"[{ROUTER}] starting: {shlex.join(command)}", flush=True)
    router = SglangServer(command, port, out_dir / "router.log", dict(os.environ)).__enter__()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if not router.alive():
            break
        try:
            workers = requests.get(router.base_url + "/workers", timeout=5).json().get("workers", [])
            if sum(1 for w in workers if w.get("is_healthy")) == 2:
                return router
        except (requests.RequestException, ValueError):
            pass
        time.sleep(1)
    router.stop()
    tail = " | ".join(router.log_lines_before_stop()[-3:])
    raise ServerStartError(f"{ROUTER} did not list a and b as healthy within 120 s: {tail}")


def route(args, out_dir: Path, store: Store, servers: Dict[str, SglangServer], requests_out: List[ServedRequest],
          port: int) -> None:  # fmt: skip
    """The router phase: each router prefix, then the prefix plus a suffix, through the router; the
    server of each request read from the prompt-token counters (requests are sent one at a time)."""
    plan = args.plan
    router = start_router(args, out_dir, servers, port)
    try:
        for j in range(plan.router_prefixes):
            for rid, prompt in ((plan.router_write_rid(j), plan.router_write_prompt(j)),
                                (plan.router_read_rid(j), plan.router_read_prompt(j))):  # fmt: skip
                before = prompt_counters(servers)
                served = l3_servers.send(args, ROUTER, router.base_url, rid, prompt)
                served.server = server_of(len(prompt), before, servers)
                requests_out.append(served)
                if rid == plan.router_write_rid(j) and served.server in servers:
                    wait_for_store(args, store, servers[served.server], expected_objects(servers[served.server], [prompt]))
    finally:
        router.stop()


def serve(args, out_dir: Path, store: Store, requests_out: List[ServedRequest], logs: Dict[str, List[str]],
          figures: Dict, failures: List[str]) -> None:  # fmt: skip
    plan = args.plan
    servers: Dict[str, Optional[SglangServer]] = {}

    def start(name: str) -> SglangServer:
        config = serve_config(args, name, store.ports["rpc"])
        servers[name] = l3_servers.start(args, name, config, server_env(args, name, out_dir), out_dir / f"server_{name}.log")
        return servers[name]

    def send(name: str, rid: str, prompt: List[int]) -> None:
        requests_out.append(l3_servers.send(args, name, servers[name].base_url, rid, prompt))

    try:
        store.start()
        start(A)
        start(REFERENCE)
        l3_servers.wait_started(args, A, servers[A])
        l3_servers.wait_started(args, REFERENCE, servers[REFERENCE])
        for k in range(plan.prefixes):
            send(A, plan.write_rid(k), plan.write_prompt(k))
        expected = expected_objects(servers[A], [plan.write_prompt(k) for k in range(plan.prefixes)])
        figures["objects_expected"] = len(expected)
        wait_for_store(args, store, servers[A], expected)
        failures += store.failures("a up", expected, figures)
        l3_servers.wait_started(args, B, start(B))
        for k in range(plan.prefixes):
            send(B, plan.live_rid(k), plan.live_prompt(k))
            send(REFERENCE, plan.live_rid(k), plan.live_prompt(k))
        failures += store.failures("a and b up", expected, figures)
        if plan.router_prefixes:
            route(args, out_dir, store, servers, requests_out, free_port())
        l3_servers.stop(servers.pop(A), audit_dir(out_dir, A), A, logs)
        failures += store.failures("after a stopped", expected, figures)
        figures["objects_in_holder"] = figures.get("objects_held_after_a_stopped")
        flush(servers[B])
        flush(servers[REFERENCE])
        for k in range(plan.prefixes):
            send(B, plan.after_rid(k), plan.after_prompt(k))
            send(REFERENCE, plan.after_rid(k), plan.after_prompt(k))
    finally:
        for name, server in servers.items():
            l3_servers.stop(server, audit_dir(out_dir, name), name, logs)
        store.stop()


def judge(args, out_dir: Path, requests: List[ServedRequest], logs: Dict[str, List[str]], figures: Dict) -> List[str]:
    plan = args.plan
    failures = shared_store.hit_failures(plan, requests) + shared_store.router_failures(plan, requests)
    tags = {name: sorted(set(shared_store.namespace_tags(logs.get(name, [])))) for name in (A, B)}
    figures["namespace_tags"] = tags
    if not tags[A] or len(tags[A]) > 1 or tags[A] != tags[B]:
        failures.append(f"namespace: a and b must each log one key namespace, the same: a {tags[A]}, b {tags[B]}")
    restored = kv_audit_compare.restored_row_check(audit_dir(out_dir, A), audit_dir(out_dir, B),
                                                   shared_store.restored_pairs(plan))  # fmt: skip
    by_rid = {r.rid: r for r in requests}
    for j in range(plan.router_prefixes):
        write, read = by_rid.get(plan.router_write_rid(j)), by_rid.get(plan.router_read_rid(j))
        if write and read and {write.server, read.server} == {A, B}:  # router_failures judges the rest
            routed = kv_audit_compare.restored_row_check(audit_dir(out_dir, write.server), audit_dir(out_dir, read.server),
                                                         [(write.rid, read.rid, plan.prefix_tokens)])  # fmt: skip
            for key in ("requests", "positions_checked", "positions_differing"):
                restored[key] += routed[key]
            restored["failures"] += routed["failures"]
    figures["restored_rows"] = {k: v for k, v in restored.items() if k != "failures"}
    failures += restored["failures"]
    pool = kv_audit_compare.compare_runs(audit_dir(out_dir, B), audit_dir(out_dir, REFERENCE))
    figures["pool_audit"] = pool.to_json()
    figures["pool_audit_wrong_rows"] = pool.layer0_wrong_kv_rows + pool.layer0_wrong_index_rows
    figures["pool_audit_positions"] = pool.positions_compared
    failures += pool.failures
    failures += value_failures(args, out_dir, figures)
    asked = decode_config(args)
    for name in (A, B):
        failures += l3_servers.shared_kv_server_failures(name, audit_dir(out_dir, name), logs, asked,
                                                         args.ignore_log_pattern, figures)  # fmt: skip
    failures += l3_servers.log_only_failures(REFERENCE, logs, args.ignore_log_pattern)
    figures["l3_hit_rate"] = shared_store.l3_hit_rate(plan, requests)
    figures["ttft"] = shared_store.ttft_comparison(plan, requests)
    if plan.router_prefixes:
        reads = [by_rid[plan.router_read_rid(j)] for j in range(plan.router_prefixes) if plan.router_read_rid(j) in by_rid]
        figures["router"] = (f"{sum(1 for r in reads if r.storage_tokens == plan.prefix_tokens)} of "
                             f"{plan.router_prefixes} reads whole from L3 on the other server")  # fmt: skip
    return failures


def value_failures(args, out_dir: Path, figures: Dict) -> List[str]:
    """The value audit of a and b within the tolerance of the reference's own errors (which must
    have checked rows, prefill among them)."""
    reference = value_audit_compare.totals(audit_dir(out_dir, REFERENCE))
    failures = [f"reference: {f}" for f in value_audit_compare.failures(reference, reference, expect_prefill=True)]
    tolerance = value_audit_compare.tolerance(reference)
    figures["value_tolerance_max"] = tolerance and round(tolerance["max"], 5)
    worst = []
    for name in (A, B):
        values = value_audit_compare.totals(audit_dir(out_dir, name))
        figures[f"value_audit_{name}"] = value_audit_compare.report(values)
        worst += value_audit_compare.all_errors(values)
        failures += [f"{name}: {f}" for f in value_audit_compare.failures(
            values, reference, expect_graph_replays=decode_config(args).cuda_graphs)]  # fmt: skip
    figures["value_max"] = round(max(worst), 5) if worst else None
    return failures


def dry_run(args, out_dir: Path) -> None:
    store = Store(args, out_dir, DRY_RUN_PORTS)
    for name, command in zip(("master", "holder"), store.commands()):
        print(f"[{name}] {shlex.join(command)}")
    for name in SERVERS:
        config = dataclasses.replace(serve_config(args, name, DRY_RUN_PORTS["rpc"]), port=DRY_RUN_PORTS[name])
        print(f"[{name}] {l3_servers.launch_line(config, server_env(args, name, out_dir))}")
    if args.plan.router_prefixes:
        urls = [f"http://{LOOPBACK}:{DRY_RUN_PORTS[name]}" for name in (A, B)]
        print(f"[{ROUTER}] {shlex.join(router_command(DRY_RUN_PORTS['router'], urls))}")
    print("\n".join(args.plan.describe()))


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    name = shared_store.run_name(args.tp_a, args.tp_b)
    out_dir = Path(args.out_dir or f"{name}_{time.strftime('%Y%m%d_%H%M%S')}")
    if args.dry_run:
        dry_run(args, out_dir)
        return 0
    signal.signal(signal.SIGTERM, l3_servers.raise_on_sigterm)  # so every process is stopped on SIGTERM too
    out_dir.mkdir(parents=True, exist_ok=True)
    store = Store(args, out_dir, {"rpc": free_port(), "metrics": free_port(), "holder": free_port()})
    requests: List[ServedRequest] = []
    logs: Dict[str, List[str]] = {}
    figures: Dict = {}
    failures: List[str] = []
    not_started = None
    try:
        serve(args, out_dir, store, requests, logs, figures, failures)
    except ServerStartError as e:
        not_started = str(e)  # every other check would fail for this reason alone
    except (ServerError, OSError, ValueError) as e:
        failures.append(f"server: {type(e).__name__}: {e}")
    figures["decode"] = {"asked": decode_asked(decode_config(args)),
                         "served": {n: served_decode(logs[n]).describe() for n in (A, B) if n in logs}}  # fmt: skip
    failures = [not_started] if not_started else failures + judge(args, out_dir, requests, logs, figures)
    (out_dir / "report.json").write_text(json.dumps(
        {"tp_a": args.tp_a, "tp_b": args.tp_b, "plan": args.plan.describe(),
         "requests": [r.to_json() for r in requests], "figures": figures, "failures": failures}, indent=1))  # fmt: skip
    for failure in failures:
        print(f"FAIL {failure}")
    print(shared_store.verdict_line(args.tp_a, args.tp_b, failures, figures), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
