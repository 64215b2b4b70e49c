"""The smoke's read audit of per-owner decode: every row a rank attends to is its own row of the
token the global top-k selected.

In a per-owner decode forward no page is gathered, so the scratch read audit (``kv_audit``) has
nothing to look at. What can go wrong instead is the mapping from a selected token to a pool row:
the rank's owned-page table, the positions and rows of its score columns, the owner a candidate is
attributed to. This audit recomputes, for every top-k layer, what each rank must attend to from
the backend's own token table (``page_table_1``: request position -> logical loc) with the layout's
arithmetic alone (logical page ``q`` on rank ``q % cp`` as physical page ``q // cp``), and compares
it with the indices the rank hands the attention kernel:

* ``wrong_rows``: entries whose row differs from the expected one (-1 where another rank owns the
  token, or where the selection is padding);
* ``wrong_owner``: selected tokens attributed to a rank that does not own them;
* ``missing``: real requests whose selection holds fewer than ``min(seq_len, topk)`` tokens (a
  rank's candidates lost); requests on the dummy pages (sglang's padding rows) are counted apart.

Counts go to ``<dir>/decode_read_audit.rank<r>.json``; rows of another owner are logged as ERROR.
Smoke servers only: it reads the selection back to the host once per layer.

Under decode CUDA graphs (``per_owner_decode.cuda_graphs``) no Python runs inside a replayed forward, and
none may read the device while a graph is captured. Two checks cover replays:

* the table audit: the static owner tables, refreshed in Python before each replay
  (``OwnerTableBuffers.refresh``), column by column against the same layout arithmetic (the
  column's position, its row, its owner, and each request's owned token count), counted as
  ``graph_forwards`` / ``graph_columns`` with the same ``wrong_rows`` / ``wrong_owner`` /
  ``missing`` keys;
* the replay audit: during a capture, each layer's selection, candidates and attention indices
  (tensors the graph rewrites at every replay) are kept by batch size; after each replay of that
  size (``CudaGraphRunner.replay``) the per-layer check runs on them against the replay's token
  table, counted as ``graph_replays`` and ``graph_layers`` besides the shared keys. It is what sees
  a replay attending what the graph computed, not what the tables say (2026-12-03: columns cached
  across sglang's warm-ups left every replay reading the capture batch's columns; the table audit
  passed, this one counts each chosen candidate without a position as missing).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist

from sglang.srt.plugins.hook_registry import HookType

logger = logging.getLogger(__name__)

_PER_OWNER = "sglang_cp_shared_kv.model_executor.per_owner_decode.decode_forward"
_GRAPHS = "sglang_cp_shared_kv.model_executor.per_owner_decode.cuda_graphs"
COUNT_KEYS = ("forwards", "layers", "selected", "attended_rows", "wrong_rows", "wrong_owner", "missing",
              "padding_requests", "graph_forwards", "graph_columns", "graph_replays", "graph_layers")  # fmt: skip
_GRAPH_RUNNER = "sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner"
_CAPTURE_ENDED = object()  # closes a batch size's captured layers; a new capture of it starts afresh


def expected_attention_indices(layout, page_table_1, seq_lens, positions, cp_rank):
    """(rows, owners) [B, k]: the pool row rank ``cp_rank`` must attend to for each selected
    position (-1 where it owns none) and the owning rank of each selected token (-1 for padding
    and for tokens on the dummy pages, which no rank owns)."""
    ps, cp = layout.page_size, layout.cp_size
    valid = (positions >= 0) & (positions < seq_lens.unsqueeze(1))
    locs = page_table_1.long().gather(1, positions.clamp(min=0).long())
    page = locs // ps
    owners = torch.where(valid & (page >= cp), page % cp, -1)
    rows = torch.where(owners == cp_rank, (page // cp) * ps + locs % ps, -1)
    return rows, owners


def capturing() -> bool:
    """A CUDA graph is being captured on this stream: nothing may be read back to the host now."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class DecodeReadAudit:
    def __init__(self, audit_dir: Path, rank: int):
        self.path = Path(audit_dir) / f"decode_read_audit.rank{rank}.json"
        self.counts = dict.fromkeys(COUNT_KEYS, 0)
        self.forward = None
        # batch size -> [(selection, candidates, indices, cp_rank)] of the captured run, per layer
        self.captured = {}
        self.replays_by_bs = {}  # graph batch size -> replays checked

    def begin_forward(self, layout, page_table_1, seq_lens) -> None:
        self.forward = (layout, page_table_1, seq_lens)
        self.counts["forwards"] += 1

    def keep_captured(self, selection, candidates, indices, cp_rank: int) -> None:
        """During a capture: the layer's tensors, which every replay of this batch size rewrites. A
        capture's first layer starts its list afresh (only the captured run's tensors are kept)."""
        bs = indices.shape[0]
        layers = self.captured.setdefault(bs, [])
        if layers and layers[-1] is _CAPTURE_ENDED:
            layers.clear()
        layers.append((selection, candidates, indices, cp_rank))

    def end_capture(self, bs: int) -> None:
        if self.captured.get(bs):
            self.captured[bs].append(_CAPTURE_ENDED)

    def check_replay(self, layout, page_table_1, seq_lens, bs: int) -> None:
        """After a replay of the graph of ``bs``: every captured layer's per-owner top-k, as now rewritten."""
        layers = [entry for entry in self.captured.get(bs, []) if entry is not _CAPTURE_ENDED]
        if not layers:
            return
        self.counts["graph_replays"] += 1
        self.replays_by_bs[str(bs)] = self.replays_by_bs.get(str(bs), 0) + 1
        self.forward = (layout, page_table_1[:bs], seq_lens[:bs])
        for selection, candidates, indices, cp_rank in layers:
            self.counts["graph_layers"] += 1
            self.check(selection, candidates, indices, cp_rank)
        self.forward = None

    def check(self, selection, candidates, indices, cp_rank: int) -> None:
        if self.forward is None or capturing():
            return
        layout, page_table_1, seq_lens = self.forward
        seq_lens = seq_lens.long()
        chosen = selection.chosen_mask()
        mine = chosen[:, cp_rank]  # this rank's candidates in the global selection
        positions = torch.where(mine, candidates.positions, -1)
        rows, owners = expected_attention_indices(layout, page_table_1, seq_lens, positions, cp_rank)
        selected_per_request = chosen.sum(dim=(1, 2))  # min(seq_len, k) each
        padding = page_table_1[:, 0].long() // layout.page_size < layout.cp_size
        want = torch.clamp(seq_lens, max=candidates.positions.shape[1])
        wrong_rows = indices.long() != rows
        wrong_owner = mine & (owners != cp_rank)
        c = self.counts
        c["layers"] += 1
        c["selected"] += int(selected_per_request.sum())
        c["attended_rows"] += int((indices >= 0).sum())
        c["wrong_rows"] += int(wrong_rows.sum())
        c["wrong_owner"] += int(wrong_owner.sum())
        c["missing"] += int(torch.where(padding, 0, (want - selected_per_request).clamp(min=0)).sum())
        # A chosen candidate always has a position; one without is a token attended nowhere.
        unplaced = mine & (candidates.positions < 0)
        c["missing"] += int(unplaced.sum())
        c["padding_requests"] += int(padding.sum())
        if bool(unplaced.any()):
            logger.error(
                "cp-shared-kv smoke decode read audit: rank %d chose %d candidates without a position "
                "(their columns' positions were never computed for this batch)", cp_rank, int(unplaced.sum()),
            )  # fmt: skip
        if bool(wrong_rows.any()):
            b, j = (int(x) for x in torch.nonzero(wrong_rows)[0])
            logger.error(
                "cp-shared-kv smoke decode read audit: rank %d attends %d of %d entries at the wrong "
                "row (first: request %d, position %d, row %d, expected %d, owner %d)", cp_rank,
                int(wrong_rows.sum()), wrong_rows.numel(), b, int(positions[b, j]),
                int(indices[b, j]), int(rows[b, j]), int(owners[b, j]),
            )
        self.save()

    def check_tables(self, layout, real_page_table, seq_lens, tables) -> None:
        """A replay's static owner tables (rows ``[:bs]``) against the layout's arithmetic."""
        ps, cp, rank = layout.page_size, layout.cp_size, layout.cp_rank
        bs, width_pages = real_page_table.shape
        seq_lens = seq_lens[:bs].long()
        width_tokens = tables.physical_page_table.shape[1] * ps
        positions = tables.local_positions(width_tokens).long()
        rows = tables.local_physical_rows(width_tokens).long()
        listed = positions >= 0
        column = (positions // ps).clamp(0, width_pages - 1)
        pages = real_page_table.long().gather(1, column)
        expected_rows = (pages // cp) * ps + positions % ps
        inside = listed & (positions < seq_lens.unsqueeze(1)) & (positions // ps < width_pages)
        wrong_owner = listed & ~(inside & (pages >= cp) & (pages % cp == rank))
        wrong_rows = listed & ~wrong_owner & (rows != expected_rows)
        # Tokens this rank owns, per request, by the arithmetic alone.
        page_column = torch.arange(width_pages, device=real_page_table.device).unsqueeze(0)
        tokens = (seq_lens.unsqueeze(1) - page_column * ps).clamp(0, ps)
        mine = (real_page_table.long() >= cp) & (real_page_table.long() % cp == rank)
        expected_owned = torch.where(mine, tokens, 0).sum(dim=1)
        c = self.counts
        c["graph_forwards"] += 1
        c["graph_columns"] += int(listed.sum())
        c["wrong_rows"] += int(wrong_rows.sum())
        c["wrong_owner"] += int(wrong_owner.sum())
        c["missing"] += int((expected_owned - tables.owned_seq_lens[:bs].long()).abs().sum())
        if bool(wrong_rows.any()):
            b, j = (int(x) for x in torch.nonzero(wrong_rows)[0])
            logger.error(
                "cp-shared-kv smoke decode table audit: rank %d's graph owner tables map %d of %d columns "
                "to the wrong row (first: request %d, position %d, row %d, expected %d)", rank,
                int(wrong_rows.sum()), int(listed.sum()), b, int(positions[b, j]), int(rows[b, j]),
                int(expected_rows[b, j]),
            )  # fmt: skip
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**self.counts, "replays_by_bs": self.replays_by_bs}))
        os.replace(tmp, self.path)


