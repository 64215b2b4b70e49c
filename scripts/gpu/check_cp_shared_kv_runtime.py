"""Check the CP shared KV runtime (owner-filtered writes + peer-page gather) against a replicated pool.

Ranks are processes sharing one device, joined by a gloo group (``multi_rank.launch``; NCCL cannot
put two ranks on one GPU; the runtime stages gloo gathers of CUDA tensors through host memory). Each
rank holds a real ``NSATokenToKVPool`` shard (page 64, bf16 576-wide rows and fp8 656-byte rows) and writes through
sglang's own ``set_mla_kv_buffer`` and ``Indexer._store_index_k_cache`` with our hooks applied, then
reads through the hooked getters what the kernels would read; everything is compared bit for bit
with a replicated pool written by the same sglang code without hooks
(``sglang_cp_shared_kv.testing.runtime_check``: fresh prefill, chunked prefill over a cached prefix
with padding, decode with a padded request).

GPU (after the staging in docs/gpu.md):
    source scripts/gpu/remote_env.sh && python scripts/gpu/check_cp_shared_kv_runtime.py
CPU:
    python scripts/gpu/check_cp_shared_kv_runtime.py --device cpu

On CUDA the real kernels run: Triton ``quantize_k_cache_separate`` + ``set_mla_kv_buffer_triton``,
the JIT ``fused_store_index_k_cache`` (the indexer's CUDA branch), Triton ``GetKAndS``. On CPU those
are replaced by the torch stand-ins of ``testing/nsa_cpu_kernels.py`` and the indexer store takes
sglang's non-CUDA branch (``act_quant`` + ``set_index_k_scale_buffer``).
Prints ``ran``, ``rows compared`` and ``mismatches``; exits non-zero unless every case ran clean.

``--sync-debug`` runs every forward's part on the shard (the peer-page plan and table remap, every
layer's hooked stores and the hooked getters' reads) under ``torch.cuda.set_sync_debug_mode("warn")``
and attributes each synchronizing CUDA call to our code, the check's own stand-ins or stock sglang
(``testing/cuda_sync_counter.py``). The gloo transport's host bounce in ``peer_page_gather`` is the
test transport (ranks sharing one GPU), not the NCCL path, and is exempted (counted separately).
Prints ``syncs on our path = N``; with ``--sync-debug`` the run fails unless N is 0. The story covers
fresh prefill, chunked prefill over a cached prefix (old, new and mixed pages, padded tokens) and
padded decode; not HiCache load-back (no host pool here: the load-back wait is a no-op).
"""

from __future__ import annotations

import argparse
import sys
import time


def _rank_main(rank, world_size, args):
    """This rank's cases: ``[(cp_size, dtype, rank, rows compared, mismatches)]``."""
    import torch
    import torch.distributed as dist

    from sglang_cp_shared_kv.testing import runtime_check
    from sglang_cp_shared_kv.testing.nsa_cpu_kernels import act_quant_torch, cpu_kernels

    if args.device == "cuda":
        from sglang.srt.layers.attention.nsa.triton_kernel import act_quant

        torch.cuda.set_device(0)
        kernels = None
    else:
        act_quant, kernels = act_quant_torch, cpu_kernels
    if args.device == "cuda":
        _build_indexer_store_kernel_once(rank)
    runtime_check.apply_hooks()
    rows = []
    for cp_size in args.cp_sizes:
        group = dist.new_group(list(range(cp_size)))  # every process joins the creation
        for dtype_name in args.dtypes:
            if rank >= cp_size:
                continue
            if kernels is None:
                result = _run(runtime_check, rank, cp_size, group, args, dtype_name, act_quant)
            else:
                with kernels():
                    result = _run(runtime_check, rank, cp_size, group, args, dtype_name, act_quant)
            rows.append((cp_size, dtype_name, rank, result.rows_compared, result.mismatches,
                         result.syncs, result.sync_sites, result.exempted_bounces))  # fmt: skip
        dist.barrier()
    return rows


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


def _run(runtime_check, rank, cp_size, group, args, dtype_name, act_quant):
    return runtime_check.run_rank(
        rank,
        cp_size,
        group,
        device=args.device,
        dtype_name=dtype_name,
        act_quant=act_quant,
        seed=args.seed + cp_size,
        num_layers=args.layers,
        physical_pages=args.physical_pages,
        sync_debug=args.sync_debug,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--cp-sizes", default="2,4", help="comma list, e.g. 2,4,8")
    parser.add_argument("--dtypes", default="bf16,fp8", help="comma list of bf16, fp8")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--physical-pages", type=int, default=8, help="pages per rank shard")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=int, default=500)
    parser.add_argument(
        "--sync-debug", action="store_true",
        help="count synchronizing CUDA calls on our path during every forward (must be 0)",
    )  # fmt: skip
    args = parser.parse_args()
    args.cp_sizes = sorted(int(x) for x in args.cp_sizes.split(","))
    args.dtypes = args.dtypes.split(",")

    from sglang_cp_shared_kv.testing.multi_rank import launch

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

    expected_cases = len(args.cp_sizes) * len(args.dtypes)
    ran = compared = mismatches = 0
    for cp_size in args.cp_sizes:
        for dtype_name in args.dtypes:
            case = [r for r in rows if r[0] == cp_size and r[1] == dtype_name]
            errors = [errors_by_rank[r] for r in range(cp_size) if r in errors_by_rank]
            case_ok = len(case) == cp_size and not errors
            ran += case_ok
            compared += sum(r[3] for r in case)
            mismatches += sum(r[4] for r in case)
            print(
                f"cp_size={cp_size} dtype={dtype_name} device={args.device}: ranks reported "
                f"{len(case)}/{cp_size}, rows compared {sum(r[3] for r in case)}, "
                f"mismatches {sum(r[4] for r in case)}" + (f", errors {errors}" if errors else "")
            )
    print(f"rank exit codes: {exit_codes}; {time.time() - start:.1f} s")
    print(f"ran = {ran}/{expected_cases}")
    print(f"rows compared = {compared}")
    print(f"mismatches = {mismatches}")
    ok = ran == expected_cases and mismatches == 0 and compared > 0 and all(c == 0 for c in exit_codes)
    if args.sync_debug:
        ok = _report_syncs(rows) and ok
    return 0 if ok else 1


def _report_syncs(rows) -> bool:
    """Print the sync counts of every rank and case; True when our path made none."""
    counted = [r for r in rows if r[5] is not None]
    if not counted:
        print("sync debug: no CUDA on this device, nothing counted (the CPU unit test "
              "test_peer_page_plan_no_sync.py covers the plan); syncs on our path = n/a")  # fmt: skip
        return True
    totals = {owner: sum(r[5][owner] for r in counted) for owner in ("ours", "harness", "stock")}
    sites = sorted({site for r in counted for site in r[6]})
    for site in sites:
        print(f"  sync at {site}")
    print(f"gloo host bounces exempted (test transport, not on the NCCL path) = {sum(r[7] for r in counted)}")
    print(f"syncs in stock sglang code = {totals['stock']}")
    print(f"syncs in the check's own stand-ins = {totals['harness']}")
    print(f"syncs on our path = {totals['ours']}")
    return totals["ours"] == 0


if __name__ == "__main__":
    sys.exit(main())
