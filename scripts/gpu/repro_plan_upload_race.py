"""Show which wait orders the prefetch after the peer-page plan's upload (two ranks on one GPU).

The runtime check's plant ``prefetch_without_waiting_for_reads`` used to drop every
``LayerPipeline.side_waits_for_compute``, the forward's first one (``begin``) included. That first
wait is also the only thing ordering the side stream's first pack after the plan's non-blocking
upload on the compute stream (``send_physical_pages``): without it the pack can read the send list
before it lands, i.e. a recycled block, as page ids, and ``index_select`` asserts
(``srcIndex < srcSelectDimSize``) instead of the plant showing up as mismatches.

Here the upload is made late on purpose: its block is filled with 2**40 first (host-synchronised),
then the compute stream sleeps ``--upload-delay-ms`` before the copy. Cases, in this order, on
cp_size=2 fp8 prefetch: ``clean`` (0 mismatches expected), ``plant`` (the plant as it is now: the
per-layer waits dropped; mismatches > 0, no assert), ``old_plant`` (every wait dropped: the first
pack may read the send list before it lands: more mismatches than ``plant``, or the device assert,
which ends the ranks, so it runs last). Each rank prints one line per case as it ends.

    source scripts/gpu/remote_env.sh && python scripts/gpu/repro_plan_upload_race.py
"""

from __future__ import annotations

import argparse
import sys


def _rank_main(rank, world_size, args):
    import torch
    import torch.distributed as dist

    from sglang.jit_kernel.fused_store_index_cache import can_use_nsa_fused_store
    from sglang.srt.layers.attention.nsa.triton_kernel import act_quant
    from sglang_cp_shared_kv.model_executor import peer_page_plan
    from sglang_cp_shared_kv_testing import runtime_check

    torch.cuda.set_device(0)
    if rank == 0:
        can_use_nsa_fused_store(torch.bfloat16, torch.int64, 64)
    dist.barrier()
    can_use_nsa_fused_store(torch.bfloat16, torch.int64, 64)
    runtime_check.apply_hooks()

    def late_upload(staged, device):
        host = torch.from_numpy(staged).pin_memory()
        out = torch.full(host.shape, 1 << 40, dtype=torch.int64, device=device)
        torch.cuda.current_stream().synchronize()
        torch.cuda._sleep(int(args.upload_delay_ms * 2_000_000))
        out.copy_(host, non_blocking=True)
        return out

    peer_page_plan._to_device = late_upload
    current_plant = runtime_check.apply_plant

    def old_plant(runtime, plant):
        runtime.pipeline.side_waits_for_compute = lambda: None

    group, prefetch_group = dist.new_group([0, 1]), dist.new_group([0, 1])
    for name, plant in (("clean", None), ("plant", "prefetch_without_waiting_for_reads"),
                        ("old_plant", "prefetch_without_waiting_for_reads")):  # fmt: skip
        runtime_check.apply_plant = old_plant if name == "old_plant" else current_plant
        result = runtime_check.run_rank(
            rank, 2, group, device="cuda", dtype_name="fp8", act_quant=act_quant, seed=2,
            num_layers=4, physical_pages=8, prefetch_group=prefetch_group, skip_index_layers=(2,),
            hicache=True, plant=plant, read_delay_ms=40,
        )  # fmt: skip
        print(f"rank {rank} case {name}: rows {result.rows_compared}, mismatches {result.mismatches}, "
              f"prefetched forwards {result.prefetch_forwards}", flush=True)  # fmt: skip
        dist.barrier()
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--upload-delay-ms", type=float, default=100.0)
    parser.add_argument("--timeout-s", type=int, default=90)
    args = parser.parse_args()
    from sglang_cp_shared_kv_testing.multi_rank import launch

    outcomes = launch(_rank_main, 2, (args,), timeout_s=args.timeout_s, deadline_s=args.timeout_s,
                      threads_per_rank=None)  # fmt: skip
    for outcome in outcomes:
        print(f"rank {outcome.rank}: exit {outcome.exitcode}, error {outcome.error!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
