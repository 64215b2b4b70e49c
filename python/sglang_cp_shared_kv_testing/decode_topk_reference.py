"""What per-owner decode's top-k is checked against: the top-k of a replicated pool, a comparison of
two selections up to ties at the k-th score, and the request positions of a global selection.

The runtime needs none of these (it never gathers positions, and has no replicated pool); the unit
tests, the GPU checks and the decode benchmark do.
"""

from __future__ import annotations

import torch

from sglang_cp_shared_kv.model_executor.per_owner_decode.decode_topk_merge import GlobalSelection


def selected_positions(selection: GlobalSelection, gathered_positions: torch.Tensor) -> torch.Tensor:
    """[B, cp_size * k] int32 request positions of the selection (candidate order, -1 where not
    selected), from every rank's candidate positions ``[cp_size, B, k]``. For checks and audits:
    the runtime never gathers positions."""
    cp_size, batch, width = gathered_positions.shape
    flat = gathered_positions.permute(1, 0, 2).reshape(batch, cp_size * width)
    return torch.where(selection.chosen_mask().reshape(batch, -1), flat, -1).to(torch.int32)


def replicated_topk_positions(logits: torch.Tensor, seq_lens: torch.Tensor, k: int) -> torch.Tensor:
    """[B, k] int32 positions a replicated pool's top-k selects from ``logits`` [B, L] (column =
    position; columns ``>= seq_lens[b]`` ignored); -1 padding, descending score. Ties at the k-th
    score: ``torch.topk``'s choice (compare with ``same_selection_up_to_ties``)."""
    batch, width = logits.shape
    column = torch.arange(max(width, k), device=logits.device).unsqueeze(0)
    padded = torch.nn.functional.pad(logits.float(), (0, max(0, k - width)), value=float("-inf"))
    masked = torch.where(column < seq_lens.unsqueeze(1), padded, float("-inf"))
    columns = torch.topk(masked, k, dim=1).indices
    return torch.where(columns < seq_lens.unsqueeze(1), columns, -1).to(torch.int32)


def same_selection_up_to_ties(
    ours: torch.Tensor, theirs: torch.Tensor, scores: torch.Tensor, seq_lens: torch.Tensor, k: int
) -> torch.Tensor:
    """[B] bool: per request, do two selections (positions, -1 padding, any order and width) agree
    up to ties at the k-th score? Both must hold ``min(seq_len, k)`` distinct valid positions, share
    every position scoring above the k-th score, and pick the rest among positions scoring exactly
    the k-th. ``scores``: [B, L] float32, column = position."""
    batch, width = scores.shape
    column = torch.arange(width, device=scores.device).unsqueeze(0)
    in_seq = column < seq_lens.unsqueeze(1)
    masked = torch.where(in_seq, scores.float(), float("-inf"))
    kth = torch.topk(
        torch.nn.functional.pad(masked, (0, max(0, k - width)), value=float("-inf")), k, dim=1
    ).values[:, -1:]
    above = in_seq & (masked > kth)
    tied = in_seq & (masked == kth)

    def as_mask(selection):
        mask = torch.zeros((batch, width + 1), dtype=torch.int32, device=scores.device)
        index = torch.where(selection >= 0, selection.long(), width)
        mask.scatter_add_(1, index, torch.ones_like(index, dtype=torch.int32))
        return mask[:, :width]

    agree = torch.ones(batch, dtype=torch.bool, device=scores.device)
    expected = torch.clamp(seq_lens.long(), max=k)
    for selection in (ours, theirs):
        mask = as_mask(selection)
        agree &= (mask <= 1).all(dim=1)  # distinct
        agree &= (mask.sum(dim=1) == expected) & ((mask * ~in_seq).sum(dim=1) == 0)
        agree &= (mask.bool() | ~above).all(dim=1)  # every position above the k-th
        agree &= (~mask.bool() | above | tied).all(dim=1)  # the rest from the tie group
    return agree

