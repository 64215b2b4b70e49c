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
   ``j % cp_size`` (the page-level twin of the round-robin CP token split). Pages get their preferred
   owner while its quota lasts; the rest fill the leftover quotas round-robin. So a request allocated
   in one extend, or grown by decode, on a balanced pool has page ``j`` on owner ``j % cp_size``, and
   every run of its pages (a radix node) is within one page per owner. With concurrent requests and
   arbitrary chunking this is best effort: the quotas of step 1 win.

``alloc_with_owners`` skips both steps: HiCache load-back names the owner of every page (the rank
whose host pool holds it), so the pages restored keep the balance they had when backed up.

Out-of-memory contract: the exact number of new pages (per owner for ``alloc_with_owners``) is
computed from CPU data first; if it does not fit, the ``alloc*`` methods return ``None`` with every
free list and ``available_size()`` untouched (stock 0.5.11 launches its Triton kernel over the free
list before it checks).
"""

from __future__ import annotations

import functools
from typing import List, Optional, Sequence

import numpy as np
import torch

from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout

from sglang_cp_shared_kv.server_args import CP_SHARED_KV_FLAG as FLAG


class CPSharedPagedTokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """``PagedTokenToKVPoolAllocator`` handing out logical locs of the CP group (module docstring).

    ``size`` is logical tokens (``cp_size * kvcache.size``); ``get_kvcache()`` is this rank's physical
    pool. State lives in ``free_pages_by_owner`` / ``release_pages_by_owner``: logical page ids, one
    tensor per owner rank, on ``device``. The stock flat ``free_pages`` / ``release_pages`` stay
    ``None``: every method that used them is overridden. Tensors in these lists are never modified in
    place, which is what makes ``backup_state`` a cheap snapshot.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        device: str,
        kvcache,
        need_sort: bool,
        cp_size: int,
        cp_rank: int,
    ):
        self.layout = CpSharedKVLayout(cp_size, cp_rank, page_size)
        self.cp_size = cp_size
        self.cp_rank = cp_rank
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
        physical_pages = torch.arange(
            1, self.num_physical_pages + 1, dtype=torch.int64, device=self.device
        )
        self.free_pages_by_owner: List[torch.Tensor] = [
            self.layout.logical_page_of(physical_pages, rank) for rank in range(self.cp_size)
        ]
        self.release_pages_by_owner: List[torch.Tensor] = [
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
                merged = torch.cat(
                    (self.free_pages_by_owner[rank], self.release_pages_by_owner[rank])
                )
                self.free_pages_by_owner[rank] = torch.sort(merged).values
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
        if self._owner_fast_path:
            pages = self._take_round_robin(num_pages)
            if pages is not None:
                return self._page_locs(pages)
        return self._page_locs(self._take_pages(np.arange(num_pages) % self.cp_size))

    def _take_round_robin(self, num_pages: int) -> Optional[torch.Tensor]:
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
            return taken[0] if num_pages == 1 else torch.cat(taken)
        take_index = _round_robin_take_index(num_pages, cp_size, self.device)
        return torch.cat(taken).index_select(0, take_index)

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
        return self._page_locs(self._pop_pages(owners, demand))

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
            return last_loc.to(torch.int64) + 1
        return self._alloc_tokens(seq - 1, seq, last_loc, len(seq))

    def _alloc_tokens(
        self,
        prefix_lens: np.ndarray,
        seq_lens: np.ndarray,
        last_loc: torch.Tensor,
        num_tokens: int,
    ) -> Optional[torch.Tensor]:
        # Every decision is taken on the host from the CPU length twins (identical on every rank, no
        # device sync); the device only does index arithmetic on last_loc and on the pages taken.
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
        new_pages = self._take_pages(page_index_in_req % self.cp_size)

        # One entry per output token: its request and its position in the request.
        req_of_token = np.repeat(np.arange(len(seq_lens)), extend_lens)
        first_token = np.cumsum(extend_lens) - extend_lens
        pos = prefix_lens[req_of_token] + np.arange(num_tokens) - first_token[req_of_token]
        in_held_page = pos < pages_before[req_of_token] * page_size
        new_slot = first_new_slot[req_of_token] + pos // page_size - pages_before[req_of_token]
        plan = torch.from_numpy(
            np.stack(
                (
                    req_of_token,
                    pos - prefix_lens[req_of_token],
                    np.where(in_held_page, 0, new_slot),
                    pos % page_size,
                    in_held_page,
                )
            ).astype(np.int64)
        ).to(self.device, non_blocking=True)

        req_d, offset_in_held_d, new_slot_d, slot_in_page_d, in_held_page_d = plan
        held = last_loc.to(torch.int64)[req_d] + 1 + offset_in_held_d
        if num_new_pages == 0:
            return held
        fresh = new_pages[new_slot_d] * page_size + slot_in_page_d
        return torch.where(in_held_page_d.bool(), held, fresh)

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

    def _take_pages(self, preferred_owner: np.ndarray) -> torch.Tensor:
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

    def _pop_pages(self, owner: np.ndarray, quotas: Sequence[int]) -> torch.Tensor:
        """Logical page ids (int64, on ``device``) for pages on ``owner``; ``quotas[r]`` counts owner r.

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
            # list, which is never modified in place; callers build new tensors from it.
            return taken[0] if taken else self._empty_pages()
        if len(owner) < 2 or bool((owner[1:] >= owner[:-1]).all()):
            # Owners already grouped in rank order: the groups laid end to end are the answer.
            return torch.cat(taken)
        # ``taken`` is grouped by owner, each group in page order; a stable sort of the owners lists,
        # for each group slot, the page that gets it.
        by_owner = np.argsort(owner, kind="stable")
        take_index = np.empty(len(owner), dtype=np.int64)
        take_index[by_owner] = np.arange(len(owner))
        take_index = torch.from_numpy(take_index).to(self.device, non_blocking=True)
        return torch.cat(taken).index_select(0, take_index)

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
            target[rank] = torch.cat((freed, target[rank]))
        if self.debug_mode:
            self._check_free_lists()

    def _freed_pages_by_owner(self, free_index: torch.Tensor):
        """``(rank, pages)`` for every owner with freed pages: the distinct pages of ``free_index``
        (any locs, any order, repeats allowed) that ``rank`` owns, ascending, int64 on ``device``.

        The page-level work runs in NumPy on the host (a few pages: torch's per-op cost would
        dominate); the locs come to the host once (no copy on the CPU; on a GPU one copy, where the
        owner counts needed a host sync anyway), the grouped pages go back once.
        """
        locs = free_index.cpu().numpy()
        pages = np.unique(locs // self.page_size).astype(np.int64, copy=False)
        if self.cp_size == 1:
            return [(0, torch.from_numpy(pages).to(self.device, non_blocking=True))]
        owner = self.layout.owner_of_page(pages)
        counts = np.bincount(owner, minlength=self.cp_size).tolist()
        # Sorted pages, stably grouped by owner: each owner's pages stay ascending.
        grouped = torch.from_numpy(pages[np.argsort(owner, kind="stable")])
        grouped = grouped.to(self.device, non_blocking=True)
        out, start = [], 0
        for rank, count in enumerate(counts):
            if count > 0:
                out.append((rank, grouped[start : start + count]))
                start += count
        return out

    def _check_free_lists(self):
        for rank in range(self.cp_size):
            pages = torch.cat((self.free_pages_by_owner[rank], self.release_pages_by_owner[rank]))
            owner = self.layout.owner_of_page(pages)
            assert bool((owner == rank).all()), "page on the wrong owner list"
            physical = self.layout.physical_page_of(pages)
            assert bool(((physical >= 1) & (physical <= self.num_physical_pages)).all()), (
                "page out of range"
            )
            assert len(torch.unique(pages)) == len(pages), "page freed twice"

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

    def _page_locs(self, pages: torch.Tensor) -> torch.Tensor:
        """All locs of logical ``pages``, page by page."""
        return self.layout.rows_of_pages(pages * self.page_size)

    def _empty_pages(self) -> torch.Tensor:
        return torch.empty((0,), dtype=torch.int64, device=self.device)


@functools.lru_cache(maxsize=256)
def _round_robin_take_index(num_pages: int, cp_size: int, device) -> torch.Tensor:
    """For pages taken owner by owner (owner r's ``ceil((num_pages - r) / cp_size)`` pages laid end
    to end, in rank order), the index that deals them round robin: page j is owner j % cp_size's
    (j // cp_size)-th. Made once per shape; never modified in place."""
    demand = np.array([len(range(rank, num_pages, cp_size)) for rank in range(cp_size)])
    start = np.concatenate(([0], np.cumsum(demand)[:-1]))
    j = np.arange(num_pages)
    return torch.from_numpy(start[j % cp_size] + j // cp_size).to(device)


def _count(pages_by_owner: Sequence[torch.Tensor]) -> int:
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
