"""Check the CP shared KV runtime (owner-filtered writes + peer-page gather) against a replicated pool.

Ranks are processes sharing one device, joined by a gloo group (``multi_rank.launch``; NCCL cannot
put two ranks on one GPU; the runtime stages gloo gathers of CUDA tensors through host memory). Each
rank holds a real ``NSATokenToKVPool`` shard (page 64, bf16 576-wide rows and fp8 656-byte rows) and writes through
sglang's own ``set_mla_kv_buffer`` and ``Indexer._store_index_k_cache`` with our hooks applied, then
reads through the hooked getters what the kernels would read; everything is compared bit for bit
with a replicated pool written by the same sglang code without hooks
(``sglang_cp_shared_kv_testing.runtime_check``: fresh prefill, chunked prefill over a cached prefix
with padding, decode with a padded request).

Each case runs twice: ``serial`` (one scratch slot, each layer gathered after its store) and
``prefetch`` (second slot, layer-ahead gather on a side stream over a second gloo group, 4 layers
of which layer 2 skips the indexer, the cached prefix page loaded back layer by layer as HiCache
does). On CUDA the prefetch run also delays the load-back (a delay kernel on its stream) and the
compute stream before each layer's reads, so a missing stream wait shows up as a mismatch; over
gloo the gather itself is host-side, so the side stream only overlaps the GPU work around it.
With ``--plants`` every planted bug of ``runtime_check.PLANTS`` is run too and must be caught
(mismatches > 0); ``prefetch_without_waiting_for_reads`` needs the CUDA delays (skipped on CPU).

GPU (after the staging in docs/gpu.md):
    source scripts/gpu/remote_env.sh && python scripts/gpu/check_cp_shared_kv_runtime.py
CPU:
    python scripts/gpu/check_cp_shared_kv_runtime.py --device cpu

On CUDA the real kernels run: Triton ``quantize_k_cache_separate`` + ``set_mla_kv_buffer_triton``,
the JIT ``fused_store_index_k_cache`` (the indexer's CUDA branch), Triton ``GetKAndS``. On CPU those
are replaced by the torch stand-ins of ``sglang_cp_shared_kv_testing/nsa_cpu_kernels.py`` and the indexer store takes
sglang's non-CUDA branch (``act_quant`` + ``set_index_k_scale_buffer``).
Prints ``ran``, ``rows compared``, ``mismatches`` (clean cases) and ``plants caught``; exits
non-zero unless every clean case ran with 0 mismatches and every plant run was caught.

``--draft`` gives every rank an MTP draft pool too (one NextN layer, KV and indexer K, sharded by
the same layout, its own runtime sharing the target's scratch; ``cp_shared_kv_draft_pool``): after
each forward's target layers the draft layer runs on the same batch and mode (EXTEND, DECODE), then an
EAGLE step follows (TARGET_VERIFY of the target, DRAFT_EXTEND of the draft over the accepted tokens),
then the next draft: four fresh requests and the draft's multi-step decode (4 steps, top-k 1: three
step forwards, each on its own plan, ``draft_decode_steps``); the draft's reads and rows are
compared with a replicated draft pool. With ``--plants`` the draft plants
(``runtime_check.DRAFT_PLANTS``: one page of each draft store written by the next rank instead of
its owner; a draft step on the previous step's plan; draft steps planned by the decode rule; draft
steps planning only the committed tokens) run too and must be caught. ``--spec-v2`` (with ``--draft``)
makes the EAGLE step spec v2's: the draft extend is DRAFT_EXTEND_V2 over every draft token the verify
wrote.

``--sync-debug`` runs every forward (the peer-page plan and table remap, every layer's hooked stores,
the prefetch, the hooked getters' reads) under ``torch.cuda.set_sync_debug_mode("warn")`` and
attributes each synchronizing CUDA call to our code, the check's own stand-ins and comparisons, or
stock sglang (``sglang_cp_shared_kv_testing/cuda_sync_counter.py``; the replica's stores are stock sglang). The gloo
transport's host bounce in ``peer_page_gather`` is the test transport (ranks sharing one GPU), not
the NCCL path, and is exempted (counted separately). Prints ``syncs on our path = N``; with
``--sync-debug`` the run fails unless N is 0.
"""

from __future__ import annotations

import argparse
import sys
import time


DRAFT_STEPS = 4  # --speculative-num-steps of the draft's decode steps with --draft (3 step forwards)
READ_DELAY_MS = 40  # compute stream, before each layer's reads (prefetch runs on CUDA)
LOAD_BACK_DELAY_MS = 10  # load stream, before each layer's load-back


