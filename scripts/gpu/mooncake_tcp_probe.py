#!/usr/bin/env python3
"""Mooncake's transfer engine over TCP on one host, driven the way sglang 0.5.11's PD path drives it:
two processes (a "decode" that receives, a "prefill" that sends), each with its own
``mooncake.engine.TransferEngine`` initialised as ``initialize(host, "P2PHANDSHAKE", "rdma", "")``
(``MooncakeTransferEngine.initialize`` in sglang; the protocol argument does not pick the transport
in mooncake's Python binding), buffers registered with ``batch_register_memory`` and written with
``batch_transfer_sync_write`` to ``"host:rpc_port"`` in several scattered blocks, as the KV sender
writes pages.

With ``MC_FORCE_TCP`` in the environment (set here unless ``--no-force-tcp``; mooncake only checks
that it is set, any value counts) the engine installs its TCP transport only and skips RDMA
discovery; each engine's own log must say so (``MC_FORCE_TCP is set, using TCP transport only``).

Every case writes ``--mib`` MiB in ``--blocks`` blocks into the destination in reverse block order,
between guard bytes; the receiver checks every byte and that the guards are untouched.
Devices: ``cpu`` (host memory; torch tensors, or ctypes buffers where torch is missing) or
``cuda:N`` (torch tensors; the TCP transport copies through the host). Default cases: ``cpu>cpu``,
plus ``cuda:0>cuda:1`` and ``cuda:1>cuda:1`` on two GPUs (prefill rank 0 / rank 1 -> decode on GPU 1,
as in scripts/glm5_pd_smoke.py), or ``cuda:0>cuda:0`` on one.

Exit 0 when every case passed, 1 otherwise (also on a timeout or an import error, e.g. a system
library that mooncake's engine.so needs and the machine lacks).

  python3 scripts/gpu/mooncake_tcp_probe.py [--cases cpu>cpu,cuda:0>cuda:1] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

HOST = "127.0.0.1"
GUARD_BYTES = 4096
GUARD_VALUE = 0xAB
TCP_ONLY_LOG = "MC_FORCE_TCP is set, using TCP transport only"
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=None, help="comma-separated SRC>DST, each cpu or cuda:N (default: see above)")
    p.add_argument("--mib", type=int, default=8, help="MiB written per case")
    p.add_argument("--blocks", type=int, default=8, help="blocks per case (scattered like KV pages)")
    p.add_argument("--no-force-tcp", action="store_true", help="leave MC_FORCE_TCP unset (mooncake picks: RDMA if it finds HCAs)")
    p.add_argument("--timeout", type=float, default=90, help="seconds for the whole probe")
    p.add_argument("--log-dir", default=None, help="where the two engines' logs go (default: a temporary folder)")
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)
    if args.mib < 1 or args.blocks < 1 or (args.mib << 20) % args.blocks:
        p.error("--mib MiB must split into --blocks equal blocks")
    return args


def default_cases() -> List[Tuple[str, str]]:
    cases = [("cpu", "cpu")]
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        gpus = 0
    if gpus >= 2:
        cases += [("cuda:0", "cuda:1"), ("cuda:1", "cuda:1")]
    elif gpus == 1:
        cases += [("cuda:0", "cuda:0")]
    return cases


def parse_cases(text: Optional[str]) -> List[Tuple[str, str]]:
    if not text:
        return default_cases()
    cases = []
    for item in text.split(","):
        src, sep, dst = item.strip().partition(">")
        for dev in (src, dst):
            if not sep or not (dev == "cpu" or (dev.startswith("cuda:") and dev[5:].isdigit())):
                raise SystemExit(f"mooncake_tcp_probe: bad case {item!r} (want SRC>DST, each cpu or cuda:N)")
        cases.append((src, dst))
    return cases


def pattern(case_index: int, nbytes: int) -> bytes:
    period = bytes((i * 7 + case_index * 13) % 251 for i in range(251))
    return (period * (nbytes // 251 + 1))[:nbytes]


class Buffer:
    """A byte buffer on the host or a GPU with a stable address (torch tensor, or ctypes without torch)."""

    def __init__(self, device: str, data: bytes):
        self.device, self.nbytes = device, len(data)
        try:
            import torch
        except ImportError:
            if device != "cpu":
                raise
            self._raw = ctypes.create_string_buffer(data, len(data))
            self.ptr = ctypes.addressof(self._raw)
            self._tensor = None
            return
        host = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._tensor = host if device == "cpu" else host.to(device)
        self.ptr = self._tensor.data_ptr()

    def read(self) -> bytes:
        if self._tensor is None:
            return ctypes.string_at(self.ptr, self.nbytes)
        return self._tensor.cpu().numpy().tobytes()


def _redirect_output(log_path: str) -> None:
    """The engine logs through glog on fd 2: send this process's fds 1 and 2 to its own file."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _make_engine():
    try:
        import torch  # noqa: F401  (sglang imports torch first: its libcudart.so.13 is then loaded)
    except ImportError:
        pass
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    # What sglang 0.5.11 passes (device_communicators/mooncake_transfer_engine.py, device_name "" when
    # --disaggregation-ib-device is unset).
    ret = engine.initialize(HOST, "P2PHANDSHAKE", "rdma", "")
    if ret != 0:
        raise RuntimeError(f"TransferEngine.initialize returned {ret}")
    return engine, f"{HOST}:{engine.get_rpc_port()}"


