"""MTP (EAGLE / NEXTN with the built-in NextN layer, top-k 1) with shared KV: an explicit opt-in.

Every forward mode MTP runs is planned and checked on one GPU through sglang's own classes, and MTP
has served clean with shared KV at CP 2 (one-GPU test mode, 2026-12-03), not yet at CP 4 or 8 nor
on a PD prefill server, so the server refuses it unless ``SGLANG_CP_SHARED_KV_MTP=1`` opts in.
The opt-in lifts only that rule (``server_args.speculative_problems``); the settings MTP
cannot be combined with stay refused whatever it says (``mtp_combination_problems``). Read from the
launching process's environment, which every scheduler inherits: every rank decides the same.
"""

from __future__ import annotations

from typing import List

from sglang_cp_shared_kv.model_executor.decode_path import is_pd_prefill_server
from sglang_cp_shared_kv.model_executor.scratch_sizing import logical_capacity_reason
from sglang_cp_shared_kv.settings import (
    DECODE_PATH_ENV,
    GATHER,
    MTP_ENV,
    PER_OWNER,
    current_settings,
)



def mtp_opted_in() -> bool:
    """``SGLANG_CP_SHARED_KV_MTP`` (``settings``' boolean rule); a ``ValueError`` naming it when bad."""
    return current_settings().mtp


def mtp_combination_problems(server_args, flag: str) -> List[str]:
    """Settings MTP with shared KV cannot run with, one message each naming both settings."""
    algorithm = server_args.speculative_algorithm
    problems = []
    if not server_args.disable_cuda_graph:
        # The draft's graphs (EAGLEDraftCudaGraphRunner) capture the step backends' metadata, which
        # the page gather cannot replay (peer_page_reads refuses it, but only once the model loaded).
        problems.append(
            f"--speculative-algorithm {algorithm} with {flag} requires --disable-cuda-graph: the "
            "draft's decode steps and the target verify gather pages, which CUDA graphs cannot replay"
        )
    if not is_pd_prefill_server(server_args) and logical_capacity_reason(server_args) is None:
        # The draft's decode steps gather over the whole batch (draft_decode_steps); per-owner
        # decode sizes the gather scratch for prefill batches only (scratch_sizing).
        problems.append(
            f"--speculative-algorithm {algorithm} with {DECODE_PATH_ENV}={PER_OWNER}: the draft's "
            "decode steps gather the pages of every request, but per-owner decode sizes the gather "
            f"scratch for prefill batches only; use {DECODE_PATH_ENV}={GATHER} or auto (the default, "
            "which gathers under MTP) with MTP"
        )
    return problems
