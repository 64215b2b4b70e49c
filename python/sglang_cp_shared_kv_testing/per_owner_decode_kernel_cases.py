"""The fused per-owner decode kernels against their torch references, on awkward inputs.

``per_owner_decode.fused_kernels`` runs on CUDA tensors; its torch forms in ``decode_topk_merge`` and
``attention_lse_merge`` are the reference. ``compare(device)`` runs both on the same inputs:
candidate gathers with padding columns and an empty request; selections with many exact ties at the
k-th score spread over the ranks, a request shorter than k, one with no tokens, widths above the
kernel's block; partials with empty LSEs (+inf, -inf, NaN) and an all-empty token, both as the
scaled sum's term and as the one-exchange merge of the packed, gathered buffer. Selections must be
equal exactly, the scaled partials and the merge within two bf16 roundings.

On CPU the kernels run in Triton's interpreter, which reads ``TRITON_INTERPRET`` when triton is
first imported, so run this module in a fresh process:

    TRITON_INTERPRET=1 python -m sglang_cp_shared_kv_testing.per_owner_decode_kernel_cases
    python -m sglang_cp_shared_kv_testing.per_owner_decode_kernel_cases --device cuda

It prints one JSON object; ``"passed"`` says whether every comparison held.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def _tied(generator, shape, levels):
    return (torch.randint(0, levels, shape, generator=generator).float() - 1.0) * 0.5


def compare(device: str, seed: int = 0) -> dict:
    from sglang_cp_shared_kv.model_executor.per_owner_decode import attention_lse_merge as merge
    from sglang_cp_shared_kv.model_executor.per_owner_decode import decode_topk_merge as topk
    from sglang_cp_shared_kv.model_executor.per_owner_decode import fused_kernels as kernels

    g = torch.Generator().manual_seed(seed)
    result = {"device": device}

    # Candidate gather: columns of a top-k, padding columns, an empty request.
    batch, width, k = 4, 700, 96
    logits = torch.randn(batch, width, generator=g)
    positions = torch.randint(0, 10_000, (batch, width), generator=g, dtype=torch.int32)
    rows = torch.randint(0, 10_000, (batch, width), generator=g, dtype=torch.int32)
    lengths = torch.tensor([700, 50, 0, 96])
    columns = topk.topk_columns(logits, lengths, k)
    want = topk.LocalCandidates(
        scores=torch.where(columns >= 0, logits.gather(1, columns.clamp(min=0).long()), float("-inf")),
        physical_rows=torch.where(columns >= 0, rows.gather(1, columns.clamp(min=0).long()), -1),
        positions=torch.where(columns >= 0, positions.gather(1, columns.clamp(min=0).long()), -1),
    )
    got = kernels.gather_candidates(*(t.to(device) for t in (columns, logits, positions, rows)))
    result["gather_equal"] = all(
        torch.equal(a.cpu(), b) for a, b in zip(got, (want.scores, want.physical_rows, want.positions))
    )

    # Selection: ties across ranks, short and empty requests; k above the kernel's block.
    selections = []
    for cp_size, k, levels in ((2, 64, 3), (3, 96, 4), (8, 2048, 40), (4, 2048, 2)):
        gathered = _tied(g, (cp_size, 5, k), levels)
        gathered[:, 1, k // 3 :] = float("-inf")  # fewer than k tokens in all
        gathered[:, 2] = float("-inf")  # no tokens
        gathered[1 % cp_size, 3, : k // 2] = float("-inf")  # one rank owns fewer than k
        selection = topk.select_global(gathered, k)  # kth columns from the CPU top-k
        chosen = selection.chosen_mask()
        candidate_rows = torch.randint(0, 1 << 20, (cp_size, 5, k), generator=g, dtype=torch.int32)
        equal = True
        for rank in range(cp_size):
            want_indices = torch.where(chosen[:, rank], candidate_rows[rank], -1)
            got_indices = kernels.owned_selection(
                gathered.to(device), selection.kth_columns.to(device), candidate_rows[rank].to(device), rank
            )
            equal &= torch.equal(got_indices.cpu(), want_indices)
        selections.append({"cp_size": cp_size, "k": k, "equal": equal,
                           "selected": chosen.sum(dim=(1, 2)).tolist()})
    result["selections"] = selections

    # Scaled partials: empty partials (+inf, -inf, NaN LSE) and an all-empty token; garbage out.
    cp_size, tokens, heads, dim = 3, 6, 8, 512
    out = (torch.randn(cp_size, tokens, heads, dim, generator=g) * 4).to(torch.bfloat16)
    lses = torch.randn(cp_size, tokens, heads, generator=g) * 3
    lses[0, 0] = float("inf")
    lses[1, 1] = float("-inf")
    lses[2, 2] = float("nan")
    lses[:, 3] = float("-inf")  # a padded token: every partial empty
    out[1, 1] = float("nan")  # an empty partial's output is never read
    worst, nan = 0.0, False
    for rank in range(cp_size):
        want_scaled = merge.scaled_partial(out[rank], lses[rank], merge.global_lse(lses)).to(torch.bfloat16)
        got_scaled = kernels.scaled_partial(out[rank].to(device), lses[rank].to(device), lses.to(device)).cpu()
        nan |= bool(got_scaled.isnan().any())
        tolerance = want_scaled.float().abs() * 2**-7 + 1e-30  # one bf16 rounding
        worst = max(worst, float(((got_scaled.float() - want_scaled.float()).abs() / tolerance).max()))
    result["scaled_partial_worst_in_bf16_roundings"] = worst
    result["scaled_partial_nan"] = nan

    # The one-exchange merge of the same partials, packed and gathered as the all-gather delivers them.
    gathered = torch.stack([merge.pack_partial(out[rank], lses[rank]) for rank in range(cp_size)])
    want_merged = merge.merge_partials(*merge.unpack_gathered(gathered, dim)).to(torch.bfloat16)
    got_merged = kernels.merge_gathered(gathered.to(device), dim).cpu()
    tolerance = want_merged.float().abs() * 2**-7 + 1e-30
    merged_worst = float(((got_merged.float() - want_merged.float()).abs() / tolerance).max())
    result["merge_gathered_worst_in_bf16_roundings"] = merged_worst
    result["merge_gathered_nan"] = bool(got_merged.isnan().any()) or bool(want_merged.isnan().any())
    result["merge_gathered_padded_zero"] = bool((got_merged[3] == 0).all())
    result["passed"] = (
        result["gather_equal"] and all(s["equal"] for s in selections) and worst <= 2.0 and not nan
        and merged_worst <= 2.0 and not result["merge_gathered_nan"] and result["merge_gathered_padded_zero"]
    )
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    result = compare(args.device)
    print(json.dumps(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