def _block_layout(nbytes: int, blocks: int) -> List[Tuple[int, int, int]]:
    """(source offset, destination offset, length) per block: reverse order, inside the guards."""
    size = nbytes // blocks
    return [(k * size, GUARD_BYTES + (blocks - 1 - k) * size, size) for k in range(blocks)]


def receiver(cases, nbytes, blocks, log_path, to_main, from_main) -> None:
    _redirect_output(log_path)
    try:
        engine, session = _make_engine()
        dsts = [Buffer(dst, bytes([GUARD_VALUE]) * (nbytes + 2 * GUARD_BYTES)) for _, dst in cases]
        ret = engine.batch_register_memory([b.ptr for b in dsts], [b.nbytes for b in dsts])
        to_main.put({"session": session, "dst_ptrs": [b.ptr for b in dsts], "register_ret": ret})
        if from_main.get(timeout=600) != "verify":
            return
        results = []
        for index, dst in enumerate(dsts):
            got = dst.read()
            src = pattern(index, nbytes)
            bad = sum(got[d : d + n] != src[s : s + n] for s, d, n in _block_layout(nbytes, blocks))
            guards_ok = got[:GUARD_BYTES] == bytes([GUARD_VALUE]) * GUARD_BYTES and got[GUARD_BYTES + nbytes :] == bytes(
                [GUARD_VALUE]
            ) * GUARD_BYTES
            results.append({"bad_blocks": bad, "guards_ok": guards_ok})
        to_main.put({"verify": results})
    except BaseException as e:  # noqa: BLE001  (reported to the parent, which decides)
        to_main.put({"error": f"receiver: {type(e).__name__}: {e}"})


def sender(cases, nbytes, blocks, log_path, info, to_main) -> None:
    _redirect_output(log_path)
    try:
        engine, session = _make_engine()
        srcs = [Buffer(src, pattern(i, nbytes)) for i, (src, _) in enumerate(cases)]
        reg = engine.batch_register_memory([b.ptr for b in srcs], [b.nbytes for b in srcs])
        results = []
        for src, dst_ptr in zip(srcs, info["dst_ptrs"]):
            layout = _block_layout(nbytes, blocks)
            start = time.perf_counter()
            ret = engine.batch_transfer_sync_write(
                info["session"], [src.ptr + s for s, _, _ in layout], [dst_ptr + d for _, d, _ in layout],
                [n for _, _, n in layout],
            )  # fmt: skip
            results.append({"ret": ret, "seconds": time.perf_counter() - start})
        to_main.put({"send": results, "register_ret": reg, "session": session})
    except BaseException as e:  # noqa: BLE001
        to_main.put({"error": f"sender: {type(e).__name__}: {e}"})


def _get(q, deadline: float, what: str) -> Dict:
    try:
        return q.get(timeout=max(1.0, deadline - time.monotonic()))
    except queue.Empty:
        return {"error": f"timed out waiting for {what}"}


