"""Transfer blocks of a PD prefill: how many the mooncake sender makes, and what they cost over TCP.

sglang 0.5.11's mooncake sender (``MooncakeKVManager._send_kvcache_generic``) merges a chunk's page
pairs into blocks of pages contiguous on both sides (``group_concurrent_contiguous``), then writes
every layer's blocks in ONE ``batch_transfer_sync`` call (KV per chunk; the NSA indexer-K pages of
the whole request in a second call on the last chunk). A block is one mooncake transfer request.
A shared-KV prefill rank owns every ``cp_size``-th page of a request (the allocator's placement),
so its destination pages are every ``cp_size``-th decode page and, with the placement of the
allocator's default, no two of them are adjacent: one block per page per layer.

Two modes:

``count`` (CPU, sglang installed): runs the real transfer path (``sglang_cp_shared_kv_testing/fake_pd_transfer.py``:
the scheduler's ``send_kv_chunk``, the stock sender bookkeeping and transfer worker, the stock
grouping, our subclasses) over a recording engine, for a fresh request whose pages come from the
real allocators (ours on the prefill, stock's on the decode, or scattered decode pages), and prints
per rank the blocks per layer and bytes per block, scaled to GLM-5's rows (78 layers, fp8 KV rows
656 B or bf16 1152 B, indexer rows 132 B, page 64):

    python benchmark/bench_pd_transfer_blocks.py count                    # 8K and 32K, cp 2/4/8

``measure`` (mooncake's transfer engine, a CUDA GPU or only the host): one receiver process (the
decode) and one process per sending prefill rank, each with its own ``TransferEngine`` set up as
sglang sets it up (``scripts/gpu/mooncake_tcp_probe.py``), write the bytes one request hands over
in the block layouts of the pair: ``stock`` (CP rank 0 alone sends the request, 2 blocks per
layer: what a stock prefill sends without ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER``),
``ranges`` (every rank a contiguous range of pages, 2 blocks per layer and rank: stock with that
variable), ``shared-kv-round-robin`` (every rank its owned pages under the allocator's default
placement, one block per page, every layer in one call: the shared-KV sender before owner runs) and
``shared-kv`` (owned pages in runs of ``--run-pages``, at most ``MAX_BLOCKS_PER_TRANSFER_CALL``
blocks per call: the shared-KV sender of a PD prefill server). Same byte count in every layout; the
receiver checks every byte of every repeat (and that nothing else was written). Prints ms (median
of ``--repeats``, from the first sender's start to the last sender's end) and GB/s:

    python benchmark/bench_pd_transfer_blocks.py measure --devices 'cuda:0>cuda:0,cpu>cpu'
    python benchmark/bench_pd_transfer_blocks.py measure --small --devices 'cpu>cpu'   # seconds, CPU

``measure`` needs ``mooncake.engine`` (``mooncake-transfer-engine-cuda13``; docs/gpu.md, "PD pair
smoke") and fails with a message saying so; ``measure --dry-run`` prints the layouts only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
PAGE = 64
GLM5_LAYERS = 78
KV_ROW_BYTES = {"fp8": 656, "bf16": 1152}  # one token of one layer (MLA latent + rope)
INDEXER_ROW_BYTES = 132  # NSA indexer K of one token of one layer: 128 fp8 + one fp32 scale
LAYOUTS = ("stock", "ranges", "shared-kv-round-robin", "shared-kv")


# ---------------------------------------------------------------------------------------------------
# The request's bytes and the block layouts (pure arithmetic; checked against the real path by
# test/registered/unit/disaggregation/test_cp_shared_kv_pd_transfer_blocks.py)
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestShape:
    """One fresh request as the decode side holds it: per layer a KV region and an indexer region of
    ``pages`` pages each, laid out like sglang's pools (layer-major buffers, ``page * item_len``)."""

    pages: int
    layers: int
    kv_item_bytes: int  # one page of one layer
    indexer_item_bytes: int

    @property
    def layer_bytes(self) -> int:
        return self.pages * (self.kv_item_bytes + self.indexer_item_bytes)

    @property
    def total_bytes(self) -> int:
        return self.layers * self.layer_bytes

    def kv_offset(self, layer: int, page: int) -> int:
        return layer * self.pages * self.kv_item_bytes + page * self.kv_item_bytes

    def indexer_offset(self, layer: int, page: int) -> int:
        return self.layers * self.pages * self.kv_item_bytes + (
            layer * self.pages * self.indexer_item_bytes + page * self.indexer_item_bytes
        )


