"""A ``mooncake_master`` of our own for tests and checks of the Mooncake L3 backend.

Mooncake Store needs its master process running before any client (sglang's ``MooncakeStore``) is
built. The wheels ship the binary next to the ``mooncake`` package; it loads libibverbs and libnl at
start. The master binds every interface: the CPU test runs it inside a network namespace of its own
(loopback only); on a GPU machine that reaches nothing outside, it runs as is.

``start_master`` waits (bounded) until the RPC port accepts connections and ties the master's life
to the caller's (parent-death signal), so a killed test or check never leaves one behind.
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
from typing import Optional


def master_binary() -> Optional[str]:
    """The ``mooncake_master`` executable shipped with the installed ``mooncake`` package (else on
    PATH); None when there is none."""
    try:
        import mooncake
    except ImportError:
        return shutil.which("mooncake_master")
    path = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    return path if os.access(path, os.X_OK) else shutil.which("mooncake_master")


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def start_master(rpc_port: int, metrics_port: int, start_timeout_s: float = 30.0) -> subprocess.Popen:
    """Start ``mooncake_master`` on ``rpc_port``; returns once it listens (RuntimeError if it exits
    or does not listen within ``start_timeout_s``)."""
    binary = master_binary()
    if binary is None:
        raise RuntimeError("mooncake_master not found (pip install mooncake-transfer-engine)")
    master = subprocess.Popen(
        [binary, f"--rpc_port={rpc_port}", f"--metrics_port={metrics_port}",
         "--eviction_high_watermark_ratio=0.95"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=_die_with_parent,
    )  # fmt: skip
    deadline = time.monotonic() + start_timeout_s
    while time.monotonic() < deadline:
        if master.poll() is not None:
            raise RuntimeError(f"mooncake_master exited: {master.stderr.read().decode()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", rpc_port), timeout=1).close()
            return master
        except OSError:
            time.sleep(0.2)
    master.kill()
    raise RuntimeError(f"mooncake_master did not listen on port {rpc_port} within {start_timeout_s} s")


def stop_master(master: subprocess.Popen) -> None:
    master.terminate()
    try:
        master.wait(timeout=10)
    except subprocess.TimeoutExpired:
        master.kill()
        master.wait()


def client_extra_config(rpc_port: int, segment_bytes: int = 32 << 20, **more) -> str:
    """``--hicache-storage-backend-extra-config`` for a TCP client of the master on loopback."""
    config = {
        "master_server_address": f"127.0.0.1:{rpc_port}",
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "local_hostname": "127.0.0.1",
        "global_segment_size": segment_bytes,
    }
    config.update(more)
    return json.dumps(config)
