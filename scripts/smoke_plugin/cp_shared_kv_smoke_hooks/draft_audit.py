"""The smoke's oracle for the MTP draft pool (EAGLE with the model's NextN layer, top-k 1).

With ``--speculative-algorithm EAGLE`` the draft worker owns a one-layer ``NSATokenToKVPool`` (KV and
indexer K of the NextN layer) at the target's locs; under shared KV it is sharded by the target's
layout and served by its own runtime (``cp_shared_kv_draft_pool``). What can be judged about it,
and what cannot:

* **Not judged: the draft's bytes against the stock reference.** The NextN layer's input at position
  ``p`` is the embedding of token ``p + 1`` and the target's last hidden state at ``p``, which went
  through every target layer's attention. Like the target's deeper layers (which the pool audit
  reports, not judges), a draft row carries that attention noise, so no tolerance separates a wrong
  row from noise reliably. The pool audit reports its error against the reference's draft rows.
* **Judged, write audit** (this module, shared KV): after every store of the draft layer (KV and
  indexer K), every rank all-gathers the draft pool's layer, rebuilds the logical view with its own
  arithmetic, and checks that the owner's row at each written logical loc holds the row this rank
  stored for it. Draft forwards (draft extend, draft steps) run the whole batch on every rank, and
  a CP extend all-gathers its chunk before the store, so every rank stores the same tokens' rows;
  rounding aside they are equal. A row that stayed stale on its owner (a page written by another
  rank) holds another token's row: relative error far above ``WRONG_ROW_RELATIVE_ERROR``.
  Counts: ``draft_write_audit.rank<r>.json``.
* **Judged, read audit** (``kv_audit.ReadAudit`` on the draft's runtime, shared KV): every row the
  draft forward references, read through the gather scratch, equals the owner's row. The draft
  steps are planned per step (``plan_draft_step``), so their references are taken when each step's
  plan is selected. Counts: ``read_audit_draft.rank<r>.json``.
* **Judged, cached-prefix ledger** (``kv_audit_compare.cached_row_ledger``, shared KV): a position
  a request gets from the cache (device or host) is never recomputed, not even by the draft (its
  extend covers the extended tokens only), so its draft rows must equal, bit for bit, the rows the
  request that stored the prefix held when it finished. A load-back that leaves the draft stale
  (stock 0.5.11 does, see docs/speculative-decoding.md) breaks that. Reported, not judged, on the
  stock reference.
* **Judged, PD**: the stock decode server's draft rows equal the prefill server's, byte for byte
  (the transfer is a copy, ``kv_audit_compare.copy_failures``).

This module finds the draft pool (the pool dump needs it on every server, shared KV or not) and runs
the write audit.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import List

import torch

from sglang.srt.plugins.hook_registry import HookType

logger = logging.getLogger(__name__)

_RUNTIME = "sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime.CpSharedKVRuntime"
_MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
_ATTACH_DRAFT = "sglang_cp_shared_kv.model_executor.cp_shared_kv_draft_pool.attach_draft_runtime"
_DRAFT_MARK = "_cp_shared_kv_smoke_draft_pool"
_DRAFT_POOLS: List = []  # the draft pools of this process (a scheduler process has one)


def mark_draft_pool(pool) -> None:
    if not getattr(pool, _DRAFT_MARK, False):
        setattr(pool, _DRAFT_MARK, True)
        _DRAFT_POOLS.append(pool)


def is_draft_pool(pool) -> bool:
    return bool(getattr(pool, _DRAFT_MARK, False))


def process_draft_pool():
    """The draft pool of this process's draft worker, or None (no MTP)."""
    return _DRAFT_POOLS[-1] if _DRAFT_POOLS else None


def after_init_attention_backend(result, model_runner, *args, **kwargs):
    """AFTER ``ModelRunner.init_attention_backend``: remember a draft worker's pool (stock or sharded)."""
    if getattr(model_runner, "is_draft_worker", False):
        mark_draft_pool(model_runner.token_to_kv_pool)
    return None


