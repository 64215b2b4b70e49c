"""A stand-in for ``sglang serve`` on loopback, for the serving benchmark's dry run on a CPU.

  python -m sglang_cp_shared_kv_testing.e2e.fake_sglang_server <the arguments of sglang serve>

It takes the command line the benchmark would give sglang (``--port``, ``--tp``,
``--max-total-tokens``, ``--enable-nsa-prefill-cp-shared-kv``, ``--enable-hierarchical-cache``,
``--hicache-ratio``, ``--disaggregation-mode``; the rest is ignored) and answers the endpoints the
benchmark and the soak use as sglang 0.5.11 does: ``/health`` (and ``/health_generate``), ``/server_info`` (and the deprecated
``/get_server_info``) with ``max_total_num_tokens`` (``cp_size`` x the per-rank pool under shared
KV), ``/generate`` (streamed ``data:`` chunks or one JSON body, ``meta_info`` with ``cached_tokens``
and ``cached_tokens_details``), ``/flush_cache``, ``/abort_request`` (accepted, the request still runs to its end) and ``/metrics`` (``sglang:cached_tokens_total`` by
``cache_source``, ``sglang:prompt_tokens_total``, ``sglang:max_total_num_tokens``).

Its device pool is ``--max-total-tokens`` rows per rank or, for a model directory whose config.json
gives ``num_hidden_layers``, at most what a fixed KV budget (``FAKE_KV_BUDGET_BYTES``) holds, less the
shared-KV gather scratch's reservation as the plugin's runtime makes it (slot 0: the logical capacity,
or one prefill batch where decode runs per owner, ``decodes_per_owner``; ``FAKE_SGLANG_NO_SCRATCH=1`` skips
the reservation: a planted capacity bug; ``FAKE_SGLANG_FAIL_EVERY=N`` answers every Nth ``/generate``
with HTTP 500: a planted server error); it logs sglang's "KV Cache is allocated" line, the
runtime's slot-0 and decode-path lines and, without ``--disable-cuda-graph``, sglang's end of graph
capture per rank.
Its cache is ``PrefixCacheModel``: whole pages, a device tier and (with HiCache) a host tier, LRU
leaf-first eviction, device pages written through to host. Latency is a fixed cost per token
computed, per token loaded from host and per output token, so a hit is visibly cheaper. It binds
127.0.0.1 only and exits on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional, Sequence, Tuple

LOOPBACK = "127.0.0.1"
PAGE_SIZE = 64
# Simulated costs (seconds): small enough that a dry run takes seconds.
FIXED_S = 0.002
PER_COMPUTED_TOKEN_S = 2e-6
PER_HOST_TOKEN_S = 2e-7
PER_OUTPUT_TOKEN_S = 0.0005
FAKE_TOKEN_ID = 7
FAKE_KV_BUDGET_BYTES = 2 << 30  # per rank
NO_SCRATCH_ENV = "FAKE_SGLANG_NO_SCRATCH"
FAIL_EVERY_ENV = "FAKE_SGLANG_FAIL_EVERY"  # N: every Nth /generate answers HTTP 500 (a planted server error)


class PrefixCacheModel:
    """Whole-page prefix cache with a device and a host tier (capacities in tokens).

    A page is keyed by the prompt prefix it ends (all earlier tokens included), so a match walks
    pages from the start and stops at the first page not cached. ``serve`` returns the tokens
    matched on device and on host, then makes the prompt's pages device-resident and most recent.
    """

    def __init__(self, device_tokens: int, host_tokens: int, page_size: int = PAGE_SIZE):
        self.device_pages = device_tokens // page_size
        self.host_pages = host_tokens // page_size
        self.page_size = page_size
        self.clock = 0
        self.device: Dict[Tuple[int, ...], Tuple[int, int]] = {}  # key -> (last use, depth)
        self.host: Dict[Tuple[int, ...], Tuple[int, int]] = {}

    def _keys(self, input_ids: Sequence[int]) -> List[Tuple[int, ...]]:
        full = len(input_ids) // self.page_size
        return [tuple(input_ids[: (k + 1) * self.page_size]) for k in range(full)]

    def serve(self, input_ids: Sequence[int]) -> Tuple[int, int]:
        self.clock += 1
        keys = self._keys(input_ids)
        # A prompt never hits its own last token: sglang computes at least one (its logits).
        if keys and len(keys) * self.page_size == len(input_ids):
            keys_matchable = keys[:-1]
        else:
            keys_matchable = keys
        device_hit = host_hit = 0
        for key in keys_matchable:
            if key in self.device:
                device_hit += self.page_size
            elif key in self.host:
                host_hit += self.page_size
            else:
                break
        for depth, key in enumerate(keys):
            self.device[key] = (self.clock, depth)
            if self.host_pages:
                self.host[key] = (self.clock, depth)  # write-through
        self._evict(self.device, self.device_pages)
        self._evict(self.host, self.host_pages)
        return device_hit, host_hit

    @staticmethod
    def _evict(tier: Dict, capacity_pages: int) -> None:
        if len(tier) <= capacity_pages:
            return
        # Oldest first; within one use, deepest first (leaves before their parents).
        victims = sorted(tier, key=lambda k: (tier[k][0], -tier[k][1]))[: len(tier) - capacity_pages]
        for key in victims:
            del tier[key]

    def flush(self) -> None:
        self.device.clear()
        self.host.clear()


def parse_serve_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-total-tokens", type=int, default=65536)
    p.add_argument("--enable-nsa-prefill-cp-shared-kv", action="store_true")
    p.add_argument("--enable-hierarchical-cache", action="store_true")
    p.add_argument("--hicache-ratio", type=float, default=2.0)
    p.add_argument("--disaggregation-mode", default="null")
    p.add_argument("--model-path", default="")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--disable-cuda-graph", action="store_true")
    args, _ = p.parse_known_args(list(argv))
    return args


def decodes_per_owner(args: argparse.Namespace) -> bool:
    """``decode_path``'s rule for the decode impl sglang picks on Hopper (bf16 KV: fa3, fp8 KV:
    flashmla_kv), without importing sglang: ``per_owner`` always, ``auto`` with fa3 only."""
    from sglang_cp_shared_kv.startup_rules import AUTO_PER_OWNER_DECODE_IMPLS
    from sglang_cp_shared_kv.settings import AUTO, PER_OWNER, current_settings

    from sglang_cp_shared_kv_testing.e2e.server_process import hopper_nsa_decode_impl

    path = current_settings().decode_path
    impl = hopper_nsa_decode_impl(["--kv-cache-dtype", args.kv_cache_dtype])
    return path == PER_OWNER or (path == AUTO and impl in AUTO_PER_OWNER_DECODE_IMPLS)


def decode_line(args: argparse.Namespace) -> str:
    """The decode path a shared-KV server's rank logs at startup (``per_owner_decode.attach``)."""
    from sglang_cp_shared_kv.settings import DECODE_PATH_ENV, current_settings
    from sglang_cp_shared_kv_testing.e2e.server_process import hopper_nsa_decode_impl

    impl = hopper_nsa_decode_impl(["--kv-cache-dtype", args.kv_cache_dtype])
    if decodes_per_owner(args):
        return f"CP shared KV: decode per owner with {impl} (local top-k + LSE merge, no page gather)"
    return (f"CP shared KV: decode uses the page gather: {DECODE_PATH_ENV}={current_settings().decode_path} "
            f"with --nsa-decode-backend {impl} (fake server)")  # fmt: skip


