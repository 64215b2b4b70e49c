"""``python -m sglang_cp_shared_kv.check_launch <sglang serve arguments>``: would shared KV accept this
launch? Answered on any machine, no GPU needed.

The arguments go through sglang's own parser and ``ServerArgs`` (``prepare_server_args``, what
``sglang serve`` runs) with the plugins loaded, so every startup rule of ours runs, including the
environment settings (``settings``): run it with the same environment as the server. Stock
``ServerArgs`` asks the machine for its accelerator before any plugin rule runs; here the machine
is taken to be the one the launch is for: ``--device cuda`` unless given, a GPU of compute
capability ``--assume-sm`` (default 9.0, H100/H200) for sglang's per-architecture defaults (KV
dtype, NSA impls), and of ``--assume-gpu-memory-mib`` MiB (default 143,771, what an H200 reports)
for its memory-sized defaults (chunked prefill size, CUDA graph batch sizes, memory fraction). The
model path must hold the model's ``config.json`` (weights are not read).

Prints the effective settings and exits 0 when accepted; prints ``REFUSED:`` and every problem and
exits 1 when refused, by our rules or by sglang's own checks of the arguments (its assertions
included); argparse's usage errors exit 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence, TextIO
from unittest import mock

from sglang_cp_shared_kv.settings import CP_SHARED_KV_FIELD, CP_SHARED_KV_FLAG, current_settings

ACCEPTED, REFUSED = 0, 1
H200_MEMORY_MIB = 143_771  # torch.cuda.mem_get_info's total on an H200, as sglang reads it


def _split_own_options(argv: Sequence[str]):
    """``--assume-sm X.Y`` and ``--assume-gpu-memory-mib N`` are ours; ``sglang serve`` / ``serve``
    in front are dropped."""
    args = list(argv)
    while args and args[0] in ("sglang", "serve"):
        args.pop(0)
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--assume-sm", default="9.0")
    own.add_argument("--assume-gpu-memory-mib", type=int, default=H200_MEMORY_MIB)
    known, rest = own.parse_known_args(args)
    try:
        major, minor = (int(part) for part in known.assume_sm.split("."))
    except ValueError:
        raise SystemExit(f"--assume-sm must be MAJOR.MINOR (e.g. 9.0), got {known.assume_sm!r}")
    if "--device" not in rest and not any(a.startswith("--device=") for a in rest):
        rest = rest + ["--device", "cuda"]
    return (major, minor), known.assume_gpu_memory_mib, rest


def check_launch(argv: Sequence[str], out: TextIO = sys.stdout, load_plugins=None) -> int:
    """Parse ``argv`` as ``sglang serve`` does and report; returns the exit code.
    ``load_plugins``: sglang's (default); tests pass one that leaves the hooks they applied."""
    from sglang.srt.server_args import prepare_server_args

    if load_plugins is None:
        from sglang.srt.plugins import load_plugins

    from sglang_cp_shared_kv.startup_rules import decide_decode_path, decide_scratch
    from sglang_cp_shared_kv.startup_summary import effective_settings

    capability, memory_mib, serve_argv = _split_own_options(argv)
    load_plugins()
    try:
        with mock.patch("torch.cuda.get_device_capability", return_value=capability), mock.patch(
            "sglang.srt.server_args.get_device_memory_capacity", return_value=memory_mib
        ):
            server_args = prepare_server_args(serve_argv)
    except ValueError as error:  # our rules (every problem in one message) and sglang's
        print(f"REFUSED: {error}", file=out)
        return REFUSED
    except Exception as error:  # sglang's own checks: assertions in ServerArgs.__post_init__, ...
        print(f"REFUSED: sglang refused the arguments ({type(error).__name__}): {error}", file=out)
        return REFUSED
    if not getattr(server_args, CP_SHARED_KV_FIELD, False):
        print(f"REFUSED: {CP_SHARED_KV_FLAG} is not in the arguments (stock sglang would run)", file=out)
        return REFUSED
    model_config = vars(server_args).get("model_config")
    context_len = getattr(model_config, "context_len", None)
    settings = current_settings()  # accepted: every value parsed
    decode = decide_decode_path(server_args, settings)
    scratch = None if context_len is None else decide_scratch(server_args, settings, decode, context_len)
    print(f"ACCEPTED: {CP_SHARED_KV_FLAG} runs with", file=out)
    for name, value in effective_settings(server_args, settings, decode, scratch):
        print(f"  {name}: {value}", file=out)
    return ACCEPTED


def main(argv: Optional[List[str]] = None) -> None:
    sys.exit(check_launch(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
