"""A host copy of ``req_to_token`` at page granularity, so the per-forward plan never reads the device.

The peer-page plan needs, for every request of a forward, the logical page of each of its pages:
``req_to_token[row, k * page_size] // page_size`` for ``k < ceil(seq_len / page_size)``. The paged
allocator keeps positions page-aligned (the tokens at positions ``[k*page_size, (k+1)*page_size)``
of a row share one page, and ``loc % page_size == position % page_size``), so one page id per page
index describes the row exactly. ``ReqToPageMirror.pages[row, k]`` is that page id, kept equal to the
device table by updating it at every program point where sglang writes ``req_to_token`` (in
``req_to_page_mirror_writers``), from host data only:

* new pages: the allocator's host record of its latest allocation (``PagesHandedOut``);
* a cached prefix: the host page ids of the radix tree's node values (``tree_value_pages``).

Rows start as zeros, like the device table, and keep stale content after their request ends, like the
device table: every position a forward reads was written during its request's life.

``SGLANG_CP_SHARED_KV_CHECK_PAGE_MIRROR=1`` makes every plan compare the mirror rows it reads with the
device table (a device-to-host copy, a sync: a debugging aid, off by default; read once, into the
server's spec, ``CpSharedKVRuntime.check_page_mirror``).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import torch

from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG


_MIRROR_ATTR = "_cp_req_to_page_mirror"


def mirror_of(req_to_token_pool) -> Optional["ReqToPageMirror"]:
    """The mirror kept for ``req_to_token_pool``; None when none is attached (flag off, tests)."""
    return getattr(req_to_token_pool, _MIRROR_ATTR, None)


class ReqToPageMirror:
    """``pages[row, k]``: logical page id at page index ``k`` of ``req_to_token`` row ``row`` (int32)."""

    def __init__(self, num_rows: int, max_context_len: int, page_size: int):
        self.page_size = page_size
        self.pages = np.zeros((num_rows, -(-max_context_len // page_size)), dtype=np.int32)

    @classmethod
    def attach(cls, req_to_token_pool, page_size: int) -> "ReqToPageMirror":
        """Create the mirror of ``req_to_token_pool`` (whose table must still be all zeros)."""
        rows, width = req_to_token_pool.req_to_token.shape
        mirror = cls(rows, width, page_size)
        setattr(req_to_token_pool, _MIRROR_ATTR, mirror)
        return mirror

    def write(self, row: int, first_page: int, pages: np.ndarray) -> None:
        """Page indices ``first_page ..`` of ``row`` now hold ``pages``."""
        self.pages[row, first_page : first_page + len(pages)] = pages

    def row_pages(self, row: int, num_pages: int) -> np.ndarray:
        """The first ``num_pages`` page ids of ``row`` (a view: copy it to keep it)."""
        return self.pages[row, :num_pages]

    def mismatches(
        self, req_to_token: torch.Tensor, rows: Sequence[int], seq_lens: Sequence[int]
    ) -> List[str]:
        """Every position ``< seq_len`` of the given rows whose device loc is not on the mirrored page.

        Reads the device table (syncs): only for tests and the page-mirror check of the settings.
        """
        page_size = self.page_size
        problems = []
        for row, seq_len in zip(rows, seq_lens):
            device_pages = req_to_token[row, :seq_len].cpu().numpy().astype(np.int64) // page_size
            mirrored = np.repeat(self.pages[row, : -(-seq_len // page_size)], page_size)[:seq_len]
            wrong = np.flatnonzero(device_pages != mirrored)
            if wrong.size:
                first = int(wrong[0])
                problems.append(
                    f"row {row}: {wrong.size} of {seq_len} positions differ, first at {first} "
                    f"(device page {int(device_pages[first])}, mirror page {int(mirrored[first])})"
                )
        return problems

    def check(self, req_to_token: torch.Tensor, rows: Sequence[int], seq_lens: Sequence[int]) -> None:
        problems = self.mismatches(req_to_token, rows, seq_lens)
        if problems:
            raise RuntimeError(
                f"{FLAG}: the host mirror of req_to_token differs from the device table: "
                + "; ".join(problems)
            )
