"""Shared KV's state of one KV pool: one object on the pool, owning everything that serves it.

``CpSharedKVState`` is created with the capacity (``cp_shared_kv_capacity``: the target's pool)
or with the draft's runtime (``cp_shared_kv_draft_pool``), and filled by the attach
(``startup_wiring``). It owns:

* ``spec``: the frozen facts (``CpSharedKVSpec``), the same object for the target and the draft;
* ``runtime``: the plan, the stores and the scratch slots of the page gather (``CpSharedKVRuntime``);
* ``mirror``: the host mirror of ``req_to_token`` the plan reads (``ReqToPageMirror``; the target
  and the draft share one, as they share ``req_to_token``);
* ``per_owner``: per-owner decode (``PerOwnerDecode``) where the spec says decode runs per owner.

The two decode paths meet here and only here. A decode forward that per-owner decode takes runs
without a plan (``begin_per_owner_forward``, ``begin_captured_per_owner_forward``): the stores keep
the owned rows and gather nothing, and the pool getters serve the physical pool while it runs
(``reads_physical_pool``) until the next forward, or a draft step, ends it
(``end_per_owner_forward``). Neither path touches the other's attributes.
"""

from __future__ import annotations

from typing import Optional

from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG

_STATE_ATTR = "_cp_shared_kv_state"


def state_of(pool) -> Optional["CpSharedKVState"]:
    """The state of ``pool``; None for every other pool (the scratch slots included)."""
    return getattr(pool, _STATE_ATTR, None)


def serving_state(pool) -> Optional["CpSharedKVState"]:
    """The state of ``pool`` once its runtime is attached (before that the hooks serve nothing)."""
    state = state_of(pool)
    return state if state is not None and state.runtime is not None else None


class CpSharedKVState:
    """See the module docstring; constructing it attaches it to ``pool``."""

    def __init__(self, pool, spec):
        if state_of(pool) is not None:
            raise ValueError(f"{FLAG}: this KV pool already has a shared-KV state")
        self.pool = pool
        self.spec = spec
        self.runtime = None  # CpSharedKVRuntime, attached by startup_wiring
        self.mirror = None  # ReqToPageMirror of the runner's req_to_token_pool
        self.per_owner = None  # PerOwnerDecode where decode runs per owner
        setattr(pool, _STATE_ATTR, self)

    # ---- where the page gather and per-owner decode meet (module docstring) ----

    def begin_per_owner_forward(self, backend, forward_batch) -> bool:
        """``forward_dispatch``: per-owner decode takes this forward (True; it runs without a plan)
        or leaves it to the page gather (False)."""
        if self.per_owner is None or not self.per_owner.begin_forward(backend, forward_batch):
            return False
        self.runtime.clear_plan()
        return True

    def begin_captured_per_owner_forward(self, tables, paged_mqa_schedule) -> None:
        """A decode graph's capture or replay (``per_owner_decode.cuda_graphs``): per-owner decode
        over the static owner tables, without a plan."""
        self.per_owner.begin_static_forward(tables, paged_mqa_schedule)
        self.runtime.clear_plan()

    def end_per_owner_forward(self) -> None:
        """A per-owner decode forward of this pool (if any) is over: the getters serve the scratch."""
        if self.per_owner is not None:
            self.per_owner.end_forward()

    def reads_physical_pool(self) -> bool:
        """True while a per-owner decode forward runs: the pool getters serve the physical pool."""
        return self.per_owner is not None and self.per_owner.forward is not None
