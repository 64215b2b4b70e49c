"""Keep ``ReqToPageMirror`` equal to ``req_to_token`` through sglang's speculative (EAGLE) writers.

sglang 0.5.11's EAGLE with top-k 1 and page size > 1 writes ``req_to_token`` in four places; each
one that changes the table is hooked and does the same write on the mirror from host data (the
allocator's host record of its allocation, ``PagesHandedOut``, and the host lengths sglang already
holds), never from the device:

* spec v1, ``EAGLEWorker._draft_preprocess_decode`` (``assign_draft_cache_locs``): positions
  ``seq_len .. seq_len + num_steps - 1`` of every row get the draft steps' locs, allocated with
  ``alloc_paged_token_slots_extend`` from ``seq_lens_cpu`` and then handed back
  (``restore_state``): the table keeps them, and so does the mirror, until the verify's
  allocation below writes the same positions again.
* spec v1, ``EagleVerifyInput.prepare_for_verify`` (``assign_req_to_token_pool``): positions
  ``seq_len .. seq_len + num_draft_tokens - 1`` get the verify's allocation (from ``seq_lens_cpu``).
* spec v2, ``EagleDraftInputV2Mixin.prepare_for_decode`` (``assign_req_to_token_pool``): positions
  ``kv_allocated_len .. committed + 2 * alloc_len_per_decode - 1`` get the over-allocation, whose
  lengths sglang computes on the host from each request's ``kv_allocated_len`` /
  ``kv_committed_len``. Spec v2's draft steps (``assign_draft_cache_locs_page_size_1``) and verify
  (``assign_extend_cache_locs``) only read the table at positions this write filled.
* spec v1, ``EagleVerifyInput.verify`` after sampling (``eagle_info.py`` 541 and 575): positions
  ``seq_len .. seq_len + accepted`` get ``out_cache_loc[accept_index]``. With top-k 1 the draft
  tokens are a chain and ``accept_index`` of request ``i`` is ``i * num_draft_tokens + 0 .. accepted``,
  so the write puts back the locs ``prepare_for_verify`` wrote there: nothing changes, and nothing is
  mirrored. With a tree (top-k > 1, refused at startup) it would move locs by an index that exists
  only on the device; the hook refuses that.

Frees change no row. Spec v1's ``verify`` frees the rejected draft tokens' whole pages
(``align_evict_mask_to_page_size``; a page that also holds an accepted token stays); the freed
positions lie at or past the new ``seq_len`` and are not read before the next round's writes above
fill them again, exactly as the device table keeps the freed locs. Spec v2 frees its over-allocation
when the request ends (``release_kv_cache``), like any finished request's tail.
"""

from __future__ import annotations

import numpy as np

from sglang.srt.plugins.hook_registry import HookType
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror import mirror_of
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror_writers import (
    allocation_of,
    write_new_pages,
)
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG

_EAGLE_INFO = "sglang.srt.speculative.eagle_info.EagleVerifyInput"
_EAGLE_WORKER = "sglang.srt.speculative.eagle_worker.EAGLEWorker"
_EAGLE_INFO_V2 = "sglang.srt.speculative.eagle_info_v2.EagleDraftInputV2Mixin"


def _rows(batch) -> list:
    return [req.req_pool_idx for req in batch.reqs]


def _pages_holding(positions, page_size: int) -> np.ndarray:
    """Pages a row holds when its tokens end at ``positions`` (host lengths)."""
    return -(-np.asarray(positions, dtype=np.int64) // page_size)


def _refuse_draft_tree(topk: int) -> None:
    if topk != 1:
        raise ValueError(
            f"{FLAG}: --speculative-eagle-topk {topk}: the host mirror of req_to_token follows "
            f"top-k 1 only (a draft tree's accepted tokens are moved by a device-only index)"
        )


def _mirror_locs_after_committed(mirror, batch) -> None:
    """The pages of the batch's latest allocation (``out_cache_loc``), placed right after each
    request's committed tokens (``seq_lens_cpu``), written into the mirror."""
    record = allocation_of(batch.token_to_kv_pool_allocator, batch.out_cache_loc)
    write_new_pages(
        mirror, _rows(batch), record, _pages_holding(batch.seq_lens_cpu, mirror.page_size)
    )


def draft_preprocess_decode(original, worker, batch, *args, **kwargs):
    """AROUND spec v1's ``EAGLEWorker._draft_preprocess_decode``: the draft steps' locs."""
    mirror = mirror_of(batch.req_to_token_pool)
    if mirror is None:
        return original(worker, batch, *args, **kwargs)
    _refuse_draft_tree(worker.topk)
    result = original(worker, batch, *args, **kwargs)
    _mirror_locs_after_committed(mirror, batch)
    return result


def prepare_for_verify(original, verify_input, batch, *args, **kwargs):
    """AROUND spec v1's ``EagleVerifyInput.prepare_for_verify``: the draft tokens' locs."""
    mirror = mirror_of(batch.req_to_token_pool)
    if mirror is None or batch.forward_mode.is_idle():
        return original(verify_input, batch, *args, **kwargs)
    _refuse_draft_tree(verify_input.topk)
    result = original(verify_input, batch, *args, **kwargs)
    _mirror_locs_after_committed(mirror, batch)  # seq_lens_cpu: still the committed lengths
    return result


def verify(original, verify_input, batch, *args, **kwargs):
    """AROUND spec v1's ``EagleVerifyInput.verify``: its accepted-token rewrite is a no-op with
    top-k 1 (module docstring); anything else cannot be mirrored."""
    if mirror_of(batch.req_to_token_pool) is not None:
        _refuse_draft_tree(verify_input.topk)
    return original(verify_input, batch, *args, **kwargs)


def v2_prepare_for_decode(original, draft_input, batch, *args, **kwargs):
    """AROUND spec v2's ``prepare_for_decode``: the over-allocation of every request."""
    mirror = mirror_of(batch.req_to_token_pool)
    if mirror is None:
        return original(draft_input, batch, *args, **kwargs)
    allocator = batch.token_to_kv_pool_allocator
    previous = allocator.last_allocation
    allocated_before = [req.kv_allocated_len for req in batch.reqs]
    result = original(draft_input, batch, *args, **kwargs)
    record = allocator.last_allocation
    page_size = mirror.page_size
    pages_before = _pages_holding(allocated_before, page_size)
    pages_after = _pages_holding([req.kv_allocated_len for req in batch.reqs], page_size)
    if (
        record is previous
        or record.new_pages_per_req is None
        or not np.array_equal(record.new_pages_per_req, pages_after - pages_before)
    ):
        raise RuntimeError(
            f"{FLAG}: spec v2's decode allocation is not the allocator's latest per-request "
            f"allocation; the host mirror cannot follow"
        )
    write_new_pages(mirror, _rows(batch), record, pages_before)
    return result


def register_hooks(registry) -> None:
    registry.register(
        f"{_EAGLE_WORKER}._draft_preprocess_decode", draft_preprocess_decode, HookType.AROUND
    )
    registry.register(f"{_EAGLE_INFO}.prepare_for_verify", prepare_for_verify, HookType.AROUND)
    registry.register(f"{_EAGLE_INFO}.verify", verify, HookType.AROUND)
    registry.register(f"{_EAGLE_INFO_V2}.prepare_for_decode", v2_prepare_for_decode, HookType.AROUND)