def run(args) -> Dict:
    cases = parse_cases(args.cases)
    nbytes = args.mib << 20
    for key, value in MULTICAST_OFF_ENV.items():
        os.environ.setdefault(key, value)
    if args.no_force_tcp:
        os.environ.pop("MC_FORCE_TCP", None)
    else:
        os.environ["MC_FORCE_TCP"] = "true"
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="mooncake_tcp_probe."))
    log_dir.mkdir(parents=True, exist_ok=True)
    logs = {"receiver": str(log_dir / "receiver.log"), "sender": str(log_dir / "sender.log")}
    ctx = mp.get_context("spawn")
    to_main, to_receiver = ctx.Queue(), ctx.Queue()
    deadline = time.monotonic() + args.timeout
    result: Dict = {"cases": [f"{s}>{d}" for s, d in cases], "bytes_per_case": nbytes, "blocks": args.blocks,
                    "force_tcp": not args.no_force_tcp, "logs": logs, "errors": []}  # fmt: skip
    procs = [ctx.Process(target=receiver, args=(cases, nbytes, args.blocks, logs["receiver"], to_main, to_receiver))]
    procs[0].start()
    try:
        info = _get(to_main, deadline, "the receiver's engine")
        if "error" in info:
            result["errors"].append(info["error"])
            return result
        result["receiver_session"] = info["session"]
        result["receiver_register_ret"] = info["register_ret"]
        send_q = ctx.Queue()
        procs.append(ctx.Process(target=sender, args=(cases, nbytes, args.blocks, logs["sender"], info, send_q)))
        procs[1].start()
        sent = _get(send_q, deadline, "the sender")
        if "error" in sent:
            result["errors"].append(sent["error"])
            return result
        result["sender_register_ret"] = sent["register_ret"]
        to_receiver.put("verify")
        checked = _get(to_main, deadline, "the receiver's check")
        if "error" in checked:
            result["errors"].append(checked["error"])
            return result
        result["results"] = [
            {"case": f"{s}>{d}", **sent_one, **check_one}
            for (s, d), sent_one, check_one in zip(cases, sent["send"], checked["verify"])
        ]
    finally:
        to_receiver.put("stop")  # a receiver still waiting for "verify" returns
        for proc in procs:
            proc.join(timeout=max(1.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        result["log_tails"] = {}
        for name, path in logs.items():
            text = Path(path).read_text(errors="replace") if Path(path).exists() else ""
            result["log_tails"][name] = text.splitlines()[-15:]
            result[f"{name}_tcp_only"] = TCP_ONLY_LOG in text
    return result


def failures(result: Dict) -> List[str]:
    out = list(result["errors"])
    for r in result.get("results", []):
        if r["ret"] != 0 or r["bad_blocks"] or not r["guards_ok"]:
            out.append(f"{r['case']}: ret {r['ret']}, {r['bad_blocks']} bad blocks, guards ok {r['guards_ok']}")
    if not out and not result.get("results"):
        out.append("no case ran")
    for side in ("receiver", "sender"):
        if result.get(f"{side}_register_ret", 0) != 0:
            out.append(f"{side}: batch_register_memory returned {result[f'{side}_register_ret']}")
        if result["force_tcp"] and not result["errors"] and not result.get(f"{side}_tcp_only"):
            out.append(f"{side}: the engine's log does not say '{TCP_ONLY_LOG}'")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    result = run(args)
    result["seconds"] = round(time.monotonic() - start, 2)
    for r in result.get("results", []):
        rate = result["bytes_per_case"] / r["seconds"] / 1e6 if r["seconds"] > 0 else float("inf")
        print(f"mooncake_tcp_probe: {r['case']:<16} ret={r['ret']} {result['bytes_per_case'] >> 20} MiB in "
              f"{r['seconds'] * 1e3:.1f} ms ({rate:.0f} MB/s), bad blocks {r['bad_blocks']}/{result['blocks']}, "
              f"guards ok {r['guards_ok']}")  # fmt: skip
    for name, lines in result.get("log_tails", {}).items():
        print(f"--- {name} engine log (last lines, {result['logs'][name]}):")
        print("\n".join("    " + line[:300] for line in lines))
    problems = failures(result)
    result["failures"] = problems
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    for problem in problems:
        print(f"FAIL {problem}")
    print(f"mooncake_tcp_probe: {'FAILED' if problems else 'PASSED'} in {result['seconds']} s "
          f"(MC_FORCE_TCP {'set' if result['force_tcp'] else 'unset'})")  # fmt: skip
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