def startup_problem(args: argparse.Namespace) -> Optional[str]:
    """What the real startup validation refuses here: shared KV with CUDA graphs unless decode runs
    per owner with graphs on (``decode_path``)."""
    from sglang_cp_shared_kv.settings import DECODE_PATH_ENV, GRAPH_DECODE_ENV, current_settings

    if not args.enable_nsa_prefill_cp_shared_kv or args.disable_cuda_graph:
        return None
    if decodes_per_owner(args) and current_settings().decode_cuda_graph:
        return None
    return (
        f"--disable-cuda-graph is required unless decode runs per owner ({DECODE_PATH_ENV}) "
        f"with {GRAPH_DECODE_ENV} on"
    )


def physical_pool_tokens(args: argparse.Namespace, cp_size: int) -> Tuple[int, Optional[int]]:
    """(Rows per rank: the cap, or what the budget holds (see the module docstring); the gather
    scratch's slot 0 in logical tokens, None without a reservation)."""
    import os
    from pathlib import Path

    config = Path(args.model_path) / "config.json"
    model = json.loads(config.read_text()) if config.is_file() else {}
    layers = model.get("num_hidden_layers")
    if not layers:
        return args.max_total_tokens, None
    from sglang_cp_shared_kv.model_executor.gather_scratch import scratch_bytes, slot0_scratch_tokens
    from sglang_cp_shared_kv.startup_rules import default_prefill_scratch_tokens
    from sglang_cp_shared_kv_testing.e2e.glm5_width import kv_bytes_per_token_per_layer, kv_row_bytes

    dtype = "fp8" if args.kv_cache_dtype.startswith("fp8") else "bf16"
    cell = layers * kv_bytes_per_token_per_layer(dtype)
    pages = lambda budget: int(budget // cell) // PAGE_SIZE * PAGE_SIZE  # noqa: E731
    stock = min(args.max_total_tokens, pages(FAKE_KV_BUDGET_BYTES))
    if cp_size == 1 or os.environ.get(NO_SCRATCH_ENV) == "1":
        return stock, None
    # Slot 0: the whole logical capacity where decode gathers; one prefill batch with per-owner
    # decode (``prefill_scratch``: the context length plus one chunk).
    prefill_tokens = None
    if decodes_per_owner(args):
        context_len = model.get("max_position_embeddings", args.max_total_tokens)
        prefill_tokens = default_prefill_scratch_tokens(context_len, args.chunked_prefill_size, None)
    slot0 = slot0_scratch_tokens(prefill_tokens, cp_size * stock, PAGE_SIZE)
    reserve = scratch_bytes(slot0, kv_row_bytes(dtype), PAGE_SIZE)
    return min(args.max_total_tokens, pages(FAKE_KV_BUDGET_BYTES - reserve)), slot0


class FakeSglang:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        cp = args.tp if args.enable_nsa_prefill_cp_shared_kv else 1
        self.physical_tokens, self.scratch_slot0_tokens = physical_pool_tokens(args, cp)
        self.max_total_num_tokens = self.physical_tokens * cp
        host = int(args.hicache_ratio * self.max_total_num_tokens) if args.enable_hierarchical_cache else 0
        self.cache = PrefixCacheModel(self.max_total_num_tokens, host)
        self.lock = threading.Lock()
        self.counters = {"device": 0, "host": 0, "prompt": 0, "generation": 0, "requests": 0}

    def generate(self, body: Dict) -> Tuple[Dict, float, int, int]:
        """(meta_info, seconds to the first token, new tokens, the request's 1-based number) of one
        request; the number is taken under the lock, so concurrent handlers never share one."""
        input_ids = list(body.get("input_ids") or [])
        new_tokens = int((body.get("sampling_params") or {}).get("max_new_tokens", 16))
        with self.lock:
            device_hit, host_hit = self.cache.serve(input_ids)
            self.counters["device"] += device_hit
            self.counters["host"] += host_hit
            self.counters["prompt"] += len(input_ids)
            self.counters["generation"] += new_tokens
            self.counters["requests"] += 1
            number = self.counters["requests"]
        computed = len(input_ids) - device_hit - host_hit
        ttft = FIXED_S + computed * PER_COMPUTED_TOKEN_S + host_hit * PER_HOST_TOKEN_S
        meta = {
            "prompt_tokens": len(input_ids),
            "completion_tokens": new_tokens,
            "cached_tokens": device_hit + host_hit,
        }
        if device_hit or host_hit:
            meta["cached_tokens_details"] = {"device": device_hit, "host": host_hit}
        return meta, ttft, new_tokens, number

    def metrics_text(self) -> str:
        c = self.counters
        return "\n".join([
            "# TYPE sglang:cached_tokens_total counter",
            f'sglang:cached_tokens_total{{cache_source="device"}} {c["device"]}',
            f'sglang:cached_tokens_total{{cache_source="host"}} {c["host"]}',
            "# TYPE sglang:prompt_tokens_total counter",
            f"sglang:prompt_tokens_total {c['prompt']}",
            "# TYPE sglang:generation_tokens_total counter",
            f"sglang:generation_tokens_total {c['generation']}",
            "# TYPE sglang:max_total_num_tokens gauge",
            f'sglang:max_total_num_tokens{{tp_rank="0"}} {self.max_total_num_tokens}',
            "",
        ])  # fmt: skip


def make_handler(fake: FakeSglang):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            path = self.path.split("?")[0]
            if path in ("/health", "/health_generate"):
                self._send(200, b"")
            elif path in ("/server_info", "/get_server_info"):
                info = {"max_total_num_tokens": fake.max_total_num_tokens, "tp_size": fake.args.tp,
                        "disaggregation_mode": fake.args.disaggregation_mode}  # fmt: skip
                self._send(200, json.dumps(info).encode())
            elif path == "/metrics":
                self._send(200, fake.metrics_text().encode(), "text/plain")
            elif path == "/flush_cache":
                self.do_POST()
            else:
                self._send(404, b"{}")

        def do_POST(self):
            path = self.path.split("?")[0]
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}") if length else {}
            if path == "/flush_cache":
                with fake.lock:
                    fake.cache.flush()
                self._send(200, b"Cache flushed.\n", "text/plain")
                return
            if path == "/abort_request":  # accepted; the fake's requests run to their end
                self._send(200, b"")
                return
            if path != "/generate":
                self._send(404, b"{}")
                return
            meta, ttft, new_tokens, number = fake.generate(body)
            fail_every = int(os.environ.get(FAIL_EVERY_ENV) or 0)
            if fail_every and number % fail_every == 0:
                self._send(500, json.dumps({"error": "planted server error"}).encode())
                return
            time.sleep(ttft)
            if not body.get("stream"):
                time.sleep(new_tokens * PER_OUTPUT_TOKEN_S)
                self._send(200, json.dumps({"output_ids": [FAKE_TOKEN_ID] * new_tokens, "meta_info": meta}).encode())
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            try:
                for k in range(1, new_tokens + 1):
                    if k > 1:
                        time.sleep(PER_OUTPUT_TOKEN_S)
                    chunk = {"output_ids": [FAKE_TOKEN_ID] * k, "meta_info": {**meta, "completion_tokens": k}}
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client went away (sglang aborts such a request): nothing to finish

    return Handler


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_serve_args(sys.argv[1:] if argv is None else argv)
    problem = startup_problem(args)
    if problem is not None:
        print(f"ValueError: {problem}", file=sys.stderr, flush=True)
        return 1
    fake = FakeSglang(args)
    server = ThreadingHTTPServer((LOOPBACK, args.port), make_handler(fake))
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    for rank in range(args.tp):
        print(f"[{stamp} TP{rank}] KV Cache is allocated. #tokens: {fake.physical_tokens}, KV size: 0.00 GB")
        if fake.scratch_slot0_tokens is not None:  # as the runtime logs it (gather_scratch.py)
            print(f"[{stamp} TP{rank}] CP shared KV gather scratch slot 0: {fake.scratch_slot0_tokens} logical "
                  "tokens x 1 layer (0.00 GB)")  # fmt: skip
        if args.enable_nsa_prefill_cp_shared_kv:
            print(f"[{stamp} TP{rank}] {decode_line(args)}")
        if not args.disable_cuda_graph:  # as ModelRunner.init_device_graphs ends
            print(f"[{stamp} TP{rank}] Capture cuda graph end. Time elapsed: 0.00 s. mem usage=0.00 GB. "
                  "avail mem=0.00 GB.")  # fmt: skip
    print(f"fake sglang on {LOOPBACK}:{args.port}: max_total_num_tokens={fake.max_total_num_tokens}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
