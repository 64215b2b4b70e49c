"""Deliberate bugs in the shared-KV path, planted by hooks, to show the smoke's oracle catches them.

* ``read-wrong-owner``: every forward, the first gathered page of the plan is read from the same
  slot of the next rank's part of the gather, i.e. another owner's page (a plan/gather bug).
* ``load-back-wrong-page``: on rank 1, each host load-back of two or more pages writes its pages
  one page off, rotated (a controller mapping bug; KV and indexer K move together, as a real bug
  in the shared mapping would).
* ``pd-send-wrong-page``: on cp rank 1 of a PD prefill server, each KV chunk of two or more pages
  lands one page off, rotated, in the decode server's pages (a page-pairing bug; the indexer K
  still goes where it belongs).
* ``decode-wrong-page``: on cp rank 1, each per-owner decode forward's owned-page table is rotated
  by one column, so the rank scores and attends to the wrong physical page of each request (an
  owner-table bug; caught by the decode read audit). Planted where eager decode builds the tables
  (``per_owner_decode``) and where decode CUDA graphs refresh their static ones
  (``per_owner_decode.cuda_graphs``, which imports the builder under its own name).
* ``draft-wrong-owner`` (MTP): in every store of the draft pool (KV and indexer K), the first page
  of the stored locs is written by the next rank (into its own physical page of the same number)
  instead of its owner, whose row stays stale (an owner-filter bug of the draft's runtime; caught by
  the draft write audit).
* ``skip-load-ack`` (HiCache): on cp rank 1, every load-back whose acknowledgement the ranks agreed
  on keeps its lock: the ack is popped but its node's lock is not released (a lost ack). Rank 1's
  lock references and evictable size then differ from the others' (caught by the soak's tree dumps,
  or by the hang its diverging evictions lead to).
* ``draft-stale-load-back`` (MTP with HiCache): every host load-back restores the target's pages
  only; the draft KV and indexer K of the loaded-back prefix stay whatever the new locs held, as
  stock 0.5.11 leaves them (caught by the cached-prefix ledger).

Value-only plants: every row read and written stays right, only a number computed from them is
wrong, so the row audits pass and only the value audit (``value_audit``) can catch them:

* ``value-merge-skew``: per-owner decode, cp rank 1's partial enters the merge with its LSE raised by
  ``MERGE_LSE_SKEW`` (a wrong merge weight), eagerly and in every captured graph.
* ``value-graph-stale-lse``: per-owner decode under CUDA graphs, each captured merge reads the LSEs
  of the last warm-up run before the capture (a static buffer no replay rewrites) instead of the
  ones the replay computes. Eager forwards are untouched: only a graph replay shows it.
* ``value-gathered-scale``: page-gather path, after each layer's store assembled the gather scratch
  (and the read audit checked its bytes), the gathered pages' latent values are scaled by
  ``GATHERED_SCALE`` (bf16 rows) or their fp8 tile scales are (fp8 rows): a misapplied scale.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from sglang.srt.plugins.hook_registry import HookType

logger = logging.getLogger(__name__)

PLANTS = (
    "read-wrong-owner",
    "load-back-wrong-page",
    "pd-send-wrong-page",
    "decode-wrong-page",
    "draft-wrong-owner",
    "draft-stale-load-back",
    "skip-load-ack",
    "value-merge-skew",
    "value-graph-stale-lse",
    "value-gathered-scale",
)
VALUE_PLANTS = ("value-merge-skew", "value-graph-stale-lse", "value-gathered-scale")
MERGE_LSE_SKEW = 4.0
GATHERED_SCALE = 0.5
_RUNTIME = "sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime.CpSharedKVRuntime"
_CONTROLLER = "sglang_cp_shared_kv.mem_cache.cp_hybrid_cache_controller.CpHybridCacheController"
_CP_HIRADIX = "sglang_cp_shared_kv.mem_cache.cp_hiradix_cache.CpHiRadixCache"
_PD_MANAGER = "sglang_cp_shared_kv.disaggregation.mooncake.conn.CpSharedKVMooncakeKVManager"
_PER_OWNER = "sglang_cp_shared_kv.model_executor.per_owner_decode.decode_forward"
_PER_OWNER_GRAPHS = "sglang_cp_shared_kv.model_executor.per_owner_decode.cuda_graphs"


def read_from_wrong_owner(plan, runtime, forward_batch):
    n, cp_size = plan.gather_pages_per_rank, plan.layout.cp_size
    if n == 0 or cp_size < 2:
        return None
    gathered = (plan.lookup >= 1) & (plan.lookup < 1 + cp_size * n)
    if not bool(gathered.any()):
        return None
    page = int(torch.nonzero(gathered)[0])
    scratch_page = int(plan.lookup[page])
    wrong = 1 + ((scratch_page - 1) + n) % (cp_size * n)  # same slot, next rank's part
    lookup = plan.lookup.clone()
    lookup[page] = wrong
    runtime.plan = dataclasses.replace(plan, lookup=lookup)
    return runtime.plan


def load_one_page_off(result, controller, metadata, logical_device_indices, node_id, *args, **kwargs):
    if controller.layout.cp_rank != 1:
        return None
    op = controller.load_queue[-1]
    page_size = controller.page_size
    if op.device_indices.numel() < 2 * page_size:
        return None
    op.device_indices = torch.roll(op.device_indices, page_size)
    for transfer in getattr(op, "pool_transfers", None) or []:
        transfer.device_indices = torch.roll(transfer.device_indices, page_size)
    logger.warning("planted bug: load-back of node %d rotated by one page on rank 1", node_id)
    return None


def send_one_page_off(original, manager, session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, *rest):
    layout = manager.cp_shared_kv_layout
    if layout is not None and layout.cp_rank == 1 and len(dst_kv_indices) >= 2:
        dst_kv_indices = np.roll(np.asarray(dst_kv_indices), 1)
        logger.warning("planted bug: a KV chunk of %d pages sent one page off on rank 1", len(dst_kv_indices))
    return original(manager, session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, *rest)


def decode_tables_one_page_off(tables, layout, *args, **kwargs):
    if layout.cp_rank != 1:
        return None
    return dataclasses.replace(tables, physical_page_table=torch.roll(tables.physical_page_table, 1, dims=1))


def draft_page_to_wrong_owner(original, runtime, plan, logical_locs):
    """AROUND ``CpSharedKVRuntime.row_maps`` (the rows every store of a forward writes): on the draft
    pool's runtime, the first real page of the locs goes to the next rank's physical page of the
    same number, and the owner sends its rows to the dummy page. Host syncs: a plant, not the product."""
    from cp_shared_kv_smoke_hooks.draft_audit import is_draft_pool

    maps = original(runtime, plan, logical_locs)
    layout = runtime.layout
    if not is_draft_pool(runtime.pool) or layout.cp_size < 2:
        return maps
    ps, cp = layout.page_size, layout.cp_size
    locs = logical_locs.long()
    pages = locs // ps
    real = pages >= cp  # logical pages 0 .. cp-1 are the dummy pages
    if not bool(real.any()):
        return maps
    page = int(pages[real][0])
    owner = page % cp
    on_page = pages == page
    physical = maps.physical_rows.clone()
    if layout.cp_rank == owner:
        physical[on_page] = locs[on_page] % ps  # the dummy page's slots, where non-owned rows sink
    elif layout.cp_rank == (owner + 1) % cp:
        physical[on_page] = (page // cp) * ps + locs[on_page] % ps
    else:
        return maps
    return dataclasses.replace(maps, physical_rows=physical, physical_page_slot=(physical // ps, physical % ps))


_SKIPPING_DRAFT_RESTORE = "_cp_shared_kv_smoke_skipping_draft_restore"


def load_without_the_draft(original, controller, *args, **kwargs):
    """AROUND ``CpHybridCacheController.start_loading``: this load restores the target only."""
    setattr(controller, _SKIPPING_DRAFT_RESTORE, True)
    try:
        return original(controller, *args, **kwargs)
    finally:
        setattr(controller, _SKIPPING_DRAFT_RESTORE, False)


def target_pools_only_while_loading(original, controller, with_draft: bool = True):
    """AROUND ``CpHybridCacheController._target_and_draft_pools``: no draft pool inside a load."""
    if getattr(controller, _SKIPPING_DRAFT_RESTORE, False) and with_draft:
        logger.warning("planted bug: a host load-back leaves the draft pool's rows stale")
        with_draft = False
    return original(controller, with_draft)


def keep_load_locks_on_rank_1(original, cache, *args, **kwargs):
    """AROUND ``CpHiRadixCache.loading_check``: on cp rank 1, the loads it acknowledges keep their lock."""
    if cache.cp_layout.cp_rank != 1:
        return original(cache, *args, **kwargs)
    tracked = dict(cache.ongoing_load_back)
    result = original(cache, *args, **kwargs)
    for ack_id, node in tracked.items():
        if ack_id not in cache.ongoing_load_back:
            cache.inc_lock_ref(node)  # undoes the release loading_check just made
            logger.warning("planted bug: load-back ack %s popped without releasing its lock on rank 1", ack_id)
    return result


def merge_with_skewed_lse(original, state, out, lse):
    """AROUND ``PerOwnerDecode.merge``: cp rank 1's LSE raised (its partial over-weighted)."""
    if state.cp_rank == 1:
        lse = lse + MERGE_LSE_SKEW
    return original(state, out, lse)


