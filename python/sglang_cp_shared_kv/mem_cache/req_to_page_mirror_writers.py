"""Keep ``ReqToPageMirror`` equal to ``req_to_token``: a hook on every writer of the table.

sglang 0.5.11 writes ``req_to_token`` (prefill / colocated server, without speculative decoding; EAGLE's
own writers are hooked in ``req_to_page_mirror_spec_writers``) in exactly three places, each hooked
here with the same write done on the mirror from host data:

* ``mem_cache.common.alloc_for_extend`` (``write_cache_indices``): positions ``[0, prefix_len)`` from
  ``req.prefix_indices``, ``[prefix_len, seq_len)`` from the allocation. The allocation's new pages
  come from the allocator's host record (``PagesHandedOut``; a partially filled last prefix page is
  continued, so its page id does not change). The prefix is the tree path to ``req.last_node``
  (``tree_value_pages.path_pages``), followed, after a ``cache_unfinished_req``, by the unaligned
  tail that the request kept from its own row (radix cache), or the request's whole own row
  (``ChunkCache``); the mirror row already holds that part, so only the tree part is written.
* ``mem_cache.common.alloc_for_decode``: position ``seq_len`` gets the new token's loc: a new page
  from the allocator's record when the token opens one, else the same page.
* ``RadixCache.cache_unfinished_req`` (also HiCache's): ``[cache_protected_len, len(new_indices))``
  from the tree path to the new ``req.last_node``.

The tree's own value pages are fed here too: both ``cache_*_req`` insert a row copy, and stock
``RadixCache.insert`` / ``_split_node`` are wrapped (``CpHiRadixCache`` does the same in its own
overrides). ``ForwardBatch.init_new`` keeps the batch's row ids on the host (``ROWS_ATTR``) for the
plan. Tree caches whose writes are not covered (C++ radix tree, unified radix tree, streaming
sessions) are refused at startup.
"""

from __future__ import annotations

import numpy as np

from sglang.srt.plugins.hook_registry import HookType
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror import mirror_of
from sglang_cp_shared_kv.mem_cache.tree_value_pages import (
    inserting_from,
    path_pages,
    record_inserted_values,
    split_value_pages,
    tracks_value_pages,
    value_pages,
)
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG

# ForwardBatch attribute: int64 NumPy array of the batch's req_to_token rows, before padding.
ROWS_ATTR = "cp_req_pool_indices_cpu"

_COMMON = "sglang.srt.mem_cache.common"
_RADIX = "sglang.srt.mem_cache.radix_cache.RadixCache"


def allocation_of(allocator, locs):
    """The allocator's host record of the allocation that handed out ``locs`` (its latest); a write
    of any other locs cannot be mirrored from host data and raises."""
    record = getattr(allocator, "last_allocation", None)
    if record is None or record.locs is not locs or record.new_pages_per_req is None:
        raise RuntimeError(
            f"{FLAG}: req_to_token was written with locs that are not the allocator's latest "
            f"per-request allocation; the host mirror cannot follow"
        )
    return record


def write_new_pages(mirror, rows, record, pages_before_expected) -> None:
    """Write the pages ``record`` handed each of ``rows`` into the mirror, after the
    ``pages_before_expected`` pages each row held (checked against the record)."""
    if not np.array_equal(record.pages_before, pages_before_expected):
        raise RuntimeError(f"{FLAG}: the allocation does not continue the rows the batch writes")
    starts = np.cumsum(record.new_pages_per_req) - record.new_pages_per_req
    for row, first, start, count in zip(
        rows, record.pages_before, starts.tolist(), record.new_pages_per_req.tolist()
    ):
        if count:
            mirror.write(row, int(first), record.new_pages[start : start + count])


