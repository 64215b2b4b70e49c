"""Launch ``sglang serve`` on loopback, wait for it, talk to it, and always take it down.

The server runs in its own session (process group), so stopping it reaches the tokenizer,
detokenizer and every scheduler process it spawned without touching anything else; stop() sends
SIGTERM to that group, waits, then SIGKILL.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from sglang_cp_shared_kv.settings import DECODE_PATH_ENV, GATHER, GRAPH_DECODE_ENV, PER_OWNER
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG
from sglang_cp_shared_kv.settings import MTP_ENV
from sglang_cp_shared_kv_testing.e2e.server_log import ServedDecode, startup_error

LOOPBACK = "127.0.0.1"
SHARED_KV_FLAG = CP_SHARED_KV_FLAG
# MTP as GLM-5's H200 recipes run it: EAGLE with the model's NextN layer, 3 steps, top-k 1, 4 draft
# tokens (the model directory needs ``num_nextn_predict_layers``: make_tiny_glm5_config.py --nextn).
MTP_SERVER_ARGS = (
    "--speculative-algorithm", "EAGLE",
    "--speculative-num-steps", "3",
    "--speculative-eagle-topk", "1",
    "--speculative-num-draft-tokens", "4",
)  # fmt: skip
# The shared-KV server's explicit opt-in to MTP; given to every server of an MTP smoke (stock sglang,
# the reference, runs MTP without it and ignores it).
MTP_OPT_IN_ENV = MTP_ENV
# ServeConfig.decode_path of a shared-KV server launched as a user would, with no decode setting in its
# environment: the server's own default decides (what serving the default itself checks).
SERVER_DEFAULT_DECODE = "server-default"
# The soak's and the L3 restart smoke's --decode and --cuda-graphs (``add_decode_options``).
DRIVER_DECODE_CHOICES = (SERVER_DEFAULT_DECODE, PER_OWNER, GATHER)
AUTO_GRAPHS = "auto"
CUDA_GRAPHS_CHOICES = (AUTO_GRAPHS, "on", "off")


def hopper_nsa_decode_impl(server_args: Sequence[str]) -> str:
    """The NSA decode impl sglang 0.5.11 picks on Hopper for these serve arguments: flashmla_kv for
    an fp8 KV cache, fa3 otherwise."""
    args = list(server_args)
    dtype = args[args.index("--kv-cache-dtype") + 1] if "--kv-cache-dtype" in args[:-1] else "auto"
    return "flashmla_kv" if dtype.startswith("fp8") else "fa3"


def default_decode_is_per_owner(server_args: Sequence[str]) -> bool:
    """Whether a shared-KV server launched with these arguments and no decode setting decodes per
    owner (and so keeps CUDA graphs): ``auto`` in ``decode_path``, without MTP."""
    from sglang_cp_shared_kv.startup_rules import AUTO_PER_OWNER_DECODE_IMPLS

    impl = hopper_nsa_decode_impl(server_args)
    return impl in AUTO_PER_OWNER_DECODE_IMPLS and "--speculative-algorithm" not in server_args


def add_decode_options(parser) -> None:
    """``--decode`` and ``--cuda-graphs`` of a driver serving one kind of shared-KV server (the soak,
    the L3 restart smoke): by default what a user launches (``decode_setup`` says what each means)."""
    parser.add_argument(
        "--decode", choices=DRIVER_DECODE_CHOICES, default=SERVER_DEFAULT_DECODE,
        help=f"the shared-KV decode path: {SERVER_DEFAULT_DECODE} (default: no decode setting, the server's "
             f"own default, as the README launches it), {PER_OWNER} or {GATHER} (named in the environment, "
             f"{DECODE_PATH_ENV})",
    )  # fmt: skip
    parser.add_argument(
        "--cuda-graphs", choices=CUDA_GRAPHS_CHOICES, default=AUTO_GRAPHS,
        help=f"decode CUDA graphs: {AUTO_GRAPHS} (default) keeps them wherever decode runs per owner (sglang's "
             "own capture list) and passes --disable-cuda-graph where it gathers (--decode gather; the "
             "server's default with fp8 KV or MTP); on / off ask for them (off: per owner, eagerly)",
    )  # fmt: skip


def decode_setup(decode: str, cuda_graphs: str, server_args: Sequence[str]) -> Tuple[str, bool]:
    """(``ServeConfig.decode_path``, ``ServeConfig.cuda_graphs``) of a shared-KV server for a driver's
    ``--decode`` and ``--cuda-graphs`` with these extra serve arguments; a ``ValueError`` naming a
    combination the server's startup refuses (the gather under graphs; MTP with per-owner decode)."""
    if decode not in DRIVER_DECODE_CHOICES or cuda_graphs not in CUDA_GRAPHS_CHOICES:
        raise ValueError(f"--decode {decode!r} / --cuda-graphs {cuda_graphs!r}: not a choice")
    if decode == GATHER:
        if cuda_graphs == "on":
            raise ValueError(f"--decode {GATHER} with --cuda-graphs on: the page gather cannot be replayed in "
                             "CUDA graphs (the server requires --disable-cuda-graph)")  # fmt: skip
        return GATHER, False
    if decode == PER_OWNER:
        if "--speculative-algorithm" in server_args:
            raise ValueError(f"--decode {PER_OWNER} with --speculative-algorithm: the shared-KV server refuses MTP "
                             "with per-owner decode (its draft steps gather)")  # fmt: skip
        return PER_OWNER, cuda_graphs != "off"
    per_owner = default_decode_is_per_owner(server_args)
    if cuda_graphs == "on" and not per_owner:
        raise ValueError(f"--cuda-graphs on with --decode {SERVER_DEFAULT_DECODE}: with these arguments (fp8 KV or "
                         "MTP) the server's default decode gathers pages, which requires --disable-cuda-graph")  # fmt: skip
    return SERVER_DEFAULT_DECODE, per_owner if cuda_graphs == AUTO_GRAPHS else cuda_graphs == "on"


