"""Prefill admission hands its remaining token budget to HiCache load-back as ``mem_quota``.

``HiRadixCache.load_back(node, mem_quota)`` loads all evicted ancestors of ``node`` or nothing, and
refuses when they exceed ``mem_quota``; ``init_load_back`` then returns no indices and the request
recomputes that prefix. sglang 0.5.11's ``PrefillAdder.add_one_req`` calls ``init_load_back``
without a quota, so that gate never fires: a load-back that grew since matching (ancestors evicted
between matching and admission) would allocate pages already promised to the running batch and to
requests admitted earlier in the same round. In 0.5.11 the scheduler re-matches each request right
before ``add_one_req`` and the adder locks the matched device prefix first, so the load-back equals
the match and admission has already charged it; the quota is then never binding (see
``load_back_quota_tokens``) and guards any path on which the tree changes in between.

Two hooks pass the quota without copying ``add_one_req``:

* AROUND ``PrefillAdder.add_one_req`` records which adder is admitting which request;
* AROUND ``HiRadixCache.init_load_back`` (under the CP cache's class REPLACE it wraps the CP cache)
  fills ``InitLoadBackParams.mem_quota`` from that adder when the call belongs to that request.

Units: every number here is a *logical* token count. ``rem_total_tokens`` is built from the
allocator's ``available_size()`` (logical for ``CPSharedPagedTokenToKVPoolAllocator``), the tree's
``evictable_size()`` and the adder's offsets, all of which are identical on every CP rank, so all
ranks compute the same quota and take the same load / recompute decision without a collective.

The user-facing summary is in the README ("Supported combinations"); the tests are in
``test/registered/unit/managers/test_prefill_load_back_quota.py``.
"""

from __future__ import annotations

import dataclasses
import math
from contextvars import ContextVar
from typing import Optional, Tuple

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS, PrefillAdder
from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
from sglang.srt.plugins.hook_registry import HookType

# (adder, request) while ``adder.add_one_req(request, ...)`` runs in this thread.
_admission: ContextVar[Optional[Tuple[PrefillAdder, Req]]] = ContextVar(
    "cp_shared_kv_prefill_admission", default=None
)


def register_hooks(registry) -> None:
    registry.register(
        "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
        _add_one_req_around,
        HookType.AROUND,
    )
    registry.register(
        "sglang.srt.mem_cache.hiradix_cache.HiRadixCache.init_load_back",
        _init_load_back_around,
        HookType.AROUND,
    )


def load_back_quota_tokens(adder: PrefillAdder, req: Req) -> int:
    """Logical tokens a load-back for ``req`` may allocate while ``adder`` admits it.

    ``add_one_req`` admitted ``req`` because ``total_tokens = extend_input_len + max_new +
    page_size`` is below ``adder.rem_total_tokens`` (available + evictable minus what is promised
    elsewhere). ``extend_input_len`` counts the matched host hit, so the request needs
    ``total_tokens - host_hit_length`` besides its load-back, and the load-back may use the rest.
    A load-back of exactly the matched ``host_hit_length`` therefore always fits; only one that
    grew beyond the match is refused.
    """
    # The same max_new count add_one_req admitted the request on.
    max_new_tokens = min(
        max(req.sampling_params.max_new_tokens - len(req.output_ids), 0),
        CLIP_MAX_NEW_TOKENS,
    )
    needed_besides_load_back = (
        req.extend_input_len - req.host_hit_length + max_new_tokens + adder.page_size
    )
    # rem_total_tokens is a float (new_token_ratio); floor keeps the quota a whole token count.
    return math.floor(adder.rem_total_tokens - needed_besides_load_back)


def _add_one_req_around(original, adder: PrefillAdder, req: Req, *args, **kwargs):
    token = _admission.set((adder, req))
    try:
        return original(adder, req, *args, **kwargs)
    finally:
        _admission.reset(token)


def _init_load_back_around(original, tree_cache, params: InitLoadBackParams):
    admission = _admission.get()
    if admission is not None and params.mem_quota is None:
        adder, req = admission
        if params.req is req:
            params = dataclasses.replace(
                params, mem_quota=load_back_quota_tokens(adder, req)
            )
    return original(tree_cache, params)