def register_hooks(registry, audit_dir: Path) -> None:
    audits = {}

    def audit() -> DecodeReadAudit:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return audits.setdefault(rank, DecodeReadAudit(audit_dir, rank))

    def after_begin_forward(taken, state, backend, forward_batch, *args, **kwargs):
        if taken:
            metadata = backend.forward_metadata
            audit().begin_forward(state.layout, metadata.page_table_1, metadata.cache_seqlens_int32)
        return None

    def after_owned_attention_indices(indices, selection, candidates, cp_rank, *args, **kwargs):
        if capturing():
            audit().keep_captured(selection, candidates, indices, cp_rank)
        else:
            audit().check(selection, candidates, indices, cp_rank)
        return None

    def after_capture_one_batch_size(result, runner, bs, *args, **kwargs):
        audit().end_capture(bs)
        return None

    def after_replay(result, runner, forward_batch, *args, **kwargs):
        backend = runner.model_runner.attn_backend
        state = getattr(backend, "_cp_per_owner_decode", None)
        metadata = getattr(backend, "forward_metadata", None)
        if state is not None and metadata is not None and forward_batch.forward_mode.is_decode():
            audit().check_replay(state.layout, metadata.page_table_1, metadata.cache_seqlens_int32, runner.bs)
        return None

    def after_refresh(tables, buffers, layout, real_page_table, seq_lens, *args, **kwargs):
        if not capturing():  # a capture's batch is sglang's dummy
            audit().check_tables(layout, real_page_table, seq_lens, tables)
        return None

    registry.register(f"{_PER_OWNER}.PerOwnerDecode.begin_forward", after_begin_forward, HookType.AFTER)
    registry.register(f"{_PER_OWNER}.owned_attention_indices", after_owned_attention_indices, HookType.AFTER)
    registry.register(f"{_GRAPHS}.OwnerTableBuffers.refresh", after_refresh, HookType.AFTER)
    registry.register(f"{_GRAPH_RUNNER}.capture_one_batch_size", after_capture_one_batch_size, HookType.AFTER)
    registry.register(f"{_GRAPH_RUNNER}.replay", after_replay, HookType.AFTER)


