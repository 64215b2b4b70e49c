"""Capture per-owner NSA decode in a CUDA graph and replay it with new contents, on ONE GPU.

CP ranks are emulated in one process (``sglang_cp_shared_kv_testing/per_owner_decode_graph_emulation.py``): each rank's
shard and static owner tables (``OwnerTableBuffers``, the buffers the server's graphs read) live
side by side and the exchanges are device ops inside the graph (NCCL cannot put two ranks on one
GPU, gloo cannot be captured). Per decode impl (``--decode-impls``, default all three served per
owner) and cp size:

1. load batch A into the static inputs, refresh the owner tables (the replay metadata hook's job),
   capture one graph of the whole layer (every rank's indexer, local top-k, global selection,
   attention, LSE merge), replay it;
2. load batch B (other lengths, pages and contents; same batch size), refresh, replay.

Each merge form per-owner decode runs is captured (``--merge-forms``, default both): the one
exchange (every rank's partial and LSE packed, gathered, merged by ``merge_gathered``: the fused
kernel on CUDA) and the scaled sum. A one-exchange replay is also compared with the same layer run
eagerly, fresh, with the scaled sum (today's merge before the one exchange; ``FRESH_TOL``).

Each impl uses its KV row format and its attention call as the runtime makes it
(``sglang_cp_shared_kv_testing/nsa_decode_kernel_calls.py``), with the LSE read in the base per-owner decode declares
for it (``per_owner_decode.SERVED_DECODE_IMPLS``):

* ``flashmla_kv``: fp8 656-byte rows, ``flash_mla_with_kvcache`` with ``indices``, natural LSE;
* ``flashmla_sparse``: bf16 576-wide rows, ``flash_mla_sparse_fwd``, base-2 LSE;
* ``fa3``: bf16 rows, ``flash_attn_with_kvcache`` over the owned indices compacted to the front
  (``compact_owned_indices``, inside the graph) with their count as ``cache_seqlens``, natural LSE.

Each replay is compared with the same layer run eagerly from tables built fresh from the batch
(same kernels, same inputs, up to the order in which the attention sums the selected rows: 1e-2
relative L2, see ``FRESH_TOL``) and with the
replicated pool (selection equal up to ties, outputs within 2e-2 relative L2, bf16).

``--plant stale-tables`` leaves rank 1's owner tables unrefreshed before the second replay (a
static buffer not refreshed on replay); the check must then FAIL on batch B, for every impl.

Then (``--hooked-cp-sizes``, default 2) one decode layer per impl runs through sglang's own decode
methods with our hooks, on gloo ranks sharing the device (``sglang_cp_shared_kv_testing/per_owner_decode_hooked.py``),
through the decode-graph hooks: owner tables built at "capture" from capture-time contents, the
batch copied into the backend's static metadata, the replay hook's refresh, the layer over the
static tables (not captured: gloo cannot be). It must match the replicated pool, and must NOT once
the refresh is left out (``graph-stale``, run in the same go as a built-in plant).

Kernels on CUDA (no fallback): ``deep_gemm.fp8_paged_mqa_logits`` with its schedule (refreshed
outside the graph, as sglang does), ``sgl_kernel.flash_mla`` (``flash_mla_with_kvcache`` with its
tile metadata, refreshed likewise; ``flash_mla_sparse_fwd``) and sglang's fa3
``flash_attn_with_kvcache``. fa3's kernel library is not always installed: where it does not run,
the fa3 cases are SKIPPED with the reason printed and counted in the summary. Torch references on
CPU (``--device cpu``), where no graph exists and a "replay" re-runs the layer over the static
buffers, which still shows a stale buffer.

GPU:  python scripts/gpu/check_per_owner_decode_graphs.py
CPU:  python scripts/gpu/check_per_owner_decode_graphs.py --device cpu
Prints one line per (impl, cp size, batch) and per hooked (impl, mode), then
``check: N passed, M failed, K impls skipped``; exit 0 only if all passed and something ran.
"""

from __future__ import annotations

import argparse
import sys
import time

from sglang_cp_shared_kv_testing.nsa_decode_kernel_calls import DECODE_IMPLS

