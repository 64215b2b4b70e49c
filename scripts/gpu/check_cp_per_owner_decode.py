"""Check per-owner NSA decode (owner top-k + LSE merge) against a replicated pool, with the real kernels.

CP ranks are emulated in one process: one replicated pool (KV rows as the decode impl reads them:
fp8 656-byte rows for ``flashmla_kv``, bf16 576-wide rows for ``flashmla_sparse`` and ``fa3``;
132-byte indexer rows, 64-token pages) is built, and each rank's physical shard is cut from it by
the layout (``CpSharedKVLayout``: logical page q on rank q % cp as physical page q // cp). Then, per
cp size and decode impl (``--decode-impls``):

* replicated: indexer logits over the logical block table, top-k (our rule; and sglang's own
  ``fast_topk_v2`` where it imports, compared up to ties), sparse attention over the replicated pool;
* per owner, for every rank: the rank's physical block table, indexer logits over its shard only,
  local candidates, the global selection from all ranks' candidates (the all-gather is a stack
  here), attention over the selected rows the rank owns (-1 elsewhere; fa3: compacted to the front,
  their count as ``cache_seqlens``) with the LSE kept; the partials merged by the scaled sum and
  by the one-exchange form (each rank's partial and LSE packed as ``attention_lse_merge.pack_partial``
  packs them, the all-gather a stack, merged by ``merge_gathered``: the fused kernel on CUDA). The kernel's LSE, read in the base per-owner decode declares for the impl
  (``per_owner_decode.SERVED_DECODE_IMPLS``), must equal the torch reference's natural-log LSE.

``--hooked-cp-sizes`` (default 2,4) then runs decode steps through sglang's own decode methods with
our hooks applied (``sglang_cp_shared_kv_testing/per_owner_decode_hooked.py``: metadata hook, per layer
``get_indexer_metadata`` + ``Indexer._get_topk_paged`` or a ``skip_topk`` layer reusing the
indices, ``forward_decode`` with its owner-filtered store, ``get_key_buffer`` and the impl's kernel
call), three layers, two steps, a padded request, one gloo rank per process sharing the device,
against the replicated pool.

Compared, for every real request (padded requests must give no NaN): selected positions equal the
replicated selection (exactly, and up to ties at the k-th score); the rows the ranks attend to,
mapped back to logical locs, are the replicated selection's locs, each once; merged outputs within
bf16 tolerance of the replicated kernel's output (relative L2 error per request).

Kernels: ``deep_gemm.fp8_paged_mqa_logits`` (indexer); attention ``sgl_kernel.flash_mla.flash_mla_with_kvcache``
with ``indices`` (``flashmla_kv``), ``sgl_kernel.flash_mla.flash_mla_sparse_fwd`` (``flashmla_sparse``),
sglang's fa3 ``flash_attn_with_kvcache`` (``fa3``); ``sgl_kernel.fast_topk_v2`` (sglang's top-k).
deep_gemm and FlashMLA are used when they import on CUDA and otherwise replaced by their torch
reference (``sglang_cp_shared_kv_testing/nsa_decode_reference.py``), with the reason printed; fa3 cases are SKIPPED,
with the reason printed, when fa3 does not run (its kernel library is not always installed).
``--device cpu`` uses the references.

``--plant`` plants one bug; the check must then FAIL:
  drop-partial   the last rank's partial is left out of the merge
  lse-base       the kernel's LSE is taken in the other base (natural <-> 2)
  wrong-owner    every rank attends the selected candidates of the next rank's share

``--sync-debug``: the hooked part counts every host wait for the GPU in its decode steps
(``torch.cuda.set_sync_debug_mode``, ``sglang_cp_shared_kv_testing/cuda_sync_counter.py``); the plugin's own count must be
0 (``no_syncs_of_ours``); gloo's host staging of the exchanges is exempted as deliberate.

GPU (after the staging in docs/gpu.md; about 2 minutes, most of it process start-up):
    source scripts/gpu/remote_env.sh && python scripts/gpu/check_cp_per_owner_decode.py [--sync-debug]
CPU:
    python scripts/gpu/check_cp_per_owner_decode.py --device cpu
Prints one line per cp size and ``check: N passed, M failed``; exits non-zero unless all passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

from sglang_cp_shared_kv_testing.nsa_decode_kernel_calls import DECODE_IMPLS, KV_DTYPE_OF_IMPL

PLANTS = ("none", "drop-partial", "lse-base", "wrong-owner")
# Natural-log LSE of a kernel vs the float32 reference, per KV dtype. fp8: FlashMLA's fp8 decode
# scores dequantized rows with its own rounding; its LSE was up to 2.6e-2 off at cp 4/8 on an H200
# (bf16: 1.7e-5) while the merged outputs stayed within 4.6e-3. A wrong base is off by 4 or more.
LSE_TOL = {"fp8": 6e-2, "bf16": 2e-2}
HEADS = 64
INDEX_HEADS = 32
PAGE = 64
TOPK = 2048
REL_TOL = 2e-2  # bf16 outputs: relative L2 error per request


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--cp-sizes", default="2,4,8", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument(
        "--seq-lens",
        default="6000,2048,700,3001",
        type=lambda s: [int(x) for x in s.split(",")],
        help="real requests (tokens); a padded request is appended",
    )
    parser.add_argument(
        "--hooked-cp-sizes",
        default="2,4",
        type=lambda s: [int(x) for x in s.split(",") if x],
        help="also run one decode layer through sglang's own decode methods with our hooks, as "
        "gloo ranks (processes) sharing the device; '' skips it",
    )
    parser.add_argument(
        "--decode-impls",
        default=",".join(DECODE_IMPLS),
        type=lambda s: [x for x in s.split(",") if x],
        help="NSA decode impls to check (flashmla_kv: fp8 KV; flashmla_sparse, fa3: bf16 KV)",
    )
    parser.add_argument("--plant", choices=PLANTS, default="none")
    parser.add_argument(
        "--sync-debug", action="store_true",
        help="hooked part: count host waits for the GPU in every decode step; ours must be 0",
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


# ---- kernels: the real ones where they import, else torch references ----


class Kernels:
    """The indexer, per-impl attention (None: not run here) and (optional, None) sglang top-k
    callables, and what each one is. ``attention[impl](q, rows, indices, sm_scale, seq_lens)`` ->
    (out [B, H, 512], LSE [B, H] in the kernel's base); ``rows`` as the impl's pool stores them."""

    def __init__(self, logits, attention: dict, sglang_topk, names: dict, skipped: dict):
        self.logits, self.attention, self.sglang_topk = logits, attention, sglang_topk
        self.names, self.skipped = names, skipped


def _reference_attention():
    from sglang_cp_shared_kv_testing import nsa_decode_kernel_calls as calls
    from sglang_cp_shared_kv_testing import nsa_decode_reference as ref

    def flashmla_kv(q, rows, indices, sm_scale, seq_lens):
        out, lse = ref.sparse_mla_decode_reference(q, ref.kv_rows_as_float(rows), indices, sm_scale)
        return out.to(q.dtype), lse

    def flashmla_sparse(q, rows, indices, sm_scale, seq_lens):
        return calls.flashmla_sparse_call(ref.flash_mla_sparse_fwd_reference, q, rows, indices, sm_scale)

    def fa3(q, rows, indices, sm_scale, seq_lens):
        return calls.fa3_call(ref.fa3_paged_decode_reference, q, rows, indices, sm_scale, seq_lens)

    return {"flashmla_kv": flashmla_kv, "flashmla_sparse": flashmla_sparse, "fa3": fa3}


def pick_kernels(device: str, decode_impls=DECODE_IMPLS) -> Kernels:
    from sglang_cp_shared_kv_testing import nsa_decode_reference as ref

    names, skipped = {}, {}

    def ref_logits(q_fp8, weights, pages, block_table, seq_lens):
        return ref.paged_mqa_logits_reference(q_fp8, weights, pages, block_table, seq_lens, PAGE)

    logits, attention, sglang_topk = ref_logits, _reference_attention(), None
    attention = {impl: attention[impl] for impl in decode_impls}
    if device != "cuda":
        names = {"indexer": "torch reference (cpu)", "attention": "torch references (cpu)",
                 "sglang top-k": "skipped (cpu)"}
        return Kernels(logits, attention, None, names, skipped)
    try:
        import deep_gemm

        def logits(q_fp8, weights, pages, block_table, seq_lens):
            lens = seq_lens.to(torch_int32())
            schedule = deep_gemm.get_paged_mqa_logits_metadata(lens, PAGE, deep_gemm.get_num_sms())
            return deep_gemm.fp8_paged_mqa_logits(
                q_fp8.unsqueeze(1),
                pages.view(pages.shape[0], PAGE, 1, -1),
                weights,
                lens,
                block_table.to(torch_int32()).contiguous(),
                schedule,
                block_table.shape[1] * PAGE,
                clean_logits=False,
            )

        names["indexer"] = "deep_gemm.fp8_paged_mqa_logits"
    except Exception as error:  # noqa: BLE001  (any import failure: report and fall back)
        names["indexer"] = f"torch reference (deep_gemm not importable: {error!r})"
    try:
        from sgl_kernel.flash_mla import (
            flash_mla_sparse_fwd,
            flash_mla_with_kvcache,
            get_mla_metadata,
        )

        from sglang_cp_shared_kv_testing import nsa_decode_kernel_calls as calls

        def flashmla_kv(q, rows, indices, sm_scale, seq_lens):
            cache_seqlens = seq_lens.clamp(max=TOPK).to(torch_int32())
            metadata, splits = get_mla_metadata(cache_seqlens, HEADS, 1, HEADS, True, TOPK)
            return calls.flashmla_kv_call(
                flash_mla_with_kvcache, q, rows, indices, sm_scale, cache_seqlens, metadata, splits
            )

        def flashmla_sparse(q, rows, indices, sm_scale, seq_lens):
            return calls.flashmla_sparse_call(flash_mla_sparse_fwd, q, rows, indices, sm_scale)

        for impl, fn in (("flashmla_kv", flashmla_kv), ("flashmla_sparse", flashmla_sparse)):
            if impl in attention:
                attention[impl] = fn
        names["attention (flashmla)"] = "sgl_kernel.flash_mla (flash_mla_with_kvcache, flash_mla_sparse_fwd)"
    except Exception as error:  # noqa: BLE001
        names["attention (flashmla)"] = f"torch reference (flash_mla not importable: {error!r})"
    if "fa3" in attention:
        from sglang_cp_shared_kv_testing.per_owner_decode_hooked import real_fa3_problem

        problem = real_fa3_problem(device)
        if problem is None:
            from sglang.srt.layers.attention import nsa_backend

            from sglang_cp_shared_kv_testing.nsa_decode_kernel_calls import fa3_call

            attention["fa3"] = lambda q, rows, indices, sm_scale, seq_lens: fa3_call(
                nsa_backend.flash_attn_with_kvcache, q, rows, indices, sm_scale, seq_lens
            )
            names["attention (fa3)"] = "sglang nsa_backend.flash_attn_with_kvcache (fa3)"
        else:
            del attention["fa3"]
            skipped["fa3"] = f"fa3 does not run here: {problem}"
            names["attention (fa3)"] = f"SKIPPED ({problem})"
    try:
        from sgl_kernel import fast_topk_v2

        def sglang_topk(logits, seq_lens):
            return fast_topk_v2(logits.contiguous(), seq_lens.to(torch_int32()), TOPK)

        names["sglang top-k"] = "sgl_kernel.fast_topk_v2"
    except Exception as error:  # noqa: BLE001
        names["sglang top-k"] = f"skipped (not importable: {error!r})"
    return Kernels(logits, attention, sglang_topk, names, skipped)


def torch_int32():
    import torch

    return torch.int32


# ---- one cp size ----


def build_pool(generator, batch, device, kv_dtype="fp8"):
    """Replicated pool: KV rows (fp8 [rows, 656] uint8 or bf16 [rows, 576]) and indexer pages
    [pages, 64 * 132], with exact score ties planted (indexer rows copied between pages of one
    request)."""
    import torch

    from sglang_cp_shared_kv_testing import nsa_decode_reference as ref

    rows = batch.logical_pages * PAGE
    kv = torch.randn(rows, 576, generator=generator).to(torch.bfloat16)
    index_k = torch.randn(rows, 128, generator=generator).to(torch.float8_e4m3fn)
    index_scale = torch.rand(rows, generator=generator) + 0.5
    locs = batch.token_locs().cpu()
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        if seq_len < 2 * PAGE:
            continue
        src = torch.randint(0, seq_len - PAGE, (64,), generator=generator)
        dst = (src + PAGE * torch.randint(1, max(2, (seq_len - 1) // PAGE), (64,), generator=generator))
        dst = dst.clamp(max=seq_len - 1)
        k_bytes = index_k.view(torch.uint8)
        k_bytes[locs[b, dst]] = k_bytes[locs[b, src]]
        index_scale[locs[b, dst]] = index_scale[locs[b, src]]
    return (
        ref.fp8_kv_rows(kv.to(device)) if kv_dtype == "fp8" else kv.to(device),
        ref.index_pages(index_k.to(device), index_scale.to(device), PAGE),
    )


def run_case(args, cp_size: int, kernels: Kernels, decode_impl: str = "flashmla_kv") -> dict:
    import torch

    from sglang_cp_shared_kv.model_executor.per_owner_decode.decode_forward import (
        SERVED_DECODE_IMPLS,
    )
    from sglang_cp_shared_kv_testing import nsa_decode_reference as ref

    from sglang_cp_shared_kv.model_executor.per_owner_decode import attention_lse_merge as merge
    from sglang_cp_shared_kv.model_executor.per_owner_decode.decode_topk_merge import owned_attention_indices
    from sglang_cp_shared_kv_testing.decode_topk_reference import (
        replicated_topk_positions,
        same_selection_up_to_ties,
    )
    from sglang_cp_shared_kv_testing.per_owner_decode_cases import per_owner_topk, random_batch

    device = args.device
    g = torch.Generator().manual_seed(args.seed * 100 + cp_size)
    seq_lens = list(args.seq_lens) + [1]
    real = torch.tensor([True] * len(args.seq_lens) + [False], device=device)
    batch = random_batch(g, cp_size, PAGE, seq_lens, [False] * len(args.seq_lens) + [True], device)
    kv_dtype = KV_DTYPE_OF_IMPL[decode_impl]
    attention = kernels.attention[decode_impl]
    kv_rows, index_pool = build_pool(g, batch, device, kv_dtype)
    b = len(seq_lens)
    q_index = torch.randn(b, INDEX_HEADS, 128, generator=g).to(device).to(torch.float8_e4m3fn)
    weights = (torch.rand(b, INDEX_HEADS, generator=g) * 0.1).to(device)
    q = (torch.randn(b, HEADS, 576, generator=g) * 3.0).to(device).to(torch.bfloat16)
    sm_scale = 576**-0.5

    # Replicated pool.
    logits_rep = kernels.logits(q_index, weights, index_pool, batch.page_table, batch.seq_lens)
    logits_rep = logits_rep.float()
    positions_rep = replicated_topk_positions(logits_rep, batch.seq_lens, TOPK)
    locs_rep = torch.where(
        positions_rep >= 0, batch.token_locs().gather(1, positions_rep.clamp(min=0).long()), -1
    )
    out_rep, _ = attention(q, kv_rows, locs_rep, sm_scale, batch.seq_lens)

    # Per owner.
    def shard(rank):
        physical = torch.arange(batch.physical_pages, device=device)
        pages = batch.layout(rank).logical_page_of(physical)
        rows = batch.shard_rows(rank)
        return index_pool[pages], kv_rows[rows]

    shards = [shard(r) for r in range(cp_size)]

    def local_logits(rank, tables):
        return kernels.logits(
            q_index, weights, shards[rank][0], tables.physical_page_table, tables.owned_seq_lens
        ).float()

    ranks = per_owner_topk(batch, local_logits, TOPK)
    base = SERVED_DECODE_IMPLS[decode_impl]
    wrong_base = 2.0 if base == math.e else math.e
    outs, lses, lse_err = [], [], 0.0
    for rank_id, rank in enumerate(ranks):
        indices = rank.attention_indices
        if args.plant == "wrong-owner":  # the selection's owners shifted by one rank
            indices = owned_attention_indices(rank.selection, rank.candidates, (rank_id + 1) % cp_size)
            rank = dataclasses.replace(rank, attention_indices=indices)
            ranks[rank_id] = rank
        out_r, lse_r = attention(q, shards[rank_id][1], indices, sm_scale, batch.seq_lens)
        lse_r = merge.natural_lse(lse_r, base=wrong_base if args.plant == "lse-base" else base)
        rows_float = shards[rank_id][1]
        rows_float = ref.kv_rows_as_float(rows_float) if kv_dtype == "fp8" else rows_float.float()
        _, lse_want = ref.sparse_mla_decode_reference(q.float(), rows_float, indices, sm_scale)
        finite = torch.isfinite(lse_want) & real[:, None]
        if bool((torch.isfinite(lse_r) != torch.isfinite(lse_want))[real].any()):
            lse_err = float("inf")  # an empty partial read as a real one, or the reverse
        elif bool(finite.any()):
            lse_err = max(lse_err, float((lse_r - lse_want)[finite].abs().max()))
        if args.plant == "drop-partial" and rank_id == cp_size - 1:
            lse_r = torch.full_like(lse_r, float("-inf"))
        outs.append(out_r)
        lses.append(lse_r)
    lse_all = merge.global_lse(torch.stack(lses))
    merged = torch.zeros_like(outs[0])
    for out_r, lse_r in zip(outs, lses):  # the bf16 sum all-reduce, rank by rank
        merged = merged + merge.scaled_partial(out_r, lse_r, lse_all).to(out_r.dtype)
    gathered = torch.stack([merge.pack_partial(out_r, lse_r) for out_r, lse_r in zip(outs, lses)])
    merged_gather = merge.merge_gathered(gathered, outs[0].shape[-1])

    # Compare.
    selection = ranks[0].positions
    same_on_ranks = all(torch.equal(r.positions, selection) for r in ranks)
    ours_sorted = selection.sort(dim=1, descending=True).values[:, :TOPK]
    exact = (ours_sorted == positions_rep.sort(dim=1, descending=True).values).all(dim=1) & real
    ties_ok = same_selection_up_to_ties(selection, positions_rep, logits_rep, batch.seq_lens, TOPK)
    union_ok = []
    for row in range(b):
        if not bool(real[row]):
            continue
        attended = []
        for rank_id, rank in enumerate(ranks):
            idx = rank.attention_indices[row]
            attended += batch.shard_rows(rank_id)[idx[idx >= 0].long()].tolist()
        expected = locs_rep[row][locs_rep[row] >= 0].tolist()
        union_ok.append(sorted(attended) == sorted(expected))
    result = {
        "cp_size": cp_size,
        "decode_impl": decode_impl,
        "lse_err": lse_err,
        "requests": int(real.sum()),
        "same_on_ranks": same_on_ranks,
        "exact": int(exact.sum()),
        "ties_ok": int((ties_ok & real).sum()),
        "union_ok": sum(union_ok),
        "nan": int(merged.isnan().any()) + int(merged_gather.isnan().any()),
        "rel_err": _rel_err(merged, out_rep, real),
        "rel_err_gather_form": _rel_err(merged_gather, out_rep, real),
        "empty_lse": _empty_partial_lse(lses, ranks),
    }
    if kernels.sglang_topk is not None:
        theirs = kernels.sglang_topk(logits_rep, batch.seq_lens)
        agree = same_selection_up_to_ties(positions_rep, theirs, logits_rep, batch.seq_lens, TOPK)
        result["sglang_ties_ok"] = int((agree & real).sum())
    n = result["requests"]
    result["passed"] = (
        same_on_ranks
        and result["ties_ok"] == n
        and result["union_ok"] == n
        and result["nan"] == 0
        and result["rel_err"] <= REL_TOL
        and result["rel_err_gather_form"] <= REL_TOL
        and result["lse_err"] <= LSE_TOL[kv_dtype]
        and result.get("sglang_ties_ok", n) == n
    )
    return result


def _rel_err(out, ref, real) -> float:
    diff = (out.float() - ref.float())[real].flatten(1).norm(dim=1)
    return float((diff / ref.float()[real].flatten(1).norm(dim=1).clamp_min(1e-12)).max())


def _empty_partial_lse(lses, ranks) -> str:
    """What the attention kernel returned as LSE for a (token, rank) with no owned selected rows."""
    for lse_r, rank in zip(lses, ranks):
        empty = (rank.attention_indices < 0).all(dim=1)
        if bool(empty.any()):
            return str(float(lse_r[empty][0, 0]))
    return "n/a"


def hooked_scenario(args, decode_impl: str):
    """The scenario the hooked section runs: the given requests, one of a single page (a rank owns
    none of its rows) and a padded one; a top-k layer, a ``skip_topk`` layer, a top-k layer; two
    decode steps."""
    from sglang_cp_shared_kv_testing.per_owner_decode_hooked import Scenario

    return Scenario(
        seq_lens=tuple(args.seq_lens) + (40,), topk=TOPK, kv_dtype=KV_DTYPE_OF_IMPL[decode_impl],
        decode_impl=decode_impl, padded=1, layers=("topk", "skip", "topk"), steps=2, seed=args.seed,
        sync_debug=args.sync_debug,
    )


def run_hooked_case(args, cp_size: int, kernels: Kernels) -> dict:
    """Decode steps through sglang's ``get_indexer_metadata``, ``Indexer._get_topk_paged`` and
    ``forward_decode`` (store, ``get_key_buffer``, the impl's kernel) with our hooks, on ``cp_size``
    gloo ranks, for each checked decode impl, against the replicated pool (this process's
    kernels). Returns {impl: passed}."""
    from sglang_cp_shared_kv_testing import per_owner_decode_hooked as hooked

    impls = [impl for impl in args.decode_impls if impl in kernels.attention]
    start = time.monotonic()
    scenarios = [hooked_scenario(args, impl) for impl in impls]

    def attention_fn(impl):
        def attend(q, rows, locs, sm_scale, seq_lens, kv_dtype):
            return kernels.attention[impl](q, rows, locs, sm_scale, seq_lens)

        return attend

    per_rank = hooked.run_ranks_for(cp_size, scenarios, args.device, timeout_s=600)
    verdicts = {}
    for i, (impl, scenario) in enumerate(zip(impls, scenarios)):
        results = [rank_results[i] for rank_results in per_rank]
        case = hooked.make_case(cp_size, scenario, args.device)
        expected = hooked.replicated_reference(
            case, results, logits_fn=kernels.logits, attention_fn=attention_fn(impl)
        )
        comparison = hooked.compare(case, results, expected, REL_TOL)
        ok = hooked.passed(comparison)
        kernels_used = ", ".join(f"{k}: {v}" for k, v in results[0]["kernels"].items())
        flags = " ".join(f"{k}={v}" for k, v in comparison.items() if k != "rel_err")
        empty = sum(r["empty_partials"] for r in results)
        if scenario.sync_debug:
            syncs = {k: sum(r["syncs"][k] for r in results) for k in results[0]["syncs"]}
            sites = sorted({site for r in results for site in r["our_sync_sites"]})
            print(f"hooked cp={cp_size} {impl} syncs (all ranks, all steps): {syncs}; ours at: {sites or 'none'}")
        print(
            f"hooked cp={cp_size} {impl} ({kernels_used}) {flags} empty partials={empty} "
            f"max rel err={comparison['rel_err']:.2e} {'PASS' if ok else 'FAIL'}",
            flush=True,
        )
        verdicts[impl] = ok
    print(f"hooked cp={cp_size}: [{time.monotonic() - start:.1f}s]", flush=True)
    return verdicts


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; use --device cpu")
        return 2
    unknown = [impl for impl in args.decode_impls if impl not in DECODE_IMPLS]
    if unknown:
        print(f"unknown --decode-impls {unknown}; choose from {DECODE_IMPLS}")
        return 2
    kernels = pick_kernels(args.device, args.decode_impls)
    for role, name in kernels.names.items():
        print(f"{role}: {name}")
    for impl, reason in kernels.skipped.items():
        print(f"SKIPPED {impl}: {reason}")
    print(f"plant: {args.plant}")
    passed = failed = 0
    for cp_size in args.cp_sizes:
        for impl in args.decode_impls:
            if impl not in kernels.attention:
                continue
            start = time.monotonic()
            result = run_case(args, cp_size, kernels, impl)
            elapsed = time.monotonic() - start
            verdict = "PASS" if result["passed"] else "FAIL"
            n = result["requests"]
            print(
                f"cp={cp_size} {impl} requests={n} selection: same on ranks={result['same_on_ranks']} "
                f"exact={result['exact']}/{n} up-to-ties={result['ties_ok']}/{n} "
                f"attended rows={result['union_ok']}/{n} "
                + (f"sglang top-k up-to-ties={result['sglang_ties_ok']}/{n} " if "sglang_ties_ok" in result else "")
                + f"max rel err={result['rel_err']:.2e} (all-gather form {result['rel_err_gather_form']:.2e}, "
                f"tol {REL_TOL:.0e}) lse err={result['lse_err']:.1e} (tol {LSE_TOL[KV_DTYPE_OF_IMPL[result['decode_impl']]]:.0e}) "
                f"nan={result['nan']} empty-partial lse={result['empty_lse']} [{elapsed:.1f}s] {verdict}",
                flush=True,
            )
            passed += result["passed"]
            failed += not result["passed"]
    if args.plant == "none":  # the plants live in this process's emulation only
        for cp_size in args.hooked_cp_sizes:
            for ok in run_hooked_case(args, cp_size, kernels).values():
                passed += ok
                failed += not ok
    print(f"check: {passed} passed, {failed} failed, {len(kernels.skipped)} impls skipped")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
