"""The per-layer collective that copies owned, referenced pages of one layer into the scratch.

Each rank packs its ``n`` planned pages (``PeerPagePlan.send_physical_pages``, padded with its dummy
page 0) straight into its own slice of the scratch's gathered region, then one in-place all-gather
over the attention CP group fills the other ranks' slices. Whether the collective runs depends only
on the shared plan, so every rank enters it, including a rank that owns none of the pages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

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
    cp_size, cp_rank = plan.layout.cp_size, plan.layout.cp_rank
    region = scratch_pages[1 : 1 + cp_size * n]
    own = region[cp_rank * n : (cp_rank + 1) * n]
    torch.index_select(physical_pages, 0, plan.send_physical_pages, out=own)
    if region.is_cuda and dist.get_backend(group) == dist.Backend.GLOO:
        # gloo moves host memory; this happens when CP ranks share one GPU (scripts/gpu checks).
        # The bounce syncs by design: exempt it (only it) from the checks' sync debugging.
        with sync_debug_exempt():
            host = region.cpu()
            dist.all_gather_into_tensor(host, host[cp_rank * n : (cp_rank + 1) * n], group=group)
            region.copy_(host)
        return
    dist.all_gather_into_tensor(region, own, group=group)


def as_pages(buffer: torch.Tensor, page_size: int) -> torch.Tensor:
    """View a token-row pool buffer ``[rows, 1, dim]`` (rows page-aligned) as ``[pages, page bytes]``."""
    return buffer.view(buffer.shape[0] // page_size, -1)