def decode_asked(config: ServeConfig) -> str:
    """The decode a driver asked of a shared-KV server, for its verdict: the path, and graphs where
    the path alone does not say."""
    if config.decode_path == SERVER_DEFAULT_DECODE and config.cuda_graphs:
        return SERVER_DEFAULT_DECODE
    if config.decode_path == GATHER:
        return GATHER
    return f"{config.decode_path}, graphs {'on' if config.cuda_graphs else 'off'}"


def served_decode_failures(config: ServeConfig, served: ServedDecode) -> List[str]:
    """A started shared-KV server must log its decode path (every rank the same), the one asked for
    where the driver named one, and capture decode CUDA graphs exactly when asked to."""
    if not served.logged:
        return ["decode: the server logged no decode path (no 'CP shared KV: decode ...' line)"]
    failures = []
    if served.per_owner_impls and served.gather_reasons:
        failures.append(f"decode: the ranks disagree ({served.describe()})")
    if config.decode_path == PER_OWNER and not served.per_owner:
        failures.append(f"decode: asked {PER_OWNER}, the server logged {served.describe()}")
    if config.decode_path == GATHER and served.per_owner_impls:
        failures.append(f"decode: asked {GATHER}, the server logged {served.describe()}")
    if served.graphs != config.cuda_graphs:
        failures.append(f"decode: CUDA graphs asked {'on' if config.cuda_graphs else 'off'}, the server "
                        f"{'captured them' if served.graphs else 'captured none'}")  # fmt: skip
    return failures