def merge_with_warmup_lse():
    """AROUND ``PerOwnerDecode.merge``: an eager call keeps a copy of its LSE per shape; a captured
    call merges with that copy (the last warm-up's) instead of the LSE the graph computes."""
    from cp_shared_kv_smoke_hooks import value_audit

    kept = {}

    def merge(original, state, out, lse):
        key = (id(state), tuple(lse.shape))
        if not value_audit.capturing():
            kept[key] = lse.clone()
        elif key in kept:
            lse = kept[key]
        return original(state, out, lse)

    return merge


def gathered_region_rows(plan):
    """(first, end) scratch rows of the pages the plan gathers (pages 1 .. gathered region)."""
    ps = plan.layout.page_size
    return ps, ps * (1 + plan.gathered_region_pages)


def scale_gathered_pages(result, runtime, original, layer, *args, **kwargs):
    """AFTER ``CpSharedKVRuntime.store_mla_kv``: the layer's slot holds its gathered pages now."""
    plan = runtime.plan
    if plan is None or plan.gathered_region_pages == 0:
        return None
    first, end = gathered_region_rows(plan)
    rows = runtime.kv_slot_for_read(layer.layer_id).kv_buffer[0][first:end, 0]
    if rows.element_size() == 1:  # fp8 rows: 512 fp8 values, then 4 fp32 tile scales
        rows[:, 512:528].view(torch.float32).mul_(GATHERED_SCALE)
    else:
        rows[:, :512].mul_(GATHERED_SCALE)
    return None


