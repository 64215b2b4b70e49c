"""Which pages one CP rank sends to the decode instance, and where each one lands.

A prefill request's KV is listed page by page in request order: ``req_to_token`` gives the logical
page of every position, and the decode instance sends, for the same positions, the page ids it
allocated (``dst_kv_indices`` for KV, ``dst_state_indices`` for NSA indexer-K pages). Stock sglang
pairs them position by position. With shared KV, logical page ``q`` is stored only on CP rank
``q % cp_size``, at physical page ``q // cp_size`` (``CpSharedKVLayout``). So each rank keeps the
positions whose logical page it owns, reads them from its physical page, and writes them to the
decode page of the same position:

    position i:  logical page L[i]  ->  owner L[i] % cp_size
                 source (on the owner)  physical page L[i] // cp_size
                 destination            D[i]

Every position has exactly one owner, so the ranks' sends partition the request: together they
write every decode page once, and no rank reads a page it does not hold. A rank may own no position
of a chunk (a chunk shorter than ``cp_size`` pages); it then pairs nothing, and still takes part in
the transfer protocol (see ``mooncake/conn.py``).

The same pairing serves KV pages and indexer-K pages: one shared-KV page is one NSA indexer page,
owned by the same rank at the same physical page number.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout


@dataclass(frozen=True)
class OwnedPagePairs:
    """One rank's share of a page list: ``src_pages[k]`` (physical, on this rank) goes to
    ``dst_pages[k]`` (decode), for the request position ``positions[k]``."""

    positions: np.ndarray  # int64, increasing
    src_pages: np.ndarray  # int32, physical page ids in this rank's pool
    dst_pages: np.ndarray  # int32, the decode instance's page ids

    def __len__(self) -> int:
        return len(self.positions)


def owned_page_pairs(
    layout: CpSharedKVLayout, logical_pages, dst_pages
) -> OwnedPagePairs:
    """The positions of ``logical_pages`` this rank owns, their physical pages, and the decode pages
    at the same positions. ``logical_pages`` and ``dst_pages`` must be position-aligned (same length)."""
    logical = np.asarray(logical_pages, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_pages, dtype=np.int64).reshape(-1)
    if logical.shape != dst.shape:
        raise ValueError(
            f"owned_page_pairs: {len(logical)} source pages but {len(dst)} destination pages; "
            "they must be position-aligned"
        )
    if logical.size and int(logical.min()) < 0:
        raise ValueError("owned_page_pairs: negative logical page")
    positions = np.flatnonzero(layout.owner_of_page(logical) == layout.cp_rank)
    return OwnedPagePairs(
        positions=positions.astype(np.int64),
        src_pages=layout.physical_page_of(logical[positions]).astype(np.int32),
        dst_pages=dst[positions].astype(np.int32),
    )


def position_aligned(prefill_pages, dst_pages):
    """The common prefix of two page lists that should be equally long, and whether they were.

    Stock sglang pairs indexer-K state pages the same way (it truncates the longer list with a
    warning); KV chunks are already cut to the decode slice by the transfer worker."""
    prefill = np.asarray(prefill_pages).reshape(-1)
    dst = np.asarray(dst_pages).reshape(-1)
    n = min(len(prefill), len(dst))
    return prefill[:n], dst[:n], len(prefill) == len(dst)
