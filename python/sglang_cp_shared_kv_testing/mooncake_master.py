"""A Mooncake Store of our own for tests, checks and drivers of the Mooncake L3 backend: its master,
a holder of the objects, and what the master says about them.

Mooncake Store needs its master process running before any client (sglang's ``MooncakeStore``) is
built. An object lives in the memory segment of the client the master placed it in (among the
segments mounted when it is put, at random), and leaves the store with that segment: a client that
stops takes the objects in its segment along. A store that outlives the servers writing to it
therefore needs a **holder**, a client that mounts the segment and stays, while the servers mount
none (``global_segment_size`` 0): the wheel's ``mooncake_client`` ("real client") is such a process
(docs/hicache-storage.md, "Several servers, one Mooncake Store").

The wheels ship both binaries next to the ``mooncake`` package; they load libibverbs and libnl at
start. The master, the holder and every client's transfer engine bind every interface: the CPU tests
run them inside a network namespace of their own (loopback only, ``unshare_prefix``); on a GPU
machine that reaches nothing outside, they run as is.

``start_master`` and ``start_holder`` wait (bounded) until the process serves and tie its life to
the caller's (parent-death signal), so a killed test, check or driver never leaves one behind. The
master's HTTP port answers what it holds (``mounted_segments``, ``object_endpoints``).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

MASTER = "mooncake_master"
HOLDER = "mooncake_client"
# Keys per /batch_query_keys request: a storage key is about 90 characters, so a query stays short.
KEYS_PER_QUERY = 64


def store_binary(name: str) -> Optional[str]:
    """The executable ``name`` shipped with the installed ``mooncake`` package (else on PATH); None
    when there is none."""
    try:
        import mooncake
    except ImportError:
        return shutil.which(name)
    path = os.path.join(os.path.dirname(mooncake.__file__), name)
    return path if os.access(path, os.X_OK) else shutil.which(name)


def master_binary() -> Optional[str]:
    return store_binary(MASTER)


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def master_command(rpc_port: int, metrics_port: int) -> List[str]:
    return [master_binary() or MASTER, f"--rpc_port={rpc_port}", f"--metrics_port={metrics_port}",
            "--eviction_high_watermark_ratio=0.95"]  # fmt: skip


def holder_command(master_rpc_port: int, service_port: int, segment_bytes: int) -> List[str]:
    """The holder: Mooncake's standalone client mounting ``segment_bytes`` of host memory for the
    store, over TCP on loopback; ``service_port`` is its own RPC port (for Mooncake's dummy clients,
    which we do not use)."""
    return [store_binary(HOLDER) or HOLDER, f"--global_segment_size={segment_bytes}",
            f"--master_server_address=127.0.0.1:{master_rpc_port}", "--metadata_server=P2PHANDSHAKE",
            "--protocol=tcp", "--host=127.0.0.1", f"--port={service_port}"]  # fmt: skip


def _spawn(command: Sequence[str], log: Optional[Path]) -> subprocess.Popen:
    if command[0] in (MASTER, HOLDER):
        raise RuntimeError(f"{command[0]} not found (pip install mooncake-transfer-engine)")
    out = open(log, "wb") if log is not None else subprocess.DEVNULL
    try:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT if log else subprocess.PIPE,
                                preexec_fn=_die_with_parent)  # fmt: skip
    finally:
        if log is not None:
            out.close()


def _exit_text(process: subprocess.Popen, log: Optional[Path]) -> str:
    text = log.read_bytes().decode(errors="replace") if log is not None else process.stderr.read().decode()
    return text[-2000:]


def start_master(rpc_port: int, metrics_port: int, start_timeout_s: float = 30.0,
                 log: Optional[Path] = None) -> subprocess.Popen:  # fmt: skip
    """Start ``mooncake_master`` on ``rpc_port``; returns once it listens (RuntimeError if it exits
    or does not listen within ``start_timeout_s``). Its output goes to ``log`` (else stderr is kept
    for the error)."""
    master = _spawn(master_command(rpc_port, metrics_port), log)
    deadline = time.monotonic() + start_timeout_s
    while time.monotonic() < deadline:
        if master.poll() is not None:
            raise RuntimeError(f"mooncake_master exited: {_exit_text(master, log)}")
        try:
            socket.create_connection(("127.0.0.1", rpc_port), timeout=1).close()
            return master
        except OSError:
            time.sleep(0.2)
    master.kill()
    raise RuntimeError(f"mooncake_master did not listen on port {rpc_port} within {start_timeout_s} s")


@dataclass(frozen=True)
class Segment:
    """A client's mounted segment as the master lists it."""

    name: str
    endpoint: str  # its transfer engine's endpoint: what an object's replica names
    size_bytes: int
    used_bytes: int