PLANTS = ("none", "stale-tables")
MERGE_FORMS = ("all_gather", "scaled_sum")  # attention_lse_merge.ONE_EXCHANGE, SCALED_SUM
HEADS = 64
TOPK = 2048
# Replay vs the same layer run eagerly on fresh tables: sglang's radix top-k returns its columns in
# an order that varies from run to run, so the attention sums the same rows in another order (bf16
# roundings, measured 1.1e-3); a stale static buffer gives about 1.
FRESH_TOL = 1e-2
REL_TOL = 2e-2
# Batch A and B: same batch size (one graph), different lengths; then --padded-rows padded requests
# (length 0 here: sglang's seq len 1 on the dummy page, which no rank owns).
SEQ_LENS_A = (6000, 2048, 700, 3001)
SEQ_LENS_B = (9100, 130, 2500, 4097)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--cp-sizes", default="2,4,8", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument(
        "--decode-impls",
        default=",".join(DECODE_IMPLS),
        type=lambda s: [x for x in s.split(",") if x],
        help="NSA decode impls to capture (flashmla_kv: fp8 KV; flashmla_sparse, fa3: bf16 KV)",
    )
    parser.add_argument(
        "--merge-forms",
        default="all_gather,scaled_sum",
        type=lambda s: [x for x in s.split(",") if x],
        help="merge forms to capture (all_gather: one exchange; scaled_sum: two)",
    )
    parser.add_argument("--plant", choices=PLANTS, default="none")
    parser.add_argument(
        "--hooked-cp-sizes",
        default="2",
        type=lambda s: [int(x) for x in s.split(",") if x],
        help="also run one decode layer through sglang's methods and the decode-graph hooks on gloo "
        "ranks sharing the device; '' skips it",
    )
    parser.add_argument(
        "--padded-rows", type=int, default=1,
        help="padded requests in each batch (a served replay of batch 6 in the graph of 8 has 2; "
        "with CUDA_LAUNCH_BLOCKING=1 a kernel faulting in the eager warm-up is named)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.padded_rows < 0:
        parser.error("--padded-rows must be >= 0")
    return args


def cuda_kernels(decode_impls=DECODE_IMPLS):
    """The real kernels, graph-ready: the indexer schedule and FlashMLA's tile metadata are separate
    calls (refreshed outside the graph). fa3 is skipped, with the reason, where it does not run."""
    import deep_gemm
    import torch
    from sgl_kernel.flash_mla import flash_mla_sparse_fwd, flash_mla_with_kvcache, get_mla_metadata

    from sglang_cp_shared_kv_testing import nsa_decode_kernel_calls as calls
    from sglang_cp_shared_kv_testing.per_owner_decode_graph_emulation import (
        PAGE,
        GraphKernels,
        ImplAttention,
    )
    from sglang_cp_shared_kv_testing.per_owner_decode_hooked import real_fa3_problem

    num_sms = deep_gemm.get_num_sms()

    def schedule(lens):
        return deep_gemm.get_paged_mqa_logits_metadata(lens.to(torch.int32), PAGE, num_sms)

    def logits(q_fp8, weights, pages, block_table, lens, sched):
        return deep_gemm.fp8_paged_mqa_logits(
            q_fp8.unsqueeze(1), pages.view(pages.shape[0], PAGE, 1, -1), weights,
            lens.to(torch.int32), block_table.to(torch.int32).contiguous(), sched,
            block_table.shape[1] * PAGE, clean_logits=False,
        )

    def flashmla_kv(q, rows, indices, sm_scale, lens, metadata):
        return calls.flashmla_kv_call(flash_mla_with_kvcache, q, rows, indices, sm_scale, lens, *metadata)

    def flashmla_sparse(q, rows, indices, sm_scale, lens, metadata):
        return calls.flashmla_sparse_call(flash_mla_sparse_fwd, q, rows, indices, sm_scale)

    available = {
        "flashmla_kv": ImplAttention(lambda lens: get_mla_metadata(lens, HEADS, 1, HEADS, True, TOPK), flashmla_kv),
        "flashmla_sparse": ImplAttention(lambda lens: None, flashmla_sparse),
    }
    names = {"indexer": "deep_gemm.fp8_paged_mqa_logits",
             "attention (flashmla_kv)": "sgl_kernel.flash_mla.flash_mla_with_kvcache (sparse, fp8 KV)",
             "attention (flashmla_sparse)": "sgl_kernel.flash_mla.flash_mla_sparse_fwd (bf16 KV)"}
    skipped = {}
    if "fa3" in decode_impls:
        problem = real_fa3_problem("cuda")
        if problem is None:
            from sglang.srt.layers.attention import nsa_backend

            def fa3(q, rows, indices, sm_scale, lens, metadata):
                return calls.fa3_call(nsa_backend.flash_attn_with_kvcache, q, rows, indices, sm_scale, lens)

            available["fa3"] = ImplAttention(lambda lens: None, fa3)
            names["attention (fa3)"] = "sglang nsa_backend.flash_attn_with_kvcache (fa3, bf16 KV)"
        else:
            skipped["fa3"] = f"fa3 does not run here: {problem}"
            names["attention (fa3)"] = f"SKIPPED ({problem})"
    attention = {impl: available[impl] for impl in decode_impls if impl in available}
    return GraphKernels(logits, schedule, attention, names, skipped)


def run_cp(args, cp_size, kernels, decode_impl="flashmla_kv", merge_form="all_gather") -> list:
    """[batch A passed, batch B passed] of ``decode_impl`` at ``cp_size``, merged in ``merge_form``."""
    import torch

    from sglang_cp_shared_kv_testing import cpu_graph_recorder
    from sglang_cp_shared_kv_testing import per_owner_decode_graph_emulation as emu
    from sglang_cp_shared_kv_testing.decode_topk_reference import same_selection_up_to_ties

    device = args.device
    g = torch.Generator().manual_seed(args.seed * 100 + cp_size)
    padded = (0,) * args.padded_rows
    seq_lens_a, seq_lens_b = SEQ_LENS_A + padded, SEQ_LENS_B + padded
    width_pages = -(-max(seq_lens_a + seq_lens_b) // emu.PAGE) + 8
    needed = sum(-(-s // emu.PAGE) for s in seq_lens_a + seq_lens_b)
    physical_pages = 2 + -(-needed // cp_size)
    layer = emu.EmulatedDecodeLayer(cp_size, physical_pages, width_pages, len(seq_lens_a), HEADS,
                                    TOPK, kernels, device, decode_impl, merge_form)
    graph = None
    results = []
    for name, seq_lens in (("A", seq_lens_a), ("B", seq_lens_b)):
        start = time.monotonic()
        batch = emu.random_batch(g, cp_size, physical_pages, width_pages, list(seq_lens), HEADS, device,
                                 layer.kv_dtype)
        layer.load(batch)
        stale = (1,) if args.plant == "stale-tables" and name == "B" else ()
        layer.refresh(skip_ranks=stale)
        if device == "cuda":
            if graph is None:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    layer.step()  # warm-up outside the capture (lazy inits)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_out = layer.step()
            graph.replay()
            out = static_out.clone()
            mode = "graph replay"
        else:
            # CUDA graph semantics on CPU: the captured run's ops replayed on the same tensors.
            if graph is None:
                layer.step()  # warm-up outside the capture, as on CUDA
                graph = cpu_graph_recorder.RecordedRun()
                with graph:
                    static_out = layer.step()
            graph.replay()
            out = static_out.clone()
            mode = "recorded run replayed (cpu)"
        fresh = layer.fresh_step()
        expected, positions_rep = layer.replicated(batch)
        real = torch.tensor([s > 0 for s in seq_lens], device=out.device)
        selection = layer.selection()
        logits_rep = kernels.logits(batch.q_index, batch.weights, batch.index_pages,
                                    batch.page_table, batch.seq_lens,
                                    kernels.schedule(batch.seq_lens)).float()
        ties = same_selection_up_to_ties(selection, positions_rep, logits_rep, batch.seq_lens.long(), TOPK)
        err_fresh = emu.rel_err(out, fresh, real)
        err_rep = emu.rel_err(out, expected, real)
        # The one exchange against today's merge (the scaled sum), same layer, fresh and eager.
        err_today = emu.rel_err(out, layer.fresh_step("scaled_sum"), real) if merge_form == "all_gather" else 0.0
        nan = bool(out.isnan().any())
        padded_max = float(out[~real].float().abs().max()) if bool((~real).any()) else 0.0
        ok = (err_fresh <= FRESH_TOL and err_rep <= REL_TOL and err_today <= FRESH_TOL
              and bool(ties[real].all()) and not nan)
        results.append(ok)
        if device == "cuda":
            torch.cuda.synchronize()
        print(
            f"cp={cp_size} {decode_impl} {merge_form} batch {name} ({mode}): vs fresh tables rel "
            f"err={err_fresh:.2e} (tol {FRESH_TOL:.0e}), vs replicated rel err={err_rep:.2e} (tol {REL_TOL:.0e}), "
            f"{f'vs the scaled sum rel err={err_today:.2e}, ' if merge_form == 'all_gather' else ''}"
            f"selection up to ties {int(ties[real].sum())}/{int(real.sum())}, nan={nan}, "
            f"padded rows max |out|={padded_max:.3g}"
            f"{' [rank 1 tables not refreshed]' if stale else ''} "
            f"[{time.monotonic() - start:.1f}s] {'PASS' if ok else 'FAIL'}",
            flush=True,
        )
    return results


HOOKED_SEQ_LENS = (6000, 2048, 700, 3001)


def run_hooked(args, cp_size, kernels) -> list:
    """Per checked impl: (graph-replay passes, graph-stale fails) through sglang's decode methods
    and our hooks, every scenario on the same ``cp_size`` gloo ranks (one start-up)."""
    import torch

    from sglang_cp_shared_kv_testing import per_owner_decode_hooked as hooked
    from sglang_cp_shared_kv_testing.nsa_decode_kernel_calls import KV_DTYPE_OF_IMPL

    start = time.monotonic()
    cases = [(impl, mode, should_pass)
             for impl in args.decode_impls if impl in kernels.attention
             for mode, should_pass in (("graph-replay", True), ("graph-stale", False))]
    scenarios = [
        hooked.Scenario(seq_lens=HOOKED_SEQ_LENS, topk=TOPK, graph=mode, decode_impl=impl,
                        kv_dtype=KV_DTYPE_OF_IMPL[impl], padded=args.padded_rows)
        for impl, mode, _ in cases
    ]

    # The replicated selection from this process's indexer kernel (the ranks run the same one):
    # torch reference scores would differ from deep_gemm's in the last bits and move ties.
    def logits_fn(q_index, weights, index_pages, page_table, seq_lens):
        lens = seq_lens.to(torch.int32)
        return kernels.logits(q_index, weights, index_pages, page_table, lens, kernels.schedule(lens))

    outcomes = hooked.run_scenarios(cp_size, scenarios, args.device, REL_TOL, logits_fn=logits_fn)
    verdicts = []
    for (impl, mode, should_pass), (results, comparison) in zip(cases, outcomes):
        ok = hooked.passed(comparison) == should_pass
        if not ok:
            print(f"hooked cp={cp_size} {impl} {mode}: {comparison}", flush=True)
        role = "attention (fa3)" if impl == "fa3" else "attention (flashmla)"
        kernels_used = ", ".join(f"{k}: {v}" for k, v in results[0]["kernels"].items() if k in ("indexer", role))
        print(
            f"hooked cp={cp_size} {impl} {mode} ({kernels_used}): max rel err={comparison['rel_err']:.2e}, "
            f"padded rows zero={comparison['padded_rows_zero']}, finite={comparison['finite']}, "
            f"{'passes' if hooked.passed(comparison) else 'fails'} (must "
            f"{'pass' if should_pass else 'fail'}) {'PASS' if ok else 'FAIL'}",
            flush=True,
        )
        verdicts.append(ok)
    print(f"hooked cp={cp_size}: [{time.monotonic() - start:.1f}s]", flush=True)
    return verdicts


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from sglang_cp_shared_kv_testing import per_owner_decode_graph_emulation as emu

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; use --device cpu")
        return 2
    unknown = [impl for impl in args.decode_impls if impl not in DECODE_IMPLS]
    if unknown or not args.decode_impls:
        print(f"--decode-impls {args.decode_impls}: choose one or more of {DECODE_IMPLS}")
        return 2
    if not args.merge_forms or any(form not in MERGE_FORMS for form in args.merge_forms):
        print(f"--merge-forms {args.merge_forms}: choose one or more of {MERGE_FORMS}")
        return 2
    if args.device == "cuda":
        kernels = cuda_kernels(args.decode_impls)
    else:
        kernels = emu.reference_kernels(args.decode_impls)
    for role, name in kernels.names.items():
        print(f"{role}: {name}")
    for impl, reason in kernels.skipped.items():
        print(f"SKIPPED {impl}: {reason}")
    print(f"plant: {args.plant}")
    passed = failed = 0
    for impl in args.decode_impls:
        if impl not in kernels.attention:
            continue
        for cp_size in args.cp_sizes:
            for merge_form in args.merge_forms:
                for ok in run_cp(args, cp_size, kernels, impl, merge_form):
                    passed += ok
                    failed += not ok
    if args.plant == "none":
        for cp_size in args.hooked_cp_sizes:
            for ok in run_hooked(args, cp_size, kernels):
                passed += ok
                failed += not ok
    print(f"check: {passed} passed, {failed} failed, {len(kernels.skipped)} impls skipped")
    # Nothing checked (every impl skipped) is no pass.
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
