"""The smoke's value audit: attention computed from the right rows gives the right numbers.

The row audits (``kv_audit``, ``decode_read_audit``) prove that every rank reads and writes the right
rows. They cannot see a wrong value computed from right rows: a merge of per-owner partials with a
wrong weight, a scale misapplied to gathered peer pages, a captured CUDA graph reading a buffer left
from its warm-up. This audit recomputes, on the same server, what attention over a replicated KV
cache gives, and compares it with the output the server went on with.

For the audited layers of every forward (prefill chunks; decode, eager or replayed from a CUDA graph;
MTP's verify, draft extend and draft decode steps) one request of the batch is checked, the same one on
every rank (chosen from the batch alone, ``checked_request``):

1. its context's rows, read from their owners' physical pools by the layout's arithmetic alone
   (logical page ``q`` on rank ``q % cp`` as physical page ``q // cp``) and summed over the CP group
   (one owner per row, the other ranks add zeros): the replicated KV and indexer K, through no path
   of the plugin. A stock server reads its own replicated pool;
2. for each of the request's query rows on this rank (``PREFILL_ROWS`` of them, spread, in a prefill
   chunk): the indexer's scores from the query the indexer used (its fp8 query and head weights, kept
   from ``Indexer._get_topk_*``) over the row's causal context, their top-k, and sparse MLA attention
   over those rows with the server's attention query, in fp32 (``reference_attention``);
3. the relative L2 error of the server's output row (per owner: after the merge) against it.

The selection is recomputed rather than taken from the server, so no plugin arithmetic enters the
reference; a near tie at the top-k boundary can pick another token, an error a stock server shows
too. The tolerance comes from the stock reference server's own errors against the same
recomputation (``value_audit_compare``).

Under decode CUDA graphs nothing may be read while a graph is captured, and a replay runs no Python.
During the capture of each batch size the audited layers' inputs and outputs (tensors every replay
rewrites) are kept; after each replay of that size the check runs on them with the replay's batch.
sglang's eager warm-up runs before a capture are skipped (their batch is a dummy).

Per-owner decode merges the ranks' partial outputs in one of two forms (one exchange, or the scaled
sum: ``attention_lse_merge``); the form each checked decode row was merged by is recorded as it ran
(hooks on the two merge functions), so a run shows which merge its values judged, replays included
(a captured graph replays the form of its capture).

Each rank writes ``value_audit.rank<r>.json``: per kind of forward the rows compared and their
errors, the replays checked by batch size, the checked rows by merge form, and problems that made a
check impossible. Smoke servers
only: it reads back to the host and runs a collective per checked layer.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from sglang.srt.plugins.hook_registry import HookType
from sglang_cp_shared_kv.model_executor.per_owner_decode.attention_lse_merge import ONE_EXCHANGE, SCALED_SUM

logger = logging.getLogger(__name__)

_BACKEND = "sglang.srt.layers.attention.nsa_backend.NativeSparseAttnBackend"
_INDEXER = "sglang.srt.layers.attention.nsa.nsa_indexer.Indexer"
_GRAPH_RUNNER = "sglang.srt.model_executor.cuda_graph_runner.CudaGraphRunner"
_PER_OWNER_DECODE = "sglang_cp_shared_kv.model_executor.per_owner_decode.decode_forward"
# The merge functions per-owner decode calls (by their module's globals), by the form they are.
MERGE_FORM_OF = {"merge_by_all_gather": ONE_EXCHANGE, "merge_by_scaled_sum": SCALED_SUM}
# Query rows of the checked request checked per prefill chunk and rank: spread over its rows, the last one included.
PREFILL_ROWS = 8
KV_LORA_RANK, ROPE_DIM, INDEX_HEAD_DIM = 512, 64, 128
FP8_ROW_BYTES = 656  # 512 fp8 latent values | 4 fp32 scales (one per 128 values) | 64 bf16 rope values
PADDING_REQ_POOL_IDX = 0  # sglang never hands req_to_token row 0 to a request: padded rows use it
KINDS = ("extend", "decode", "decode_graph", "target_verify", "draft_extend", "draft_decode", "draft_extend_v2")
PROBLEM_KEYS = ("no_indexer_inputs", "row_map_mismatch", "non_finite_output")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# ---------------------------------------------------------------- rows: which query row is which


@dataclass(frozen=True)
class QueryRows:
    """For each query row of this rank's attention: its request (index in the batch, -1: padding)
    and how many tokens it attends causally (its context length)."""

    request: torch.Tensor  # [rows] int64
    context: torch.Tensor  # [rows] int64


def query_rows(forward_batch, metadata, num_rows: int, cp_split: Optional[Tuple[int, int]]) -> QueryRows:
    """The request and context length of each of ``num_rows`` query rows, from the batch's host
    fields (the same on every rank) and, per row, the backend's expanded sequence lengths.

    ``cp_split``: (cp rank, cp size) when this prefill is split round robin over the CP group
    (token ``i`` of the chunk on rank ``i % cp``), else None."""
    mode = forward_batch.forward_mode
    batch = int(forward_batch.batch_size)
    request = torch.full((num_rows,), -1, dtype=torch.int64)
    context = torch.zeros(num_rows, dtype=torch.int64)
    if mode.is_decode():
        n = min(batch, num_rows)
        request[:n] = torch.arange(n)
        context[:n] = metadata.cache_seqlens_int32[:n].long().cpu()
        return QueryRows(request, context)
    if mode.is_target_verify() or mode.is_draft_extend_v2():
        per_request = [num_rows // batch] * batch
    else:
        per_request = [int(x) for x in forward_batch.extend_seq_lens_cpu]
    owners = torch.repeat_interleave(torch.arange(len(per_request)), torch.tensor(per_request, dtype=torch.int64))
    if mode.is_extend() and not (mode.is_target_verify() or mode.is_draft_extend(include_v2=True)):
        seq_lens = [int(x) for x in forward_batch.seq_lens_cpu]
        lengths = torch.cat(
            [torch.arange(s - e + 1, s + 1, dtype=torch.int64) for e, s in zip(per_request, seq_lens)]
        ) if per_request else torch.zeros(0, dtype=torch.int64)  # fmt: skip
    else:
        lengths = metadata.nsa_seqlens_expanded[: owners.numel()].long().cpu()
    if cp_split is not None:
        rank, size = cp_split
        owners, lengths = owners[rank::size], lengths[rank::size]
    n = min(owners.numel(), num_rows)
    request[:n], context[:n] = owners[:n], lengths[:n]
    return QueryRows(request, context)


def checked_request(forward_batch, turn: int) -> Optional[int]:
    """The request whose rows are checked: the same on every rank. Prefill: the one with the longest
    context (peer pages and cached prefixes); otherwise the real requests in turn (``turn`` counts
    the checks, which every rank makes alike)."""
    pool_rows = forward_batch.req_pool_indices.tolist()
    real = [b for b, r in enumerate(pool_rows) if r != PADDING_REQ_POOL_IDX]
    if not real:
        return None
    seq_lens = [int(x) for x in forward_batch.seq_lens_cpu[: len(pool_rows)]]
    mode = forward_batch.forward_mode
    if mode.is_extend() and not (mode.is_target_verify() or mode.is_draft_extend(include_v2=True)):
        return max(real, key=lambda b: (seq_lens[b], -b))
    return real[turn % len(real)]


def context_tokens(forward_batch, rows: QueryRows, b: int, cp_split) -> int:
    """How many tokens of request ``b`` its rows can attend, the same on every rank (the size of the
    collective): a split prefill's sequence length (its last token, on some rank, attends them
    all), otherwise the longest context of its rows (every rank holds all of them)."""
    if cp_split is not None:
        return int(forward_batch.seq_lens_cpu[b])
    return int(rows.context[rows.request == b].max())


# ---------------------------------------------------------------- the replicated rows


def _token_index_bytes(pages: torch.Tensor, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """[n, 132] bytes of token ``slots[i]`` in indexer page ``pages[i]`` ([page_size x 128 fp8 | page_size x 4])."""
    head = INDEX_HEAD_DIM
    head_cols = slots[:, None] * head + torch.arange(head, device=pages.device)
    scale_cols = page_size * head + slots[:, None] * 4 + torch.arange(4, device=pages.device)
    return torch.cat([torch.gather(pages, 1, head_cols), torch.gather(pages, 1, scale_cols)], dim=1)


def replicated_rows(pool, layer_id: int, locs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(KV rows [n, row bytes], indexer-K rows [n, 132]) uint8 of logical ``locs`` at ``layer_id``,
    as a replicated pool holds them. Under shared KV a collective over the CP group: every rank
    contributes the rows it owns, read from its physical buffers at the layout's rows."""
    from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import runtime_of

    index = layer_id - pool.start_layer
    kv_buffer = pool.kv_buffer[index]
    index_buffer = pool.index_k_with_scale_buffer[index]
    ps = pool.page_size
    runtime = runtime_of(pool)
    locs = locs.long()
    if runtime is None:
        kv = kv_buffer[locs].reshape(locs.numel(), -1).view(torch.uint8)
        return kv, _token_index_bytes(index_buffer[locs // ps], locs % ps, ps)
    layout = runtime.layout
    owned = layout.owned_by_this_rank(locs)
    rows = layout.physical_locs_or_dummy(locs)
    kv_mine = kv_buffer[rows].reshape(locs.numel(), -1).view(torch.uint8)
    index_mine = _token_index_bytes(index_buffer[rows // ps], rows % ps, ps)
    kv = torch.where(owned[:, None], kv_mine, 0).contiguous()
    index_k = torch.where(owned[:, None], index_mine, 0).contiguous()
    dist.all_reduce(kv, group=runtime.cp_group)  # one owner per row: the sum is its row
    dist.all_reduce(index_k, group=runtime.cp_group)
    return kv, index_k


def kv_rows_as_float(rows: torch.Tensor, fp8: bool) -> torch.Tensor:
    """[n, row bytes] uint8 -> [n, 576] float32 latent + rope values (fp8 rows dequantized)."""
    if not fp8:
        return rows.contiguous().view(torch.bfloat16).float()
    n = rows.shape[0]
    latent = rows[:, :KV_LORA_RANK].contiguous().view(torch.float8_e4m3fn).float()
    scales = rows[:, KV_LORA_RANK : KV_LORA_RANK + 16].contiguous().view(torch.float32)
    latent = (latent.reshape(n, 4, 128) * scales[:, :, None]).reshape(n, KV_LORA_RANK)
    rope = rows[:, KV_LORA_RANK + 16 :].contiguous().view(torch.bfloat16).float()
    return torch.cat([latent, rope], dim=1)


def index_rows_as_float(rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[n, 132] uint8 -> (K [n, 128] float32 as stored in fp8, scale [n] float32)."""
    k = rows[:, :INDEX_HEAD_DIM].contiguous().view(torch.float8_e4m3fn).float()
    s = rows[:, INDEX_HEAD_DIM:].contiguous().view(torch.float32).reshape(-1)
    return k, s


# ---------------------------------------------------------------- the reference


def reference_attention(
    q: torch.Tensor,
    index_q: torch.Tensor,
    index_weights: torch.Tensor,
    kv: torch.Tensor,
    index_k: torch.Tensor,
    index_scale: torch.Tensor,
    context: torch.Tensor,
    topk: int,
    scaling: float,
    v_head_dim: int = KV_LORA_RANK,
) -> torch.Tensor:
    """NSA attention of query rows over a replicated context, in fp32: [R, H, v_head_dim].

    ``q`` [R, H, 576] (absorbed latent | rope); ``index_q`` [R, Hi, 128] and ``index_weights`` [R, Hi]
    as the indexer passes them to its logits kernel (the weights carry the query scale); ``kv``
    [n, 576] and ``index_k`` [n, 128] / ``index_scale`` [n] the request's rows by position;
    ``context`` [R]: row ``r`` attends positions ``< context[r]``. The indexer's score of position
    ``t`` is ``sum_h w_h relu(q_h . k_t * s_t)`` (DeepGEMM's paged MQA logits); attention is softmax
    over the top-``topk`` positions by score (all of them when the context is shorter)."""
    n = kv.shape[0]
    position = torch.arange(n, device=kv.device)
    visible = position[None, :] < context[:, None]  # [R, n]
    scores = torch.einsum("rhd,nd->rhn", index_q.float(), index_k.float()) * index_scale.float()[None, None, :]
    logits = (scores.relu() * index_weights.float()[:, :, None]).sum(dim=1)
    logits = logits.masked_fill(~visible, float("-inf"))
    k = min(topk, n)
    chosen = logits.topk(k, dim=1).indices  # [R, k]
    chosen_ok = torch.gather(visible, 1, chosen)
    rows = kv.float()[chosen]  # [R, k, 576]
    att = torch.einsum("rhd,rkd->rhk", q.float(), rows) * scaling
    att = att.masked_fill(~chosen_ok[:, None, :], float("-inf"))
    probs = torch.softmax(att, dim=-1)
    return torch.einsum("rhk,rkd->rhd", probs, rows[..., :v_head_dim])


def relative_errors(out: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per row ``||out - ref|| / ||ref||`` over heads and dims; a non-finite output counts as inf."""
    out, reference = out.float().flatten(1), reference.float().flatten(1)
    err = (out - reference).norm(dim=1) / reference.norm(dim=1).clamp(min=1e-12)
    return torch.where(torch.isfinite(out).all(dim=1), err, torch.full_like(err, math.inf))


# ---------------------------------------------------------------- the audit


@dataclass
class LayerCall:
    """One audited attention call: what the check needs, kept as the server's own tensors."""

    layer_id: int
    kind: str
    q: torch.Tensor  # [rows, H, 512] absorbed latent query
    q_rope: torch.Tensor  # [rows, H, 64]
    out: torch.Tensor  # [rows, H, 512] the output the layer went on with
    index_q: Optional[torch.Tensor]  # [rows, Hi, 128] fp8
    index_weights: Optional[torch.Tensor]  # [rows, Hi, 1] or [rows, Hi]
    index_layer_id: Optional[int]  # the layer whose indexer K selected (skip_topk layers reuse one)
    scaling: float
    v_head_dim: int
    pool: object
    topk: int
    fp8: bool
    merge_form: Optional[str] = None  # per-owner decode: the form its merge ran (captured: replayed)


class ValueAudit:
    def __init__(self, audit_dir: Path, rank: int, audited_layers):
        self.path = Path(audit_dir) / f"value_audit.rank{rank}.json"
        self.audited_layers = audited_layers  # (pool) -> leading layers audited
        self.errors: Dict[str, List[float]] = {k: [] for k in KINDS}
        self.layers_checked: Dict[str, int] = dict.fromkeys(KINDS, 0)
        self.problems = dict.fromkeys(PROBLEM_KEYS, 0)
        self.graph_replays_by_bs: Dict[str, int] = {}
        self.merge_form: Optional[str] = None  # the form of the merge that ran last in this process
        self.rows_by_merge_form: Dict[str, Dict[str, int]] = {}  # kind -> form -> rows checked
        # (pool id, layer id) -> (index q, weights) of the forward running now, from the indexer
        self.index_inputs: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = {}
        self.in_graph_warmup = False
        self.capture_key = None  # (runner id, bs) while a graph is captured
        self.captured: Dict[Tuple[int, int], List[LayerCall]] = {}
        self.checks = 0  # checks made (every rank makes the same): picks the checked request

    # -- what the hooks feed in

    def keep_index_inputs(self, pool, layer_id: int, index_q, weights) -> None:
        self.index_inputs[(id(pool), layer_id)] = (index_q, weights)

    def index_inputs_for(self, pool, layer_id: int):
        """The indexer inputs that selected ``layer_id``'s rows: its own, or (a ``skip_topk`` layer)
        the nearest earlier layer's."""
        best = None
        for (pool_id, lid), inputs in self.index_inputs.items():
            if pool_id == id(pool) and lid <= layer_id and (best is None or lid > best[0]):
                best = (lid, inputs)
        return best

    def audits_layer(self, pool, layer_id: int) -> bool:
        return layer_id - pool.start_layer < self.audited_layers(pool)

    def merged_by(self, form: str) -> None:
        self.merge_form = form

    def attention_call(self, backend, layer, forward_batch, q, q_rope, out) -> None:
        # A per-owner layer merges inside the attention call that returned ``out``: its form.
        merge_form, self.merge_form = self.merge_form, None
        pool = forward_batch.token_to_kv_pool
        if not self.audits_layer(pool, layer.layer_id):
            return
        if self.in_graph_warmup and not capturing():
            return
        heads = layer.tp_q_head_num
        if q_rope is None:  # one tensor [latent | rope] per head, as the backend also accepts
            rows = q.numel() // (heads * layer.head_dim)
            q_all = q.reshape(rows, heads, layer.head_dim)
            q, q_rope = q_all[..., : layer.v_head_dim], q_all[..., layer.v_head_dim :]
        rows = q.numel() // (heads * layer.v_head_dim)
        found = self.index_inputs_for(pool, layer.layer_id)
        call = LayerCall(
            layer_id=layer.layer_id,
            kind=kind_of(forward_batch, pool),
            q=q.reshape(rows, heads, layer.v_head_dim),
            q_rope=q_rope.reshape(rows, heads, -1),
            out=out.reshape(rows, heads, layer.v_head_dim),
            index_q=None if found is None else found[1][0],
            index_weights=None if found is None else found[1][1],
            index_layer_id=None if found is None else found[0],
            scaling=float(layer.scaling),
            v_head_dim=int(layer.v_head_dim),
            pool=pool,
            topk=int(backend.nsa_index_topk),
            fp8=pool.kv_buffer[0].element_size() == 1,
            merge_form=merge_form,
        )
        if capturing():
            if self.capture_key is not None:
                self.captured.setdefault(self.capture_key, []).append(call)
            return
        self.check(call, forward_batch, backend.forward_metadata, cp_split_of(forward_batch))

    def begin_capture(self, runner, bs: int) -> None:
        self.capture_key = (id(runner), bs)
        self.captured[self.capture_key] = []  # a recapture replaces the kept tensors
        self.in_graph_warmup = True

    def end_capture(self) -> None:
        self.capture_key = None
        self.in_graph_warmup = False

    def after_replay(self, runner, forward_batch, metadata) -> None:
        calls = self.captured.get((id(runner), runner.bs))
        if not calls or not forward_batch.forward_mode.is_decode():
            return
        key = str(runner.bs)
        self.graph_replays_by_bs[key] = self.graph_replays_by_bs.get(key, 0) + 1
        for call in calls:
            replayed = LayerCall(**{**call.__dict__, "kind": "decode_graph"})
            self.check(replayed, forward_batch, metadata, None)

    # -- the check

    def check(self, call: LayerCall, forward_batch, metadata, cp_split) -> None:
        """Every rank calls this for the same forwards and layers: the collective inside runs on all."""
        rows = query_rows(forward_batch, metadata, call.out.shape[0], cp_split)
        b = checked_request(forward_batch, self.checks)
        self.checks += 1
        if b is None:
            return
        if call.index_q is None or call.index_q.shape[0] != call.out.shape[0]:
            self.problems["no_indexer_inputs"] += 1
            self.save()
            return
        n = context_tokens(forward_batch, rows, b, cp_split)
        req_row = int(forward_batch.req_pool_indices[b])
        locs = forward_batch.req_to_token_pool.req_to_token[req_row, :n]
        kv_bytes, _ = replicated_rows(call.pool, call.layer_id, locs)
        _, index_bytes = replicated_rows(call.pool, call.index_layer_id, locs)
        mine = torch.nonzero(rows.request == b).flatten()
        if mine.numel() > PREFILL_ROWS:
            pick = torch.linspace(0, mine.numel() - 1, PREFILL_ROWS).round().long()
            mine = mine[pick]
        if mine.numel() == 0:
            return
        context = rows.context[mine]
        if bool((context > n).any()) or bool((context < 1).any()):
            self.problems["row_map_mismatch"] += 1
            logger.error(
                "cp-shared-kv smoke value audit: rows of request %d attend %s tokens of %d gathered (%s)",
                b, context.tolist(), n, forward_batch.forward_mode.name,
            )  # fmt: skip
            self.save()
            return
        device = call.out.device
        index = mine.to(device)
        kv = kv_rows_as_float(kv_bytes, call.fp8)
        index_k, index_scale = index_rows_as_float(index_bytes)
        weights = call.index_weights.reshape(call.index_weights.shape[0], -1)
        q = torch.cat([call.q[index].float(), call.q_rope[index].float()], dim=-1)
        index_q = _rows_of(call.index_q, index)
        reference = reference_attention(
            q, index_q, weights[index], kv, index_k, index_scale, context.to(device),
            call.topk, call.scaling, call.v_head_dim,
        )  # fmt: skip
        errors = relative_errors(call.out[index], reference).cpu()
        if not bool(torch.isfinite(errors).all()):
            self.problems["non_finite_output"] += int((~torch.isfinite(errors)).sum())
        self.errors[call.kind] += [round(float(e), 7) if math.isfinite(e) else 1e9 for e in errors.tolist()]
        if call.merge_form is not None:
            forms = self.rows_by_merge_form.setdefault(call.kind, {})
            forms[call.merge_form] = forms.get(call.merge_form, 0) + errors.numel()
        self.layers_checked[call.kind] += 1
        self.save()

    def save(self) -> None:
        data = {
            "errors": {k: v for k, v in self.errors.items() if v},
            "layers_checked": {k: v for k, v in self.layers_checked.items() if v},
            "problems": self.problems,
            "graph_replays_by_bs": self.graph_replays_by_bs,
            "rows_by_merge_form": self.rows_by_merge_form,
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)


def _rows_of(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tensor[index]``, for fp8 tensors too (indexed as bytes: not every device indexes fp8)."""
    if tensor.element_size() == 1 and tensor.is_floating_point():
        return tensor.view(torch.uint8)[index].view(tensor.dtype)
    return tensor[index]


def kind_of(forward_batch, pool) -> str:
    from cp_shared_kv_smoke_hooks.draft_audit import is_draft_pool

    mode = forward_batch.forward_mode
    if mode.is_target_verify():
        return "target_verify"
    if mode.is_draft_extend_v2():
        return "draft_extend_v2"
    if mode.is_draft_extend():
        return "draft_extend"
    if mode.is_decode():
        return "draft_decode" if is_draft_pool(pool) else "decode"
    return "extend"


def cp_split_of(forward_batch) -> Optional[Tuple[int, int]]:
    """(cp rank, cp size) where sglang splits this prefill's tokens round robin over the CP group."""
    from sglang.srt.layers.attention.nsa.utils import can_nsa_prefill_cp_round_robin_split
    from sglang.srt.layers.dp_attention import get_attention_cp_rank, get_attention_cp_size

    if not can_nsa_prefill_cp_round_robin_split(forward_batch):
        return None
    return get_attention_cp_rank(), get_attention_cp_size()


# ---------------------------------------------------------------- hooks


def _bound(function, args, kwargs) -> inspect.BoundArguments:
    call = inspect.signature(inspect.unwrap(function)).bind(*args, **kwargs)
    call.apply_defaults()
    return call


def register_hooks(registry, audit_dir: Path, audited_layers) -> None:
    """``audited_layers(pool)``: how many leading layers of ``pool`` the audits cover."""
    from sglang.srt.layers.attention.nsa import nsa_indexer
    from sglang.srt.layers.attention.nsa_backend import NativeSparseAttnBackend

    audits = {}

    def audit() -> ValueAudit:
        rank = _rank()
        return audits.setdefault(rank, ValueAudit(audit_dir, rank, audited_layers))

    def keeping_index_inputs(method):
        def before(indexer, *args, **kwargs):
            call = _bound(method, (indexer,) + args, kwargs).arguments
            pool = call["forward_batch"].token_to_kv_pool
            audit().keep_index_inputs(pool, call["layer_id"], call["q_fp8"], call["weights"])
            return None

        return before

    def checking(method):
        def around(original, backend, *args, **kwargs):
            out = original(backend, *args, **kwargs)
            call = _bound(method, (backend,) + args, kwargs).arguments
            audit().attention_call(
                backend, call["layer"], call["forward_batch"], call["q"], call["q_rope"], out
            )
            return out

        return around

    def merged_by(form):
        def before(*args, **kwargs):
            audit().merged_by(form)
            return None

        return before

    def around_capture_one_batch_size(original, runner, bs, *args, **kwargs):
        audit().begin_capture(runner, bs)
        try:
            return original(runner, bs, *args, **kwargs)
        finally:
            audit().end_capture()

    def after_replay(result, runner, forward_batch, *args, **kwargs):
        backend = runner.model_runner.attn_backend
        audit().after_replay(runner, forward_batch, backend.forward_metadata)
        return None

    for name in ("_get_topk_paged", "_get_topk_ragged"):
        registry.register(f"{_INDEXER}.{name}", keeping_index_inputs(getattr(nsa_indexer.Indexer, name)), HookType.BEFORE)
    for name in ("forward_decode", "forward_extend"):
        registry.register(f"{_BACKEND}.{name}", checking(getattr(NativeSparseAttnBackend, name)), HookType.AROUND)
    registry.register(f"{_GRAPH_RUNNER}.capture_one_batch_size", around_capture_one_batch_size, HookType.AROUND)
    for name, form in MERGE_FORM_OF.items():
        registry.register(f"{_PER_OWNER_DECODE}.{name}", merged_by(form), HookType.BEFORE)
    registry.register(f"{_GRAPH_RUNNER}.replay", after_replay, HookType.AFTER)