def start_holder(master_rpc_port: int, master_metrics_port: int, service_port: int, segment_bytes: int,
                 start_timeout_s: float = 30.0, log: Optional[Path] = None) -> tuple:  # fmt: skip
    """Start the holder (``holder_command``); returns (process, its ``Segment``) once the master
    lists a segment that was not there before (RuntimeError if the holder exits or none appears
    within ``start_timeout_s``)."""
    before = {segment.endpoint for segment in mounted_segments(master_metrics_port)}
    holder = _spawn(holder_command(master_rpc_port, service_port, segment_bytes), log)
    deadline = time.monotonic() + start_timeout_s
    while time.monotonic() < deadline:
        if holder.poll() is not None:
            raise RuntimeError(f"mooncake_client (the holder) exited: {_exit_text(holder, log)}")
        new = [s for s in mounted_segments(master_metrics_port) if s.endpoint not in before]
        if new:
            return holder, new[0]
        time.sleep(0.2)
    holder.kill()
    raise RuntimeError(f"the holder's segment was not mounted within {start_timeout_s} s")


def stop_store_process(process: subprocess.Popen) -> None:
    """Stop the master or the holder (SIGTERM, then SIGKILL after 10 s)."""
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def master_http(metrics_port: int, path: str, timeout_s: float = 10.0) -> str:
    """GET ``path`` of the master's HTTP (metrics and admin) port."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}{path}", timeout=timeout_s) as response:
        return response.read().decode()


def mounted_segments(metrics_port: int) -> List[Segment]:
    """Every segment mounted now (``/get_segments_detail``)."""
    detail = json.loads(master_http(metrics_port, "/get_segments_detail"))
    return [
        Segment(name=s["segment_name"], endpoint=s["te_endpoint"], size_bytes=int(s["size_bytes"]),
                used_bytes=int(s.get("allocator_used_bytes", 0)))  # fmt: skip
        for s in detail.get("segments") or []
    ]


def object_endpoints(metrics_port: int, keys: Sequence[str]) -> Dict[str, List[str]]:
    """For each key, the endpoints of the segments holding its memory replicas ([] where the store
    does not hold it), from the master's ``/batch_query_keys``."""
    out: Dict[str, List[str]] = {}
    keys = list(keys)
    for start in range(0, len(keys), KEYS_PER_QUERY):
        chunk = keys[start : start + KEYS_PER_QUERY]
        answer = json.loads(master_http(metrics_port, "/batch_query_keys?keys=" + ",".join(chunk)))
        data = answer.get("data") or {}
        for key in chunk:
            entry = data.get(key) or {}
            replicas = entry.get("values") if entry.get("ok") else None
            out[key] = [replica["transport_endpoint_"] for replica in replicas or []]
    return out


def client_extra_config(rpc_port: int, segment_bytes: int = 32 << 20, **more) -> str:
    """``--hicache-storage-backend-extra-config`` for a TCP client of the master on loopback that
    mounts ``segment_bytes`` (0: none, its objects go to other clients' segments: the holder's)."""
    config = {
        "master_server_address": f"127.0.0.1:{rpc_port}",
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "local_hostname": "127.0.0.1",
        "global_segment_size": segment_bytes,
    }
    config.update(more)
    return json.dumps(config)


# ---- the CPU tests' private network ----


def mooncake_unavailable() -> Optional[str]:
    """Why a real Mooncake Store cannot run here (None: it can): the package, a system library it
    loads, a binary, or a network namespace to run it in is missing."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as error:  # the package, or a system library it loads (libibverbs, ...)
        return f"mooncake.store does not import: {error}"
    for name in (MASTER, HOLDER):
        if store_binary(name) is None:
            return f"{name} not found in the mooncake package"
    for command in (["unshare", "-n", "true"], ["unshare", "-rn", "true"]):
        try:
            if subprocess.run(command, capture_output=True, timeout=10).returncode == 0:
                return None
        except (OSError, subprocess.TimeoutExpired):
            pass
    return "no network namespace: neither `unshare -n` nor `unshare -rn` works here"


def unshare_prefix() -> List[str]:
    """The command prefix that runs a command in a network namespace of its own (as root, else in
    a user namespace)."""
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0:
        return ["unshare", "-n", "--"]
    return ["unshare", "-rn", "--"]


def loopback_up() -> None:
    """``ip link set lo up`` in a fresh namespace, without iproute2 (SIOCGIFFLAGS / SIOCSIFFLAGS)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(sock, 0x8913, request))[1]
        fcntl.ioctl(sock, 0x8914, struct.pack("16sh", b"lo", flags | 0x1))