@dataclass(frozen=True)
class ServeConfig:
    """What one ``sglang serve`` launch of the smoke needs; ``command()`` renders it."""

    model_path: str
    tp_size: int
    shared_kv: bool
    port: int
    physical_tokens_per_rank: int  # --max-total-tokens: sglang caps the per-rank pool before CP scaling
    hicache_ratio: Optional[float]  # None: radix cache only, no HiCache
    mem_fraction_static: Optional[float] = None
    load_format: Optional[str] = None
    extra_args: Sequence[str] = ()
    # Keep sglang's CUDA-graph decode: a stock server (the baseline a user runs), or a shared-KV
    # server whose decode runs per owner (the only shared-KV decode that can be captured).
    cuda_graphs: bool = False
    # Shared KV only: decode through the page gather or per owner, named in env() either way (the
    # server's own default, auto, picks by decode impl: a run must not depend on it unless it says so
    # with SERVER_DEFAULT_DECODE, which names nothing).
    decode_path: str = "gather"
    # MTP (``MTP_SERVER_ARGS``), with its opt-in in env().
    mtp: bool = False

    def env(self) -> Dict[str, str]:
        """The environment the launch needs besides the command line: the decode path, the MTP opt-in."""
        env = {MTP_OPT_IN_ENV: "1"} if self.mtp else {}
        if not self.shared_kv or self.decode_path == SERVER_DEFAULT_DECODE:
            return env
        if self.decode_path == "gather":
            return {**env, DECODE_PATH_ENV: GATHER}
        return {**env, DECODE_PATH_ENV: PER_OWNER, GRAPH_DECODE_ENV: "1" if self.cuda_graphs else "0"}

    def command(self) -> List[str]:
        if self.decode_path not in ("gather", PER_OWNER, SERVER_DEFAULT_DECODE) or (
            self.decode_path != "gather" and not self.shared_kv
        ):
            raise ValueError(
                f"decode_path {self.decode_path!r}: 'gather', or {PER_OWNER!r} / {SERVER_DEFAULT_DECODE!r} "
                "with shared KV"
            )
        if self.cuda_graphs and self.shared_kv and self.decode_path == "gather":
            raise ValueError("cuda_graphs: shared-KV decode through the page gather requires --disable-cuda-graph")
        cmd = [
            "sglang", "serve",
            "--model-path", self.model_path,
            "--tp", str(self.tp_size),
            "--host", LOOPBACK,
            "--port", str(self.port),
            "--enable-nsa-prefill-context-parallel",
            "--max-total-tokens", str(self.physical_tokens_per_rank),
            "--enable-metrics",
            "--log-level", "info",
        ]  # fmt: skip
        if not self.cuda_graphs:
            # The shared-KV runtime's page gather cannot run in CUDA graphs (its startup validation
            # requires both flags); the reference run uses the same so the two servers differ by
            # the shared-KV flag only.
            cmd.append("--disable-cuda-graph")
        cmd.append("--disable-piecewise-cuda-graph")
        if self.hicache_ratio is not None:
            cmd += ["--enable-hierarchical-cache", "--hicache-ratio", f"{self.hicache_ratio:g}"]
        if self.shared_kv:
            cmd.append(SHARED_KV_FLAG)
        if self.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", f"{self.mem_fraction_static:g}"]
        if self.load_format is not None:
            cmd += ["--load-format", self.load_format]
        if self.mtp:
            cmd += list(MTP_SERVER_ARGS)
        return cmd + list(self.extra_args)


class ServerError(RuntimeError):
    pass


class ServerStartError(ServerError):
    """The server exited, or never answered ``/health``, before it served anything; the message
    quotes the error its log ends with (``SglangServer.wait_started``)."""


# sglang 0.5.11 refuses a --port above 55535: it derives a gRPC port as port + 10000 (server_args.py).
MAX_SGLANG_PORT = 65535 - 10000


