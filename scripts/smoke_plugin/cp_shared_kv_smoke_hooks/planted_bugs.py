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
  owner-table bug; caught by the decode read audit).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from sglang.srt.plugins.hook_registry import HookType

logger = logging.getLogger(__name__)

PLANTS = ("read-wrong-owner", "load-back-wrong-page", "pd-send-wrong-page", "decode-wrong-page")
_RUNTIME = "sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime.CpSharedKVRuntime"
_CONTROLLER = "sglang_cp_shared_kv.managers.cp_hicache_controller.CpHybridCacheController"
_PD_MANAGER = "sglang_cp_shared_kv.disaggregation.mooncake.conn.CpSharedKVMooncakeKVManager"
_PER_OWNER = "sglang_cp_shared_kv.model_executor.per_owner_decode"


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


def register_hooks(registry, plant: str) -> None:
    if plant == "read-wrong-owner":
        registry.register(f"{_RUNTIME}.begin_forward", read_from_wrong_owner, HookType.AFTER)
    elif plant == "load-back-wrong-page":
        registry.register(f"{_CONTROLLER}.load_reserved", load_one_page_off, HookType.AFTER)
    elif plant == "pd-send-wrong-page":
        registry.register(f"{_PD_MANAGER}.send_kvcache", send_one_page_off, HookType.AROUND)
    elif plant == "decode-wrong-page":
        registry.register(f"{_PER_OWNER}.build_owner_decode_tables", decode_tables_one_page_off, HookType.AFTER)
    else:
        raise ValueError(f"unknown planted bug {plant!r}; one of {PLANTS}")
    logger.warning("cp-shared-kv smoke: planted bug %s is active", plant)
