"""Host time of one peer-page plan: the host builder (today's) vs the previous device-side builder.

``build_peer_page_plan`` today takes the batch's page ids from the host mirror of ``req_to_token``
(``ReqToPageMirror``) and computes the plan in NumPy, then copies it to the device once (pinned,
non-blocking). The previous builder (kept below as ``device_side_plan``, for comparison only) read
``req_to_token`` on the device and synced several times per forward (``bincount().tolist()``,
``torch.unique``, boolean masks, ``torch.tensor(list, device=...)``). Each is timed on the host, from
the call to its return (what the forward's launch waits for), median over ``--reps``; queued device
work is drained between repetitions, outside the timers, so on CUDA the old builder's syncs cost
only the GPU's latency here (behind real queued work they would wait for all of it).

Batches (page 64): ``prefill`` one request, 128K cached prefix + 8K chunk; ``decode`` 32 requests of
4K-32K tokens (seeded); logical pages random and owner-balanced like the allocator's.

    python3 benchmark/bench_peer_page_plan.py                    # CUDA
    python3 benchmark/bench_peer_page_plan.py --device cpu
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Sequence

import numpy as np
import torch

from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror import ReqToPageMirror
from sglang_cp_shared_kv.model_executor.peer_page_plan import PeerPagePlan, build_peer_page_plan
from sglang_cp_shared_kv_testing.peer_page_plan_fills import fill_lookup

PAGE = 64


def _batches(seed: int):
    rng = np.random.default_rng(seed)
    decode_lens = rng.integers(4096, 32768 + 1, size=32)
    return {
        "prefill 128K prefix + 8K chunk": ([136 * 1024], [8 * 1024]),
        "decode 32 x 4K-32K": (decode_lens.tolist(), [1] * 32),
    }


def _setup(cp_size: int, seq_lens: Sequence[int], device: str, seed: int):
    """Rows 1.. of a req_to_token table and its mirror, on distinct random logical pages."""
    pages_per_req = [-(-s // PAGE) for s in seq_lens]
    physical_pages = 2 * sum(pages_per_req) // cp_size + 8
    rng = np.random.default_rng(seed)
    free = rng.permutation(np.arange(cp_size, cp_size * (physical_pages + 1)))
    width = max(pages_per_req) * PAGE
    table = torch.zeros((len(seq_lens) + 1, width), dtype=torch.int32)
    mirror = ReqToPageMirror(len(seq_lens) + 1, width, PAGE)
    taken = 0
    for row, count in enumerate(pages_per_req, start=1):
        pages = free[taken : taken + count]
        taken += count
        mirror.write(row, 0, pages)
        locs = torch.from_numpy(np.repeat(pages * PAGE, PAGE) + np.tile(np.arange(PAGE), count))
        table[row, : count * PAGE] = locs.to(torch.int32)
    num_logical_pages = cp_size * (physical_pages + 1)
    return table.to(device), mirror, num_logical_pages, cp_size * physical_pages + 1


def host_plan(layout, mirror, rows, seq_lens, new, num_logical_pages, scratch_num_pages, device):
    """What ``begin_forward`` does: slice the mirror rows, build on the host, one upload."""
    pages_read = [-(-s // PAGE) for s in seq_lens]
    return build_peer_page_plan(
        layout=layout,
        request_pages=[mirror.row_pages(r, p) for r, p in zip(rows, pages_read)],
        old_page_counts=[-(-(s - k) // PAGE) for s, k in zip(seq_lens, new)],
        num_logical_pages=num_logical_pages,
        scratch_num_pages=scratch_num_pages,
        device=device,
    )


def device_side_plan(layout, req_to_token, req_pool_indices, seq_lens, new_token_counts,
                     num_logical_pages, scratch_num_pages) -> tuple[PeerPagePlan, torch.Tensor]:  # fmt: skip
    """The previous builder, unchanged but for its name (a baseline: it syncs on CUDA), and the fill
    table it built too (the plan no longer holds one)."""
    cp_size = layout.cp_size
    device = req_to_token.device
    lookup = torch.zeros(num_logical_pages, dtype=torch.int32, device=device)
    fill_lookup = torch.zeros_like(lookup)
    page_size = layout.page_size
    max_len = max(seq_lens)
    first_locs = req_to_token[req_pool_indices[: len(seq_lens)].long(), :max_len:page_size]
    pages = torch.div(first_locs.long(), page_size, rounding_mode="floor")
    column = torch.arange(pages.shape[1], device=device)
    pages_read = torch.tensor([-(-s // page_size) for s in seq_lens], device=device)
    first_new_column = torch.tensor(
        [-(-(s - n) // page_size) for s, n in zip(seq_lens, new_token_counts)], device=device
    )
    read = column[None, :] < pages_read[:, None]
    old = column[None, :] < first_new_column[:, None]
    real = layout.physical_page_of(pages) > 0
    referenced, gathered = torch.unique(pages[read & real]), torch.unique(pages[read & old & real])
    fill = referenced[~torch.isin(referenced, gathered)]
    counts = torch.bincount(layout.owner_of_page(gathered), minlength=cp_size).tolist()
    if 1 + cp_size * max(counts) + fill.numel() > scratch_num_pages:
        gathered, fill = referenced, referenced[:0]
        counts = torch.bincount(layout.owner_of_page(gathered), minlength=cp_size).tolist()
    n = max(counts)
    owners = layout.owner_of_page(gathered)
    order = torch.argsort(owners, stable=True)
    gathered, owners = gathered[order], owners[order]
    counts_t = torch.tensor(counts, dtype=torch.int64, device=device)
    first_of_owner = torch.cumsum(counts_t, 0) - counts_t
    slot = torch.arange(gathered.numel(), device=device) - first_of_owner[owners]
    lookup[gathered] = (1 + owners * n + slot).to(torch.int32)
    fill_pages = 1 + cp_size * n + torch.arange(fill.numel(), device=device)
    lookup[fill] = fill_pages.to(torch.int32)
    fill_lookup[fill] = fill_pages.to(torch.int32)
    own_logical_pages = gathered[owners == layout.cp_rank]
    send = torch.zeros(n, dtype=torch.int64, device=device)
    send[: own_logical_pages.numel()] = layout.physical_page_of(own_logical_pages)
    return PeerPagePlan(layout, lookup, n, send, fill.numel()), fill_lookup


def _median_us(call, reps: int, device: str) -> float:
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    if device == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--cp-sizes", default="2,4,8")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = args.device
    print(f"device={device}, page {PAGE}, host microseconds per plan (median of {args.reps})")
    print(f"{'batch':34} {'cp':>3} {'pages':>6} {'gathered/rank':>13} {'host plan':>10} "
          f"{'old plan':>10} {'old/new':>8}")  # fmt: skip
    for name, (seq_lens, new) in _batches(args.seed).items():
        for cp_size in (int(x) for x in args.cp_sizes.split(",")):
            table, mirror, num_logical, scratch_pages = _setup(cp_size, seq_lens, device, args.seed)
            layout = CpSharedKVLayout(cp_size, 0, PAGE)
            rows = list(range(1, len(seq_lens) + 1))
            req_pool_indices = torch.tensor(rows, device=device)

            def new_call():
                return host_plan(layout, mirror, rows, seq_lens, new, num_logical, scratch_pages, device)

            def old_call():
                return device_side_plan(
                    layout, table, req_pool_indices, seq_lens, new, num_logical, scratch_pages
                )

            new_plan, (old_plan, old_fill_lookup) = new_call(), old_call()
            # Same plan, or the comparison means nothing.
            assert torch.equal(new_plan.lookup, old_plan.lookup), name
            assert torch.equal(fill_lookup(new_plan), old_fill_lookup), name
            assert torch.equal(new_plan.send_physical_pages, old_plan.send_physical_pages), name
            for _ in range(3):  # warm-up (pinned blocks, kernels)
                new_call(), old_call()
            new_us = _median_us(new_call, args.reps, device)
            old_us = _median_us(old_call, args.reps, device)
            pages = sum(-(-s // PAGE) for s in seq_lens)
            print(f"{name:34} {cp_size:>3} {pages:>6} {new_plan.gather_pages_per_rank:>13} "
                  f"{new_us:>10.0f} {old_us:>10.0f} {old_us / new_us:>8.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
