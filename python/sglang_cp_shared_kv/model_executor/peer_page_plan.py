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
in-place all-gather of ``n`` pages per rank fill the gathered region directly.

A page is *filled locally* when every referenced token in it is written by this forward: each rank
sees the whole batch's KV and indexer K in the write hooks (NSA prefill CP all-gathers the chunk
before writing it; decode is replicated), so such pages cost no traffic. Every other page (cached
prefix, earlier chunks, decode history, a page mixing old and new tokens) is gathered from its owner
after the owner's write of this layer, so it arrives complete.

Kernels keep addressing rows by (page, slot); tables are rewritten page by page through ``lookup``
(logical page -> scratch page) with the slot kept, so they read the scratch exactly as they would
read a replicated pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout

# Scratch page every table entry maps to unless its page is referenced (padding, stale columns).
DUMMY_SCRATCH_PAGE = 0


@dataclass(frozen=True)
class PeerPagePlan:
    layout: CpSharedKVLayout
    # logical page -> scratch page of every referenced page; DUMMY_SCRATCH_PAGE elsewhere. int32.
    lookup: torch.Tensor
    # Same, but only for locally filled pages: write hooks map through it so a local fill never
    # touches the gathered region (gathered pages map to the dummy page).
    fill_lookup: torch.Tensor
    # n: gathered pages each rank sends (the largest owner's count; others pad with page 0).
    gather_pages_per_rank: int
    # This rank's physical pages to send, in owner-major order, padded with physical page 0. int64 [n].
    send_physical_pages: torch.Tensor
    num_fill_pages: int

    @property
    def scratch_pages_used(self) -> int:
        return 1 + self.layout.cp_size * self.gather_pages_per_rank + self.num_fill_pages

    def remap_token_locs(self, logical_locs: torch.Tensor) -> torch.Tensor:
        """Token locs of a kernel table (``page_table_1``) -> scratch token locs (dtype kept)."""
        return _through(self.lookup, logical_locs, self.layout.page_size)

    def remap_pages(self, logical_pages: torch.Tensor) -> torch.Tensor:
        """Page ids of a kernel table (``real_page_table``) -> scratch page ids (dtype kept)."""
        return self.lookup[logical_pages.long()].to(logical_pages.dtype)

    def fill_locs(self, logical_locs: torch.Tensor) -> torch.Tensor:
        """Scratch rows a write of ``logical_locs`` fills locally; the rest go to the dummy page."""
        return _through(self.fill_lookup, logical_locs, self.layout.page_size)


def _through(page_map: torch.Tensor, logical_locs: torch.Tensor, page_size: int) -> torch.Tensor:
    pages = torch.div(logical_locs, page_size, rounding_mode="floor").long()
    return (page_map[pages] * page_size + logical_locs % page_size).to(logical_locs.dtype)


def build_peer_page_plan(
    *,
    layout: CpSharedKVLayout,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: Sequence[int],
    new_token_counts: Sequence[int],
    num_logical_pages: int,
    scratch_num_pages: int,
) -> PeerPagePlan:
    """Plan one forward. Every rank calls this with the same batch and gets the same layout.

    ``seq_lens[i]`` tokens of request ``req_pool_indices[i]`` are read; its last
    ``new_token_counts[i]`` are written by this forward. ``num_logical_pages`` bounds the logical
    page ids (size of the lookup); ``scratch_num_pages`` is the scratch size including page 0.
    Runs eagerly (one host sync for the per-owner counts).
    """
    if len(seq_lens) != len(new_token_counts):
        raise ValueError("seq_lens and new_token_counts differ in length")
    cp_size = layout.cp_size
    device = req_to_token.device
    lookup = torch.zeros(num_logical_pages, dtype=torch.int32, device=device)
    fill_lookup = torch.zeros_like(lookup)

    referenced, gathered = _referenced_and_old_pages(
        req_to_token, req_pool_indices, seq_lens, new_token_counts, layout
    )
    fill = referenced[~torch.isin(referenced, gathered)]
    counts = torch.bincount(layout.owner_of_page(gathered), minlength=cp_size).tolist()
    if 1 + cp_size * max(counts) + fill.numel() > scratch_num_pages:
        # Owners are unbalanced inside this batch. Gather everything instead: a rank owns at most
        # its physical page count, so cp_size * n then fits a scratch sized from logical capacity.
        gathered, fill = referenced, referenced[:0]
        counts = torch.bincount(layout.owner_of_page(gathered), minlength=cp_size).tolist()
    n = max(counts)
    if 1 + cp_size * n + fill.numel() > scratch_num_pages:
        raise RuntimeError(
            f"--enable-nsa-prefill-cp-shared-kv: a forward needs {1 + cp_size * n + fill.numel()} "
            f"scratch pages, the scratch has {scratch_num_pages}"
        )

    # Owner-major scratch positions of the gathered pages (gathered is sorted, so each owner's
    # pages stay in ascending logical order).
    owners = layout.owner_of_page(gathered)
    order = torch.argsort(owners, stable=True)
    gathered, owners = gathered[order], owners[order]
    counts_t = torch.tensor(counts, dtype=torch.int64, device=device)
    first_of_owner = torch.cumsum(counts_t, 0) - counts_t
    slot = torch.arange(gathered.numel(), device=device) - first_of_owner[owners]
    lookup[gathered] = (1 + owners * n + slot).to(torch.int32)

    fill_pages = 1 + cp_size * n + torch.arange(fill.numel(), device=device)
    lookup[fill] = fill_pages.to(torch.int32)
    fill_lookup[fill] = fill_pages.to(torch.int32)

    own_logical_pages = gathered[owners == layout.cp_rank]
    send = torch.zeros(n, dtype=torch.int64, device=device)
    send[: own_logical_pages.numel()] = layout.physical_page_of(own_logical_pages)
    return PeerPagePlan(
        layout=layout,
        lookup=lookup,
        fill_lookup=fill_lookup,
        gather_pages_per_rank=n,
        send_physical_pages=send,
        num_fill_pages=fill.numel(),
    )


def _referenced_and_old_pages(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: Sequence[int],
    new_token_counts: Sequence[int],
    layout: CpSharedKVLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique logical pages the batch reads, and the subset holding tokens of earlier forwards."""
    page_size, device = layout.page_size, req_to_token.device
    empty = torch.empty(0, dtype=torch.int64, device=device)
    max_len = max(seq_lens, default=0)
    if max_len == 0:
        return empty, empty
    # The paged allocator keeps positions page-aligned: the tokens at positions
    # [k*page_size, (k+1)*page_size) of a request share the page of position k*page_size.
    first_locs = req_to_token[req_pool_indices[: len(seq_lens)].long(), :max_len:page_size]
    pages = torch.div(first_locs.long(), page_size, rounding_mode="floor")
    column = torch.arange(pages.shape[1], device=device)
    pages_read = torch.tensor([-(-s // page_size) for s in seq_lens], device=device)
    # Column k holds only new tokens iff k*page_size >= prefix_len.
    first_new_column = torch.tensor(
        [-(-(s - new) // page_size) for s, new in zip(seq_lens, new_token_counts)], device=device
    )
    read = column[None, :] < pages_read[:, None]
    old = column[None, :] < first_new_column[:, None]
    # Logical pages on the dummy physical page 0 are never allocated: padded requests
    # (req_to_token row 0) land there and read nothing real.
    real = layout.physical_page_of(pages) > 0
    return torch.unique(pages[read & real]), torch.unique(pages[read & old & real])