def glm5_shape(prompt_tokens: int, dtype: str = "fp8", layers: int = GLM5_LAYERS) -> RequestShape:
    return RequestShape(-(-prompt_tokens // PAGE), layers, PAGE * KV_ROW_BYTES[dtype], PAGE * INDEXER_ROW_BYTES)


def owned_positions(layout: str, pages: int, cp_size: int, rank: int, run_pages: int = 1) -> List[List[int]]:
    """Runs of consecutive page positions ``rank`` sends, for a fresh request on fresh pools.

    ``stock``: rank 0 all of them; ``ranges``: a contiguous range per rank (stock's
    ``filter_kv_indices_for_cp_rank`` split); ``shared-kv-round-robin``: positions ``j`` with
    ``j % cp_size == rank`` (the allocator's default placement), each its own run; ``shared-kv``:
    positions ``j`` with ``(j // run_pages) % cp_size == rank`` (a PD prefill server's placement),
    in runs of ``run_pages``."""
    if layout == "stock":
        return [list(range(pages))] if rank == 0 and pages else []
    if layout == "ranges":
        base, rem = divmod(pages, cp_size)
        start = rank * base + min(rank, rem)
        size = base + (1 if rank < rem else 0)
        return [list(range(start, start + size))] if size else []
    run = 1 if layout == "shared-kv-round-robin" else run_pages
    if layout not in ("shared-kv-round-robin", "shared-kv") or run < 1:
        raise ValueError(f"unknown layout {layout!r} (run_pages {run_pages})")
    runs = []
    for first in range(rank * run, pages, cp_size * run):
        runs.append(list(range(first, min(first + run, pages))))
    return runs


def rank_blocks(shape: RequestShape, layout: str, cp_size: int, rank: int, run_pages: int = 1):
    """``(kv_blocks, indexer_blocks)``, each a list of ``(src_offset, dst_offset, length)`` in the order
    sglang submits them (layer by layer, runs in page order): the source is the rank's own pages
    packed in page order (contiguous physical pages of a fresh pool), the destination the request's
    decode regions (``RequestShape``), decode pages contiguous. For ``shared-kv`` the request must be
    a multiple of ``cp_size * run_pages`` pages (otherwise the allocator's balance moves a few pages
    to other owners)."""
    runs = owned_positions(layout, shape.pages, cp_size, rank, run_pages)
    owned = sum(len(r) for r in runs)
    kv, indexer = [], []
    for layer in range(shape.layers):
        k = 0
        for run in runs:
            n = len(run)
            kv.append(
                (layer * owned * shape.kv_item_bytes + k * shape.kv_item_bytes, shape.kv_offset(layer, run[0]),
                 n * shape.kv_item_bytes)
            )  # fmt: skip
            k += n
    src_indexer_base = shape.layers * owned * shape.kv_item_bytes
    for layer in range(shape.layers):
        k = 0
        for run in runs:
            n = len(run)
            indexer.append(
                (src_indexer_base + layer * owned * shape.indexer_item_bytes + k * shape.indexer_item_bytes,
                 shape.indexer_offset(layer, run[0]), n * shape.indexer_item_bytes)
            )  # fmt: skip
            k += n
    return kv, indexer


def senders_of(layout: str, cp_size: int) -> List[int]:
    return [0] if layout == "stock" else list(range(cp_size))


def engine_calls(layout: str, kv, indexer) -> List[List[Tuple[int, int, int]]]:
    """The engine calls a sender makes for the request: the KV batch, then the indexer batch (last
    chunk); the shared-KV sender of a PD prefill server splits each (``transfer_blocks``)."""
    if layout != "shared-kv":
        return [blocks for blocks in (kv, indexer) if blocks]
    _import_plugin()
    from sglang_cp_shared_kv.disaggregation.transfer_blocks import bounded_calls

    return [call for blocks in (kv, indexer) for call in bounded_calls(blocks)]


def _import_plugin() -> None:
    """The plugin from this checkout when it is not installed (a staged GPU machine)."""
    if str(REPO / "python") not in sys.path:
        sys.path.insert(0, str(REPO / "python"))


def layout_summary(shape: RequestShape, layout: str, cp_size: int, run_pages: int) -> Dict:
    per_rank = []
    for rank in senders_of(layout, cp_size):
        kv, indexer = rank_blocks(shape, layout, cp_size, rank, run_pages)
        per_rank.append(
            {
                "rank": rank,
                "kv_blocks_per_layer": len(kv) // shape.layers,
                "indexer_blocks_per_layer": len(indexer) // shape.layers,
                "blocks": len(kv) + len(indexer),
                "calls": len(engine_calls(layout, kv, indexer)),
                "bytes": sum(n for _, _, n in kv + indexer),
            }
        )
    return {"layout": layout, "senders": len(per_rank), "per_rank": per_rank}


# ---------------------------------------------------------------------------------------------------
# count: the real transfer path over a recording engine
# ---------------------------------------------------------------------------------------------------


def count_real_blocks(cp_size: int, prompt_tokens: int, pair: str, decode_pages: str, chunk_tokens: int, seed=0):
    """Blocks each prefill rank's real transfer path submits for one fresh request.

    ``pair``: ``stock`` (replicated KV, SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER unset: CP rank 0
    sends), ``stock-all-cp`` (replicated KV, the variable set), ``shared-kv-round-robin`` (ours with
    the allocator's default placement, page ``j`` on owner ``j % cp_size``), ``shared-kv`` (ours as
    a PD prefill server runs it: owner runs of ``owner_run_placement.owner_run_pages`` pages, and calls
    of at most ``MAX_BLOCKS_PER_TRANSFER_CALL`` blocks). Prefill pages
    come from the real allocators of a fresh pool (stock's for stock, ours for shared KV); decode
    pages from stock's allocator of a fresh pool (``contiguous``) or drawn at random (``scattered``).
    Returns per rank ``{"kv": [pages per block, ...], "indexer": [...], "calls": [blocks per engine
    call, ...]}`` for layer 0 of the KV and indexer buffers (every layer gets the same blocks; the
    pools here have one layer, so a call's count is per layer and scales with the layer count)."""
    import numpy as np
    import torch

    from sglang_cp_shared_kv_testing import fake_pd_transfer as pd

    pages = -(-prompt_tokens // PAGE)
    rng = np.random.default_rng(seed)
    physical = pages + 4  # per prefill rank: room for the whole request (stock) or its share (ours)
    decode_capacity = 4 * pages + 8
    if decode_pages == "contiguous":
        dst = _stock_allocator_pages(decode_capacity, pages)
    elif decode_pages == "scattered":
        dst = rng.choice(np.arange(1, decode_capacity + 1), pages, replace=False)
    else:
        raise ValueError(decode_pages)
    shared_kv = pair.startswith("shared-kv")
    if shared_kv:
        from types import SimpleNamespace

        from sglang_cp_shared_kv.mem_cache.owner_run_placement import owner_run_pages

        run = 1
        if pair == "shared-kv":
            run = owner_run_pages(SimpleNamespace(disaggregation_mode="prefill", chunked_prefill_size=chunk_tokens),
                                  cp_size, PAGE)  # fmt: skip
        locs = _shared_kv_allocator_locs(cp_size, physical, prompt_tokens, run)
    else:
        locs = _stock_allocator_locs(cp_size * physical, prompt_tokens)
    chunk_ends = list(range(chunk_tokens, prompt_tokens, chunk_tokens)) + [prompt_tokens]
    decode = pd.DecodeInstance.build(decode_capacity)
    result = []
    for rank in range(cp_size):
        pool = pd.build_nsa_pool(physical if shared_kv else cp_size * physical, layer_num=1)
        prefill = pd.build_prefill_rank(
            cp_size=cp_size, cp_rank=rank, pool=pool, decode=decode, shared_kv=shared_kv,
            all_cp_ranks=pair != "stock",
        )  # fmt: skip
        calls = []
        real_call = prefill.engine.batch_transfer_sync

        kv_region = pool.get_contiguous_buf_infos()[:2]
        state_region = pool.get_state_buf_infos()[:2]

        def recording_call(session_id, buffers, peer_buffer_addresses, lengths, _real=real_call, _calls=calls):
            # KV and indexer batches only (the aux metadata call is one per request and stock's)
            if any(p[0] <= buffers[0] < p[0] + n[0] for p, n in (kv_region, state_region)):
                _calls.append(len(buffers))
            return _real(session_id, buffers, peer_buffer_addresses, lengths)

        prefill.engine.batch_transfer_sync = recording_call
        pd.connect_decode(prefill, decode, 1, dst, aux_index=1)
        pd.send_request(prefill, room=1, logical_locs=torch.as_tensor(locs), chunk_ends=chunk_ends,
                        first_output_id=7, aux_index=1)  # fmt: skip
        if prefill.engine.errors:
            raise RuntimeError(f"rank {rank}: {prefill.engine.errors}")
        kv_ptrs, kv_lens, kv_items = pool.get_contiguous_buf_infos()
        st_ptrs, st_lens, st_items = pool.get_state_buf_infos()
        blocks = {"kv": [], "indexer": [], "calls": calls}
        for src, _, n in prefill.engine.copies:
            if kv_ptrs[0] <= src < kv_ptrs[0] + kv_lens[0]:
                blocks["kv"].append(n // kv_items[0])
            elif st_ptrs[0] <= src < st_ptrs[0] + st_lens[0]:
                blocks["indexer"].append(n // st_items[0])
        result.append(blocks)
    return result


def _stock_allocator_pages(capacity_pages: int, pages: int):
    """Page ids stock's paged allocator hands a first request on a fresh pool."""
    return _stock_allocator_locs(capacity_pages, pages * PAGE)[::PAGE] // PAGE


def _stock_allocator_locs(capacity_pages: int, tokens: int):
    import torch

    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

    pool = _SizeOnly(capacity_pages * PAGE)
    alloc = PagedTokenToKVPoolAllocator(capacity_pages * PAGE, PAGE, torch.bfloat16, "cpu", pool, False)
    # alloc_extend runs a Triton kernel (no CPU driver); for a first request on a fresh pool it takes
    # the head of the free list, in order, exactly as alloc does.
    locs = alloc.alloc(-(-tokens // PAGE) * PAGE)
    if locs is None:
        raise RuntimeError("allocator out of pages")
    return locs[:tokens].numpy()


def _shared_kv_allocator_locs(cp_size: int, physical_pages: int, tokens: int, owner_run_pages: int = 1):
    import torch

    from sglang_cp_shared_kv.mem_cache.allocator import CPSharedPagedTokenToKVPoolAllocator
    from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout

    pool = _SizeOnly(physical_pages * PAGE)
    alloc = CPSharedPagedTokenToKVPoolAllocator(
        cp_size * pool.size, PAGE, torch.bfloat16, "cpu", pool, False,
        CpSharedKVLayout(cp_size, 0, PAGE), owner_run_pages,
    )
    return _extend(alloc, tokens).numpy()


def _largest_call(calls_one_layer: List[int], layers: int, capped: bool) -> int:
    """Blocks of the largest engine call with ``layers`` layers: stock submits every layer's blocks of
    a batch in one call (the recorded pools have one layer); ours caps each call."""
    from sglang_cp_shared_kv.disaggregation.transfer_blocks import MAX_BLOCKS_PER_TRANSFER_CALL

    largest = max(calls_one_layer, default=0) * layers
    return min(largest, MAX_BLOCKS_PER_TRANSFER_CALL) if capped else largest


class _SizeOnly:
    """The allocators read only ``.size`` of their pool."""

    def __init__(self, size):
        self.size = size


def _extend(alloc, tokens: int):
    import torch

    zero = torch.zeros(1, dtype=torch.int64)
    seq = torch.tensor([tokens], dtype=torch.int64)
    locs = alloc.alloc_extend(zero, zero.clone(), seq, seq.clone(), torch.tensor([-1]), tokens)
    if locs is None:
        raise RuntimeError("allocator out of pages")
    return locs


def run_count(args) -> Dict:
    rows = []
    for tokens in args.prompt_tokens:
        for cp_size in args.cp_sizes:
            for decode_pages in ("contiguous", "scattered"):
                for pair in ("stock", "stock-all-cp", "shared-kv-round-robin", "shared-kv"):
                    per_rank = count_real_blocks(cp_size, tokens, pair, decode_pages, args.chunk_tokens)
                    rows.append({"tokens": tokens, "cp": cp_size, "decode_pages": decode_pages, "pair": pair,
                                 "ranks": per_rank})  # fmt: skip
    print(
        f"blocks per layer per rank (KV + indexer), GLM-5 rows: page {PAGE}, {GLM5_LAYERS} layers, "
        f"KV page {PAGE * KV_ROW_BYTES['fp8']} B fp8 / {PAGE * KV_ROW_BYTES['bf16']} B bf16, "
        f"indexer page {PAGE * INDEXER_ROW_BYTES} B; chunks of {args.chunk_tokens} tokens"
    )
    head = ("tokens", "cp", "decode pages", "pair", "sending ranks", "KV blk/layer", "idx blk/layer",
            "pages/blk (KV)", "blocks/request", "largest call", "fp8 MB/rank", "fp8 KV B/blk", "bf16 KV B/blk")  # fmt: skip
    print(" | ".join(head))
    for row in rows:
        senders = [r for r in row["ranks"] if r["kv"] or r["indexer"]]
        worst = max(senders, key=lambda r: len(r["kv"]) + len(r["indexer"]))
        kv_pages, idx_pages = sum(worst["kv"]), sum(worst["indexer"])
        mb = GLM5_LAYERS * (kv_pages * PAGE * KV_ROW_BYTES["fp8"] + idx_pages * PAGE * INDEXER_ROW_BYTES) / 1e6
        row.update(
            sending_ranks=len(senders), kv_blocks_per_layer=len(worst["kv"]),
            indexer_blocks_per_layer=len(worst["indexer"]),
            blocks_per_request_per_rank=GLM5_LAYERS * (len(worst["kv"]) + len(worst["indexer"])),
            largest_call_blocks=_largest_call(worst["calls"], GLM5_LAYERS, row["pair"].startswith("shared-kv")),
            fp8_mb_per_rank=round(mb, 1),
        )  # fmt: skip
        mean_pages = kv_pages / max(1, len(worst["kv"]))
        print(" | ".join(str(v) for v in (
            row["tokens"], row["cp"], row["decode_pages"], row["pair"], len(senders), len(worst["kv"]),
            len(worst["indexer"]), f"{mean_pages:.1f}", row["blocks_per_request_per_rank"],
            row["largest_call_blocks"], f"{mb:.1f}",
            int(mean_pages * PAGE * KV_ROW_BYTES["fp8"]), int(mean_pages * PAGE * KV_ROW_BYTES["bf16"]),
        )))  # fmt: skip
    return {"rows": [{k: v for k, v in row.items() if k != "ranks"} for row in rows]}


# ---------------------------------------------------------------------------------------------------
# measure: mooncake TCP writes of the layouts
# ---------------------------------------------------------------------------------------------------


def _probe():
    """scripts/gpu/mooncake_tcp_probe.py (engine setup as sglang's, buffers, log redirection)."""
    spec = importlib.util.spec_from_file_location("mooncake_tcp_probe", REPO / "scripts/gpu/mooncake_tcp_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def require_mooncake() -> Optional[str]:
    try:
        import torch  # noqa: F401  (loads the CUDA runtime mooncake's engine.so links against)
    except ImportError:
        pass
    try:
        import mooncake.engine  # noqa: F401
    except Exception as e:  # noqa: BLE001  (ImportError, or OSError from a missing system library)
        return (
            f"bench_pd_transfer_blocks: measure needs mooncake's transfer engine, which does not import "
            f"here ({type(e).__name__}: {e}). Install mooncake-transfer-engine-cuda13 (docs/gpu.md, "
            "'PD pair smoke'), or run `count` / `measure --dry-run`."
        )
    return None


def request_image(nbytes: int, seed: int):
    """The request's bytes as the decode must end up holding them: random, never 0 (0 = not written)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _to(device: str, tensor):
    return tensor if device == "cpu" else tensor.to(device)


def sender_main(rank, cases, shape, cp_size, run_pages, device_of_case, log_path, info_q, go_q, out_q, barriers):
    probe = _probe()
    probe._redirect_output(log_path)
    try:
        import torch

        engine, _ = probe._make_engine()
        image = request_image(shape.total_bytes, seed=1234)
        srcs, plans = {}, {}
        for case in cases:
            layout = case["layout"]
            if rank not in senders_of(layout, cp_size):
                continue
            kv, indexer = rank_blocks(shape, layout, cp_size, rank, run_pages)
            owned_bytes = sum(n for _, _, n in kv + indexer)
            src = torch.empty(owned_bytes, dtype=torch.uint8)
            for s, d, n in kv + indexer:
                src[s : s + n] = image[d : d + n]
            src = _to(device_of_case[case["name"]][0], src)
            srcs[case["name"]] = src
            plans[case["name"]] = engine_calls(layout, kv, indexer)
        if srcs:
            ret = engine.batch_register_memory([t.data_ptr() for t in srcs.values()], [t.numel() for t in srcs.values()])
            if ret != 0:
                raise RuntimeError(f"batch_register_memory returned {ret}")
        del image
        info_q.put({"rank": rank, "ready": True})
        while True:
            msg = go_q.get()
            if msg == "stop":
                return
            name, session, dst_ptr = msg["case"], msg["session"], msg["dst_ptr"]
            src = srcs[name]
            calls = plans[name]
            barriers[msg["senders"]].wait(timeout=120)
            start = time.monotonic()
            rets = []
            for blocks in calls:
                rets.append(engine.batch_transfer_sync_write(
                    session, [src.data_ptr() + s for s, _, _ in blocks], [dst_ptr + d for _, d, _ in blocks],
                    [n for _, _, n in blocks],
                ))  # fmt: skip
                if rets[-1] != 0:
                    break  # as the sender: the request failed
            end = time.monotonic()
            out_q.put({"rank": rank, "case": name, "start": start, "end": end, "rets": rets})
    except BaseException as e:  # noqa: BLE001  (reported to the parent)
        out_q.put({"rank": rank, "error": f"sender {rank}: {type(e).__name__}: {e}"})
        info_q.put({"rank": rank, "error": f"sender {rank}: {type(e).__name__}: {e}"})


def receiver_main(cases, shape, cp_size, run_pages, device_of_case, log_path, to_main, from_main):
    probe = _probe()
    probe._redirect_output(log_path)
    try:
        import torch

        engine, session = probe._make_engine()
        image = request_image(shape.total_bytes, seed=1234)
        devices = sorted({device_of_case[c["name"]][1] for c in cases})
        dsts = {dev: _to(dev, torch.zeros(shape.total_bytes, dtype=torch.uint8)) for dev in devices}
        images = {dev: _to(dev, image) for dev in devices}
        ret = engine.batch_register_memory([t.data_ptr() for t in dsts.values()], [t.numel() for t in dsts.values()])
        to_main.put({"session": session, "dst_ptrs": {d: t.data_ptr() for d, t in dsts.items()}, "register_ret": ret})
        while True:
            msg = from_main.get()
            if msg == "stop":
                return
            dev = device_of_case[msg["case"]][1]
            if msg["op"] == "reset":
                dsts[dev].zero_()
                if dev != "cpu":
                    torch.cuda.synchronize(dev)
                to_main.put({"reset": True})
            else:  # verify: every byte the case's senders wrote, and nothing else
                layout = msg["layout"]
                covered = torch.zeros(shape.total_bytes, dtype=torch.bool, device=dsts[dev].device)
                for rank in senders_of(layout, cp_size):
                    kv, indexer = rank_blocks(shape, layout, cp_size, rank, run_pages)
                    for _, d, n in kv + indexer:
                        covered[d : d + n] = True
                wrong = int(((dsts[dev] != images[dev]) & covered).sum())
                stray = int(((dsts[dev] != 0) & ~covered).sum())
                to_main.put({"wrong_bytes": wrong, "stray_bytes": stray, "covered_bytes": int(covered.sum())})
    except BaseException as e:  # noqa: BLE001
        to_main.put({"error": f"receiver: {type(e).__name__}: {e}"})


def _get(q, timeout: float, what: str) -> Dict:
    import queue

    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        return {"error": f"timed out waiting for {what}"}


def run_measure(args) -> Dict:
    shape = glm5_shape(args.prompt_tokens, args.dtype, args.layers)
    devices = [tuple(item.split(">")) for item in args.devices.split(",")]
    cases = [
        {"name": f"{layout} {src}>{dst}", "layout": layout, "devices": (src, dst)}
        for src, dst in devices
        for layout in args.layouts.split(",")
    ]
    for case in cases:
        if case["layout"] not in LAYOUTS:
            raise SystemExit(f"bench_pd_transfer_blocks: unknown layout {case['layout']!r} (one of {LAYOUTS})")
    summaries = {c["layout"]: layout_summary(shape, c["layout"], args.cp, args.run_pages) for c in cases}
    print(f"request: {args.prompt_tokens} tokens = {shape.pages} pages x {shape.layers} layers, KV page "
          f"{shape.kv_item_bytes} B, indexer page {shape.indexer_item_bytes} B, {shape.total_bytes / 1e6:.1f} MB; "
          f"cp {args.cp}")  # fmt: skip
    for layout, s in summaries.items():
        r = s["per_rank"][0]
        print(f"  layout {layout:<22} senders {s['senders']}, per sender {r['blocks']} blocks "
              f"({r['kv_blocks_per_layer']} KV + {r['indexer_blocks_per_layer']} indexer per layer) in "
              f"{r['calls']} engine calls, {r['bytes'] / 1e6:.1f} MB")  # fmt: skip
    result = {"shape": shape.__dict__, "cp": args.cp, "run_pages": args.run_pages, "layouts": summaries,
              "env": {k: v for k, v in os.environ.items() if k.startswith("MC_")}, "cases": [], "errors": []}  # fmt: skip
    if args.dry_run:
        return result
    problem = require_mooncake()
    if problem:
        result["errors"].append(problem)
        return result
    probe = _probe()
    for key, value in probe.MULTICAST_OFF_ENV.items():
        os.environ.setdefault(key, value)
    os.environ["MC_FORCE_TCP"] = "true"
    log_dir = Path(args.log_dir or f"/tmp/bench_pd_transfer_blocks.{os.getpid()}")
    log_dir.mkdir(parents=True, exist_ok=True)
    device_of_case = {c["name"]: c["devices"] for c in cases}
    ctx = mp.get_context("spawn")
    to_main, to_receiver, info_q, out_q = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    go_qs = [ctx.Queue() for _ in range(args.cp)]
    barriers = {n: ctx.Barrier(n) for n in {1, args.cp}}
    procs = [ctx.Process(target=receiver_main, args=(cases, shape, args.cp, args.run_pages, device_of_case,
                                                     str(log_dir / "receiver.log"), to_main, to_receiver))]  # fmt: skip
    procs += [
        ctx.Process(target=sender_main, args=(rank, cases, shape, args.cp, args.run_pages, device_of_case,
                                              str(log_dir / f"sender{rank}.log"), info_q, go_qs[rank], out_q, barriers))
        for rank in range(args.cp)
    ]  # fmt: skip
    for proc in procs:
        proc.start()
    try:
        info = _get(to_main, args.timeout, "the receiver's engine")
        if "error" in info:
            result["errors"].append(info["error"])
            return result
        for _ in range(args.cp):
            ready = _get(info_q, args.timeout, "a sender's engine")
            if "error" in ready:
                result["errors"].append(ready["error"])
                return result
        for case in cases:
            senders = senders_of(case["layout"], args.cp)
            times, checks = [], []
            for repeat in range(args.repeats):
                to_receiver.put({"op": "reset", "case": case["name"]})
                ack = _get(to_main, args.timeout, "the receiver's reset")
                if "error" in ack:
                    raise RuntimeError(ack["error"])
                for rank in senders:
                    go_qs[rank].put({"case": case["name"], "session": info["session"], "senders": len(senders),
                                     "dst_ptr": info["dst_ptrs"][case["devices"][1]]})  # fmt: skip
                sent = [_get(out_q, args.timeout, f"sender of {case['name']}") for _ in senders]
                for s in sent:
                    if "error" in s:
                        raise RuntimeError(s["error"])
                    if any(s["rets"]):
                        raise RuntimeError(f"{case['name']}: rank {s['rank']} batch_transfer_sync_write returned {s['rets']}")
                times.append(max(s["end"] for s in sent) - min(s["start"] for s in sent))
                to_receiver.put({"op": "verify", "case": case["name"], "layout": case["layout"]})
                check = _get(to_main, args.timeout, "the receiver's check")
                if "error" in check:
                    raise RuntimeError(check["error"])
                checks.append(check)
            nbytes = sum(r["bytes"] for r in summaries[case["layout"]]["per_rank"])
            median = statistics.median(times)
            row = {"case": case["name"], "layout": case["layout"], "devices": "%s>%s" % case["devices"],
                   "senders": len(senders), "blocks_per_sender": summaries[case["layout"]]["per_rank"][0]["blocks"],
                   "bytes": nbytes, "ms_median": median * 1e3, "ms_min": min(times) * 1e3,
                   "ms_all": [t * 1e3 for t in times], "gb_per_s": nbytes / median / 1e9,
                   "wrong_bytes": sum(c["wrong_bytes"] for c in checks),
                   "stray_bytes": sum(c["stray_bytes"] for c in checks)}  # fmt: skip
            result["cases"].append(row)
            print(f"  {row['case']:<37} {row['senders']} sender(s) x {row['blocks_per_sender']:>6} blocks: "
                  f"{row['ms_median']:8.1f} ms median ({row['ms_min']:.1f} min), {row['gb_per_s']:.2f} GB/s, "
                  f"wrong bytes {row['wrong_bytes']}, stray bytes {row['stray_bytes']}", flush=True)  # fmt: skip
    except RuntimeError as e:
        result["errors"].append(str(e))
    finally:
        to_receiver.put("stop")
        for q in go_qs:
            q.put("stop")
        for proc in procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    return result


def report_ratios(result: Dict) -> None:
    by_devices: Dict[str, Dict[str, Dict]] = {}
    for row in result["cases"]:
        by_devices.setdefault(row["devices"], {})[row["layout"]] = row
    for devices, rows in by_devices.items():
        stock = rows.get("stock")
        if not stock:
            continue
        for layout, row in rows.items():
            if layout != "stock":
                print(f"  {devices}: {layout} / stock = {row['ms_median'] / stock['ms_median']:.2f} "
                      f"({row['ms_median'] - stock['ms_median']:+.1f} ms)")  # fmt: skip


def parse_args(argv: Optional[Sequence[str]] = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("count", help="blocks of the real transfer path (CPU)")
    c.add_argument("--prompt-tokens", type=int, nargs="+", default=[8192, 32768])
    c.add_argument("--cp-sizes", type=int, nargs="+", default=[2, 4, 8])
    c.add_argument("--chunk-tokens", type=int, default=8192, help="chunked prefill size")
    m = sub.add_parser("measure", help="mooncake TCP writes of the layouts")
    m.add_argument("--prompt-tokens", type=int, default=8192)
    m.add_argument("--cp", type=int, default=2)
    m.add_argument("--layers", type=int, default=GLM5_LAYERS)
    m.add_argument("--dtype", choices=sorted(KV_ROW_BYTES), default="fp8")
    m.add_argument("--layouts", default="stock,ranges,shared-kv",
                   help=f"comma-separated, of {', '.join(LAYOUTS)} (shared-kv-round-robin fails with "
                        "mooncake's default TCP limits: raise MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER and "
                        "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER to time it)")
    m.add_argument("--run-pages", type=int, default=None,
                   help="pages per owner run of shared-kv (default: what a PD prefill server with "
                        "--chunked-prefill-size 8192 uses, owner_run_placement.owner_run_pages)")
    m.add_argument("--devices", default="cuda:0>cuda:0,cpu>cpu", help="comma-separated SRC>DST (cpu or cuda:N)")
    m.add_argument("--repeats", type=int, default=5)
    m.add_argument("--small", action="store_true", help="4 layers, 2048 tokens, 2 repeats (a quick CPU run)")
    m.add_argument("--dry-run", action="store_true", help="print the layouts only (no mooncake)")
    m.add_argument("--timeout", type=float, default=120)
    m.add_argument("--log-dir", default=None)
    for q in (c, m):
        q.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)
    if args.mode == "measure" and args.small:
        args.layers, args.prompt_tokens, args.repeats = 4, 2048, 2
    if args.mode == "measure" and args.run_pages is None:
        _import_plugin()
        from types import SimpleNamespace

        from sglang_cp_shared_kv.mem_cache.owner_run_placement import owner_run_pages

        args.run_pages = owner_run_pages(SimpleNamespace(disaggregation_mode="prefill", chunked_prefill_size=8192),
                                         args.cp, PAGE)  # fmt: skip
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    if args.mode == "count":
        result = run_count(args)
    else:
        result = run_measure(args)
        report_ratios(result)
        bad = [r["case"] for r in result["cases"] if r["wrong_bytes"] or r["stray_bytes"]]
        result["errors"] += [f"{name}: bytes differ at the receiver" for name in bad]
        for error in result["errors"]:
            print(f"FAIL {error}")
    result["seconds"] = round(time.monotonic() - start, 1)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"bench_pd_transfer_blocks {args.mode}: {'FAILED' if result.get('errors') else 'done'} in {result['seconds']} s")
    return 1 if result.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
