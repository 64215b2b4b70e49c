"""Random decode batches over a page-sharded pool, and every rank's per-owner top-k, in one process.

Shared by the unit tests and ``scripts/gpu/check_cp_per_owner_decode.py``: logical pages are drawn
without repetition from the pages the allocator can hand out (``>= cp_size``), so every rank's
physical shard is a slice of one replicated pool (``CpSharedKVLayout``), and the per-owner result
can be compared with what the replicated pool selects and attends to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List

import torch

from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.model_executor.per_owner_decode.decode_topk_merge import (
    GlobalSelection,
    LocalCandidates,
    local_candidates,
    owned_attention_indices,
    select_global,
)
from sglang_cp_shared_kv.model_executor.per_owner_decode.owner_decode_tables import (
    OwnerDecodeTables,
    build_owner_decode_tables,
)
from sglang_cp_shared_kv_testing.decode_topk_reference import selected_positions


@dataclass
class DecodeBatch:
    cp_size: int
    page_size: int
    physical_pages: int  # per rank, dummy page 0 included
    page_table: torch.Tensor  # [B, W] logical pages (0 = padding / unused columns)
    seq_lens: torch.Tensor  # [B] int64

    @property
    def logical_pages(self) -> int:
        return self.cp_size * self.physical_pages

    def layout(self, rank: int) -> CpSharedKVLayout:
        return CpSharedKVLayout(self.cp_size, rank, self.page_size)

    def token_locs(self) -> torch.Tensor:
        """[B, W * page_size] logical loc of each position (the backend's ``page_table_1``)."""
        slot = torch.arange(self.page_size, device=self.page_table.device)
        locs = self.page_table.long()[:, :, None] * self.page_size + slot
        return locs.reshape(self.page_table.shape[0], -1)

    def shard_rows(self, rank: int) -> torch.Tensor:
        """Logical loc held at each physical row of ``rank`` (the layout's inverse), [P * page]."""
        physical = torch.arange(self.physical_pages, device=self.page_table.device)
        pages = self.layout(rank).logical_page_of(physical)
        slot = torch.arange(self.page_size, device=self.page_table.device)
        return (pages[:, None] * self.page_size + slot).reshape(-1)


def random_batch(
    generator: torch.Generator,
    cp_size: int,
    page_size: int,
    seq_lens: List[int],
    padded: List[bool] | None = None,
    device: str = "cpu",
) -> DecodeBatch:
    """Requests of ``seq_lens`` tokens on distinct random pages; ``padded[b]``: a padded request,
    whose table points at page 0 (as sglang pads a decode batch)."""
    padded = padded or [False] * len(seq_lens)
    pages_per_request = [-(-s // page_size) for s in seq_lens]
    width = max(pages_per_request + [1])
    needed = sum(n for n, pad in zip(pages_per_request, padded) if not pad)
    physical_pages = 2 + -(-needed // cp_size) * 2  # room for owners to be unbalanced
    pool_pages = torch.arange(cp_size, cp_size * physical_pages)
    chosen = pool_pages[torch.randperm(pool_pages.numel(), generator=generator)[:needed]]
    table = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    taken = 0
    for b, (n, pad) in enumerate(zip(pages_per_request, padded)):
        if pad:
            continue
        table[b, :n] = chosen[taken : taken + n].to(torch.int32)
        # Columns past the request's pages hold stale pages, as req_to_token may.
        table[b, n:] = chosen[torch.randint(0, needed, (width - n,), generator=generator)].to(torch.int32)
        taken += n
    return DecodeBatch(
        cp_size=cp_size,
        page_size=page_size,
        physical_pages=physical_pages,
        page_table=table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
    )


@dataclass
class RankTopk:
    tables: OwnerDecodeTables
    candidates: LocalCandidates
    selection: GlobalSelection
    attention_indices: torch.Tensor  # [B, k] physical rows of this rank, -1 elsewhere
    positions: torch.Tensor  # [B, cp_size * k] positions of the global selection, -1 elsewhere


# logits of rank r's local columns: (rank, tables) -> [B, L] float32
LocalLogits = Callable[[int, OwnerDecodeTables], torch.Tensor]


def per_owner_topk(batch: DecodeBatch, local_logits: LocalLogits, k: int) -> List[RankTopk]:
    """Every rank's tables, candidates, the (emulated) all-gather and global selection, and indices."""
    tables, candidates = [], []
    for rank in range(batch.cp_size):
        t = build_owner_decode_tables(batch.layout(rank), batch.page_table, batch.seq_lens)
        logits = local_logits(rank, t)
        width = logits.shape[1]
        candidates.append(
            local_candidates(
                logits, t.owned_seq_lens, t.local_positions(width), t.local_physical_rows(width), k
            )
        )
        tables.append(t)
    gathered = torch.stack([c.scores for c in candidates])  # the all-gather
    gathered_positions = torch.stack([c.positions for c in candidates])
    out = []
    for rank in range(batch.cp_size):
        selection = select_global(gathered, k)
        indices = owned_attention_indices(selection, candidates[rank], rank)
        positions = selected_positions(selection, gathered_positions)
        out.append(RankTopk(tables[rank], candidates[rank], selection, indices, positions))
    return out


def emulated_local_logits(batch: DecodeBatch, replicated_logits: torch.Tensor, garbage: float = 7.5):
    """What the indexer kernel returns on each rank, given the replicated scores [B, W * page]:
    local column c scores position ``local_positions[c]``; columns past the owned tokens hold
    ``garbage`` (the kernel does not clean them)."""

    def logits(rank: int, tables: OwnerDecodeTables) -> torch.Tensor:
        width = replicated_logits.shape[1]
        positions = tables.local_positions(width)
        values = replicated_logits.gather(1, positions.clamp(min=0).long())
        return torch.where(positions >= 0, values, garbage)

    return logits
