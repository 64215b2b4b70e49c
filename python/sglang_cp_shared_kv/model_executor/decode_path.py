"""Which path decode takes on a shared-KV server, decided at startup from server args and environment.

By default every decode forward gathers the pages it reads into the gather scratch, which must then
hold one layer of the whole logical capacity. With ``SGLANG_CP_SHARED_KV_DECODE=per_owner`` decode
runs per owner (``per_owner_decode``: each rank scores and attends over its own pool, no page
gather) unless something rules it out, and the scratch only has to hold a prefill forward. The
default is still the gather because per-owner decode has not been served in a running server yet
(that needs two GPUs); measured on one H200 at GLM-5 widths it costs a fixed 44-82 us per layer
at batch 1 as a CUDA graph and 370-770 us eagerly, whatever the context, against a gather whose
on-GPU work alone grows with the batch's pages (docs/runtime.md, section 4).

The decision is needed before the model runner exists (the scratch is reserved before sglang sizes
the pool, and the CUDA-graph rule is judged on ``ServerArgs``), so it is taken here from the same
inputs on every rank: ``SGLANG_CP_SHARED_KV_DECODE`` (``gather``, the default, or ``per_owner``),
the NSA decode impl sglang resolved into ``--nsa-decode-backend``, ``SGLANG_NSA_FUSE_TOPK``, and
the PD mode (a ``--disaggregation-mode prefill`` server never decodes). At startup
``scratch_sizing.decide_scratch`` asks these rules once per model runner, and per-owner decode
attaches by that decision (``startup_wiring``); a decode forward that reaches the gather while the
scratch was sized for prefill raises (``CpSharedKVRuntime.begin_forward``).
"""

from __future__ import annotations

from typing import Optional

from sglang_cp_shared_kv.settings import (
    DECODE_PATH_ENV,
    DEFAULT_DECODE_PATH,
    GATHER,
    GRAPH_DECODE_ENV,
    PER_OWNER,
    current_settings,
)



def configured_decode_path() -> str:
    """``SGLANG_CP_SHARED_KV_DECODE`` (``settings``); a ``ValueError`` naming it when bad."""
    return current_settings().decode_path


# NSA decode impls (``--nsa-decode-backend``) that ``per_owner_decode`` serves; kept equal to what it
# attaches for (a unit test compares them), here so that startup rules need not import the runtime.
PER_OWNER_DECODE_IMPLS = ("flashmla_kv", "flashmla_sparse", "fa3")


def is_pd_prefill_server(server_args) -> bool:
    return getattr(server_args, "disaggregation_mode", None) == "prefill"


def decode_gather_reason(server_args) -> Optional[str]:
    """Why decode forwards of this server gather pages (a sentence naming the setting), or None
    when they all run per owner. A PD prefill server runs no decode forward: None."""
    if is_pd_prefill_server(server_args):
        return None
    return impl_gather_reason(server_args.nsa_decode_backend)


def impl_gather_reason(impl: Optional[str]) -> Optional[str]:
    """Why decode with this NSA decode impl gathers pages, or None when it runs per owner. The one
    rule, asked by ``scratch_sizing.decide_scratch`` (with ``--nsa-decode-backend``, which sglang's
    NSA backend takes as its decode impl) and by the startup rules."""
    if configured_decode_path() == GATHER:
        return f"{DECODE_PATH_ENV}={GATHER} (the default; {PER_OWNER} opts in)"
    if impl not in PER_OWNER_DECODE_IMPLS:
        served = ", ".join(PER_OWNER_DECODE_IMPLS)
        return f"--nsa-decode-backend {impl} (per-owner decode serves {served})"
    from sglang.srt.environ import envs

    if not envs.SGLANG_NSA_FUSE_TOPK.get():
        return "SGLANG_NSA_FUSE_TOPK is off (per-owner decode needs the fused top-k)"
    return None


# Decode under CUDA graphs (``per_owner_decode.cuda_graphs``) is opt-in until its capture and
# replay have been checked on GPUs: without it the server keeps requiring --disable-cuda-graph.
def graph_decode_opted_in() -> bool:
    return current_settings().decode_cuda_graph


def cuda_graph_problem(server_args, flag: str) -> Optional[str]:
    """Why this server cannot run decode CUDA graphs (a message naming the settings), or None.

    Decode graphs replay fixed shapes: per-owner decode has them (static owner tables, fixed-size
    exchanges), the page gather does not (its size follows the batch's pages)."""
    if server_args.disable_cuda_graph:
        return None
    if not graph_decode_opted_in():
        return (
            f"{flag} requires --disable-cuda-graph (decode CUDA graphs per owner are opt-in with "
            f"{GRAPH_DECODE_ENV}=1 until checked on GPUs)"
        )
    reason = decode_gather_reason(server_args)
    if reason is not None:
        return (
            f"{flag} requires --disable-cuda-graph while decode gathers pages ({reason}): graphs "
            f"cannot replay the per-forward, variable-size page gather"
        )
    return graph_padding_problem(
        getattr(server_args, "cuda_graph_bs", None), getattr(server_args, "tp_size", 1), flag
    )


# Per-owner decode graphs pad a replay by up to cp_size - 1 rows; accepted only where that is at most 1
# until graphs have served clean (see graph_padding_problem).
MAX_SERVED_GRAPH_CP_SIZE = 2


def graph_padding_problem(cuda_graph_bs, cp_size: int, flag: str) -> Optional[str]:
    """Why per-owner decode graphs are refused at this CP size with this capture list, or None.

    sglang captures only batch sizes that are multiples of the attention CP size and replays a
    batch in the smallest captured size that holds it. Served at CP 2 (one-GPU test mode,
    2026-12-02), a batch of 6 replayed in the graph of 8 (sglang's default list) crashed with an
    illegal memory access; the cause (2026-12-03: the captured run reused columns derived in
    sglang's warm-up runs, ``OwnerForward.begin_layer``) is fixed, and it also voids the one
    served graph run that passed. Until graphs serve clean, the fence stays: the list must hold
    every multiple of ``cp_size`` up to its largest size, and a CP size above 2 is refused (every
    batch that is not a multiple of it replays padded by up to ``cp_size - 1`` rows). ``None``
    list (sglang has not resolved it yet): judged again before capture
    (``per_owner_decode.cuda_graphs``)."""
    if cp_size > MAX_SERVED_GRAPH_CP_SIZE:
        return (
            f"{flag} with decode CUDA graphs per owner is accepted only up to CP size "
            f"{MAX_SERVED_GRAPH_CP_SIZE}, not {cp_size}: sglang pads a replay to a multiple of the CP "
            f"size (up to {cp_size - 1} rows here), and padded replays have not served clean yet; use "
            f"--disable-cuda-graph (per-owner decode then runs eagerly)"
        )
    if not cuda_graph_bs:
        return None
    step = max(1, cp_size)
    largest = max(cuda_graph_bs)
    missing = sorted(set(range(step, largest + 1, step)) - set(cuda_graph_bs))
    if not missing:
        return None
    wanted = " ".join(str(bs) for bs in range(step, largest + 1, step))
    return (
        f"{flag} with decode CUDA graphs per owner needs --cuda-graph-bs to hold every multiple of "
        f"the CP size ({step}) up to {largest}, or --disable-cuda-graph: replays padded by "
        f"{step} rows or more have not served clean yet (missing: {' '.join(map(str, missing[:8]))}"
        f"{' ...' if len(missing) > 8 else ''}); e.g. --cuda-graph-bs {wanted}"
    )
