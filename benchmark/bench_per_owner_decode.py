"""One decode layer's per-rank work, per owner vs through the page gather, on one GPU (GLM-5 widths).

GLM-5 widths: 64 heads, KV latent 512 + rope 64 (fp8 656-byte rows, ``flashmla_kv``), indexer 32
heads x 128 (fp8, 132 bytes per token), 64-token pages, top-k 2048. For each cp size, batch and
context (tokens per request), the work ONE rank does in one decode layer, timed on the device:

* per owner (what ``per_owner_decode`` runs): ``deep_gemm.fp8_paged_mqa_logits`` over the pages this
  rank owns (its block table from ``owner_decode_tables``), the local top-k candidates
  (``decode_topk_merge.local_candidates``), the global selection from the ``cp_size * k`` candidates
  and this rank's attention indices, ``flash_mla_with_kvcache`` over the owned rows (-1 elsewhere),
  and the merge arithmetic in the form ``--merge-form`` names (default ``rule``: the one per-owner
  decode picks for the cp size and batch, ``attention_lse_merge.choose_merge_exchange`` with the
  default setting): the scaled sum's (global LSE, this rank's scaled partial:
  ``scaled_partial_of_gathered``) or the one exchange's (this rank's partial and LSE packed, every
  rank's merged: ``pack_partial`` + ``merge_gathered``). The exchange is EMULATED in process: the
  other ranks' candidate scores, LSEs or packed partials are precomputed tensors concatenated with
  this rank's (no collective is timed; ``bench_per_owner_decode_exchange.py`` times the collectives).
  The owner tables are built once per forward and timed separately (``tables``).
* page gather (the path decode takes without per-owner decode): a device copy of every page of the
  batch (KV rows and indexer pages) into a scratch, which stands for the gather's writes of the
  rank's own and received pages (the network transfer is EXCLUDED), the indexer over all pages,
  sglang's fused top-k (``fast_topk_transform_fused``) and ``flash_mla_with_kvcache`` over the 2048
  selected rows.
* replicated (what stock sglang runs with shared KV off): the page gather's layer without its copy,
  over the same rows.

Times: median over ``--iters`` runs of CUDA-event time per layer, after ``--warmup`` runs, twice:
eager (host launch gaps included: what an eager decode pays) and as a CUDA graph replay of the same
layer (device time only: what decode under CUDA graphs pays). Pass/fail: none; a table, per-owner /
gather ratios, then the merge form.

``--merge-kernels`` times only the merge arithmetic of both forms, per cp size (default 2,4,8) and
batch (default 1,2,4,...,128), eager and as a graph: the scaled sum's kernel on the gathered LSEs,
and the one exchange's pack and merge kernel on a gathered buffer (the all-gather's output,
precomputed: the collectives themselves are ``bench_per_owner_decode_exchange.py``'s), next to the
form the rule picks. It needs no deep_gemm or FlashMLA.

    source scripts/gpu/remote_env.sh && python benchmark/bench_per_owner_decode.py     # H200, ~2 min
    python benchmark/bench_per_owner_decode.py --device cpu                            # dry run
    python benchmark/bench_per_owner_decode.py --merge-kernels                         # H200, seconds

Needs ``deep_gemm``, ``sgl_kernel``'s FlashMLA and fused top-k on the device (``deep_gemm`` is staged
with ``build_stage.sh --serve``). ``--device cpu`` is a dry run of the plumbing: torch references of the kernels, tiny contexts
(``--contexts-k`` defaults to 1,2 there, top-k 128); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from sglang_cp_shared_kv.settings import MODELED_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES as DEFAULT_ONE_EXCHANGE_BYTES

HEADS, INDEX_HEADS, INDEX_DIM, PAGE = 64, 32, 128, 64
KV_ROW_BYTES, INDEX_ROW_BYTES = 656, INDEX_DIM + 4
SM_SCALE = 576**-0.5


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--cp-sizes", default=None, type=lambda s: [int(x) for x in s.split(",")],
                        help="default 2,8 (--merge-kernels: 2,4,8)")
    parser.add_argument("--batches", default=None, type=lambda s: [int(x) for x in s.split(",")],
                        help="default 1,32 (--merge-kernels: 1,2,4,...,128)")
    parser.add_argument("--merge-form", choices=("rule", "all_gather", "scaled_sum"), default="rule",
                        help="the per-owner layer's merge: the rule's pick (default), or one form")
    parser.add_argument("--merge-kernels", action="store_true",
                        help="time only the merge arithmetic of both forms (no indexer, attention, gather)")
    parser.add_argument("--contexts-k", default=None, type=lambda s: [int(x) for x in s.split(",")],
                        help="tokens per request, in units of 1024 (default 4,16,64,128; cpu: 1,2)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time each part of the per-owner layer, eager and as a graph")
    parser.add_argument("--topk", type=int, default=None, help="default 2048 (cpu: 128)")
    parser.add_argument("--iters", type=int, default=None, help="default 20 (cpu: 1)")
    parser.add_argument("--warmup", type=int, default=None, help="default 3 (cpu: 0)")
    parser.add_argument("--json-out", default=None, help="write every case's numbers (for bench_stock_decode_layer.py)")
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    args.cp_sizes = args.cp_sizes or ([2, 4, 8] if args.merge_kernels else [2, 8])
    args.batches = args.batches or ([1, 2, 4, 8, 16, 32, 64, 128] if args.merge_kernels else [1, 32])
    args.contexts_k = args.contexts_k or ([1, 2] if cpu else [4, 16, 64, 128])
    args.topk = args.topk or (128 if cpu else 2048)
    args.iters = args.iters or (1 if cpu else 20)
    args.warmup = args.warmup if args.warmup is not None else (0 if cpu else 3)
    return args


# ---- kernels: real on CUDA, torch references on CPU ----


class Kernels:
    def __init__(self, device: str, topk: int):
        from sglang_cp_shared_kv_testing import nsa_decode_reference as ref

        self.device, self.topk, self.ref = device, topk, ref
        if device == "cuda":
            import deep_gemm
            from sgl_kernel import fast_topk_transform_fused
            from sgl_kernel.flash_mla import flash_mla_with_kvcache, get_mla_metadata

            self.deep_gemm, self.fused_topk = deep_gemm, fast_topk_transform_fused
            self.flash_mla, self.mla_metadata = flash_mla_with_kvcache, get_mla_metadata
            self.num_sms = deep_gemm.get_num_sms()

    def schedule(self, lens):
        if self.device != "cuda":
            return None
        return self.deep_gemm.get_paged_mqa_logits_metadata(lens, PAGE, self.num_sms)

    def logits(self, q_fp8, weights, index_pages, block_table, lens, schedule):
        if self.device != "cuda":
            pages = index_pages.view(index_pages.shape[0], -1)
            return self.ref.paged_mqa_logits_reference(q_fp8, weights, pages, block_table, lens, PAGE)
        return self.deep_gemm.fp8_paged_mqa_logits(
            q_fp8.unsqueeze(1), index_pages, weights, lens, block_table, schedule,
            block_table.shape[1] * PAGE, clean_logits=False,
        )

    def attention_metadata(self, cache_seqlens):
        if self.device != "cuda":
            return None
        return self.mla_metadata(cache_seqlens, HEADS, 1, HEADS, True, self.topk)

    def attention(self, q, kv_rows, indices, cache_seqlens, metadata):
        """(out [B, H, 512], natural LSE [B, H]) over fp8 rows [N, 656] with ``indices`` [B, k]."""
        if self.device != "cuda":
            rows = self.ref.kv_rows_as_float(kv_rows)
            out, lse = self.ref.sparse_mla_decode_reference(q.float(), rows, indices, SM_SCALE)
            return out.to(q.dtype), lse
        batch = q.shape[0]
        out, lse = self.flash_mla(
            q=q.view(batch, 1, HEADS, -1),
            k_cache=kv_rows.view(torch.float8_e4m3fn).view(-1, PAGE, 1, KV_ROW_BYTES),
            block_table=torch.empty((batch, 0), dtype=torch.int32, device=q.device),
            cache_seqlens=cache_seqlens, head_dim_v=512, tile_scheduler_metadata=metadata[0],
            num_splits=metadata[1], softmax_scale=SM_SCALE, indices=indices.view(batch, 1, -1),
            is_fp8_kvcache=True,
        )
        return out[:, 0], lse[:, :, 0]

    def sglang_topk(self, logits, lens, page_table_1, cu_seqlens_q):
        if self.device != "cuda":
            from sglang_cp_shared_kv_testing.decode_topk_reference import replicated_topk_positions

            positions = replicated_topk_positions(logits, lens, self.topk)
            return torch.where(positions >= 0, page_table_1.gather(1, positions.clamp(min=0).long()), -1)
        return self.fused_topk(
            score=logits, lengths=lens, page_table_size_1=page_table_1, cu_seqlens_q=cu_seqlens_q,
            topk=self.topk, row_starts=None,
        )


# ---- the pools ----


def make_pool(tokens: int, device: str) -> tuple:
    """Random fp8 KV rows [tokens, 656] (uint8) and indexer pages [tokens / 64, 64, 1, 132] (uint8)
    with finite values (fp8 from normals, unit scales)."""
    pages = tokens // PAGE
    kv = torch.empty(tokens, KV_ROW_BYTES, dtype=torch.uint8, device=device)
    kv[:, :512] = torch.randn(tokens, 512, device=device).to(torch.float8_e4m3fn).view(torch.uint8)
    kv[:, 512:528] = torch.ones(tokens, 4, device=device).view(torch.uint8)
    kv[:, 528:] = torch.randn(tokens, 64, device=device).to(torch.bfloat16).view(torch.uint8)
    index = torch.empty(pages, PAGE * INDEX_ROW_BYTES, dtype=torch.uint8, device=device)
    index[:, : PAGE * INDEX_DIM] = (
        torch.randn(pages, PAGE * INDEX_DIM, device=device).to(torch.float8_e4m3fn).view(torch.uint8)
    )
    index[:, PAGE * INDEX_DIM :] = torch.ones(pages, PAGE, device=device).view(torch.uint8)
    return kv, index.view(pages, PAGE, 1, INDEX_ROW_BYTES)


def _timer(device: str, iters: int, warmup: int):
    def run(fn) -> float:
        """Median microseconds of ``fn`` per call."""
        times = []
        for i in range(warmup + iters):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                elapsed_us = start.elapsed_time(end) * 1e3
            else:
                t0 = time.perf_counter()
                fn()
                elapsed_us = (time.perf_counter() - t0) * 1e6
            if i >= warmup:
                times.append(elapsed_us)
        return statistics.median(times)

    return run


def _graphed(device: str, fn):
    """``fn`` captured once into a CUDA graph; returns its replay (``fn`` itself on CPU)."""
    if device != "cuda":
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture (allocations, lazy inits)
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def run_case(args, kernels: Kernels, pool, cp_size: int, batch: int, context_tokens: int) -> dict:
    from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
    from sglang_cp_shared_kv.model_executor.per_owner_decode import attention_lse_merge as merge
    from sglang_cp_shared_kv.model_executor.per_owner_decode.decode_topk_merge import (
        local_candidates,
        owned_attention_indices,
        select_global,
    )
    from sglang_cp_shared_kv.model_executor.per_owner_decode.owner_decode_tables import (
        build_owner_decode_tables,
    )

    device, topk = args.device, args.topk
    timer = _timer(device, args.iters, args.warmup)
    g = torch.Generator(device="cpu").manual_seed(cp_size * 1000 + batch)
    kv_pool, index_pool = pool
    pages_per_request = context_tokens // PAGE
    total_pages = batch * pages_per_request
    seq_lens = torch.full((batch,), context_tokens, dtype=torch.int32, device=device)
    q_index = torch.randn(batch, INDEX_HEADS, INDEX_DIM, generator=g).to(device).to(torch.float8_e4m3fn)
    weights = (torch.rand(batch, INDEX_HEADS, generator=g) * 0.1).to(device)
    q = torch.randn(batch, HEADS, 576, generator=g).to(device).to(torch.bfloat16)
    nsa_lens = seq_lens.clamp(max=topk)

    # Per owner, rank 0: logical pages >= cp_size in a random order; rank 0's shard is physical
    # pages 0 .. total / cp + 1 of the pool buffers.
    layout = CpSharedKVLayout(cp_size, 0, PAGE)
    logical = (torch.randperm(total_pages, generator=g) + cp_size).view(batch, pages_per_request)
    real_page_table = logical.to(device=device, dtype=torch.int32)
    shard_pages = total_pages // cp_size + 2
    shard_kv, shard_index = kv_pool[: shard_pages * PAGE], index_pool[:shard_pages]
    tables = build_owner_decode_tables(layout, real_page_table, seq_lens)
    width = tables.physical_page_table.shape[1] * PAGE
    positions, rows = tables.local_positions(width), tables.local_physical_rows(width)
    owner_schedule = kernels.schedule(tables.owned_seq_lens)
    owner_metadata = kernels.attention_metadata(nsa_lens)
    owned_lens = tables.owned_seq_lens
    # The other ranks' candidates: this rank's scores in other orders (each score cp times, so the
    # global selection takes k / cp rows from each rank).
    first = local_candidates(kernels.logits(q_index, weights, shard_index, tables.physical_page_table,
                                            owned_lens, owner_schedule).float(), owned_lens, positions, rows, topk)
    shuffles = [torch.randperm(topk, generator=g).to(device) for _ in range(cp_size - 1)]
    others = torch.stack([first.scores[:, order] for order in shuffles])
    other_lses = torch.randn(cp_size - 1, batch, HEADS, generator=g).to(device)
    other_outs = torch.randn(cp_size - 1, batch, HEADS, 512, generator=g).to(device, torch.bfloat16)
    other_packed = torch.stack([merge.pack_partial(o, l) for o, l in zip(other_outs, other_lses)])
    selection = select_global(torch.cat([first.scores[None], others]), topk)
    attended = int((owned_attention_indices(selection, first, 0) >= 0).sum()) // batch  # setup only
    merge_form = args.merge_form
    if merge_form == "rule":
        merge_form = merge.choose_merge_exchange(batch, HEADS, 512, 2, cp_size, DEFAULT_ONE_EXCHANGE_BYTES)

    def merged(out, lse):
        """The merge arithmetic of ``merge_form``, its exchange emulated."""
        if merge_form == merge.ONE_EXCHANGE:
            gathered = torch.cat([merge.pack_partial(out, lse)[None], other_packed])  # emulated all-gather
            return merge.merge_gathered(gathered, out.shape[-1])
        lses = torch.cat([lse.float()[None], other_lses])  # emulated all-gather
        return merge.scaled_partial_of_gathered(out, lse, lses)  # then the sum all-reduce

    def per_owner_layer():
        logits = kernels.logits(
            q_index, weights, shard_index, tables.physical_page_table, tables.owned_seq_lens, owner_schedule
        )
        candidates = local_candidates(logits, owned_lens, positions, rows, topk)
        gathered = torch.cat([candidates.scores[None], others])  # emulated all-gather
        indices = owned_attention_indices(select_global(gathered, topk), candidates, 0)
        out, lse = kernels.attention(q, shard_kv, indices, nsa_lens, owner_metadata)
        return merged(out, lse)

    def stages():
        """The per-owner layer in its parts (each on the previous part's inputs, precomputed)."""
        logits = kernels.logits(
            q_index, weights, shard_index, tables.physical_page_table, tables.owned_seq_lens, owner_schedule
        )
        candidates = local_candidates(logits, owned_lens, positions, rows, topk)
        gathered = torch.cat([candidates.scores[None], others])
        indices = owned_attention_indices(select_global(gathered, topk), candidates, 0)
        out, lse = kernels.attention(q, shard_kv, indices, nsa_lens, owner_metadata)
        return {
            "indexer": lambda: kernels.logits(q_index, weights, shard_index, tables.physical_page_table,
                                              tables.owned_seq_lens, owner_schedule),
            "local top-k": lambda: local_candidates(logits, owned_lens, positions, rows, topk),
            "selection": lambda: owned_attention_indices(
                select_global(torch.cat([candidates.scores[None], others]), topk), candidates, 0),
            "attention": lambda: kernels.attention(q, shard_kv, indices, nsa_lens, owner_metadata),
            "merge": lambda: merged(out, lse),
        }

    def tables_per_forward():
        t = build_owner_decode_tables(layout, real_page_table, seq_lens)
        return t.local_positions(width), t.local_physical_rows(width)

    # Page gather: every page of the batch copied into a scratch (pages 1.., page 0 the dummy).
    scratch_kv = torch.empty((total_pages + 1) * PAGE, KV_ROW_BYTES, dtype=torch.uint8, device=device)
    scratch_index = torch.empty(total_pages + 1, PAGE, 1, INDEX_ROW_BYTES, dtype=torch.uint8, device=device)
    source_pages = torch.randperm(total_pages, generator=g).to(device)
    slot = torch.arange(PAGE, device=device)
    source_rows = (source_pages[:, None] * PAGE + slot).reshape(-1)
    scratch_table = (torch.arange(total_pages, device=device, dtype=torch.int32) + 1).view(batch, -1)
    page_table_1 = (scratch_table.long()[:, :, None] * PAGE + slot).reshape(batch, -1).to(torch.int32)
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
    gather_schedule = kernels.schedule(seq_lens)
    gather_metadata = kernels.attention_metadata(nsa_lens)

    def copy_pages():
        torch.index_select(kv_pool, 0, source_rows, out=scratch_kv[PAGE:])
        torch.index_select(index_pool, 0, source_pages, out=scratch_index[1:])

    def replicated_layer():
        """Stock's decode attention over a replicated pool (here the filled scratch): no copy."""
        logits = kernels.logits(q_index, weights, scratch_index, scratch_table, seq_lens, gather_schedule)
        indices = kernels.sglang_topk(logits, seq_lens, page_table_1, cu_seqlens_q)
        return kernels.attention(q, scratch_kv, indices, nsa_lens, gather_metadata)

    def gather_layer():
        copy_pages()
        return replicated_layer()

    copy_pages()  # the replicated layer reads real rows

    breakdown = {}
    if args.breakdown:
        for name, fn in stages().items():
            breakdown[name] = (timer(fn), timer(_graphed(device, fn)))
    return {
        "breakdown": breakdown,
        "cp": cp_size,
        "batch": batch,
        "context_k": context_tokens // 1024,
        "owned_rows_attended": attended,
        "merge_form": merge_form,
        "per_owner_us": timer(per_owner_layer),
        "tables_us": timer(tables_per_forward),
        "gather_us": timer(gather_layer),
        "copy_us": timer(copy_pages),
        "replicated_us": timer(replicated_layer),
        "replicated_graph_us": timer(_graphed(device, replicated_layer)),
        "per_owner_graph_us": timer(_graphed(device, per_owner_layer)),
        "tables_graph_us": timer(_graphed(device, tables_per_forward)),
        "gather_graph_us": timer(_graphed(device, gather_layer)),
    }


def run_merge_kernels(args, cp_size: int, batch: int) -> dict:
    """Microseconds of one layer's merge arithmetic in each form for ``batch`` decode tokens at
    ``cp_size``: this rank's work around the collectives, whose outputs are precomputed here."""
    from sglang_cp_shared_kv.model_executor.per_owner_decode import attention_lse_merge as merge

    device = args.device
    timer = _timer(device, args.iters, args.warmup)
    g = torch.Generator(device="cpu").manual_seed(cp_size * 1000 + batch)
    outs = (torch.randn(cp_size, batch, HEADS, 512, generator=g) * 3).to(device, torch.bfloat16)
    lses = (torch.randn(cp_size, batch, HEADS, generator=g) * 2).to(device)
    out, lse = outs[0], lses[0]
    gathered = torch.stack([merge.pack_partial(o, l) for o, l in zip(outs, lses)])  # the all-gather's output

    def scaled_sum():
        return merge.scaled_partial_of_gathered(out, lse, lses)  # then the sum all-reduce

    def one_exchange():
        merge.pack_partial(out, lse)  # the all-gather's input
        return merge.merge_gathered(gathered, 512)

    return {
        "cp": cp_size,
        "batch": batch,
        "rule": merge.choose_merge_exchange(batch, HEADS, 512, 2, cp_size, DEFAULT_ONE_EXCHANGE_BYTES),
        "scaled_sum_us": timer(scaled_sum),
        "scaled_sum_graph_us": timer(_graphed(device, scaled_sum)),
        "one_exchange_us": timer(one_exchange),
        "one_exchange_graph_us": timer(_graphed(device, one_exchange)),
    }


def main_merge_kernels(args) -> int:
    print(f"device={args.device} iters={args.iters} warmup={args.warmup}; merge arithmetic only, the "
          f"collectives' outputs precomputed (GLM-5: 64 heads x 512, bf16)")
    print("| cp | batch | scaled sum, eager / graph | one exchange (pack + merge), eager / graph | rule's pick |")
    print("|---|---|---|---|---|")
    results = []
    for cp_size in args.cp_sizes:
        for batch in args.batches:
            r = run_merge_kernels(args, cp_size, batch)
            results.append(r)
            print(f"| {cp_size} | {batch} | {r['scaled_sum_us']:.1f} / {r['scaled_sum_graph_us']:.1f} us "
                  f"| {r['one_exchange_us']:.1f} / {r['one_exchange_graph_us']:.1f} us | {r['rule']} |", flush=True)
    if args.json_out:
        import json

        with open(args.json_out, "w") as out:
            json.dump(results, out, indent=1)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; use --device cpu")
        return 2
    if args.merge_kernels:
        return main_merge_kernels(args)
    kernels = Kernels(args.device, args.topk)
    start = time.monotonic()
    largest = max(args.batches) * max(args.contexts_k) * 1024
    pool = make_pool(largest + 2 * PAGE * max(args.cp_sizes), args.device)
    print(
        f"device={args.device} topk={args.topk} iters={args.iters} warmup={args.warmup}; exchange "
        f"emulated in process (per owner) / excluded (gather: a device copy of every page instead)"
    )
    print("| cp | batch x context | per owner / layer, eager (rows attended) | (tables / forward) | page gather / layer, eager | (its copy) | per owner / gather, eager | per owner / layer, graph | (tables, graph) | page gather / layer, graph | per owner / gather, graph | replicated (stock) / layer, eager / graph | merge form |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    results = []
    for cp_size in args.cp_sizes:
        for batch in args.batches:
            for context_k in args.contexts_k:
                r = run_case(args, kernels, pool, cp_size, batch, context_k * 1024)
                results.append(r)
                print(
                    f"| {cp_size} | {batch} x {context_k}K | {r['per_owner_us']:.0f} us "
                    f"({r['owned_rows_attended']} rows) "
                    f"| {r['tables_us']:.0f} us | {r['gather_us']:.0f} us | {r['copy_us']:.0f} us "
                    f"| {r['per_owner_us'] / r['gather_us']:.2f} | {r['per_owner_graph_us']:.0f} us "
                    f"| {r['tables_graph_us']:.0f} us | {r['gather_graph_us']:.0f} us "
                    f"| {r['per_owner_graph_us'] / r['gather_graph_us']:.2f} "
                    f"| {r['replicated_us']:.0f} / {r['replicated_graph_us']:.0f} us | {r['merge_form']} |",
                    flush=True,
                )
                if r["breakdown"]:
                    parts = ", ".join(f"{k} {e:.0f}/{g:.0f}" for k, (e, g) in r["breakdown"].items())
                    print(f"|   | per owner parts, us eager/graph: {parts} |", flush=True)
    if args.json_out:
        import json

        with open(args.json_out, "w") as out:
            json.dump([{k: v for k, v in r.items() if k != "breakdown"} for r in results], out, indent=1)
    print(f"done in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
