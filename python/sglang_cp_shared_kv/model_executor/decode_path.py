"""Which path decode takes on a shared-KV server, decided at startup from server args and environment.

By default every decode forward gathers the pages it reads into the gather scratch, which must then
hold one layer of the whole logical capacity. With ``SGLANG_CP_SHARED_KV_DECODE=per_owner`` decode
runs per owner (``per_owner_decode``: each rank scores and attends over its own pool, no page
gather) unless something rules it out, and the scratch only has to hold a prefill forward. The
default is still the gather: per-owner decode has served clean (audited against stock, one-GPU test
mode) at CP 2 and 4 with bf16 KV, not yet at CP 8, nor with fp8 KV, nor with MTP. Measured on one
H200 at GLM-5 widths it costs a fixed 44-82 us per layer at batch 1 as a CUDA graph and 370-770
us eagerly, whatever the context, against a gather whose on-GPU work alone grows with the batch's
pages (docs/runtime.md, section 4).

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
            f"{GRAPH_DECODE_ENV}=1 until served at every CP size)"
        )
    reason = decode_gather_reason(server_args)
    if reason is not None:
        return (
            f"{flag} requires --disable-cuda-graph while decode gathers pages ({reason}): graphs "
            f"cannot replay the per-forward, variable-size page gather"
        )
    return graph_cp_size_problem(getattr(server_args, "tp_size", 1), flag)


# The largest CP size at which per-owner decode graphs have served clean (see graph_cp_size_problem).
MAX_SERVED_GRAPH_CP_SIZE = 4


def graph_cp_size_problem(cp_size: int, flag: str) -> Optional[str]:
    """Why per-owner decode graphs are refused at this CP size, or None.

    Served clean (one-GPU test mode, 2026-12-03; the decode audit checking every replay's selection
    and attention indices) at CP 2, with every batch size captured and with only 2 and 16 captured
    (batches of 3-15 replayed padded in the graph of 16), and at CP 4 (captured at 4 8 12 16, so
    most batches replayed padded). CP 8 has not been served: refused there, naming the way out.
    Asked at startup (``ServerArgs``) and again before capture (``per_owner_decode.cuda_graphs``)."""
    if cp_size <= MAX_SERVED_GRAPH_CP_SIZE:
        return None
    return (
        f"{flag} with decode CUDA graphs per owner is accepted only up to CP size "
        f"{MAX_SERVED_GRAPH_CP_SIZE}, not {cp_size}: they have not been served above it yet; use "
        f"--disable-cuda-graph (per-owner decode then runs eagerly)"
    )
