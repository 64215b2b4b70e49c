"""``python -m sglang_cp_shared_kv.check_launch <sglang serve arguments>``: would shared KV accept this
launch? Answered on any machine, no GPU needed.

The arguments go through sglang's own parser and ``ServerArgs`` (``prepare_server_args``, what
``sglang serve`` runs) with the plugins loaded, so every startup rule of ours runs, including the
environment settings (``settings``): run it with the same environment as the server. Stock
``ServerArgs`` asks the machine for its accelerator before any plugin rule runs; here the machine
is taken to be the one the launch is for: ``--device cuda`` unless given, and a GPU of compute
capability ``--assume-sm`` (default 9.0, H100/H200) for sglang's per-architecture defaults (KV
dtype, NSA impls). The model path must hold the model's ``config.json`` (weights are not read).

Prints the effective settings and exits 0 when accepted; prints every problem and exits 1 when
refused; argparse's usage errors exit 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence, TextIO
from unittest import mock

from sglang_cp_shared_kv.settings import CP_SHARED_KV_FIELD, CP_SHARED_KV_FLAG

ACCEPTED, REFUSED = 0, 1


def _split_own_options(argv: Sequence[str]):
    """``--assume-sm X.Y`` is ours; ``sglang serve`` / ``serve`` in front are dropped."""
    args = list(argv)
    while args and args[0] in ("sglang", "serve"):
        args.pop(0)
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--assume-sm", default="9.0")
    known, rest = own.parse_known_args(args)
    try:
        major, minor = (int(part) for part in known.assume_sm.split("."))
    except ValueError:
        raise SystemExit(f"--assume-sm must be MAJOR.MINOR (e.g. 9.0), got {known.assume_sm!r}")
    if "--device" not in rest and not any(a.startswith("--device=") for a in rest):
        rest = rest + ["--device", "cuda"]
    return (major, minor), rest


def check_launch(argv: Sequence[str], out: TextIO = sys.stdout, load_plugins=None) -> int:
    """Parse ``argv`` as ``sglang serve`` does and report; returns the exit code.
    ``load_plugins``: sglang's (default); tests pass one that leaves the hooks they applied."""
    from sglang.srt.server_args import prepare_server_args

    if load_plugins is None:
        from sglang.srt.plugins import load_plugins

    from sglang_cp_shared_kv.startup_summary import effective_settings

    capability, serve_argv = _split_own_options(argv)
    load_plugins()
    try:
        with mock.patch("torch.cuda.get_device_capability", return_value=capability):
            server_args = prepare_server_args(serve_argv)
    except ValueError as error:  # our rules (every problem in one message) and sglang's
        print(f"REFUSED: {error}", file=out)
        return REFUSED
    if not getattr(server_args, CP_SHARED_KV_FIELD, False):
        print(f"REFUSED: {CP_SHARED_KV_FLAG} is not in the arguments (stock sglang would run)", file=out)
        return REFUSED
    model_config = vars(server_args).get("model_config")
    context_len = getattr(model_config, "context_len", None)
    print(f"ACCEPTED: {CP_SHARED_KV_FLAG} runs with", file=out)
    for name, value in effective_settings(server_args, context_len):
        print(f"  {name}: {value}", file=out)
    return ACCEPTED


def main(argv: Optional[List[str]] = None) -> None:
    sys.exit(check_launch(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
