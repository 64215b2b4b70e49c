"""Shared KV's state for tests that build pools and runtimes by hand: what the capacity hook and
the startup's attach build on a server (``cp_shared_kv_capacity``, ``startup_wiring``), from a
layout and a scratch the test chose.

* ``spec_for``: a ``CpSharedKVSpec`` of ``layout`` with the settings given (default: this
  process's environment, read now) and the decode path decided for ``decode_impl`` by the startup
  rules;
* ``attach_runtime``: the pool's ``CpSharedKVState`` with that spec, its ``CpSharedKVRuntime`` and,
  given a ``req_to_token_pool``, the host mirror the plan reads;
* ``per_owner_pool_state``: a pool's state with a real per-owner decode over a stand-in runtime (the
  plan the last prefill left), for the decode-graph hooks, which bind it to the backend.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional
from unittest import mock

from sglang_cp_shared_kv.mem_cache.req_to_page_mirror import ReqToPageMirror, mirror_of
from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import CpSharedKVRuntime
from sglang_cp_shared_kv.model_executor.cp_shared_kv_spec import CpSharedKVSpec
from sglang_cp_shared_kv.model_executor.cp_shared_kv_state import CpSharedKVState
from sglang_cp_shared_kv.model_executor.per_owner_decode import decode_forward
from sglang_cp_shared_kv.settings import CpSharedKVSettings, current_settings
from sglang_cp_shared_kv.startup_rules import ScratchDecision, ScratchSizing, decide_decode_path


def spec_for(
    layout,
    *,
    settings: Optional[CpSharedKVSettings] = None,
    decode_impl: Optional[str] = "flashmla_kv",
    prefill_scratch_tokens: Optional[int] = None,
) -> CpSharedKVSpec:
    """``prefill_scratch_tokens``: slot 0 sized for prefill batches of that many tokens (None: the
    logical capacity, so decode forwards may gather)."""
    settings = current_settings() if settings is None else settings
    server_args = SimpleNamespace(
        nsa_decode_backend=decode_impl, speculative_algorithm=None, disaggregation_mode="null"
    )
    if prefill_scratch_tokens is None:
        slot0 = ScratchSizing(None, "the logical capacity (test)")
    else:
        slot0 = ScratchSizing(prefill_scratch_tokens, "prefill batches only (test)")
    return CpSharedKVSpec(
        layout=layout,
        settings=settings,
        decode=decide_decode_path(server_args, settings),
        scratch=ScratchDecision(slot0, prefetch_slot_requested_tokens=0),
    )


def attach_runtime(
    pool,
    layout,
    scratch,
    cp_group,
    *,
    req_to_token_pool=None,
    settings: Optional[CpSharedKVSettings] = None,
    decode_impl: Optional[str] = "flashmla_kv",
    scratch_serves_decode: bool = True,
    **runtime_kwargs,
) -> CpSharedKVRuntime:
    """The runtime of ``pool`` (its state attached first); ``runtime_kwargs``: the prefetch slot,
    its group and the indexer layers, as ``CpSharedKVRuntime`` takes them."""
    spec = spec_for(
        layout,
        settings=settings,
        decode_impl=decode_impl,
        prefill_scratch_tokens=None if scratch_serves_decode else scratch.size,
    )
    state = CpSharedKVState(pool, spec)
    runtime = CpSharedKVRuntime(state, scratch, cp_group, **runtime_kwargs)
    if req_to_token_pool is not None:
        state.mirror = mirror_of(req_to_token_pool) or ReqToPageMirror.attach(
            req_to_token_pool, layout.page_size
        )
    return runtime


def per_owner_pool_state(
    layout, collectives=(None, None), decode_impl: str = "fa3", settings: Optional[CpSharedKVSettings] = None
) -> CpSharedKVState:
    """``collectives``: per-owner decode's (all_gather, all_reduce_sum); ``settings``: the spec's
    (default: the defaults)."""
    spec = SimpleNamespace(layout=layout, settings=CpSharedKVSettings() if settings is None else settings)
    state = CpSharedKVState(SimpleNamespace(), spec)
    runtime = SimpleNamespace(cp_group=None, plan="last prefill's plan")
    runtime.clear_plan = lambda: setattr(runtime, "plan", None)
    state.runtime = runtime
    with mock.patch.object(decode_forward, "process_group_collectives", return_value=collectives):
        decode_forward.PerOwnerDecode(state, decode_impl=decode_impl)
    return state
