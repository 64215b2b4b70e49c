"""Per-owner NSA top-k for decode: local candidates, an all-gather, the same global top-k on every rank.

Each rank scores only the tokens it owns (``owner_decode_tables``) and keeps its local top-k as
fixed-size candidates; the CP group all-gathers them, and every rank selects the global top-k from
the ``cp_size * k`` candidates. A global top-k element is in its owner's local top-k (fewer than k
owned tokens beat it), so the global selection over candidates equals the selection over all tokens.

Tie rule: (score descending, request position ascending). A candidate travels as ONE int64 key
that sorts in exactly that order: the float32 score mapped to an order-preserving int32 in the high
32 bits, ``2**32 - 1 - position`` in the low 32 bits. Keys are distinct within a request, so
``torch.topk`` over keys selects one deterministic set, locally and globally, and every rank (same
gathered bytes, same op) selects the same set. Padding (tokens beyond a request's length, requests
with fewer than k owned tokens) is ``PAD_KEY`` (the smallest int64), below every real key; it
decodes to score -inf, position -1.

What this matches: a replicated pool selecting by the same rule (``replicated_topk_positions``)
bit for bit, given the same per-token scores. sglang's own top-k (``fast_topk_transform_fused``, a
radix select) keeps every token scoring above the k-th score and, when several tokens tie with the
k-th score, an arbitrary subset of them (kernel arrival order); for requests of at most k tokens it
keeps every token. So ours equals sglang's up to which of the tokens tied at the k-th score are
kept; ``same_selection_up_to_ties`` states that precisely. -0.0 sorts below +0.0 (distinct keys).

Exchange: one ``all_gather_into_tensor`` of ``[B, k]`` int64 per layer that computes top-k
(``skip_topk`` layers reuse the indices of the previous layer). Bytes received per rank, per token
and layer: ``(cp_size - 1) * k * 8`` (see ``decode_step_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

PAD_KEY = torch.iinfo(torch.int64).min
_LOW_32 = (1 << 32) - 1


def candidate_keys(scores: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """int64 keys of (float32 score, int position); ``PAD_KEY`` where not ``valid``. Same shape."""
    bits = scores.float().contiguous().view(torch.int32)
    # Negative floats order reversed as ints: flip their magnitude bits (sign bit kept).
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    keys = ordered * (1 << 32) + (_LOW_32 - positions.long())
    return torch.where(valid, keys, PAD_KEY)


def score_of_key(keys: torch.Tensor) -> torch.Tensor:
    """float32 scores of keys; -inf for ``PAD_KEY``."""
    ordered = torch.div(keys, 1 << 32, rounding_mode="floor").to(torch.int32)
    bits = torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    return torch.where(keys == PAD_KEY, float("-inf"), bits.view(torch.float32))


def position_of_key(keys: torch.Tensor) -> torch.Tensor:
    """int32 positions of keys; -1 for ``PAD_KEY``."""
    positions = _LOW_32 - (keys & _LOW_32)
    return torch.where(keys == PAD_KEY, -1, positions).to(torch.int32)


def top_keys(keys: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest ``k`` keys of each row, descending, and their columns (rows shorter than k are padded
    with ``PAD_KEY`` and column -1)."""
    width = keys.shape[-1]
    if width < k:
        keys = torch.nn.functional.pad(keys, (0, k - width), value=PAD_KEY)
    values, columns = torch.topk(keys, k, dim=-1, sorted=True)
    columns = torch.where(values == PAD_KEY, -1, columns)
    return values, columns


@dataclass(frozen=True)
class LocalCandidates:
    # [B, k] int64 keys of this rank's top-k owned tokens (PAD_KEY padding).
    keys: torch.Tensor
    # [B, k] int32 pool row of each candidate on this rank; -1 for padding.
    physical_rows: torch.Tensor


