"""The soak's tree dump: each rank writes its radix tree and host-slot ledger when asked, at one step.

Every rank of a shared-KV server must hold the same tree: the same nodes with the same logical locs,
host lengths and lock references, the same evictable and protected sizes and the same host-slot
ledger (``CpHostSlotLedger``), or their next admission and eviction decisions, and the collectives
behind them, part. The only moment all ranks are known to be at the same step is a request they
all handle: ``/server_info`` reaches every scheduler as a ``GetInternalStateReq`` broadcast to the
TP group and handled in the same loop iteration everywhere (``Scheduler.recv_requests``). So the
hook runs after ``Scheduler.get_internal_state`` and writes ``<dir>/tree/tree.rank<r>.<seq>.json``:

* ``shared``: what must be equal on every rank (compared by ``sglang_cp_shared_kv_testing/e2e/soak.compare_tree_dumps``);
* ``rank_local``: this rank's own host slots and free pool sizes (reported only; they differ by design).

Node ids are left out: they are equal on the ranks of one server, but not across the one-process
views of a CPU test. The dump walks the tree on the host; smoke servers only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch.distributed as dist

from sglang.srt.plugins.hook_registry import HookType

logger = logging.getLogger(__name__)

_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"


def _digest(values) -> str:
    return hashlib.sha1(repr(list(values)).encode()).hexdigest()[:16]


def _node_entry(cache, node, path: tuple) -> dict:
    evicted = node.value is None
    return {
        "path": list(path),
        "key_len": len(node.key),
        "key": _digest(node.key.token_ids),
        "device_locs": None if evicted else _digest(node.value.cpu().tolist()),
        "host_len": int(getattr(node, "host_len", 0) or 0),
        "lock_ref": int(node.lock_ref),
        "host_ref": int(getattr(node, "host_ref_counter", 0) or 0),
    }


def tree_snapshot(cache) -> dict:
    """``{"shared": ..., "rank_local": ...}`` of a radix cache (CpHiRadixCache or any stock one)."""
    nodes, own_host_slots = [], 0
    stack = [(cache.root_node, ())]
    while stack:
        node, path = stack.pop()
        for child_key in sorted(node.children, key=repr):
            child = node.children[child_key]
            child_path = path + (len(node.children), sorted(node.children, key=repr).index(child_key))
            nodes.append(_node_entry(cache, child, child_path))
            meta = getattr(child, "cp_hicache", None)
            own_host_slots += int(meta.num_owned) if meta is not None else 0
            stack.append((child, child_path))
    ledger = getattr(cache, "host_ledger", None)
    shared = {
        "nodes": nodes,
        "evictable_size": int(cache.evictable_size_),
        "protected_size": int(cache.protected_size_),
        "host_logical_tokens": int(getattr(cache, "host_logical_tokens", 0)),
        "ongoing_writes": len(getattr(cache, "ongoing_write_through", ()) or ()),
        "ongoing_loads": len(getattr(cache, "ongoing_load_back", ()) or ()),
        "ledger_free_slots": None if ledger is None else [int(x) for x in ledger.free],
    }
    controller = getattr(cache, "cache_controller", None)
    host_pool = getattr(controller, "mem_pool_host", None)
    rank_local = {
        "own_host_slots_in_tree": own_host_slots,
        "host_pool_free_slots": None if host_pool is None else int(host_pool.available_size()),
        "device_free_tokens": int(cache.token_to_kv_pool_allocator.available_size()),
    }
    return {"shared": shared, "rank_local": rank_local}


def write_dump(tree_dir: Path, rank: int, seq: int, snapshot: dict) -> Path:
    tree_dir.mkdir(parents=True, exist_ok=True)
    final = tree_dir / f"tree.rank{rank}.{seq:04d}.json"
    tmp = tree_dir / f".{final.name}"
    tmp.write_text(json.dumps({"rank": rank, "seq": seq, **snapshot}))
    os.replace(tmp, final)  # the reader's glob skips dot files: a dump is seen whole or not at all
    return final


def register_hooks(registry, audit_dir: str) -> None:
    tree_dir = Path(audit_dir) / "tree"
    seq = [0]  # per process; every rank handles the same requests, so the same numbers

    def after_get_internal_state(result, scheduler, *args, **kwargs):
        rank = dist.get_rank() if dist.is_initialized() else 0
        try:
            write_dump(tree_dir, rank, seq[0], tree_snapshot(scheduler.tree_cache))
        except Exception:  # a dump must never take the server down; the missing file fails the soak
            logger.exception("cp-shared-kv smoke: tree dump %d failed on rank %d", seq[0], rank)
        seq[0] += 1

    registry.register(f"{_SCHEDULER}.get_internal_state", after_get_internal_state, HookType.AFTER)