def totals(run_dir: Path) -> dict:
    out = dict.fromkeys(COUNT_KEYS, 0)
    out["ranks"] = 0
    out["replays_by_bs"] = {}
    for path in sorted(Path(run_dir).glob("decode_read_audit.rank*.json")):
        for key, value in json.loads(path.read_text()).items():
            if key == "replays_by_bs":
                for bs, n in value.items():
                    out[key][bs] = out[key].get(bs, 0) + n
            else:
                out[key] = out.get(key, 0) + value
        out["ranks"] += 1
    return out


def failures(t: dict) -> list:
    """Judged only where per-owner decode ran (the files exist): a wrong row, owner or lost token fails."""
    if not t.get("ranks"):
        return []
    found = []
    if not t.get("layers") and not t.get("graph_forwards"):
        found.append("decode read audit: no per-owner decode layer (or graph replay's tables) was checked")
    if t.get("graph_forwards") and not t.get("graph_replays"):
        found.append("decode read audit: graph replays ran but the replay audit checked none (no captured layer kept)")
    for key, what in (
        ("wrong_rows", "attention entries at a row other than the selected token's owner row"),
        ("wrong_owner", "selected tokens attributed to a rank that does not own them"),
        ("missing", "selected tokens missing from real requests' top-k"),
    ):
        if t.get(key):
            found.append(f"decode read audit: {t[key]} {what}")
    return found
