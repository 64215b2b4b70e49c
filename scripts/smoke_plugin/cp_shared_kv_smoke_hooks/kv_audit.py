"""The smoke's oracle: KV audits that tell a wrong page from numerical noise, and the value audit.

Comparing greedy tokens or logprobs cannot: with random weights attention is close to an average,
so a wrong page moves outputs no more than the run-to-run noise of stock sglang's NSA kernels. The
audits look at the bytes instead.

1. Pool audit, on every server (shared KV on or off; a PD decode server too, whose chunk cache
   frees what the prefill server sent). When a request finishes, before the cache takes its KV, every rank writes the KV rows (all layers) and indexer-K rows of the tokens
   it stores (shared KV: the pages it owns; replicated: rank 0 writes all) with their positions and
   token ids: ``<dir>/pool/<rid>.rank<r>.npz``. The smoke merges the ranks (each position exactly
   once) and compares with the reference server's dump of the same request. Layer-0 KV and indexer
   K depend only on (token id, position), not on attention, so a wrong write, host backup or
   load-back shows as a row of another token, far above rounding noise.
2. Read audit, on shared-KV servers. After each layer's store assembled the gather scratch, every
   rank all-gathers the layer's whole physical pool, rebuilds the replicated (logical) view with
   its own arithmetic, and checks that every row the forward references reads the same bytes
   through the scratch as in that view: ``<dir>/read_audit.rank<r>.json`` counts rows compared, rows
   that differ in any bit and rows of another token (logged as an ERROR line). This covers the plan,
   the gather and the local fills, where a wrong page never reaches the pool. Bit differences alone
   are expected in decode: every rank computes the new token's KV itself and reads its own copy
   while it is filled locally, the owner's copy afterwards; ranks may round differently.

With MTP (``--speculative-algorithm EAGLE``), the pool dumps hold the draft pool's rows too
(``draft_positions``, ``draft_kv``, ``draft_index``: the NextN layer's KV and indexer K of the
positions this rank stores, under shared KV its owned pages by the target's layout), and each dump
records how many prompt tokens the request got from the cache (``cached_tokens``), for the
cached-prefix ledger. The read audit runs on the draft's runtime as well, into its own file
(``read_audit_draft.rank<r>.json``); what is judged about the draft, and why: ``draft_audit``.

3. Value audit (``value_audit``), on every server: the attention output of the audited layers
   against attention over the replicated context recomputed in fp32, which the row audits cannot
   judge (a wrong number computed from the right rows).

All cost an extra collective or device-to-host copy per layer: smoke servers only.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from cp_shared_kv_smoke_hooks.kv_audit_compare import (
    WRONG_ROW_RELATIVE_ERROR,
    index_values,
    kv_values,
    relative_row_errors,
)
from sglang.srt.plugins.hook_registry import HookType

logger = logging.getLogger(__name__)

_RUNTIME = "sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime.CpSharedKVRuntime"
_RADIX = "sglang.srt.mem_cache.radix_cache.RadixCache"
# A PD decode server caches through ChunkCache (sglang forces it there): its dumps show what arrived.
_CHUNK = "sglang.srt.mem_cache.chunk_cache.ChunkCache"
PADDING_REQ_POOL_IDX = 0


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def audited_layers(num_layers: int) -> int:
    """How many leading layers the audits cover: all, or ``SMOKE_AUDIT_LAYERS_ENV`` if set. Every rank
    reads the same variable, so every rank skips the same layers' read-audit collectives."""
    from cp_shared_kv_smoke_hooks import SMOKE_AUDIT_LAYERS_ENV

    limit = os.environ.get(SMOKE_AUDIT_LAYERS_ENV)
    return num_layers if not limit else max(1, min(num_layers, int(limit)))


# ---------------------------------------------------------------- pool audit


def stored_rows_of(pool, logical_locs: torch.Tensor):
    """(positions in the request, pool rows) of the tokens this rank stores."""
    from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import runtime_of

    runtime = runtime_of(pool)
    positions = torch.arange(logical_locs.numel(), device=logical_locs.device)
    if runtime is None:
        return (positions, logical_locs) if _rank() == 0 else (positions[:0], logical_locs[:0])
    layout = runtime.layout
    owned = layout.owned_by_this_rank(logical_locs)
    # Every loc passed is owned, so none falls back to the dummy page.
    return positions[owned], layout.physical_locs_or_dummy(logical_locs[owned])


