"""The two ``sglang serve`` launches of a PD pair: a prefill server (NSA prefill CP, HiCache, shared KV
on or off) and a stock decode server, on one host, KV moved by mooncake.

What each side must set (docs/pd-disaggregation.md):

* prefill: ``--disaggregation-mode prefill --disaggregation-transfer-backend mooncake
  --disaggregation-bootstrap-port B`` on top of the single-server smoke's command
  (``server_process.ServeConfig``: NSA prefill CP, HiCache, no CUDA graphs);
* decode: ``--disaggregation-mode decode --disaggregation-transfer-backend mooncake``, plain sglang
  (no plugin flag), CUDA graphs on;
* both, with shared KV on: ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1`` (every prefill CP rank
  sends the pages it owns and the decode waits for each). With shared KV off it stays unset: stock
  sglang then sends from prefill CP rank 0, which holds the whole KV (its all-ranks range split
  assumes a request's pages are contiguous, which radix-cache reuse breaks);
* both, on a host without RDMA: ``MC_FORCE_TCP=true``. sglang always initialises mooncake with
  protocol "rdma", which mooncake's Python binding does not use to pick a transport; its engine
  installs the TCP transport only, skipping RDMA discovery, when ``MC_FORCE_TCP`` is set (to any
  value: it is tested with ``getenv``), and falls back to TCP by itself only where it finds no HCA;
* both: ``SGLANG_HOST_IP=127.0.0.1``. Each rank's mooncake session (``host:rpc_port``), its zmq
  endpoints and what it registers with the bootstrap server use ``get_local_ip_auto()``, which without
  the variable asks the route to 8.8.8.8 and then the hostname: on a host with no route out it may
  find nothing (the server exits, "Can not get local ip"). Both servers are on this host;
* both, with MTP (``mtp``): GLM-5's MTP recipe (``server_process.MTP_SERVER_ARGS``) and the shared-KV
  opt-in variable; the stock decode server then receives the draft pool's KV and indexer K with the
  target's (sglang registers the draft buffers on both sides) and runs the draft itself;
* both: NVLink multicast off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
  ``NVSHMEM_DISABLE_NVLS=1``), set here too so that no launch depends on the caller's environment.

GPUs: the prefill gets ``prefill_gpus`` (``CUDA_VISIBLE_DEVICES``), the decode ``decode_gpu``, which may
be one of the prefill's. sglang sizes memory from ``--mem-fraction-static`` of the *whole* GPU minus
what is already taken, so the decode, launched second, needs a fraction above the prefill's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from sglang_cp_shared_kv_testing.e2e.server_process import LOOPBACK, MTP_OPT_IN_ENV, MTP_SERVER_ARGS, ServeConfig

ALL_CP_RANKS_ENV = "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"
MOONCAKE_FORCE_TCP_ENV = "MC_FORCE_TCP"
HOST_IP_ENV = "SGLANG_HOST_IP"
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TRANSFER_BACKEND = "mooncake"


@dataclass(frozen=True)
class PDPairConfig:
    model_path: str
    shared_kv: bool
    prefill_tp: int
    decode_tp: int
    prefill_port: int
    decode_port: int
    bootstrap_port: int
    prefill_gpus: str  # CUDA_VISIBLE_DEVICES of the prefill server, e.g. "0,1"
    decode_gpu: str  # CUDA_VISIBLE_DEVICES of the decode server, e.g. "1"
    physical_tokens_per_rank: int  # prefill --max-total-tokens
    decode_max_total_tokens: int
    hicache_ratio: float
    prefill_mem_fraction_static: Optional[float] = None
    decode_mem_fraction_static: Optional[float] = None
    load_format: Optional[str] = None
    mooncake_tcp: bool = True
    prefill_extra_args: Sequence[str] = ()
    decode_extra_args: Sequence[str] = ()
    # Environment of both servers (offline hub, smoke plugin path, dummy-weight init), and of the
    # prefill only (the smoke plugin's lift of sglang's tp_size == 8 NSA-CP rule for the stock reference).
    common_env: Dict[str, str] = field(default_factory=dict)
    prefill_only_env: Dict[str, str] = field(default_factory=dict)
    decode_only_env: Dict[str, str] = field(default_factory=dict)  # e.g. its own KV audit dir
    # SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1 on both servers: always with shared KV (None);
    # a stock pair may set it too (True) when timed against the shared-KV pair on fresh prompts.
    all_cp_ranks_transfer: Optional[bool] = None
    mtp: bool = False  # MTP on both servers

    def prefill_command(self) -> List[str]:
        disaggregation = [
            "--disaggregation-mode", "prefill",
            "--disaggregation-transfer-backend", TRANSFER_BACKEND,
            "--disaggregation-bootstrap-port", str(self.bootstrap_port),
        ]  # fmt: skip
        return ServeConfig(
            model_path=self.model_path,
            tp_size=self.prefill_tp,
            shared_kv=self.shared_kv,
            port=self.prefill_port,
            physical_tokens_per_rank=self.physical_tokens_per_rank,
            hicache_ratio=self.hicache_ratio,
            mem_fraction_static=self.prefill_mem_fraction_static,
            load_format=self.load_format,
            extra_args=disaggregation + list(self.prefill_extra_args),
            mtp=self.mtp,
        ).command()

    def decode_command(self) -> List[str]:
        cmd = [
            "sglang", "serve",
            "--model-path", self.model_path,
            "--tp", str(self.decode_tp),
            "--host", LOOPBACK,
            "--port", str(self.decode_port),
            "--disaggregation-mode", "decode",
            "--disaggregation-transfer-backend", TRANSFER_BACKEND,
            "--max-total-tokens", str(self.decode_max_total_tokens),
            "--enable-metrics",
            "--log-level", "info",
        ]  # fmt: skip
        if self.decode_mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", f"{self.decode_mem_fraction_static:g}"]
        if self.load_format is not None:
            cmd += ["--load-format", self.load_format]
        if self.mtp:
            cmd += list(MTP_SERVER_ARGS)
        return cmd + list(self.decode_extra_args)

    def _both_env(self) -> Dict[str, str]:
        env = {**MULTICAST_OFF_ENV, HOST_IP_ENV: LOOPBACK, **self.common_env}
        if self.shared_kv or self.all_cp_ranks_transfer:
            env[ALL_CP_RANKS_ENV] = "1"
        if self.mooncake_tcp:
            env[MOONCAKE_FORCE_TCP_ENV] = "true"
        if self.mtp:
            env[MTP_OPT_IN_ENV] = "1"
        return env

    def prefill_env(self) -> Dict[str, str]:
        return {**self._both_env(), **self.prefill_only_env, "CUDA_VISIBLE_DEVICES": self.prefill_gpus}

    def decode_env(self) -> Dict[str, str]:
        return {**self._both_env(), **self.decode_only_env, "CUDA_VISIBLE_DEVICES": self.decode_gpu}

    @property
    def decode_cuda_graphs(self) -> bool:
        """The stock decode server captures decode CUDA graphs unless its extra arguments say not."""
        return "--disable-cuda-graph" not in self.decode_extra_args

    @property
    def prefill_url(self) -> str:
        return f"http://{LOOPBACK}:{self.prefill_port}"

    @property
    def decode_url(self) -> str:
        return f"http://{LOOPBACK}:{self.decode_port}"