def free_port(low: int = 20000, high: int = MAX_SGLANG_PORT) -> int:
    """A port in [low, high] free on loopback now (the OS's ephemeral range reaches past 55535)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    raise ServerError(f"no free port in [{low}, {high}] on {LOOPBACK}")


class SglangServer:
    """``with SglangServer(cmd, log_path, env) as server:`` starts it; leaving the block stops it."""

    def __init__(self, command: Sequence[str], port: int, log_path: Path, env: Dict[str, str]):
        self.command = list(command)
        self.base_url = f"http://{LOOPBACK}:{port}"
        self.log_path = Path(log_path)
        self.env = env
        self.process: Optional[subprocess.Popen] = None
        self.log_bytes_before_stop: Optional[int] = None

    def __enter__(self) -> "SglangServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        try:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        finally:
            log.close()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_ready(self, timeout_s: float) -> None:
        """Poll ``/health`` until 200; fail early if the server process exits."""
        import requests

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServerError(f"server exited with code {self.process.returncode}; see {self.log_path}")
            try:
                if requests.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        raise ServerError(f"server not ready after {timeout_s:.0f} s; see {self.log_path}")

    def wait_started(self, timeout_s: float) -> None:
        """``wait_ready``, failing with a ``ServerStartError`` that quotes the server's own error
        (``server_log.startup_error``), so a verdict can say why the server did not start."""
        try:
            self.wait_ready(timeout_s)
        except ServerError as e:
            lines = self.log_path.read_bytes().decode("utf-8", errors="replace").splitlines()
            raise ServerStartError(f"server did not start: {startup_error(lines)} ({e})") from e

    def stop(self, grace_s: float = 30) -> None:
        if self.process is None:
            return
        if self.log_bytes_before_stop is None:
            self.log_bytes_before_stop = self.log_path.stat().st_size if self.log_path.exists() else 0
        if self.process.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        # Children (schedulers) can outlive the leader for a moment; they share its group.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def log_lines_before_stop(self) -> List[str]:
        """Log lines written while the server ran (shutdown noise after stop() is left out)."""
        data = self.log_path.read_bytes()
        if self.log_bytes_before_stop is not None:
            data = data[: self.log_bytes_before_stop]
        return data.decode("utf-8", errors="replace").splitlines()

    def get_json(self, path: str, timeout_s: float = 30) -> Dict[str, Any]:
        import requests

        response = requests.get(self.base_url + path, timeout=timeout_s)
        response.raise_for_status()
        return response.json()

    def get_text(self, path: str, timeout_s: float = 30) -> str:
        import requests

        response = requests.get(self.base_url + path, timeout=timeout_s)
        response.raise_for_status()
        return response.text


@dataclass
class GenerateResult:
    output_ids: List[int]
    meta_info: Dict[str, Any]
    ttft_s: Optional[float]  # client side: request sent -> first streamed chunk
    e2e_s: float
    error: Optional[str] = None


def stream_chunks(response) -> Iterator[Dict[str, Any]]:
    """The JSON chunks of an sglang ``/generate`` stream (``data: {...}`` lines up to ``[DONE]``)."""
    for raw in response.iter_lines():
        if not raw.startswith(b"data:"):
            continue
        body = raw[len(b"data:"):].strip()
        if body == b"[DONE]":
            return
        yield json.loads(body)


def generate_greedy(
    base_url: str, input_ids: List[int], max_new_tokens: int, timeout_s: float, rid: Optional[str] = None
) -> GenerateResult:
    """One streamed greedy ``/generate`` request with fixed length (``ignore_eos``); ``rid`` names it
    (the KV audits key their dumps by it, so two servers' dumps of one request meet)."""
    import requests

    payload = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        "stream": True,
    }
    if rid is not None:
        payload["rid"] = rid
    start = time.perf_counter()
    ttft = None
    last: Dict[str, Any] = {}
    try:
        with requests.post(base_url + "/generate", json=payload, stream=True, timeout=timeout_s) as response:
            if response.status_code != 200:
                return GenerateResult([], {}, None, time.perf_counter() - start,
                                      f"HTTP {response.status_code}: {response.text[:500]}")  # fmt: skip
            for chunk in stream_chunks(response):
                if "error" in chunk:
                    return GenerateResult([], {}, ttft, time.perf_counter() - start, str(chunk["error"]))
                if ttft is None:
                    ttft = time.perf_counter() - start
                last = chunk
    except requests.RequestException as e:
        return GenerateResult([], {}, ttft, time.perf_counter() - start, f"{type(e).__name__}: {e}")
    e2e = time.perf_counter() - start
    if not last:
        return GenerateResult([], {}, ttft, e2e, "no output chunk")
    return GenerateResult(list(last.get("output_ids", [])), last.get("meta_info", {}), ttft, e2e)


def shared_kv_serve_config(args, port: int, extra_args: Sequence[str]) -> ServeConfig:
    """A shared-KV server from a driver's common options (``--model-path``, ``--tp``,
    ``--physical-tokens-per-rank``, ``--hicache-ratio``, ``--mem-fraction-static``,
    ``--load-format``, ``--one-gpu``, ``--decode``, ``--cuda-graphs``) and its own ``extra_args``:
    the soak and the L3 restart smoke."""
    from sglang_cp_shared_kv_testing.e2e.one_gpu import with_one_gpu_args

    extra = with_one_gpu_args(extra_args) if args.one_gpu else list(extra_args)
    decode_path, cuda_graphs = decode_setup(args.decode, args.cuda_graphs, extra)
    return ServeConfig(
        model_path=args.model_path, tp_size=args.tp, shared_kv=True, port=port,
        physical_tokens_per_rank=args.physical_tokens_per_rank, hicache_ratio=args.hicache_ratio,
        mem_fraction_static=args.mem_fraction_static, load_format=args.load_format, extra_args=extra,
        decode_path=decode_path, cuda_graphs=cuda_graphs,
    )  # fmt: skip
