"""Paged allocator over the logical KV address space of a CP group sharing one page-sharded cache.

Every rank of the CP group runs the same scheduler on the same batches, so every rank holds an
identical instance of this allocator and must take identical decisions. Nothing below depends on
``cp_rank``: it is only carried in ``layout`` for callers that map the logical locs handed out to
their own physical rows.

Which logical pages exist (arithmetic in ``CpSharedKVLayout``): each rank's pool holds
``physical_size`` tokens in physical pages ``1..num_physical_pages``, plus sglang's dummy page 0 that
padded tokens write. Logical page ``q`` lives on rank ``q % cp_size`` as physical page
``q // cp_size``, so the pages handed out are ``cp_size .. cp_size * (num_physical_pages + 1) - 1``,
``size = cp_size * physical_size`` logical tokens. Logical pages ``0..cp_size-1`` are physical page 0
on every rank and are never handed out.

Placement: free pages are kept per owner rank. Taking ``n`` pages happens in two steps:

1. Quotas (``_owner_quotas``): one page at a time from the owner with the most free pages, ties in
   cyclic rank order starting at the first page's preferred owner. An allocation never widens the gap
   between the ranks' used physical pages beyond ``max(gap before, 1)``, so a pool that has only been
   allocated from stays within one page on every rank; frees can open the gap, later allocations
   close it first.
2. Assignment (``_assign_owners``): a new page at page index ``j`` of its request prefers owner
   ``(j // owner_run_pages) % cp_size``; with the default ``owner_run_pages = 1`` that is
   ``j % cp_size``, the page-level twin of the round-robin CP token split. Pages get their preferred
   owner while its quota lasts; the rest fill the leftover quotas round-robin. So a request allocated
   in one extend, or grown by decode, on a balanced pool has page ``j`` on owner ``j % cp_size``, and
   every run of its pages (a radix node) is within one page per owner (within ``owner_run_pages``
   with longer runs). With concurrent requests and arbitrary chunking this is best effort: the quotas
   of step 1 win. A PD prefill server uses runs of several pages, so that each rank's share of a
   request reaches the decode server in few large transfer blocks (``disaggregation/transfer_blocks.py``);
   where a page lives never matters for correctness (every rank stores its owned rows of the whole
   all-gathered chunk).

``alloc_with_owners`` skips both steps: HiCache load-back names the owner of every page (the rank
whose host pool holds it), so the pages restored keep the balance they had when backed up.

Free lists live on the host (NumPy), unlike stock's device tensors: every decision above is taken on
the host anyway, so an allocation is host arithmetic plus one host-to-device copy of its locs, and a
free is one device-to-host copy of the freed locs (stock's ``torch.unique`` syncs as well) and no device
op at all.

Out-of-memory contract: the exact number of new pages (per owner for ``alloc_with_owners``) is
computed from CPU data first; if it does not fit, the ``alloc*`` methods return ``None`` with every
free list and ``available_size()`` untouched (stock 0.5.11 launches its Triton kernel over the free
list before it checks).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np
import torch

from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout

from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG


@dataclass(frozen=True)
class PagesHandedOut:
    """The new logical pages of the allocator's latest allocation, on the host (``last_allocation``).

    ``locs`` is the device tensor that call returned (callers check identity to pair a record with
    the locs they hold). For per-request calls (``alloc_extend``, ``alloc_decode``) request ``i`` got
    ``new_pages_per_req[i]`` new pages at its page indices ``pages_before[i]`` onward, in
    ``new_pages`` request by request; for ``alloc`` / ``alloc_with_owners`` both are ``None`` and
    ``new_pages`` lists every page of ``locs`` in order. The host mirror of ``req_to_token``
    (``req_to_page_mirror``) and the radix tree's value pages are fed from it, so no device tensor is
    read back to learn where tokens went.
    """

    locs: torch.Tensor
    new_pages: np.ndarray
    pages_before: Optional[np.ndarray] = None
    new_pages_per_req: Optional[np.ndarray] = None


class CPSharedPagedTokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """``PagedTokenToKVPoolAllocator`` handing out logical locs of the CP group (module docstring).

    ``size`` is logical tokens (``cp_size * kvcache.size``); ``get_kvcache()`` is this rank's physical
    pool. State lives in ``free_pages_by_owner`` / ``release_pages_by_owner``: logical page ids, one
    int64 NumPy array per owner rank, on the host. The stock flat ``free_pages`` / ``release_pages``
    stay ``None``: every method that used them is overridden. Arrays in these lists are never modified
    in place, which is what makes ``backup_state`` a cheap snapshot. Locs handed out are int64 tensors
    on ``device``.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        device: str,
        kvcache,
        need_sort: bool,
        layout: CpSharedKVLayout,
        owner_run_pages: int = 1,
    ):
        if isinstance(owner_run_pages, bool) or not isinstance(owner_run_pages, int) or owner_run_pages < 1:
            raise ValueError(f"{FLAG}: owner_run_pages must be an int >= 1, got {owner_run_pages!r}")
        # Consecutive pages of a request preferred on one owner (module docstring, step 2).
        self.owner_run_pages = owner_run_pages
        # THE layout: the server's spec's (``model_executor.cp_shared_kv_spec``, built once where the
        # capacity is installed); the CP HiRadixCache and the HiCache controller read it here.
        if layout.page_size != page_size:
            raise ValueError(f"{FLAG}: the layout's page size {layout.page_size} is not {page_size}")
        self.layout = layout
        cp_size = layout.cp_size
        self.cp_size = cp_size
        self.cp_rank = layout.cp_rank
        # Tokens of this rank's pool, excluding the dummy page 0.
        self.physical_size = kvcache.size
        if self.physical_size % page_size != 0:
            raise ValueError(
                f"{FLAG}: the physical KV pool size ({self.physical_size} tokens) must be a "
                f"multiple of page_size ({page_size})"
            )
        if size != cp_size * self.physical_size:
            raise ValueError(
                f"{FLAG}: logical allocator size must be cp_size x physical pool size "
                f"({cp_size} x {self.physical_size}), got {size}"
            )
        self.num_physical_pages = self.physical_size // page_size
        # The base constructor sets num_pages (logical pages handed out) and calls clear().
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)

    # ---- state ----

    def clear(self):
        # Owner r holds the logical pages of its physical pages 1..num_physical_pages (0 is the dummy).
        physical_pages = np.arange(1, self.num_physical_pages + 1, dtype=np.int64)
        self.free_pages_by_owner: List[np.ndarray] = [
            self.layout.logical_page_of(physical_pages, rank) for rank in range(self.cp_size)
        ]
        self.release_pages_by_owner: List[np.ndarray] = [
            self._empty_pages() for _ in range(self.cp_size)
        ]
        self.is_not_in_free_group = True
        self.free_group = []

    def available_size(self) -> int:
        """Free logical tokens, released-but-unsorted pages included (as stock)."""
        return (
            _count(self.free_pages_by_owner) + _count(self.release_pages_by_owner)
        ) * self.page_size

    def backup_state(self):
        return (list(self.free_pages_by_owner), list(self.release_pages_by_owner))

    def restore_state(self, state):
        free_pages_by_owner, release_pages_by_owner = state
        self.free_pages_by_owner = list(free_pages_by_owner)
        self.release_pages_by_owner = list(release_pages_by_owner)

    def merge_and_sort_free(self):
        for rank in range(self.cp_size):
            if len(self.release_pages_by_owner[rank]) > 0:
                merged = np.concatenate(
                    (self.free_pages_by_owner[rank], self.release_pages_by_owner[rank])
                )
                merged.sort()  # a new array: the lists' arrays are never modified in place
                self.free_pages_by_owner[rank] = merged
                self.release_pages_by_owner[rank] = self._empty_pages()

    def debug_print(self) -> str:
        free = [len(p) for p in self.free_pages_by_owner]
        released = [len(p) for p in self.release_pages_by_owner]
        return f"free pages by owner={free}, released pages by owner={released}"

    # ---- allocation ----

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """Whole pages for ``need_size`` (page-aligned) tokens; page k prefers owner k % cp."""
        if need_size % self.page_size != 0:
            raise ValueError(
                f"{FLAG}: alloc needs a page-aligned size, got {need_size} tokens "
                f"(page_size {self.page_size})"
            )
        num_pages = need_size // self.page_size
        if not self._make_room(num_pages):
            return None
        pages = self._take_round_robin(num_pages) if self._owner_fast_path else None
        if pages is None:
            pages = self._take_pages(np.arange(num_pages) % self.cp_size)
        return self._record(self._locs_on_device(pages), pages)

    def _take_round_robin(self, num_pages: int) -> Optional[np.ndarray]:
        """``_take_pages(arange(num_pages) % cp)`` when every page gets its preferred owner (the owner
        quotas equal the pages each owner is preferred for, as on a balanced pool); ``None``, with
        nothing taken, otherwise. Page j is then the (j // cp)-th page taken from owner j % cp."""
        cp_size = self.cp_size
        if num_pages == 0 or cp_size == 1:
            return None  # _take_pages has both already
        base, extra = divmod(num_pages, cp_size)
        demand = [base + (rank < extra) for rank in range(cp_size)]
        free_lists = self.free_pages_by_owner
        if _owner_quotas([p.shape[0] for p in free_lists], num_pages, tie_start=0) != demand:
            return None
        taken = []
        for rank in range(min(cp_size, num_pages)):  # the owners with a nonzero demand
            free, quota = free_lists[rank], demand[rank]
            taken.append(free[:quota])
            free_lists[rank] = free[quota:]
        if num_pages <= cp_size:
            # One page per owner 0, 1, ..: the owners' pages in rank order are the answer.
            return taken[0] if num_pages == 1 else np.concatenate(taken)
        return np.concatenate(taken)[_round_robin_take_index(num_pages, cp_size)]

    def alloc_with_owners(self, page_owners) -> Optional[torch.Tensor]:
        """Whole pages, page k on owner rank ``page_owners[k]`` (a tensor or NumPy array of ranks);
        ``None`` (nothing touched) if an owner lacks free pages.

        For HiCache load-back: a page's KV sits in the host pool of the rank that owned it when it was
        backed up, so its new logical page must have that same owner. No balance choice is left.
        """
        owners, demand = self._owner_demand(page_owners)
        if any(self._shortfall(demand)):
            return None
        free = [p.shape[0] for p in self.free_pages_by_owner]
        if any(d > f for d, f in zip(demand, free)):
            self.merge_and_sort_free()
        pages = self._pop_pages(owners, demand)
        return self._record(self._locs_on_device(pages), pages)

    def page_shortfall_by_owner(self, page_owners) -> List[int]:
        """Pages each owner rank lacks for ``alloc_with_owners(page_owners)``; all zero if it fits.

        Counts free and released pages, like ``alloc_with_owners``. Depends only on allocator state,
        which is identical on every rank, so every rank computes the same shortfall.
        """
        return self._shortfall(self._owner_demand(page_owners)[1])

    def _shortfall(self, demand: List[int]) -> List[int]:
        return [
            max(0, d - f.shape[0] - r.shape[0])
            for d, f, r in zip(demand, self.free_pages_by_owner, self.release_pages_by_owner)
        ]

    def _owner_demand(self, page_owners):
        """Owners as a NumPy array (no copy for a CPU tensor) and the page count of each rank."""
        if isinstance(page_owners, torch.Tensor):
            page_owners = page_owners.cpu().numpy()
        owners = np.asarray(page_owners)
        if len(owners) and not (0 <= owners.min() and owners.max() < self.cp_size):
            raise ValueError(f"{FLAG}: page owners must be ranks in [0, {self.cp_size})")
        return owners, np.bincount(owners, minlength=self.cp_size).tolist()

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> Optional[torch.Tensor]:
        """Locs for tokens ``prefix_len..seq_len-1`` of each request, as stock: first the rest of the
        request's partially filled last page (continuing ``last_loc``), then new pages."""
        return self._alloc_tokens(
            np.asarray(prefix_lens_cpu, dtype=np.int64),
            np.asarray(seq_lens_cpu, dtype=np.int64),
            last_loc,
            extend_num_tokens,
        )

    def alloc_decode(
        self,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
    ) -> Optional[torch.Tensor]:
        """One loc per request, for token ``seq_len - 1`` (``seq_lens`` already counts it, stock)."""
        seq = np.asarray(seq_lens_cpu, dtype=np.int64)
        if not ((seq - 1) % self.page_size == 0).any():
            # The common step: every request continues inside its last page.
            no_pages = np.zeros(len(seq), dtype=np.int64)
            return self._record(
                last_loc.to(torch.int64) + 1,
                self._empty_pages(),
                (seq - 1 + self.page_size - 1) // self.page_size,
                no_pages,
            )
        return self._alloc_tokens(seq - 1, seq, last_loc, len(seq))

    def _alloc_tokens(
        self,
        prefix_lens: np.ndarray,
        seq_lens: np.ndarray,
        last_loc: torch.Tensor,
        num_tokens: int,
    ) -> Optional[torch.Tensor]:
        # Every decision is taken on the host from the CPU length twins (identical on every rank, no
        # device sync); the device only continues held pages from last_loc.
        page_size = self.page_size
        extend_lens = seq_lens - prefix_lens
        if int(extend_lens.sum()) != num_tokens:
            raise ValueError(
                f"{FLAG}: {num_tokens} tokens requested but seq_lens - prefix_lens sums to "
                f"{int(extend_lens.sum())}"
            )
        # Pages a request holds before/after this call; the last one held before may be partial.
        pages_before = (prefix_lens + page_size - 1) // page_size
        new_pages_per_req = (seq_lens + page_size - 1) // page_size - pages_before
        num_new_pages = int(new_pages_per_req.sum())
        if not self._make_room(num_new_pages):
            return None

        first_new_slot = np.cumsum(new_pages_per_req) - new_pages_per_req
        req_of_page = np.repeat(np.arange(len(seq_lens)), new_pages_per_req)
        page_index_in_req = (
            pages_before[req_of_page] + np.arange(num_new_pages) - first_new_slot[req_of_page]
        )
        new_pages = self._take_pages((page_index_in_req // self.owner_run_pages) % self.cp_size)
        locs = self._alloc_token_locs(
            prefix_lens, seq_lens, last_loc, num_tokens, new_pages, pages_before, new_pages_per_req
        )
        return self._record(locs, new_pages, pages_before, new_pages_per_req)

    def _alloc_token_locs(
        self, prefix_lens, seq_lens, last_loc, num_tokens, new_pages, pages_before, new_pages_per_req
    ) -> torch.Tensor:
        """The device locs of ``_alloc_tokens`` once its new pages are taken."""
        page_size = self.page_size
        extend_lens = seq_lens - prefix_lens
        num_new_pages = new_pages.shape[0]
        first_new_slot = np.cumsum(new_pages_per_req) - new_pages_per_req
        if not np.count_nonzero(prefix_lens % page_size):
            # No request continues a held page (page-aligned prefixes: radix matches, whole-page
            # chunks): the locs are the new pages' rows, request by request, cut at each seq_len.
            return self._tensor_on_device(
                self._rows_cut_at_lengths(new_pages, new_pages_per_req, extend_lens)
            )

        # One entry per output token: its request and its position in the request.
        req_of_token = np.repeat(np.arange(len(seq_lens)), extend_lens)
        first_token = np.cumsum(extend_lens) - extend_lens
        pos = prefix_lens[req_of_token] + np.arange(num_tokens) - first_token[req_of_token]
        in_held_page = pos < pages_before[req_of_token] * page_size
        # Tokens on new pages get their locs here; tokens continuing a held page need last_loc,
        # which is on the device (only those are computed there).
        if num_new_pages:
            new_slot = first_new_slot[req_of_token] + pos // page_size - pages_before[req_of_token]
            fresh = new_pages[np.where(in_held_page, 0, new_slot)] * page_size + pos % page_size
        else:
            fresh = np.zeros(num_tokens, dtype=np.int64)
        if not np.count_nonzero(in_held_page):
            return self._tensor_on_device(fresh)
        plan = self._tensor_on_device(
            np.stack((req_of_token, pos - prefix_lens[req_of_token], fresh, in_held_page)).astype(
                np.int64
            )
        )
        req_d, offset_in_held_d, fresh_d, in_held_page_d = plan
        held = last_loc.to(torch.int64)[req_d] + 1 + offset_in_held_d
        if num_new_pages == 0:
            return held
        return torch.where(in_held_page_d.bool(), held, fresh_d)

    def _rows_cut_at_lengths(
        self, pages: np.ndarray, pages_per_req: np.ndarray, lens: np.ndarray
    ) -> np.ndarray:
        """Rows of ``pages`` (each request's run of ``pages_per_req`` pages, in order), keeping the
        first ``lens[i]`` rows of request i: page-level work plus one expansion, nothing per token
        but the cut of each request's unused last-page tail."""
        page_size = self.page_size
        rows = self.layout.rows_of_pages(pages * page_size)
        unused = pages_per_req * page_size - lens  # < page_size per request
        num_unused = int(unused.sum())
        if num_unused == 0:
            return rows
        tail_start = np.cumsum(pages_per_req) * page_size - unused
        first_of_tail = np.cumsum(unused) - unused
        dropped = np.repeat(tail_start - first_of_tail, unused) + np.arange(num_unused)
        keep = np.ones(rows.shape[0], dtype=bool)
        keep[dropped] = False
        return rows[keep]

    def _make_room(self, num_pages: int) -> bool:
        """Whether ``num_pages`` can be taken; merges released pages only when they make it fit."""
        num_free = _count(self.free_pages_by_owner)
        if num_pages <= num_free:
            return True
        if num_pages > num_free + _count(self.release_pages_by_owner):
            return False
        self.merge_and_sort_free()
        return True

    # Whether ``_take_pages`` may skip the general owner assignment where its result is known (one
    # owner, or every page can have its preferred owner). Tests turn it off on a twin allocator and
    # require identical pages.
    _owner_fast_path = True

    def _take_pages(self, preferred_owner: np.ndarray) -> np.ndarray:
        """Pop one free logical page per entry of ``preferred_owner``, in that order (balance rule of
        the module docstring). The caller has checked that they fit (``_make_room``)."""
        num_pages = len(preferred_owner)
        if num_pages == 0:
            return self._empty_pages()
        if self.cp_size == 1 and self._owner_fast_path:
            # One owner: its quota is every page, taken off the head of its free list in order.
            return self._pop_pages(preferred_owner, [num_pages])
        quotas = _owner_quotas(
            [p.shape[0] for p in self.free_pages_by_owner],
            num_pages,
            tie_start=int(preferred_owner[0]),
        )
        if (
            self._owner_fast_path
            and np.bincount(preferred_owner, minlength=self.cp_size).tolist() == quotas
        ):
            # Each owner's quota is exactly its preferred pages: every page gets its preferred
            # owner, which is what _assign_owners returns then (no leftover quota to deal).
            owner = preferred_owner
        else:
            owner = _assign_owners(preferred_owner, quotas)
        return self._pop_pages(owner, quotas)

    def _pop_pages(self, owner: np.ndarray, quotas: Sequence[int]) -> np.ndarray:
        """Logical page ids (int64) for pages on ``owner``; ``quotas[r]`` counts owner r.

        Pages from an owner come off the head of its free list, in page order.
        """
        taken = []
        for rank, quota in enumerate(quotas):
            if quota > 0:
                free = self.free_pages_by_owner[rank]
                taken.append(free[:quota])
                self.free_pages_by_owner[rank] = free[quota:]
        if len(taken) <= 1:
            # One owner (or none): its pages in page order are the answer. A view of the old free
            # list, which is never modified in place; callers build new arrays from it.
            return taken[0] if taken else self._empty_pages()
        pages = np.concatenate(taken)
        if len(owner) < 2 or not np.count_nonzero(owner[1:] < owner[:-1]):
            # Owners already grouped in rank order: the groups laid end to end are the answer.
            return pages
        # ``taken`` is grouped by owner, each group in page order; a stable sort of the owners lists,
        # for each group slot, the page that gets it.
        by_owner = np.argsort(owner, kind="stable")
        take_index = np.empty(len(owner), dtype=np.int64)
        take_index[by_owner] = np.arange(len(owner))
        return pages[take_index]

    # ---- free ----

    def free(self, free_index: torch.Tensor):
        """Give the pages of logical locs ``free_index`` back to their owners (freed first, stock)."""
        if free_index.numel() == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group.append(free_index)
            return
        target = self.release_pages_by_owner if self.need_sort else self.free_pages_by_owner
        for rank, freed in self._freed_pages_by_owner(free_index):
            target[rank] = np.concatenate((freed, target[rank]))
        if self.debug_mode:
            self._check_free_lists()

    def _freed_pages_by_owner(self, free_index: torch.Tensor):
        """``(rank, pages)`` for every owner with freed pages: the distinct pages of ``free_index``
        (any locs, any order, repeats allowed) that ``rank`` owns, ascending, int64.

        The locs come to the host once (no copy on the CPU; one copy from a GPU, where stock's
        ``torch.unique`` syncs as well); the rest is NumPy on a few pages.
        """
        pages = free_index.cpu().numpy() // self.page_size
        # One entry per run of equal pages first (a page's locs usually come together), so the sort
        # below sees about one entry per page, not one per token.
        pages = pages[_first_of_runs(pages)]
        pages = _sorted_distinct(pages.astype(np.int64, copy=False))  # a new array: sorted in place
        if self.cp_size == 1:
            return [(0, pages)]
        owner = self.layout.owner_of_page(pages)
        out = []
        for rank in range(self.cp_size):
            mine = pages[owner == rank]  # stays ascending
            if mine.shape[0]:
                out.append((rank, mine))
        return out

    def _check_free_lists(self):
        for rank in range(self.cp_size):
            pages = np.concatenate(
                (self.free_pages_by_owner[rank], self.release_pages_by_owner[rank])
            )
            owner = self.layout.owner_of_page(pages)
            assert bool((owner == rank).all()), "page on the wrong owner list"
            physical = self.layout.physical_page_of(pages)
            assert bool(((physical >= 1) & (physical <= self.num_physical_pages)).all()), (
                "page out of range"
            )
            assert len(np.unique(pages)) == len(pages), "page freed twice"

    # ---- unsupported ----

    def get_cpu_copy(self, indices, mamba_indices=None):
        raise ValueError(
            f"{FLAG}: KV cache CPU offload (get_cpu_copy, used by PD-disaggregation decode) is not "
            "supported: a request's logical pages are sharded across the CP ranks"
        )

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None):
        raise ValueError(
            f"{FLAG}: KV cache CPU offload (load_cpu_copy, used by PD-disaggregation decode) is not "
            "supported: a request's logical pages are sharded across the CP ranks"
        )

    # The latest allocation's new pages on the host (``PagesHandedOut``); None before the first.
    last_allocation: Optional[PagesHandedOut] = None

    def _record(self, locs, new_pages, pages_before=None, new_pages_per_req=None) -> torch.Tensor:
        self.last_allocation = PagesHandedOut(locs, new_pages, pages_before, new_pages_per_req)
        return locs

    def _locs_on_device(self, pages: np.ndarray) -> torch.Tensor:
        """All locs of logical ``pages``, page by page, as an int64 tensor on ``device``."""
        return self._tensor_on_device(self.layout.rows_of_pages(pages * self.page_size))

    def _tensor_on_device(self, values: np.ndarray) -> torch.Tensor:
        # A pageable source is staged before this returns: no stream sync, and the array may go.
        return torch.from_numpy(values).to(self.device, non_blocking=True)

    def _empty_pages(self) -> np.ndarray:
        return np.empty((0,), dtype=np.int64)


@functools.lru_cache(maxsize=256)
def _round_robin_take_index(num_pages: int, cp_size: int) -> np.ndarray:
    """For pages taken owner by owner (owner r's ``ceil((num_pages - r) / cp_size)`` pages laid end
    to end, in rank order), the index that deals them round robin: page j is owner j % cp_size's
    (j // cp_size)-th. Made once per shape; read-only."""
    demand = np.array([len(range(rank, num_pages, cp_size)) for rank in range(cp_size)])
    start = np.concatenate(([0], np.cumsum(demand)[:-1]))
    j = np.arange(num_pages)
    index = start[j % cp_size] + j // cp_size
    index.flags.writeable = False
    return index


def _sorted_distinct(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` of a 1-D array the caller owns (sorted in place), without np.unique's
    Python-level overhead (a free of one node runs it on a few pages)."""
    values.sort()
    return values[_first_of_runs(values)]


def _first_of_runs(values: np.ndarray) -> np.ndarray:
    """Bool mask of the entries that differ from the one before them (the first entry always)."""
    first = np.empty(values.shape[0], dtype=bool)
    if values.shape[0]:
        first[0] = True
        np.not_equal(values[1:], values[:-1], out=first[1:])
    return first


def _count(pages_by_owner: Sequence[np.ndarray]) -> int:
    return sum(p.shape[0] for p in pages_by_owner)


def _owner_quotas(free_pages: List[int], num_pages: int, tie_start: int) -> List[int]:
    """Pages to take from each owner: one at a time from the owner with the most free pages, ties in
    cyclic rank order from ``tie_start``. Closed form: lower every owner above a common level to it,
    then take one more from the first owners (in tie order) sitting at that level."""
    # Lowering the k fullest owners to a level L takes (sum of their free pages) - k * L pages. Find
    # the first k for which lowering them to the next owner's count would cover the demand; the level
    # is then the smallest L whose take does not exceed it.
    ordered = sorted(free_pages, reverse=True) + [0]
    top_total = 0
    for k in range(1, len(free_pages) + 1):
        top_total += ordered[k - 1]
        if top_total - k * ordered[k] >= num_pages:
            level = -(-(top_total - num_pages) // k)
            break
    else:
        raise AssertionError("demand exceeds free pages; _make_room must run first")
    quotas = [max(0, f - level) for f in free_pages]
    remaining = num_pages - sum(quotas)
    cp_size = len(free_pages)
    for step in range(cp_size):
        rank = (tie_start + step) % cp_size
        if remaining > 0 and free_pages[rank] >= level:
            quotas[rank] += 1
            remaining -= 1
    return quotas


def _assign_owners(preferred_owner: np.ndarray, quotas: List[int]) -> np.ndarray:
    """Owner of each page: its preferred owner while that quota lasts (in page order), else the
    leftover quotas dealt round-robin to the remaining pages in page order."""
    owner = np.full(len(preferred_owner), -1, dtype=np.int64)
    leftover = []
    for rank, quota in enumerate(quotas):
        granted = np.flatnonzero(preferred_owner == rank)[:quota]
        owner[granted] = rank
        leftover.append(quota - len(granted))
    # Deal round by round: one page per owner that still has leftover quota, in rank order.
    ranks = np.repeat(np.arange(len(quotas)), leftover)
    rounds = np.concatenate([np.arange(n) for n in leftover])
    owner[owner < 0] = ranks[np.lexsort((ranks, rounds))]
    return owner