def dump_finished_request(audit_dir: Path, cache, req, draft_pool=None) -> None:
    """``draft_pool``: the MTP draft worker's pool (same locs as the target's), dumped alongside."""
    pool = cache.token_to_kv_pool_allocator.get_kvcache()
    n = req.kv_committed_len
    locs = cache.req_to_token_pool.req_to_token[req.req_pool_idx, :n].long()
    token_ids = np.asarray((req.origin_input_ids + req.output_ids)[:n], dtype=np.int64)
    positions, rows = stored_rows_of(pool, locs)
    if pool.device != "cpu":
        torch.cuda.synchronize()
    layers = audited_layers(len(pool.kv_buffer))
    kv = torch.stack([buf[rows].flatten(1).view(torch.uint8) for buf in pool.kv_buffer[:layers]], 1)
    ps = pool.page_size
    index = torch.stack(
        [token_bytes(buf[rows // ps], rows % ps, ps, "index") for buf in pool.index_k_with_scale_buffer[:layers]], 1
    )
    draft = {}
    if draft_pool is not None:
        from cp_shared_kv_smoke_hooks.draft_audit import stored_draft_rows

        draft = stored_draft_rows(draft_pool, stored_rows_of(draft_pool, locs))
    write_pool_dump(
        audit_dir, req.rid, _rank(), positions.cpu().numpy(), token_ids, kv.cpu().numpy(), index.cpu().numpy(),
        str(pool.dtype), int(getattr(req, "cached_tokens", 0) or 0), **draft,
    )  # fmt: skip


def write_pool_dump(audit_dir, rid, rank, positions, token_ids, kv, index, kv_dtype="torch.bfloat16",
                    cached_tokens=0, **draft) -> None:  # fmt: skip
    """One rank's dump of one request (the format ``kv_audit_compare.load_dumps`` reads): the rows
    (``[positions, layers, bytes]``) of the ``positions`` this rank stores, the request's token ids,
    and the prompt tokens it got from the cache at its first schedule. Written under a dot name and
    renamed, so a reader never sees half a dump."""
    out = Path(audit_dir) / "pool"
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{rid}.rank{rank}.npz"
    with open(tmp, "wb") as f:
        np.savez(f, positions=np.asarray(positions), token_ids=np.asarray(token_ids), kv=kv, index=index,
                 kv_dtype=np.array(kv_dtype), cached_tokens=np.array(cached_tokens), **draft)  # fmt: skip
    os.replace(tmp, out / f"{rid}.rank{rank}.npz")


# ---------------------------------------------------------------- read audit



def gather_shards(runtime, pool_pages: torch.Tensor) -> torch.Tensor:
    """Every rank's ``pool_pages`` (one layer as ``[pages, page bytes]``), ``[cp, pages, page bytes]``:
    logical page ``q`` is at ``[q % cp, q // cp]``. A collective over the CP group."""
    cp = runtime.layout.cp_size
    # Gathered into the concatenated [cp * pages, page bytes] shape, which every backend accepts
    # (gloo refuses the stacked [cp, pages, page bytes] output that NCCL also takes).
    gathered = torch.empty(
        (cp * pool_pages.shape[0],) + tuple(pool_pages.shape[1:]), dtype=pool_pages.dtype, device=pool_pages.device
    )
    dist.all_gather_into_tensor(gathered, pool_pages.contiguous(), group=runtime.cp_group)
    return gathered.view((cp,) + tuple(pool_pages.shape))

class ReadAudit:
    """Counts of rows read through the scratch that differ from their owner's row (see module doc)."""

    def __init__(self, audit_dir: Path, name: str = "read_audit"):
        """``name``: ``read_audit`` (the target's runtime) or ``read_audit_draft`` (the draft's)."""
        self.path = audit_dir / f"{name}.rank{_rank()}.json"
        self.counts = {"forwards": 0, "padding_requests": 0, "dummy_refs": 0}
        for kind in ("kv", "index"):
            self.counts.update({f"{kind}_rows": 0, f"{kind}_bit_diffs": 0, f"{kind}_wrong": 0})
        self.referenced_locs = None
        # The EAGLE draft's steps, planned together: (step backend, references, description).
        self.draft_steps: list = []

    def begin_forward(self, forward_batch) -> None:
        """Referenced locs of every real request of the forward. ``req_pool_idx`` 0 is never handed
        to a request (sglang's ``ReqToTokenPool`` starts its free slots at 1): it is the padding row
        DP-attention batches are padded with (one token at loc 0, output discarded), left out."""
        self.draft_steps = []
        self.referenced_locs, self.forward_desc, padding = self.references_of(forward_batch)
        self.counts["padding_requests"] += padding
        self.counts["forwards"] += 1

    def plan_draft_step(self, backend, forward_batch) -> None:
        """A draft step was planned (all steps are, before the first runs): its references are the
        committed tokens its metadata reads (``draft_step_lengths``), kept until the step runs."""
        self.draft_steps.append((backend, *self.references_of(forward_batch)))

    def begin_draft_step(self, backend) -> None:
        """The step of ``backend`` runs on its own plan: its references are the forward's."""
        for step_backend, locs, desc, padding in self.draft_steps:
            if step_backend is backend:
                self.referenced_locs, self.forward_desc = locs, desc
                self.counts["padding_requests"] += padding
                self.counts["forwards"] += 1
                return

    @staticmethod
    def references_of(forward_batch):
        """(referenced locs of the real requests, a description, padding requests)."""
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        rows = forward_batch.req_pool_indices.tolist()
        seq_lens = forward_batch.seq_lens_cpu.tolist()
        parts = [req_to_token[r, :n].long() for r, n in zip(rows, seq_lens) if r != PADDING_REQ_POOL_IDX]
        padding = sum(1 for r in rows if r == PADDING_REQ_POOL_IDX)
        desc = f"{forward_batch.forward_mode.name} req_pool_indices={rows[:8]} seq_lens={seq_lens[:8]}"
        return (torch.cat(parts) if parts else None), desc, padding

    def check_layer(self, runtime, pool_pages: torch.Tensor, scratch_pages: torch.Tensor, kind: str):
        """``pool_pages`` / ``scratch_pages``: one layer viewed as ``[pages, page bytes]`` (uint8)."""
        locs = self.referenced_locs
        if locs is None or runtime.plan is None or locs.numel() == 0:
            return
        ps, cp = runtime.layout.page_size, runtime.layout.cp_size
        gathered = gather_shards(runtime, pool_pages)
        page = locs // ps
        allocated = page >= cp  # logical pages 0..cp-1 are the ranks' dummy pages, never handed out
        if kind == "kv" and not bool(allocated.all()):
            self.counts["dummy_refs"] += int((~allocated).sum())
            if self.counts["dummy_refs"] < 20:
                first = int(torch.nonzero(~allocated)[0])
                logger.error(
                    "cp-shared-kv smoke read audit: %d referenced positions in never-allocated pages "
                    "(first: referenced index %d of %d, loc %d) in %s", int((~allocated).sum()), first,
                    locs.numel(), int(locs[first]), self.forward_desc,
                )
        locs, page = locs[allocated], page[allocated]
        owner, physical_page, slot = page % cp, page // cp, locs % ps
        truth = token_bytes(gathered[owner, physical_page], slot, ps, kind)
        scratch_locs = runtime.plan.remap_token_locs(locs)
        read = token_bytes(scratch_pages[scratch_locs // ps], scratch_locs % ps, ps, kind)
        differs = (truth != read).any(dim=1)
        if kind == "kv":
            errors = relative_row_errors(kv_values(truth, str(runtime.pool.dtype)), kv_values(read, str(runtime.pool.dtype)))
        else:
            errors = relative_row_errors(index_values(truth), index_values(read))
        wrong = errors > WRONG_ROW_RELATIVE_ERROR
        self.counts[f"{kind}_rows"] += locs.numel()
        self.counts[f"{kind}_bit_diffs"] += int(differs.sum())
        self.counts[f"{kind}_wrong"] += int(wrong.sum())
        if bool(wrong.any()):
            from sglang_cp_shared_kv_testing.peer_page_plan_fills import fill_lookup

            first = int(torch.nonzero(wrong)[0])
            logger.error(
                "cp-shared-kv smoke read audit: %d of %d %s rows read through the scratch hold another "
                "token than their owner's rows (first: logical loc %d, scratch loc %d, relative error "
                "%.3f, filled locally: %s)", int(wrong.sum()), locs.numel(), kind, int(locs[first]),
                int(scratch_locs[first]), float(errors[first]),
                bool(fill_lookup(runtime.plan)[locs[first] // ps] != 0),
            )
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.counts))
        os.replace(tmp, self.path)


def token_bytes(pages: torch.Tensor, slots: torch.Tensor, page_size: int, kind: str) -> torch.Tensor:
    """Bytes of token ``slots[i]`` in ``pages[i]`` (``pages``: ``[n, page bytes]`` uint8). KV pages
    are token rows back to back; an NSA indexer page is ``[page_size x head bytes | page_size x 4
    scale bytes]``."""
    per_token = pages.shape[1] // page_size
    if kind == "kv":
        cols = slots[:, None] * per_token + torch.arange(per_token, device=pages.device)
        return torch.gather(pages, 1, cols)
    head = per_token - 4
    head_cols = slots[:, None] * head + torch.arange(head, device=pages.device)
    scale_cols = page_size * head + slots[:, None] * 4 + torch.arange(4, device=pages.device)
    return torch.cat([torch.gather(pages, 1, head_cols), torch.gather(pages, 1, scale_cols)], dim=1)


def register_hooks(registry, audit_dir: str) -> None:
    from cp_shared_kv_smoke_hooks import draft_audit
    from sglang_cp_shared_kv.settings import cp_shared_kv_enabled_in_env

    root = Path(audit_dir)
    root.mkdir(parents=True, exist_ok=True)
    audits = {}

    def audit_of(runtime) -> ReadAudit:
        if id(runtime) not in audits:
            name = "read_audit_draft" if draft_audit.is_draft_pool(runtime.pool) else "read_audit"
            audits[id(runtime)] = ReadAudit(root, name)
        return audits[id(runtime)]

    from cp_shared_kv_smoke_hooks import SMOKE_AUDIT_POOL_ENV

    pool_setting = os.environ.get(SMOKE_AUDIT_POOL_ENV)  # None: every request; "0": none; else a rid regex
    dump_only = re.compile(pool_setting) if pool_setting not in (None, "0") else None

    def before_cache_finished_req(cache, req, *args, **kwargs):
        if dump_only is None or dump_only.search(str(req.rid)):
            dump_finished_request(root, cache, req, draft_audit.process_draft_pool())

    def after_begin_forward(plan, runtime, forward_batch):
        audit_of(runtime).begin_forward(forward_batch)

    def after_plan_draft_step(plan, runtime, backend, forward_batch):
        audit_of(runtime).plan_draft_step(backend, forward_batch)

    def after_begin_draft_step(selected, runtime, backend):
        if selected:
            audit_of(runtime).begin_draft_step(backend)

    # A forward without a plan (per-owner decode, eager or captured) reads no scratch: nothing to
    # check, and no slot was assembled (``kv_slot_for_read`` would raise).
    def after_store_mla_kv(result, runtime, original, layer, *args, **kwargs):
        if runtime.plan is None or layer.layer_id - runtime.pool.start_layer >= audited_layers(len(runtime.pool.kv_buffer)):
            return

        from sglang_cp_shared_kv.model_executor.gather_scratch import SCRATCH_LAYER_ID
        from sglang_cp_shared_kv.model_executor.peer_page_gather import as_pages

        # The slot this layer's store assembled (slot l % 2 under the layer-ahead prefetch).
        pool, scratch = runtime.pool, runtime.kv_slot_for_read(layer.layer_id)
        audit_of(runtime).check_layer(
            runtime,
            as_pages(pool.kv_buffer[layer.layer_id - pool.start_layer], pool.page_size).view(torch.uint8),
            as_pages(scratch.kv_buffer[SCRATCH_LAYER_ID], scratch.page_size).view(torch.uint8),
            "kv",
        )

    def after_store_index_k(result, runtime, original, indexer, forward_batch, layer_id, *args, **kwargs):
        if runtime.plan is None or layer_id - runtime.pool.start_layer >= audited_layers(len(runtime.pool.kv_buffer)):
            return

        from sglang_cp_shared_kv.model_executor.gather_scratch import SCRATCH_LAYER_ID

        pool, scratch = runtime.pool, runtime.index_slot_for_read(layer_id)
        audit_of(runtime).check_layer(
            runtime,
            pool.index_k_with_scale_buffer[layer_id - pool.start_layer],
            scratch.index_k_with_scale_buffer[SCRATCH_LAYER_ID],
            "index",
        )

    if pool_setting != "0":
        registry.register(f"{_RADIX}.cache_finished_req", before_cache_finished_req, HookType.BEFORE)
        registry.register(f"{_CHUNK}.cache_finished_req", before_cache_finished_req, HookType.BEFORE)
    shared_kv = cp_shared_kv_enabled_in_env()
    draft_audit.register_hooks(registry, root, _rank, shared_kv)
    # Every server, stock too: the stock reference's errors are the shared-KV run's tolerance.
    from cp_shared_kv_smoke_hooks import value_audit

    value_audit.register_hooks(registry, root, lambda pool: audited_layers(len(pool.kv_buffer)))
    if not shared_kv:  # the read audit checks the shared-KV gather only
        return
    registry.register(f"{_RUNTIME}.begin_forward", after_begin_forward, HookType.AFTER)
    registry.register(f"{_RUNTIME}.plan_draft_step", after_plan_draft_step, HookType.AFTER)
    registry.register(f"{_RUNTIME}.begin_draft_step", after_begin_draft_step, HookType.AFTER)
    registry.register(f"{_RUNTIME}.store_mla_kv", after_store_mla_kv, HookType.AFTER)
    registry.register(f"{_RUNTIME}.store_index_k", after_store_index_k, HookType.AFTER)
    # Per-owner decode reads no scratch: its own audit checks the rows each rank attends to.
    from cp_shared_kv_smoke_hooks import decode_read_audit

    decode_read_audit.register_hooks(registry, root)
