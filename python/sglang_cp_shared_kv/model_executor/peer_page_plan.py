"""Which KV pages a forward needs from which rank, and where they sit in the gather scratch.

Under CP shared KV a rank's pool holds only the logical pages it owns (``CpSharedKVLayout``), yet
attention and the NSA indexer on every rank read every page the batch references: cached prefix,
earlier chunks, decode history. Once per forward, from the *unfiltered* batch (``req_to_token``
rows up to ``seq_lens``, identical on every rank), we lay out a one-layer scratch holding all of
them, in *scratch pages*:

    page 0                          dummy: padded and unreferenced table entries point here
    pages 1 .. cp_size*n            gathered pages, owner-major: rank r's j-th page is 1 + r*n + j
    pages 1 + cp_size*n ..          pages filled locally (see below)

``n`` is the largest number of gathered pages one rank owns. Owner-major order lets a single
in-place all-gather of ``n`` pages per rank fill the gathered region directly (the *padded*
layout). When the owners are unbalanced inside the batch and that does not fit the scratch, the
*exact* layout packs each owner's ``c_r`` pages back to back (rank r's j-th page is
``1 + c_0 + .. + c_{r-1} + j``) and the region is filled by one broadcast per owner: the batch then
needs exactly ``1 + referenced pages`` scratch pages, whatever the owners, which is what lets a
prefill-sized scratch bound its batches by their page counts alone (``scratch_sizing.prefill_batch_scratch_pages``).

A page is *filled locally* when every referenced token in it is written by this forward: each rank
sees the whole batch's KV and indexer K in the write hooks (NSA prefill CP all-gathers the chunk
before writing it; decode is replicated), so such pages cost no traffic. Every other page (cached
prefix, earlier chunks, decode history, a page mixing old and new tokens) is gathered from its owner
after the owner's write of this layer, so it arrives complete.

Kernels keep addressing rows by (page, slot); tables are rewritten page by page through ``lookup``
(logical page -> scratch page) with the slot kept, so they read the scratch exactly as they would
read a replicated pool.

The plan is computed on the host, from host page ids (the ``req_to_token`` mirror,
``ReqToPageMirror``), in NumPy: which pages, which owner, how many per rank (``n`` sizes the
collective, so it must be a host number). Only its result goes to the device: the referenced pages
and their scratch pages as compact pairs, and this rank's send list, in one non-blocking copy from
pinned memory, scattered into the lookup table there. Nothing in it waits for the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout

# Scratch page every table entry maps to unless its page is referenced (padding, stale columns).
DUMMY_SCRATCH_PAGE = 0


@dataclass(frozen=True)
class PeerPagePlan:
    layout: CpSharedKVLayout
    # logical page -> scratch page of every referenced page; DUMMY_SCRATCH_PAGE elsewhere. int32.
    # Gathered pages map into 1 .. gathered_region_pages, locally filled pages beyond it.
    lookup: torch.Tensor
    # n: gathered pages each rank sends (the largest owner's count; in the padded layout the others
    # pad with page 0).
    gather_pages_per_rank: int
    # This rank's physical pages to send, in owner-major order; padded with physical page 0 to n
    # in the padded layout, exactly this rank's count in the exact layout. int64.
    send_physical_pages: torch.Tensor
    num_fill_pages: int
    # Gathered pages of each owner (host ints, identical on every rank).
    gather_page_counts: tuple = ()
    # True: owners' pages back to back, one broadcast per owner (see the module docstring).
    exact_layout: bool = False

    @property
    def gathered_region_pages(self) -> int:
        if self.exact_layout:
            return sum(self.gather_page_counts)
        return self.layout.cp_size * self.gather_pages_per_rank

    @property
    def scratch_pages_used(self) -> int:
        return 1 + self.gathered_region_pages + self.num_fill_pages

    def owner_slices(self) -> list:
        """(first page, page count) of each owner's part of the gathered region (region-relative)."""
        if not self.exact_layout:
            n = self.gather_pages_per_rank
            return [(r * n, n) for r in range(self.layout.cp_size)]
        starts = np.cumsum((0,) + tuple(self.gather_page_counts[:-1]))
        return [(int(start), int(count)) for start, count in zip(starts, self.gather_page_counts)]

    def remap_token_locs(self, logical_locs: torch.Tensor) -> torch.Tensor:
        """Token locs of a kernel table (``page_table_1``) -> scratch token locs (dtype kept)."""
        return _through(self.lookup, logical_locs, self.layout.page_size)

    def remap_pages(self, logical_pages: torch.Tensor) -> torch.Tensor:
        """Page ids of a kernel table (``real_page_table``) -> scratch page ids (dtype kept)."""
        return self.lookup[logical_pages.long()].to(logical_pages.dtype)


def _through(page_map: torch.Tensor, logical_locs: torch.Tensor, page_size: int) -> torch.Tensor:
    pages = torch.div(logical_locs, page_size, rounding_mode="floor").long()
    return (page_map[pages] * page_size + logical_locs % page_size).to(logical_locs.dtype)


