"""The per-layer collective that copies owned, referenced pages of one layer into the scratch.

Each rank packs its planned pages (``PeerPagePlan.send_physical_pages``) straight into its own
slice of the scratch's gathered region; then the other ranks' slices are filled over the attention
CP group: one in-place all-gather of ``n`` pages per rank in the plan's padded layout (the usual
case), one broadcast per owner that sends anything in its exact layout (owners unbalanced inside a
batch that a prefill-sized scratch could not hold padded). Whether and which collectives run
depends only on the shared plan, so every rank enters the same ones in the same order, including
a rank that owns none of the pages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sglang_cp_shared_kv.observability.cp_shared_kv_metrics import metrics as cp_metrics
from sglang_cp_shared_kv.model_executor.peer_page_plan import PeerPagePlan
from sglang_cp_shared_kv.model_executor.sync_debug import sync_debug_exempt


def gather_peer_pages(
    plan: PeerPagePlan,
    physical_pages: torch.Tensor,
    scratch_pages: torch.Tensor,
    group: dist.ProcessGroup,
) -> None:
    """Fill the gathered region of ``scratch_pages`` for one layer.

    ``physical_pages``: this rank's pool buffer of the layer viewed as ``[physical pages, bytes]``;
    ``scratch_pages``: the scratch buffer viewed the same way (scratch page ids on dim 0).
    """
    n = plan.gather_pages_per_rank
    if n == 0:
        return
    cp_rank = plan.layout.cp_rank
    region = scratch_pages[1 : 1 + plan.gathered_region_pages]
    slices = plan.owner_slices()
    start, count = slices[cp_rank]
    own = region[start : start + count]
    if count:
        torch.index_select(physical_pages, 0, plan.send_physical_pages, out=own)
    if cp_metrics() is not None:
        cp_metrics().gathered_bytes.inc(received_bytes(plan, scratch_pages))
    if plan.exact_layout:
        _broadcast_owner_slices(region, slices, group)
        return
    if region.is_cuda and dist.get_backend(group) == dist.Backend.GLOO:
        # gloo moves host memory; this happens when CP ranks share one GPU (scripts/gpu checks).
        # The bounce syncs by design: exempt it (only it) from the checks' sync debugging.
        with sync_debug_exempt():
            host = region.cpu()
            dist.all_gather_into_tensor(host, host[cp_rank * n : (cp_rank + 1) * n], group=group)
            region.copy_(host)
        return
    dist.all_gather_into_tensor(region, own, group=group)


def received_bytes(plan: PeerPagePlan, scratch_pages: torch.Tensor) -> int:
    """Bytes of other ranks' pages one ``gather_peer_pages`` call brings into ``scratch_pages`` (host
    arithmetic on the plan: the exact layout's per-owner slices, else ``n`` pages per peer)."""
    cp_rank = plan.layout.cp_rank
    if plan.exact_layout:
        pages = sum(count for rank, (_, count) in enumerate(plan.owner_slices()) if rank != cp_rank)
    else:
        pages = (plan.layout.cp_size - 1) * plan.gather_pages_per_rank
    return pages * scratch_pages[0].numel() * scratch_pages.element_size()


def _broadcast_owner_slices(region: torch.Tensor, slices, group: dist.ProcessGroup) -> None:
    """Exact layout: each owner with pages broadcasts its slice (in rank order, on every rank)."""
    staged = region.is_cuda and dist.get_backend(group) == dist.Backend.GLOO
    for owner, (start, count) in enumerate(slices):
        if count == 0:
            continue
        part = region[start : start + count]
        if staged:  # gloo moves host memory (CP ranks sharing one GPU in the checks)
            with sync_debug_exempt():
                host = part.cpu()
                dist.broadcast(host, group=group, group_src=owner)
                part.copy_(host)
        else:
            dist.broadcast(part, group=group, group_src=owner)


def as_pages(buffer: torch.Tensor, page_size: int) -> torch.Tensor:
    """View a token-row pool buffer ``[rows, 1, dim]`` (rows page-aligned) as ``[pages, page bytes]``."""
    return buffer.view(buffer.shape[0] // page_size, -1)
