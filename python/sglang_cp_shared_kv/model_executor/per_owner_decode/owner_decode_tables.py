"""Per-owner decode tables: each request's pages that this rank owns, as physical pages.

Per-owner decode scores and attends over this rank's own physical pool, without gathering peer
pages. The indexer kernel (``fp8_paged_mqa_logits``) scores a request through a block table and a
length; here the block table lists the request's *owned* pages (physical ids, in logical order) and
the length is the number of tokens this rank owns. Score column ``c`` of request ``b`` then is
local token ``c``:

    local page   j = c // page_size        slot s = c % page_size
    position     logical_page_column[b, j] * page_size + s     (token position in the request)
    physical row physical_page_table[b, j] * page_size + s     (row of this rank's pool)

All owned pages are full except possibly the request's last logical page, which is partial and,
when owned, is the last owned page: local columns ``< owned_seq_lens[b]`` are exactly the owned
tokens.

Built on the device from the backend's ``real_page_table`` (logical page ids) and the sequence
lengths: elementwise maps and one sort per row, fixed shapes (width = the batch's table width), no
host sync, so a CUDA graph can capture it. Logical pages below ``cp_size`` map to the dummy
physical page 0 (padded requests point there) and are owned by no rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout


@dataclass(frozen=True)
class OwnerDecodeTables:
    page_size: int
    # [B, W] int32: this rank's physical page of each owned page, in logical order; 0 (the dummy
    # page) past the owned ones.
    physical_page_table: torch.Tensor
    # [B, W] int32: logical page column (position // page_size) of each owned page; -1 past them.
    logical_page_column: torch.Tensor
    # [B] int32: tokens of each request stored on this rank (the indexer's score length).
    owned_seq_lens: torch.Tensor

    def local_positions(self, width_tokens: int) -> torch.Tensor:
        """[B, width_tokens] int32: request position of each local score column; -1 past the owned tokens."""
        column, slot, valid = self._local_columns(width_tokens)
        pages = self.logical_page_column.gather(1, column)
        return torch.where(valid, pages * self.page_size + slot, -1).to(torch.int32)

    def local_physical_rows(self, width_tokens: int) -> torch.Tensor:
        """[B, width_tokens] int32: pool row of each local score column; -1 past the owned tokens."""
        column, slot, valid = self._local_columns(width_tokens)
        pages = self.physical_page_table.gather(1, column)
        return torch.where(valid, pages * self.page_size + slot, -1).to(torch.int32)

    def _local_columns(self, width_tokens: int):
        device = self.owned_seq_lens.device
        local = torch.arange(width_tokens, device=device)
        page_columns = self.physical_page_table.shape[1]
        column = (local // self.page_size).clamp(max=max(page_columns - 1, 0))
        column = column.unsqueeze(0).expand(self.owned_seq_lens.shape[0], -1).long()
        slot = (local % self.page_size).unsqueeze(0)
        valid = local.unsqueeze(0) < self.owned_seq_lens.unsqueeze(1)
        return column, slot, valid


def build_owner_decode_tables(
    layout: CpSharedKVLayout, real_page_table: torch.Tensor, seq_lens: torch.Tensor
) -> OwnerDecodeTables:
    """Tables of this rank (``layout.cp_rank``) for a decode batch.

    ``real_page_table``: [B, W] logical page ids (the backend's ``real_page_table``; columns past a
    request's pages may hold anything). ``seq_lens``: [B] tokens each request attends to.
    """
    page_size, cp_size = layout.page_size, layout.cp_size
    batch, width = real_page_table.shape
    device = real_page_table.device
    pages = real_page_table.long()
    column = torch.arange(width, device=device).unsqueeze(0)
    seq_lens = seq_lens.long().unsqueeze(1)
    pages_read = (seq_lens + page_size - 1) // page_size
    owned = (
        (column < pages_read)
        & (pages >= cp_size)
        & (layout.owner_of_page(pages) == layout.cp_rank)
    )
    # Owned columns first, each group in column (= logical) order: keys are distinct per row.
    order = torch.sort(torch.where(owned, column, column + width), dim=1).indices
    owned_pages = owned.sum(dim=1, keepdim=True)
    in_owned = column < owned_pages
    physical = layout.physical_page_of(pages.gather(1, order))
    tokens_per_column = (seq_lens - column * page_size).clamp(0, page_size)
    return OwnerDecodeTables(
        page_size=page_size,
        physical_page_table=torch.where(in_owned, physical, 0).to(torch.int32),
        logical_page_column=torch.where(in_owned, order, -1).to(torch.int32),
        owned_seq_lens=torch.where(owned, tokens_per_column, 0).sum(dim=1).to(torch.int32),
    )