def _cases(args):
    """``(cp_size, dtype, mode, plant)`` in the order every rank runs them."""
    cases = [(c, d, m, None) for c in args.cp_sizes for d in args.dtypes for m in ("serial", "prefetch")]
    if args.plants:
        from sglang_cp_shared_kv_testing.runtime_check import PLANTS

        for plant in PLANTS:
            if plant == "prefetch_without_waiting_for_reads" and args.device != "cuda":
                continue
            cases.append((args.cp_sizes[0], args.dtypes[-1], "prefetch", plant))
        if args.draft:
            from sglang_cp_shared_kv_testing.runtime_check import DRAFT_PLANTS

            cases += [(args.cp_sizes[0], args.dtypes[-1], "serial", plant) for plant in DRAFT_PLANTS]
    return cases


def _rank_main(rank, world_size, args):
    """This rank's cases: ``[(case, rank, rows compared, mismatches, prefetch forwards)]``."""
    import torch
    import torch.distributed as dist

    from sglang_cp_shared_kv_testing import runtime_check
    from sglang_cp_shared_kv_testing.nsa_cpu_kernels import act_quant_torch, cpu_kernels

    if args.device == "cuda":
        from sglang.srt.layers.attention.nsa.triton_kernel import act_quant

        torch.cuda.set_device(0)
        kernels = None
    else:
        act_quant, kernels = act_quant_torch, cpu_kernels
    if args.device == "cuda":
        _build_indexer_store_kernel_once(rank)
    runtime_check.apply_hooks()
    # Every process joins every group's creation, in the same order (dist.new_group needs it).
    groups = {c: (dist.new_group(list(range(c))), dist.new_group(list(range(c)))) for c in args.cp_sizes}
    rows = []
    for case in _cases(args):
        cp_size, dtype_name, mode, plant = case
        if rank < cp_size:
            group, prefetch_group = groups[cp_size]
            options = dict(
                seed=args.seed + cp_size, num_layers=args.layers, physical_pages=args.physical_pages,
                draft=args.draft, spec=args.draft, spec_v2=args.spec_v2,
                draft_steps=DRAFT_STEPS if args.draft else 0,
            )  # fmt: skip
            if mode == "serial" and plant is not None:  # a draft plant
                options["plant"] = plant
            if mode == "prefetch":
                delays = args.device == "cuda"
                options.update(
                    prefetch_group=prefetch_group,
                    num_layers=max(args.layers, 4),
                    skip_index_layers=(2,),
                    hicache=True,
                    plant=plant,
                    read_delay_ms=READ_DELAY_MS if delays else 0,
                )
            context = kernels() if kernels is not None else _nothing()
            with context:
                result = runtime_check.run_rank(
                    rank, cp_size, group, device=args.device, dtype_name=dtype_name,
                    act_quant=act_quant, sync_debug=args.sync_debug, **options,
                )
            rows.append((case, rank, result.rows_compared, result.mismatches, result.prefetch_forwards,
                         result.syncs, result.sync_sites, result.exempted_bounces))  # fmt: skip
        dist.barrier()
    return rows


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def _build_indexer_store_kernel_once(rank):
    """Rank 0 JIT-compiles the fused indexer store first, so ranks do not compile it concurrently."""
    import torch
    import torch.distributed as dist

    from sglang.jit_kernel.fused_store_index_cache import can_use_nsa_fused_store

    if rank == 0:
        fused = can_use_nsa_fused_store(torch.bfloat16, torch.int64, 64)
        branch = "fused JIT store" if fused else "act_quant + set_index_k_scale_buffer (JIT unavailable)"
        print(f"indexer K store branch on CUDA: {branch}", flush=True)
    dist.barrier()
    can_use_nsa_fused_store(torch.bfloat16, torch.int64, 64)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--cp-sizes", default="2,4", help="comma list, e.g. 2,4,8")
    parser.add_argument("--dtypes", default="bf16,fp8", help="comma list of bf16, fp8")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--physical-pages", type=int, default=8, help="pages per rank shard")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=int, default=500)
    parser.add_argument("--plants", action="store_true", help="also run every planted bug")
    parser.add_argument(
        "--draft", action="store_true",
        help="every rank also holds an MTP draft pool (one NextN layer) sharded by the same layout, "
        "and the story ends with a target verify and a draft extend",
    )  # fmt: skip
    parser.add_argument(
        "--spec-v2", action="store_true",
        help="with --draft: the EAGLE step's draft extend is spec v2's (DRAFT_EXTEND_V2)",
    )  # fmt: skip
    parser.add_argument(
        "--sync-debug", action="store_true",
        help="count synchronizing CUDA calls on our path during every forward (must be 0)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.spec_v2 and not args.draft:
        parser.error("--spec-v2 needs --draft")
    args.cp_sizes = sorted(int(x) for x in args.cp_sizes.split(","))
    args.dtypes = args.dtypes.split(",")

    from sglang_cp_shared_kv_testing.multi_rank import launch

    start = time.time()
    # One torch thread per CPU rank (ranks share the cores); a hung rank fails the run at the deadline.
    outcomes = launch(
        _rank_main,
        max(args.cp_sizes),
        (args,),
        timeout_s=args.timeout_s,
        deadline_s=args.timeout_s,
        threads_per_rank=1 if args.device == "cpu" else None,
    )
    exit_codes = [outcome.exitcode for outcome in outcomes]
    rows = [row for outcome in outcomes if outcome.ok for row in outcome.value]
    errors_by_rank = {o.rank: repr(o.error) for o in outcomes if o.error is not None}

    cases = _cases(args)
    clean = [c for c in cases if c[3] is None]
    ran = compared = mismatches = caught = 0
    for case in cases:
        cp_size, dtype_name, mode, plant = case
        got = [r for r in rows if r[0] == case]
        errors = [errors_by_rank[r] for r in range(cp_size) if r in errors_by_rank]
        case_ok = len(got) == cp_size and not errors
        case_compared, case_mismatches = sum(r[2] for r in got), sum(r[3] for r in got)
        prefetched = [r[4] for r in got]
        name = f"cp_size={cp_size} dtype={dtype_name} {mode}" + (f" plant={plant}" if plant else "")
        print(
            f"{name} device={args.device}: ranks reported {len(got)}/{cp_size}, rows compared "
            f"{case_compared}, mismatches {case_mismatches}, prefetched forwards per rank "
            f"{prefetched}" + (f", errors {errors}" if errors else "")
        )
        if mode == "prefetch" and case_ok and prefetched != [1] * cp_size:
            print(f"  {name}: the prefetch path did not run")
            case_ok = False
        if plant is None:
            ran += case_ok
            compared += case_compared
            mismatches += case_mismatches
        else:
            caught += case_ok and case_mismatches > 0
    plants = len(cases) - len(clean)
    # A rank reports its rows only when all its cases ran, so a rank that fails loses every case's
    # rows and its error shows on each case above; its traceback says where it failed.
    for outcome in outcomes:
        if outcome.error is not None:
            tail = "\n".join(outcome.traceback.strip().splitlines()[-12:])
            print(f"rank {outcome.rank} failed: {outcome.error!r}; traceback (last lines):\n{tail}")
    print(f"rank exit codes: {exit_codes}; {time.time() - start:.1f} s")
    print(f"ran = {ran}/{len(clean)}")
    print(f"rows compared = {compared}")
    print(f"mismatches = {mismatches}")
    if plants:
        print(f"plants caught = {caught}/{plants}")
    ok = (
        ran == len(clean)
        and mismatches == 0
        and compared > 0
        and caught == plants
        and all(c == 0 for c in exit_codes)
    )
    if args.sync_debug:
        ok = _report_syncs(rows) and ok
    return 0 if ok else 1


def _report_syncs(rows) -> bool:
    """Print the sync counts over every rank and case; True when our path made none."""
    counted = [r for r in rows if r[5] is not None]
    if not counted:
        print("sync debug: no CUDA on this device, nothing counted (the CPU unit test "
              "test_peer_page_plan_no_sync.py covers the plan); syncs on our path = n/a")  # fmt: skip
        return True
    totals = {owner: sum(r[5][owner] for r in counted) for owner in ("ours", "harness", "stock")}
    for site in sorted({site for r in counted for site in r[6]}):
        print(f"  sync at {site}")
    print(f"gloo host bounces exempted (test transport, not on the NCCL path) = {sum(r[7] for r in counted)}")
    print(f"syncs in stock sglang code = {totals['stock']}")
    print(f"syncs in the check's own stand-ins and comparisons = {totals['harness']}")
    print(f"syncs on our path = {totals['ours']}")
    return totals["ours"] == 0


if __name__ == "__main__":
    sys.exit(main())
