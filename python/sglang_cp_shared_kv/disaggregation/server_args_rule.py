"""Which PD disaggregation setups ``--enable-nsa-prefill-cp-shared-kv`` supports, as startup messages.

``unsupported_disaggregation_server_args(server_args)`` returns one message per offending setting,
each naming its flag or variable; the plugin's server-args validation (``server_args.py``,
``_unsupported_combinations``) adds them to its list. Supported: ``--disaggregation-mode prefill``
with ``--disaggregation-transfer-backend mooncake`` and ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1``.

Why the others are refused:

* ``--disaggregation-mode decode``: decode-side shared KV is out of scope; the decode server is stock
  sglang (no plugin flag).
* nixl: its decode side (0.5.11 ``NixlKVManager.update_transfer_status`` / ``TransferStatus``) counts
  KV chunk notifications per PP rank, not per sender; all CP ranks of a prefill share PP rank 0, so it
  cannot tell when every CP rank's pages have landed (and with all CP ranks sending it expects
  ``attn_cp_size`` PP ranks that never report, so requests wait until the timeout).
* mori, ascend: not ported (their senders filter a contiguous page range per CP rank, like stock
  mooncake, and index the pool by logical page).
* ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER`` unset or false: then only CP rank 0 sends and the
  decode asks only rank 0, but rank 0 holds ``1/cp_size`` of the pages. The decode server must set it
  too; this check sees only the prefill server's environment.
"""

from __future__ import annotations

import os

from sglang_cp_shared_kv.server_args import CP_SHARED_KV_FLAG

ALL_CP_RANKS_ENV = "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"
SUPPORTED_BACKEND = "mooncake"
_TRUE = ("true", "1", "yes", "y")  # what sglang's EnvBool reads as true


# PD prefill with shared KV has passed its CPU tests (a decode pool assembled from the CP ranks'
# sends equals stock's byte for byte) but has not run on GPUs yet: until the PD smoke
# (scripts/glm5_pd_smoke.py) has passed there, a user opts in explicitly.
EXPERIMENTAL_PD_ENV = "SGLANG_CP_SHARED_KV_EXPERIMENTAL_PD"


def unsupported_disaggregation_server_args(server_args) -> list[str]:
    """Messages for the PD settings the flag cannot serve (empty: supported, or PD off)."""
    mode = server_args.disaggregation_mode
    if mode in (None, "null"):
        return []
    if mode == "decode":
        return [
            f"--disaggregation-mode decode: {CP_SHARED_KV_FLAG} is supported on the prefill server "
            "only; run the decode server without it (it receives whole pages from every CP rank)"
        ]
    if mode != "prefill":
        return [f"--disaggregation-mode {mode}: unknown mode"]

    problems = []
    if os.environ.get(EXPERIMENTAL_PD_ENV) != "1":
        problems.append(
            f"--disaggregation-mode prefill with {CP_SHARED_KV_FLAG} is experimental: it has passed "
            f"CPU tests but has not run on GPUs yet; set {EXPERIMENTAL_PD_ENV}=1 to run it anyway"
        )
    backend = server_args.disaggregation_transfer_backend
    if backend == "nixl":
        problems.append(
            "--disaggregation-transfer-backend nixl: not supported with "
            f"{CP_SHARED_KV_FLAG}; nixl's decode side counts KV arrivals per PP rank, not per CP "
            f"rank, so it cannot wait for every CP rank's pages; use --disaggregation-transfer-backend "
            f"{SUPPORTED_BACKEND}"
        )
    elif backend != SUPPORTED_BACKEND:
        problems.append(
            f"--disaggregation-transfer-backend {backend}: not supported with {CP_SHARED_KV_FLAG}; "
            f"use --disaggregation-transfer-backend {SUPPORTED_BACKEND}"
        )
    value = os.environ.get(ALL_CP_RANKS_ENV)
    if value is None or value.strip().lower() not in _TRUE:
        shown = "unset" if value is None else f"set to {value!r}"
        problems.append(
            f"{ALL_CP_RANKS_ENV} is {shown}: --disaggregation-mode prefill with {CP_SHARED_KV_FLAG} "
            f"needs {ALL_CP_RANKS_ENV}=1 on the prefill and the decode server (every CP rank sends "
            "the pages it owns)"
        )
    return problems
