"""Per-owner NSA top-k for decode: local candidates, an all-gather, the same global top-k on every rank.

Each rank scores only the tokens it owns (``owner_decode_tables``) and keeps its local top-k as
fixed-size candidates (score, pool row, position); the CP group all-gathers the candidates' float32
scores, and every rank selects the global top-k from the ``cp_size * k`` candidates. A token scoring
above the request's k-th score is in its owner's local top-k (fewer than k owned tokens can beat
it), and the owners' candidates hold enough tokens tied at the k-th score, so the global selection
over candidates is a top-k over all tokens.

Kernels: the local top-k is sglang's own radix select (``sgl_kernel.fast_topk_v2``, what sglang's
decode top-k runs; it serves k = 2048, GLM-5's and DeepSeek-V3.2's ``index_topk``), with a
``torch.topk`` reference on CPU and for other k. The global selection needs the k-th score only:
one more radix select over the gathered scores gives it, then elementwise masks and one cumulative
sum pick the selection, fixed shapes, no host sync, so decode CUDA graphs capture it. On CUDA the
candidate gather and this rank's share of the selection run as one fused kernel each
(``fused_kernels``); the torch forms here are their reference and serve CPU.

Tie rule: the selection holds every token scoring above the k-th score ``t`` and, of the tokens
scoring exactly ``t``, the first ones in candidate order (rank ascending, then the rank's local
top-k output order) until it holds ``k`` (or every token of a shorter request). What this matches:
sglang's own top-k (a radix select) also keeps every token above ``t`` and an arbitrary subset of
those tied at ``t``; a replicated pool's selection equals ours up to which tokens tied at ``t`` are
kept (``same_selection_up_to_ties`` of the tests' ``decode_topk_reference`` states it precisely).
The radix selects may pick different tied tokens on different runs, but the global step is a
deterministic function of the gathered bytes, which are identical on every rank, so every rank
selects the same set; their attention indices partition it.

Padding (tokens beyond a request's owned length, requests with fewer than k owned tokens): score
``-inf``, row and position -1; never selected. Real indexer scores are finite.

Exchange: one ``all_gather_into_tensor`` of ``[B, k]`` float32 per layer that computes top-k
(``skip_topk`` layers reuse the indices of the previous layer). Bytes received per rank, per token
and layer: ``(cp_size - 1) * k * 4`` (the tests' ``decode_step_bytes`` counts it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RADIX_TOPK_K = 2048  # the k sgl_kernel's fast_topk_v2 serves


def topk_columns(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """[B, k] int32 columns of the ``k`` largest ``scores`` [B, L] float32 among each row's first
    ``lengths[b]`` columns, in no particular order, ties kept arbitrarily; -1 padding where a row
    has fewer than k. sgl_kernel's radix select on CUDA for k = 2048, ``torch.topk`` otherwise."""
    if scores.is_cuda and k == RADIX_TOPK_K:
        from sgl_kernel import fast_topk_v2  # CUDA only (needs libcuda)

        return fast_topk_v2(scores.contiguous(), lengths.to(torch.int32), k)
    batch, width = scores.shape
    column = torch.arange(max(width, k), device=scores.device).unsqueeze(0)
    in_row = column < lengths.unsqueeze(1)
    padded = torch.nn.functional.pad(scores.float(), (0, max(0, k - width)), value=float("-inf"))
    columns = torch.topk(torch.where(in_row, padded, float("-inf")), k, dim=1).indices
    # Column order, padding last: like the radix select, not ordered by score.
    inside = columns < lengths.unsqueeze(1)
    columns = torch.where(inside, columns, torch.iinfo(torch.int64).max).sort(dim=1).values
    return torch.where(columns < lengths.unsqueeze(1), columns, -1).to(torch.int32)


@dataclass(frozen=True)
class LocalCandidates:
    # [B, k] float32 score of each of this rank's top-k owned tokens; -inf for padding.
    scores: torch.Tensor
    # [B, k] int32 pool row of each candidate on this rank; -1 for padding.
    physical_rows: torch.Tensor
    # [B, k] int32 request position of each candidate; -1 for padding.
    positions: torch.Tensor