def alloc_for_extend(original, batch, *args, **kwargs):
    result = original(batch, *args, **kwargs)
    mirror = mirror_of(batch.req_to_token_pool)
    if mirror is None:
        return result
    out_cache_loc, _, rows = result
    record = allocation_of(batch.token_to_kv_pool_allocator, out_cache_loc)
    page_size = mirror.page_size
    prefix_lens = np.asarray(batch.prefix_lens, dtype=np.int64)
    for req, row, prefix_len in zip(batch.reqs, rows, prefix_lens.tolist()):
        tree_pages = path_pages(req.last_node)
        if len(tree_pages) * page_size > prefix_len:
            raise RuntimeError(
                f"{FLAG}: request {req.rid}: its tree path is longer than its prefix"
            )
        mirror.write(row, 0, tree_pages)
    write_new_pages(mirror, rows, record, -(-prefix_lens // page_size))
    return result


def alloc_for_decode(original, batch, token_per_req, *args, **kwargs):
    # Writes position seq_lens (before the batch's increment) of every row.
    result = original(batch, token_per_req, *args, **kwargs)
    mirror = mirror_of(batch.req_to_token_pool)
    if mirror is None:
        return result
    record = allocation_of(batch.token_to_kv_pool_allocator, result)
    rows = [req.req_pool_idx for req in batch.reqs]
    positions = np.asarray(batch.seq_lens_cpu, dtype=np.int64)
    write_new_pages(mirror, rows, record, -(-positions // mirror.page_size))
    return result


def cache_unfinished_req(original, tree, req, *args, **kwargs):
    mirror = mirror_of(tree.req_to_token_pool)
    if mirror is None or tree.disable:
        return original(tree, req, *args, **kwargs)
    row, protected_len = req.req_pool_idx, req.cache_protected_len
    with inserting_from(tree, mirror.pages[row].copy()):
        result = original(tree, req, *args, **kwargs)
    page_size = mirror.page_size
    tree_pages = path_pages(req.last_node)
    if protected_len % page_size or len(tree_pages) * page_size != req.cache_protected_len:
        raise RuntimeError(f"{FLAG}: request {req.rid}: cached prefix not page-aligned")
    first = protected_len // page_size
    mirror.write(row, first, tree_pages[first:])
    return result


def cache_finished_req(original, tree, req, *args, **kwargs):
    mirror = mirror_of(tree.req_to_token_pool)
    if mirror is None or req.req_pool_idx is None:
        return original(tree, req, *args, **kwargs)
    with inserting_from(tree, mirror.pages[req.req_pool_idx].copy()):
        return original(tree, req, *args, **kwargs)


def radix_insert(original, tree, params, *args, **kwargs):
    result = original(tree, params, *args, **kwargs)
    if tracks_value_pages(tree) and not tree.disable:
        record_inserted_values(tree, params.key.page_aligned(tree.page_size))
    return result


def radix_split_node(original, tree, key, child, split_len, *args, **kwargs):
    pages = value_pages(child) if tracks_value_pages(tree) else None
    new_node = original(tree, key, child, split_len, *args, **kwargs)
    split_value_pages(new_node, child, pages, split_len, tree.page_size)
    return new_node


def keep_batch_rows(result, cls, batch, *args, **kwargs):
    """AFTER ``ForwardBatch.init_new``: the rows of ``batch.reqs`` (host) for the plan."""
    if batch.reqs is not None and mirror_of(result.req_to_token_pool) is not None:
        setattr(
            result,
            ROWS_ATTR,
            np.fromiter((r.req_pool_idx for r in batch.reqs), dtype=np.int64, count=len(batch.reqs)),
        )
    return result


def refuse_untracked_tree_cache(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.init_cache_with_memory_pool``: only caches whose writes are hooked."""
    if mirror_of(scheduler.req_to_token_pool) is None:
        return None
    from sglang.srt.mem_cache.chunk_cache import ChunkCache
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sglang_cp_shared_kv.mem_cache.cp_hiradix_cache import CpHiRadixCache

    tree = scheduler.tree_cache
    if not (type(tree) in (ChunkCache, RadixCache) or isinstance(tree, CpHiRadixCache)):
        raise ValueError(
            f"{FLAG} supports the radix cache and HiCache (--enable-hierarchical-cache), not "
            f"{type(tree).__name__} (SGLANG_EXPERIMENTAL_CPP_RADIX_TREE, "
            f"SGLANG_ENABLE_UNIFIED_RADIX_TREE and --enable-streaming-session are unsupported)"
        )
    return None


def register_hooks(registry) -> None:
    registry.register(f"{_COMMON}.alloc_for_extend", alloc_for_extend, HookType.AROUND)
    registry.register(f"{_COMMON}.alloc_for_decode", alloc_for_decode, HookType.AROUND)
    registry.register(f"{_RADIX}.cache_unfinished_req", cache_unfinished_req, HookType.AROUND)
    registry.register(f"{_RADIX}.cache_finished_req", cache_finished_req, HookType.AROUND)
    registry.register(f"{_RADIX}.insert", radix_insert, HookType.AROUND)
    registry.register(f"{_RADIX}._split_node", radix_split_node, HookType.AROUND)
    registry.register(
        "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
        keep_batch_rows,
        HookType.AFTER,
    )
    registry.register(
        "sglang.srt.managers.scheduler.Scheduler.init_cache_with_memory_pool",
        refuse_untracked_tree_cache,
        HookType.AFTER,
    )
