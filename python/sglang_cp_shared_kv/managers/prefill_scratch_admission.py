"""Admission keeps every prefill batch within a gather scratch sized for prefill only.

When decode runs per owner, slot 0 of the gather scratch holds what one prefill batch may
reference (``startup_rules.decide_scratch``), not the logical capacity. An extend forward reads,
per request, its prefix and this forward's chunk (``len(req.fill_ids)`` tokens), and needs at most
1 + the sum of their ``request_scratch_pages`` (the dummy page). sglang's ``PrefillAdder`` bounds the new tokens of a batch
(chunked prefill, ``--max-prefill-tokens``) but not the prefixes, so a batch of requests with long
cached prefixes could exceed the scratch. Hooks on the adder, for every rank's scheduler alike
(host lengths only):

* ``add_chunked_req`` (AROUND): the continuing chunked request joins first; its pages are counted.
* ``add_one_req`` (AROUND): before sglang admits a request, its whole context (``len(fill_ids)``,
  an upper bound of what it references after chunking) is checked against what the batch has left.
  If it does not fit, the batch is capped there (``AddReqResult.OTHER``, the request waits for a
  later batch; one INFO log line the first time, DEBUG after). A request whose context alone
  exceeds the scratch can never be prefilled (its last chunk reads its whole context): it is
  aborted with an error naming the setting, as sglang aborts a request longer than the context.
  After sglang admitted it, its real (possibly chunk-truncated) context is counted.

Nothing is capped while the scratch holds the logical capacity (decode gathering, mixed chunks):
no batch can reference more pages than exist.
"""

from __future__ import annotations

import logging
from typing import Optional

from sglang.srt.managers.schedule_policy import AddReqResult
from sglang.srt.plugins.hook_registry import HookType

from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import runtime_of
from sglang_cp_shared_kv.model_executor.scratch_sizing import request_scratch_pages
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG
from sglang_cp_shared_kv.settings import PREFILL_SCRATCH_TOKENS_ENV

logger = logging.getLogger(__name__)

_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
_USED_ATTR = "_cp_shared_kv_scratch_pages_used"


class _CapLog:
    """First cap at INFO, later ones at DEBUG (a busy server caps often)."""

    logged = False
    caps = 0


def scratch_pages_of(adder) -> Optional[int]:
    """Slot 0's pages (dummy page included) when it is prefill-sized; None: nothing to cap."""
    allocator = adder.token_to_kv_pool_allocator
    get_kvcache = getattr(allocator, "get_kvcache", None)
    runtime = runtime_of(get_kvcache()) if get_kvcache is not None else None
    if runtime is None or runtime.scratch_serves_decode:
        return None
    return runtime.scratch_num_pages


def _pages_used(adder) -> int:
    return getattr(adder, _USED_ATTR, 1)  # the dummy scratch page 0


def _count(adder, req, page_size: int) -> None:
    setattr(adder, _USED_ATTR, _pages_used(adder) + request_scratch_pages(len(req.fill_ids), page_size))


def add_chunked_req(original, adder, req):
    result = original(adder, req)
    if scratch_pages_of(adder) is not None and req in adder.can_run_list:
        _count(adder, req, adder.page_size)
    return result


def add_one_req(original, adder, req, *args, **kwargs):
    scratch_pages = scratch_pages_of(adder)
    if scratch_pages is None:
        return original(adder, req, *args, **kwargs)
    page_size = adder.page_size
    needed = request_scratch_pages(len(req.fill_ids), page_size)
    if 1 + needed > scratch_pages:
        req.set_finish_with_abort(
            f"{FLAG}: the request's context ({len(req.fill_ids)} tokens) does not fit the gather "
            f"scratch of one prefill forward ({(scratch_pages - 1) * page_size} tokens); raise "
            f"{PREFILL_SCRATCH_TOKENS_ENV} or send a shorter request"
        )
        req.init_next_round_input(adder.tree_cache)  # the one-token prefill of an aborted request
        needed = request_scratch_pages(len(req.fill_ids), page_size)
    used = _pages_used(adder)
    if used + needed > scratch_pages and adder.can_run_list:
        _CapLog.caps += 1
        level = logging.DEBUG if _CapLog.logged else logging.INFO
        _CapLog.logged = True
        logger.log(
            level,
            "CP shared KV: prefill batch capped at %d requests: the next one's context (%d tokens) "
            "would take the gather scratch past its %d pages (%d used); it waits for a later batch "
            "(cap #%d; later caps are logged at DEBUG)",
            len(adder.can_run_list),
            len(req.fill_ids),
            scratch_pages,
            used,
            _CapLog.caps,
        )
        return AddReqResult.OTHER
    result = original(adder, req, *args, **kwargs)
    if adder.can_run_list and adder.can_run_list[-1] is req:
        _count(adder, req, page_size)
    return result


def register_hooks(registry) -> None:
    registry.register(f"{_ADDER}.add_one_req", add_one_req, HookType.AROUND)
    registry.register(f"{_ADDER}.add_chunked_req", add_chunked_req, HookType.AROUND)