def register_hooks(registry, plant: str) -> None:
    if plant == "read-wrong-owner":
        registry.register(f"{_RUNTIME}.begin_forward", read_from_wrong_owner, HookType.AFTER)
    elif plant == "load-back-wrong-page":
        registry.register(f"{_CONTROLLER}.load_reserved", load_one_page_off, HookType.AFTER)
    elif plant == "pd-send-wrong-page":
        registry.register(f"{_PD_MANAGER}.send_kvcache", send_one_page_off, HookType.AROUND)
    elif plant == "decode-wrong-page":
        for module in (_PER_OWNER, _PER_OWNER_GRAPHS):
            registry.register(f"{module}.build_owner_decode_tables", decode_tables_one_page_off, HookType.AFTER)
    elif plant == "draft-wrong-owner":
        registry.register(f"{_RUNTIME}.row_maps", draft_page_to_wrong_owner, HookType.AROUND)
    elif plant == "draft-stale-load-back":
        registry.register(f"{_CONTROLLER}.start_loading", load_without_the_draft, HookType.AROUND)
        registry.register(f"{_CONTROLLER}._target_and_draft_pools", target_pools_only_while_loading, HookType.AROUND)
    elif plant == "skip-load-ack":
        registry.register(f"{_CP_HIRADIX}.loading_check", keep_load_locks_on_rank_1, HookType.AROUND)
    elif plant == "value-merge-skew":
        registry.register(f"{_PER_OWNER}.PerOwnerDecode.merge", merge_with_skewed_lse, HookType.AROUND)
    elif plant == "value-graph-stale-lse":
        registry.register(f"{_PER_OWNER}.PerOwnerDecode.merge", merge_with_warmup_lse(), HookType.AROUND)
    elif plant == "value-gathered-scale":
        registry.register(f"{_RUNTIME}.store_mla_kv", scale_gathered_pages, HookType.AFTER)
    else:
        raise ValueError(f"unknown planted bug {plant!r}; one of {PLANTS}")
    logger.warning("cp-shared-kv smoke: planted bug %s is active", plant)
