"""Which path decode takes on a shared-KV server, decided at startup from server args and environment.

Per owner (``per_owner_decode``): each rank scores and attends over its own pool, no page gather,
the gather scratch only holds a prefill forward, and decode runs under CUDA graphs. Through the
gather: every decode forward gathers the pages it reads into the scratch, which must then hold one
layer of the whole logical capacity, and graphs are refused (the gather's size follows the batch).

``SGLANG_CP_SHARED_KV_DECODE=auto`` (the default) decodes per owner with the NSA decode impls that
have served clean at CP 2, 4 and 8 (audited against stock, one-GPU test mode, 2026-12-03: ``fa3``,
sglang's decode impl for bf16 KV on Hopper) and gathers otherwise: with ``flashmla_kv`` (fp8 KV;
served clean per owner at CP 2 and 4, not yet at 8), with impls per-owner decode does not serve,
and with MTP (the draft's decode steps gather). ``per_owner`` asks for it with any impl it serves
(and refuses MTP); ``gather`` keeps every decode on the gather. Measured on one H200 at GLM-5
widths per-owner decode costs a fixed 44-82 us per layer at batch 1 as a CUDA graph and 370-770 us
eagerly, whatever the context, against a gather whose on-GPU work alone grows with the batch's
pages (docs/runtime.md, section 4).

The decision is needed before the model runner exists (the scratch is reserved before sglang sizes
the pool, and the CUDA-graph rule is judged on ``ServerArgs``), so it is taken here from the same
inputs on every rank: ``SGLANG_CP_SHARED_KV_DECODE``, the NSA decode impl sglang resolved into
``--nsa-decode-backend``, ``--speculative-algorithm``, ``SGLANG_NSA_FUSE_TOPK``, and the PD mode
(a ``--disaggregation-mode prefill`` server never decodes). At startup
``scratch_sizing.decide_scratch`` asks these rules once per model runner, and per-owner decode
attaches by that decision (``startup_wiring``); a decode forward that reaches the gather while the
scratch was sized for prefill raises (``CpSharedKVRuntime.begin_forward``). The startup summary
prints the path and, where decode gathers, why.
"""

from __future__ import annotations

from typing import Optional

from sglang_cp_shared_kv.settings import (
    AUTO,
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
# The impls ``auto`` decodes per owner with: served clean at CP 2, 4 and 8 (docs/gpu.md, served-audit
# table). flashmla_kv has served clean at CP 2 and 4 only; flashmla_sparse has not been served.
AUTO_PER_OWNER_DECODE_IMPLS = ("fa3",)


def is_pd_prefill_server(server_args) -> bool:
    return getattr(server_args, "disaggregation_mode", None) == "prefill"


def decode_gather_reason(server_args) -> Optional[str]:
    """Why decode forwards of this server gather pages (a sentence naming the setting), or None
    when they all run per owner. A PD prefill server runs no decode forward: None."""
    if is_pd_prefill_server(server_args):
        return None
    return impl_gather_reason(server_args.nsa_decode_backend, server_args.speculative_algorithm)


def impl_gather_reason(impl: Optional[str], speculative_algorithm: Optional[str] = None) -> Optional[str]:
    """Why decode with this NSA decode impl gathers pages, or None when it runs per owner. The one
    rule, asked by ``scratch_sizing.decide_scratch`` (with ``--nsa-decode-backend``, which sglang's
    NSA backend takes as its decode impl) and by the startup rules. ``speculative_algorithm``
    matters to ``auto`` only: with an explicit ``per_owner`` MTP is refused instead
    (``mtp_opt_in.mtp_combination_problems``), never quietly moved to the gather."""
    path = configured_decode_path()
    if path == GATHER:
        return f"{DECODE_PATH_ENV}={GATHER}"
    if impl not in PER_OWNER_DECODE_IMPLS:
        served = ", ".join(PER_OWNER_DECODE_IMPLS)
        return f"--nsa-decode-backend {impl} (per-owner decode serves {served})"
    if path == AUTO and impl not in AUTO_PER_OWNER_DECODE_IMPLS:
        return (
            f"{DECODE_PATH_ENV}={AUTO} (the default) decodes per owner with "
            f"{', '.join(AUTO_PER_OWNER_DECODE_IMPLS)} only, not yet with --nsa-decode-backend {impl} "
            f"(not served clean at every CP size; {DECODE_PATH_ENV}={PER_OWNER} asks for it)"
        )
    if path == AUTO and speculative_algorithm is not None:
        return (
            f"--speculative-algorithm {speculative_algorithm} with {DECODE_PATH_ENV}={AUTO} (the "
            f"default): the draft's decode steps gather pages"
        )
    from sglang.srt.environ import envs

    if not envs.SGLANG_NSA_FUSE_TOPK.get():
        return "SGLANG_NSA_FUSE_TOPK is off (per-owner decode needs the fused top-k)"
    return None


# Decode under CUDA graphs (``per_owner_decode.cuda_graphs``): on by default where decode runs per
# owner; SGLANG_CP_SHARED_KV_DECODE_CUDA_GRAPH=0 turns it off (the server then needs --disable-cuda-graph).
def graph_decode_enabled() -> bool:
    return current_settings().decode_cuda_graph


def cuda_graph_problem(server_args, flag: str) -> Optional[str]:
    """Why this server cannot run decode CUDA graphs (a message naming the settings), or None.

    Decode graphs replay fixed shapes: per-owner decode has them (static owner tables, fixed-size
    exchanges), the page gather does not (its size follows the batch's pages)."""
    if server_args.disable_cuda_graph:
        return None
    if not graph_decode_enabled():
        return f"{flag} requires --disable-cuda-graph with {GRAPH_DECODE_ENV}=0 (decode CUDA graphs off)"
    reason = decode_gather_reason(server_args)
    if reason is not None:
        return (
            f"{flag} requires --disable-cuda-graph while decode gathers pages ({reason}): graphs "
            f"cannot replay the per-forward, variable-size page gather"
        )
    # Per-owner decode graphs have served clean at every CP size the flag accepts (2, 4 and 8;
    # one-GPU test mode, 2026-12-03), with padded replays: no CP-size or capture-list rule.
    return None