def after_attach_draft_runtime(runtime, draft_pool, *args, **kwargs):
    """AFTER ``attach_draft_runtime``: the pool a draft runtime serves is a draft pool."""
    mark_draft_pool(draft_pool)
    return None


def owner_rows(runtime, pool_pages: torch.Tensor, logical_locs: torch.Tensor, kind: str) -> torch.Tensor:
    """Bytes of each logical loc's row on its owner: ``pool_pages`` (this rank's layer as
    ``[pages, page bytes]`` uint8) all-gathered over the CP group, then read at the owner's physical
    page. Every rank must call it (a collective)."""
    from cp_shared_kv_smoke_hooks.kv_audit import gather_shards, token_bytes

    ps, cp = runtime.layout.page_size, runtime.layout.cp_size
    gathered = gather_shards(runtime, pool_pages)
    page = logical_locs // ps
    return token_bytes(gathered[page % cp, page // cp], logical_locs % ps, ps, kind)


class DraftWriteAudit:
    """Counts of draft rows written by a forward whose owner's row holds something else (module doc)."""

    def __init__(self, audit_dir: Path, rank: int):
        self.path = Path(audit_dir) / f"draft_write_audit.rank{rank}.json"
        self.counts = {"stores": 0, "padding_rows": 0}
        for kind in ("kv", "index"):
            self.counts.update({f"{kind}_rows": 0, f"{kind}_bit_diffs": 0, f"{kind}_wrong": 0})

    def check(self, runtime, pool_pages: torch.Tensor, logical_locs: torch.Tensor, stored: torch.Tensor, kind: str):
        """``stored``: ``[len(logical_locs), row bytes]`` uint8, the rows this rank stored for the locs."""
        from cp_shared_kv_smoke_hooks.kv_audit_compare import (
            WRONG_ROW_RELATIVE_ERROR,
            index_values,
            kv_values,
            relative_row_errors,
        )

        locs = logical_locs.long()
        truth = owner_rows(runtime, pool_pages, locs, kind)
        # Logical pages 0 .. cp-1 are the ranks' dummy pages: padded tokens write there (loc 0).
        real = (locs // runtime.layout.page_size) >= runtime.layout.cp_size
        self.counts["stores"] += 1
        if kind == "kv":
            self.counts["padding_rows"] += int((~real).sum())
        truth, stored, locs = truth[real], stored[real], locs[real]
        if kind == "kv":
            dtype = str(runtime.pool.dtype)
            errors = relative_row_errors(kv_values(truth, dtype), kv_values(stored, dtype))
        else:
            errors = relative_row_errors(index_values(truth), index_values(stored))
        wrong = errors > WRONG_ROW_RELATIVE_ERROR
        self.counts[f"{kind}_rows"] += int(locs.numel())
        self.counts[f"{kind}_bit_diffs"] += int((truth != stored).any(dim=1).sum())
        self.counts[f"{kind}_wrong"] += int(wrong.sum())
        if bool(wrong.any()):
            first = int(torch.nonzero(wrong)[0])
            logger.error(
                "cp-shared-kv smoke draft write audit: %d of %d draft %s rows written by this forward "
                "are not on their owner (first: logical loc %d, owner rank %d, relative error %.3f)",
                int(wrong.sum()), locs.numel(), kind, int(locs[first]),
                int(locs[first] // runtime.layout.page_size % runtime.layout.cp_size), float(errors[first]),
            )  # fmt: skip
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.counts))
        os.replace(tmp, self.path)


def register_hooks(registry, audit_dir: Path, rank_of, shared_kv: bool) -> None:
    """The draft pool's discovery (every server), and under shared KV the write audit of its stores.
    ``rank_of()``: this process's rank (the dump files' and counts' names)."""
    registry.register(f"{_MODEL_RUNNER}.init_attention_backend", after_init_attention_backend, HookType.AFTER)
    if not shared_kv:
        return
    registry.register(_ATTACH_DRAFT, after_attach_draft_runtime, HookType.AFTER)
    audits: dict = {}

    def audit_of(runtime) -> DraftWriteAudit:
        return audits.setdefault(id(runtime), DraftWriteAudit(audit_dir, rank_of()))

    def around_store_mla_kv(original_store, runtime, setter, layer, logical_locs, cache_k_nope, cache_k_rope):
        if not is_draft_pool(runtime.pool) or runtime.plan is None:
            return original_store(runtime, setter, layer, logical_locs, cache_k_nope, cache_k_rope)
        from cp_shared_kv_smoke_hooks.kv_audit import token_bytes
        from sglang_cp_shared_kv.model_executor.gather_scratch import SCRATCH_LAYER_ID
        from sglang_cp_shared_kv.model_executor.peer_page_gather import as_pages

        stored: list = []

        def storing(slot, scratch_layer, scratch_locs, *rest):
            # The runtime stores the batch once, into the scratch slot; its bytes are what this rank
            # wrote for each loc (before the gather fills the slot's other pages from their owners).
            out = setter(slot, scratch_layer, scratch_locs, *rest)
            pages = as_pages(slot.kv_buffer[SCRATCH_LAYER_ID], slot.page_size).view(torch.uint8)
            rows = scratch_locs.long()
            stored.append(token_bytes(pages[rows // slot.page_size], rows % slot.page_size, slot.page_size, "kv").clone())
            return out

        result = original_store(runtime, storing, layer, logical_locs, cache_k_nope, cache_k_rope)
        pool = runtime.pool
        layer_pages = as_pages(pool.kv_buffer[layer.layer_id - pool.start_layer], pool.page_size).view(torch.uint8)
        audit_of(runtime).check(runtime, layer_pages, logical_locs, stored[0], "kv")
        return result

    def around_store_index_k(original_store, runtime, setter, indexer, forward_batch, layer_id, key, act_quant):
        if not is_draft_pool(runtime.pool) or runtime.plan is None:
            return original_store(runtime, setter, indexer, forward_batch, layer_id, key, act_quant)
        from cp_shared_kv_smoke_hooks.kv_audit import token_bytes
        from sglang_cp_shared_kv.model_executor.gather_scratch import SCRATCH_LAYER_ID

        logical_locs = forward_batch.out_cache_loc
        stored: list = []

        def storing(indexer_, batch, scratch_layer_id, key_, act_quant=None):
            # Called with the batch pointed at the scratch slot and its scratch locs.
            out = setter(indexer_, batch, scratch_layer_id, key_, act_quant=act_quant)
            slot, rows = batch.token_to_kv_pool, batch.out_cache_loc.long()
            pages = slot.index_k_with_scale_buffer[SCRATCH_LAYER_ID]
            stored.append(token_bytes(pages[rows // slot.page_size], rows % slot.page_size, slot.page_size, "index").clone())
            return out

        result = original_store(runtime, storing, indexer, forward_batch, layer_id, key, act_quant)
        pool = runtime.pool
        layer_pages = pool.index_k_with_scale_buffer[layer_id - pool.start_layer]
        audit_of(runtime).check(runtime, layer_pages, logical_locs, stored[0], "index")
        return result

    registry.register(f"{_RUNTIME}.store_mla_kv", around_store_mla_kv, HookType.AROUND)
    registry.register(f"{_RUNTIME}.store_index_k", around_store_index_k, HookType.AROUND)


def stored_draft_rows(draft_pool, positions_and_rows) -> dict:
    """The draft pool's rows of a finished request for the pool dump: its KV and indexer K (one layer)."""
    from cp_shared_kv_smoke_hooks.kv_audit import token_bytes

    positions, rows = positions_and_rows
    ps = draft_pool.page_size
    kv = torch.stack([buf[rows].flatten(1).view(torch.uint8) for buf in draft_pool.kv_buffer], 1)
    index = torch.stack(
        [token_bytes(buf[rows // ps], rows % ps, ps, "index") for buf in draft_pool.index_k_with_scale_buffer], 1
    )
    return {"draft_positions": positions.cpu().numpy(), "draft_kv": kv.cpu().numpy(), "draft_index": index.cpu().numpy()}