def build_peer_page_plan(
    *,
    layout: CpSharedKVLayout,
    request_pages: Sequence[np.ndarray],
    old_page_counts: Sequence[int],
    num_logical_pages: int,
    scratch_num_pages: int,
    device,
) -> PeerPagePlan:
    """Plan one forward on the host. Every rank calls this with the same batch and gets the same layout.

    ``request_pages[i]``: logical page ids of request ``i``'s pages ``0 .. ceil(seq_len / page_size)-1``
    (host, any int dtype). Its first ``old_page_counts[i]`` pages hold tokens of earlier forwards
    (``ceil(prefix_len / page_size)``); the rest only tokens this forward writes.
    ``num_logical_pages`` bounds the logical page ids (size of the lookup); ``scratch_num_pages`` is
    the scratch size including page 0. No device tensor is read; the device gets one pinned copy.
    """
    if len(request_pages) != len(old_page_counts):
        raise ValueError("request_pages and old_page_counts differ in length")
    cp_size = layout.cp_size
    referenced, gathered, fill = _referenced_gathered_and_fill_pages(
        request_pages, old_page_counts, cp_size
    )
    counts = np.bincount(layout.owner_of_page(gathered), minlength=cp_size)
    n = int(counts.max())
    # Owners unbalanced inside this batch: pack them exactly (1 + referenced pages in all).
    exact = 1 + cp_size * n + fill.shape[0] > scratch_num_pages
    if exact and 1 + referenced.shape[0] > scratch_num_pages:
        raise RuntimeError(
            f"--enable-nsa-prefill-cp-shared-kv: a forward references {referenced.shape[0]} pages, "
            f"the gather scratch holds {scratch_num_pages - 1} (admission caps prefill batches to "
            f"the scratch; a decode forward that gathers needs the full-capacity scratch)"
        )

    # Owner-major scratch positions of the gathered pages (gathered is sorted, so each owner's
    # pages stay in ascending logical order). Ranks as uint8: NumPy's stable sort of 8-bit keys is a
    # radix sort.
    owners = layout.owner_of_page(gathered).astype(np.uint8)
    order = np.argsort(owners, kind="stable")
    gathered, owners = gathered[order], owners[order].astype(np.int64)
    first_of_owner = np.cumsum(counts) - counts
    slot = np.arange(gathered.shape[0]) - first_of_owner[owners]
    num_gathered, num_fill = gathered.shape[0], fill.shape[0]
    own = slice(first_of_owner[layout.cp_rank], first_of_owner[layout.cp_rank] + counts[layout.cp_rank])
    send = layout.physical_page_of(gathered[own])
    region_start = first_of_owner[owners] if exact else owners * n
    region_pages = num_gathered if exact else cp_size * n
    send_length = int(counts[layout.cp_rank]) if exact else n

    # One staging array: [referenced page ids | their scratch pages | send list (padded to n)].
    num_referenced = num_gathered + num_fill
    staged = np.zeros(2 * num_referenced + send_length, dtype=np.int64)
    staged[:num_gathered] = gathered
    staged[num_gathered:num_referenced] = fill
    staged[num_referenced : num_referenced + num_gathered] = 1 + region_start + slot
    staged[num_referenced + num_gathered : 2 * num_referenced] = 1 + region_pages + np.arange(num_fill)
    staged[2 * num_referenced : 2 * num_referenced + send.shape[0]] = send
    on_device = _to_device(staged, device)

    ids, scratch_pages = on_device[:num_referenced], on_device[num_referenced : 2 * num_referenced]
    lookup = torch.zeros(num_logical_pages, dtype=torch.int32, device=device)
    if num_referenced:
        # scatter_ (like any integer-index write) never syncs; ids are distinct.
        lookup.scatter_(0, ids, scratch_pages.to(torch.int32))
    return PeerPagePlan(
        layout=layout,
        lookup=lookup,
        gather_pages_per_rank=n,
        send_physical_pages=on_device[2 * num_referenced :],
        num_fill_pages=num_fill,
        gather_page_counts=tuple(int(c) for c in counts),
        exact_layout=bool(exact),
    )


def _to_device(staged: np.ndarray, device) -> torch.Tensor:
    """One host-to-device copy that never waits for the GPU.

    The source is pinned (``pin_memory()`` takes a block from torch's caching host allocator), so the
    copy is truly asynchronous. A fresh pinned block per forward, rather than one reused buffer, is
    what makes that safe: the copy may run long after this returns (behind queued GPU work), and the
    caching host allocator records the copy's stream on the block and hands it out again only once
    the copy has completed, so the next forward's plan can never overwrite this one's pending source.
    """
    host = torch.from_numpy(staged)
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _referenced_gathered_and_fill_pages(
    request_pages: Sequence[np.ndarray], old_page_counts: Sequence[int], cp_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sorted unique logical pages the batch reads; those holding tokens of earlier forwards (some
    read of them is old: gathered); the others (filled locally).

    One sort of ``2 * page + (0 if old else 1)`` over every read: each page's first key says whether
    any of its reads is old (NumPy's ``unique`` hashes, several times slower at these sizes).
    """
    if not len(request_pages):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    keys = np.concatenate(request_pages).astype(np.int64) * 2 + 1
    start = 0
    for row, count in zip(request_pages, old_page_counts):
        keys[start : start + min(count, len(row))] -= 1  # old reads sort first
        start += len(row)
    # Logical pages on the dummy physical page 0 (ids below cp_size) are never allocated: padded
    # requests (req_to_token row 0) land there and read nothing real.
    keys = keys[keys >= 2 * cp_size]
    keys.sort()
    first = np.empty(keys.shape[0], dtype=bool)
    if keys.shape[0]:
        first[0] = True
        np.not_equal(keys[1:] >> 1, keys[:-1] >> 1, out=first[1:])
    keys = keys[first]
    referenced = keys >> 1
    old = (keys & 1) == 0
    return referenced, referenced[old], referenced[~old]
