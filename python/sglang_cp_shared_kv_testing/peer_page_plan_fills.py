"""Which pages a peer-page plan fills locally, read back from its ``lookup``.

The runtime never asks (its write hooks map every row through ``CpSharedKVRuntime.row_maps``); tests,
the smoke's KV audit and the gather benchmark do. The plan lays the gathered region out first
(scratch pages ``1 .. gathered_region_pages``) and the locally filled pages after it
(``peer_page_plan``), so a page is filled locally exactly when its scratch page lies beyond the
gathered region.
"""

from __future__ import annotations

import dataclasses

import torch

from sglang_cp_shared_kv.model_executor.peer_page_plan import DUMMY_SCRATCH_PAGE, PeerPagePlan


def fill_lookup(plan: PeerPagePlan) -> torch.Tensor:
    """Logical page -> scratch page of the pages the forward fills locally; the dummy page for every
    other page (gathered or not referenced). int32, on the plan's device."""
    return torch.where(plan.lookup > plan.gathered_region_pages, plan.lookup, DUMMY_SCRATCH_PAGE)


def fill_locs(plan: PeerPagePlan, logical_locs: torch.Tensor) -> torch.Tensor:
    """Scratch rows a write of ``logical_locs`` fills locally; the rest go to the dummy page."""
    return fills_only(plan).remap_token_locs(logical_locs)


def fills_only(plan: PeerPagePlan) -> PeerPagePlan:
    """The plan with ``fill_lookup`` as its lookup: its remaps send only locally filled pages into
    the scratch (the table the plan itself kept until the runtime stopped reading it)."""
    return dataclasses.replace(plan, lookup=fill_lookup(plan))