def local_candidates(
    logits: torch.Tensor, positions: torch.Tensor, physical_rows: torch.Tensor, k: int
) -> LocalCandidates:
    """This rank's candidates from its indexer scores.

    ``logits``: [B, L] float32 scores of local columns (values past a request's owned length are
    ignored, the kernel need not clean them); ``positions`` / ``physical_rows``: [B, L] int32 from
    ``OwnerDecodeTables.local_positions`` / ``local_physical_rows`` (-1 past the owned tokens).
    """
    keys = candidate_keys(logits, positions, positions >= 0)
    values, columns = top_keys(keys, k)
    rows = physical_rows.gather(1, columns.clamp(min=0).long())
    return LocalCandidates(keys=values, physical_rows=torch.where(columns >= 0, rows, -1))


@dataclass(frozen=True)
class GlobalSelection:
    # [B, k] rank owning each selected token; -1 for padding (fewer than k tokens in the request).
    owner: torch.Tensor
    # [B, k] index of the selected token in its owner's candidate list; -1 for padding.
    slot: torch.Tensor
    # [B, k] int32 request positions of the selection, descending key order; -1 for padding.
    positions: torch.Tensor


def select_global(gathered_keys: torch.Tensor) -> GlobalSelection:
    """The global top-k from every rank's candidates ``[cp_size, B, k]`` (rank-major, as gathered)."""
    cp_size, batch, k = gathered_keys.shape
    flat = gathered_keys.permute(1, 0, 2).reshape(batch, cp_size * k)
    values, columns = top_keys(flat, k)
    pad = columns < 0
    return GlobalSelection(
        owner=torch.where(pad, -1, torch.div(columns, k, rounding_mode="floor")),
        slot=torch.where(pad, -1, columns % k),
        positions=position_of_key(values),
    )


def owned_attention_indices(
    selection: GlobalSelection, candidates: LocalCandidates, cp_rank: int
) -> torch.Tensor:
    """[B, k] int32 attention indices of this rank: its pool row for each selected token it owns,
    -1 for every other entry (tokens of other owners, padding)."""
    rows = candidates.physical_rows.gather(1, selection.slot.clamp(min=0).long())
    return torch.where(selection.owner == cp_rank, rows, -1).to(torch.int32)


def compact_owned_indices(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid (>= 0) indices first, in their order, -1 after; and their count per row (int32).

    For kernels that read ``cache_seqlens`` entries and do not skip -1 (fa3 with a page-size-1
    table). One stable sort per row, fixed shapes, no host sync.
    """
    valid = indices >= 0
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    return indices.gather(1, order), valid.sum(dim=1, dtype=torch.int32)


def all_gather_candidates(keys: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[cp_size, B, k]`` keys of every rank; every rank of ``group`` must call it, in the same order."""
    cp_size = dist.get_world_size(group)
    staged = keys.is_cuda and dist.get_backend(group) == dist.Backend.GLOO  # gloo moves host memory
    source = (keys.cpu() if staged else keys).contiguous()
    # Ranks concatenated along dim 0 (the shape gloo requires), then viewed rank-major.
    out = source.new_empty((cp_size * source.shape[0], *source.shape[1:]))
    dist.all_gather_into_tensor(out, source, group=group)
    return out.view(cp_size, *source.shape).to(keys.device)


# ---- the replicated reference ----


def replicated_topk_positions(logits: torch.Tensor, seq_lens: torch.Tensor, k: int) -> torch.Tensor:
    """[B, k] int32 positions a replicated pool selects by the same rule from ``logits`` [B, L]
    (column = position; columns ``>= seq_lens[b]`` ignored); -1 padding, descending key order."""
    batch, width = logits.shape
    positions = torch.arange(width, device=logits.device).unsqueeze(0).expand(batch, -1)
    keys = candidate_keys(logits, positions, positions < seq_lens.unsqueeze(1))
    return position_of_key(top_keys(keys, k)[0])


def same_selection_up_to_ties(
    ours: torch.Tensor, theirs: torch.Tensor, scores: torch.Tensor, seq_lens: torch.Tensor, k: int
) -> torch.Tensor:
    """[B] bool: per request, do two selections (positions, -1 padding, any order) agree up to ties
    at the k-th score? Both must hold ``min(seq_len, k)`` distinct valid positions, share every
    position scoring above the k-th score, and pick the rest among positions scoring exactly the k-th.
    ``scores``: [B, L] float32, column = position."""
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