def local_candidates(
    logits: torch.Tensor,
    owned_seq_lens: torch.Tensor,
    positions: torch.Tensor,
    physical_rows: torch.Tensor,
    k: int,
) -> LocalCandidates:
    """This rank's candidates from its indexer scores.

    ``logits``: [B, L] float32 scores of local columns (values past a request's owned length are
    ignored, the kernel need not clean them); ``owned_seq_lens``: [B] owned tokens per request;
    ``positions`` / ``physical_rows``: [B, L] int32 from ``OwnerDecodeTables.local_positions`` /
    ``local_physical_rows`` (-1 past the owned tokens).
    """
    columns = topk_columns(logits, owned_seq_lens, k)
    if logits.is_cuda:
        from sglang_cp_shared_kv.model_executor.per_owner_decode import fused_kernels  # Triton: CUDA

        scores, rows, picked_positions = fused_kernels.gather_candidates(
            columns, logits, positions, physical_rows
        )
        return LocalCandidates(scores=scores, physical_rows=rows, positions=picked_positions)
    valid = columns >= 0
    index = columns.clamp(min=0).long()
    return LocalCandidates(
        scores=torch.where(valid, logits.float().gather(1, index), float("-inf")),
        physical_rows=torch.where(valid, physical_rows.gather(1, index), -1),
        positions=torch.where(valid, positions.gather(1, index), -1),
    )


@dataclass(frozen=True)
class GlobalSelection:
    """The global top-k over every rank's candidates, identical on every rank: a function of the
    gathered scores only."""

    # [cp_size, B, k] float32 candidate scores of every rank, as all-gathered.
    gathered_scores: torch.Tensor
    # [B, k] int32 columns, in candidate order (rank r's candidate j is column r * k + j), of one
    # top-k over the gathered scores: the smallest score among them is the k-th score.
    kth_columns: torch.Tensor

    def chosen_mask(self) -> torch.Tensor:
        """[B, cp_size, k] bool: is candidate j of rank r selected for request b (padding never is)."""
        cp_size, batch, width = self.gathered_scores.shape
        flat = self.gathered_scores.permute(1, 0, 2).reshape(batch, cp_size * width)
        kth = flat.gather(1, self.kth_columns.long()).amin(dim=1, keepdim=True)
        above = flat > kth
        tied = flat == kth
        wanted_ties = width - above.sum(dim=1, keepdim=True)
        chosen = (above | (tied & (tied.cumsum(dim=1) <= wanted_ties))) & (flat > float("-inf"))
        return chosen.view(batch, cp_size, width)


def select_global(gathered_scores: torch.Tensor, k: int) -> GlobalSelection:
    """The global top-k from every rank's candidate scores ``[cp_size, B, k]`` (rank-major, as
    gathered), by the module's tie rule."""
    cp_size, batch, width = gathered_scores.shape
    if width != k:
        raise ValueError(f"candidates hold {width} per rank, the top-k is {k}")
    flat = gathered_scores.permute(1, 0, 2).reshape(batch, cp_size * width)  # candidate order
    lengths = torch.full((batch,), cp_size * width, dtype=torch.int32, device=flat.device)
    # Which tied tokens a radix select keeps does not change the k-th score (the smallest of any
    # top-k); cp_size * k >= k columns, so none of them is padding.
    return GlobalSelection(gathered_scores=gathered_scores, kth_columns=topk_columns(flat, lengths, k))


def owned_attention_indices(
    selection: GlobalSelection, candidates: LocalCandidates, cp_rank: int
) -> torch.Tensor:
    """[B, k] int32 attention indices of this rank: its pool row for each selected token it owns,
    -1 for every other entry."""
    if selection.gathered_scores.is_cuda:
        from sglang_cp_shared_kv.model_executor.per_owner_decode import fused_kernels  # Triton: CUDA

        return fused_kernels.owned_selection(
            selection.gathered_scores, selection.kth_columns, candidates.physical_rows, cp_rank
        )
    chosen = selection.chosen_mask()[:, cp_rank]
    return torch.where(chosen, candidates.physical_rows, -1).to(torch.int32)


def compact_owned_indices(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid (>= 0) indices first, in their order, -1 after; and their count per row (int32).

    For kernels that read ``cache_seqlens`` entries and do not skip -1 (fa3 with a page-size-1
    table). One stable sort per row, fixed shapes, no host sync.
    """
    valid = indices >= 0
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    return indices.gather(1, order), valid.sum(dim=1, dtype=torch.int32)
