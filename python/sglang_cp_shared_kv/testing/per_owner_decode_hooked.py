"""One per-owner decode layer through sglang's own decode methods, on one rank of a gloo group.

Shared by ``test_per_owner_decode_gloo.py`` (CPU, kernels replaced by torch references) and
``scripts/gpu/check_cp_per_owner_decode.py`` (CUDA, the real kernels where they import). Every rank
rebuilds the same replicated pool (``make_case``), holds its shard in a real fp8
``NSATokenToKVPool``, applies our hooks and runs what a decode forward runs: the backend's metadata
hook, the decode tokens' KV store (owner-filtered), ``get_indexer_metadata`` +
``Indexer._get_topk_paged``, ``get_key_buffer`` and ``_forward_flashmla_kv``. ``replicated_reference``
computes what a replicated pool gives, from the rows the owners stored.
"""

from __future__ import annotations

import sys
import types
from contextlib import ExitStack
from types import SimpleNamespace
from unittest import mock

import torch

from sglang_cp_shared_kv.testing import nsa_decode_reference as ref
from sglang_cp_shared_kv.testing.per_owner_decode_cases import random_batch

HEADS, INDEX_HEADS, PAGE = 64, 32, 64
SM_SCALE = 576**-0.5


def make_case(cp_size: int, seq_lens, device: str, seed: int = 7) -> SimpleNamespace:
    """The replicated pool and queries (identical wherever built with the same arguments)."""
    g = torch.Generator().manual_seed(seed + cp_size)
    batch = random_batch(g, cp_size, PAGE, list(seq_lens))
    rows = batch.logical_pages * PAGE
    kv = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
    b = len(seq_lens)
    new_kv = torch.randn(b, 576, generator=g).to(torch.bfloat16)  # the decode tokens' KV
    last_locs = batch.token_locs().gather(1, (batch.seq_lens - 1)[:, None]).reshape(-1)
    index_k = torch.randn(rows, 128, generator=g).to(torch.float8_e4m3fn)
    index_scale = torch.rand(rows, generator=g) + 0.5
    q_index = torch.randn(b, INDEX_HEADS, 128, generator=g).to(torch.float8_e4m3fn)
    weights = torch.rand(b, INDEX_HEADS, generator=g) * 0.1
    q = (torch.randn(b, HEADS, 576, generator=g) * 3.0).to(torch.bfloat16)
    batch.page_table = batch.page_table.to(device)
    batch.seq_lens = batch.seq_lens.to(device)
    kv_rows = ref.fp8_kv_rows(kv.to(device))
    kv_rows_new = kv_rows.clone()  # after the decode store, with the torch quantizer
    kv_rows_new[last_locs.to(device)] = ref.fp8_kv_rows(new_kv.to(device))
    return SimpleNamespace(
        batch=batch,
        kv_rows=kv_rows,
        kv_rows_new=kv_rows_new,
        new_kv=new_kv.to(device),
        last_locs=last_locs.to(device),
        index_pages=ref.index_pages(index_k.to(device), index_scale.to(device), PAGE),
        q_index=q_index.to(device),
        weights=weights.to(device),
        q=q.to(device),
    )


def _reference_deep_gemm():
    def fp8_paged_mqa_logits(q, kv_cache, weights, lens, block_table, schedule, max_len, clean_logits):
        pages = kv_cache.reshape(kv_cache.shape[0], -1)
        return ref.paged_mqa_logits_reference(q[:, 0], weights, pages, block_table, lens, PAGE)

    return SimpleNamespace(
        fp8_paged_mqa_logits=fp8_paged_mqa_logits,
        get_paged_mqa_logits_metadata=lambda *args: None,
        get_num_sms=lambda: 1,
    )


def _reference_flash_mla():
    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
                               tile_scheduler_metadata, num_splits, softmax_scale, indices,
                               is_fp8_kvcache, **_):
        rows = ref.kv_rows_as_float(k_cache.view(torch.uint8).reshape(-1, k_cache.shape[-1]))
        out, lse = ref.sparse_mla_decode_reference(q[:, 0].float(), rows, indices[:, 0], softmax_scale, head_dim_v)
        return out.to(q.dtype)[:, None], lse[:, :, None]

    module = types.ModuleType("sgl_kernel.flash_mla")
    module.flash_mla_with_kvcache = flash_mla_with_kvcache
    module.get_mla_metadata = lambda *args, **kwargs: (torch.zeros(1), torch.zeros(1))
    return module


def kernels_in_this_process(stack: ExitStack, device: str) -> dict:
    """Real deep_gemm / flash_mla on CUDA where they import, torch references otherwise; returns
    what each role uses."""
    from sglang.srt.layers.attention.nsa import nsa_indexer

    names = {}
    deep_gemm = None
    if device == "cuda":
        try:
            import deep_gemm

            names["indexer"] = "deep_gemm.fp8_paged_mqa_logits"
        except Exception as error:  # noqa: BLE001
            names["indexer"] = f"torch reference (deep_gemm not importable: {error!r})"
            deep_gemm = None
    else:
        names["indexer"] = "torch reference (cpu)"
    stack.enter_context(
        mock.patch.object(nsa_indexer, "deep_gemm", deep_gemm or _reference_deep_gemm(), create=True)
    )
    real_flash_mla = False
    if device == "cuda":
        try:
            from sgl_kernel.flash_mla import flash_mla_with_kvcache  # noqa: F401

            real_flash_mla = True
            names["attention"] = "sgl_kernel.flash_mla.flash_mla_with_kvcache"
        except Exception as error:  # noqa: BLE001
            names["attention"] = f"torch reference (flash_mla not importable: {error!r})"
    else:
        names["attention"] = "torch reference (cpu)"
    if not real_flash_mla:
        from sglang_cp_shared_kv.testing import sgl_kernel_cpu_shim

        sgl_kernel_cpu_shim.install()
        module = _reference_flash_mla()
        stack.enter_context(mock.patch.dict(sys.modules, {"sgl_kernel.flash_mla": module}))
        stack.enter_context(mock.patch.object(sys.modules["sgl_kernel"], "flash_mla", module, create=True))
    names["real_flash_mla"] = real_flash_mla
    names["deep_gemm"] = deep_gemm
    return names


GRAPH_MODES = ("eager", "graph-replay", "graph-stale")


def run_rank(rank: int, world_size: int, seq_lens, topk: int, device: str, mode: str = "eager") -> dict:
    """This rank's decode layer; returns its output, indices, stored rows and what it observed.

    ``mode``: ``eager`` runs the backend's metadata hook; ``graph-replay`` instead goes through the
    decode-graph hooks as a captured graph sees them: static tables built at "capture" from
    capture-time contents (every request on the dummy row, length 1), then the batch copied into the
    backend's static metadata and refreshed by the replay hook, and the layer run over the static
    tables; ``graph-stale`` skips that refresh (the check must then fail)."""
    from sglang.srt.layers.attention.nsa import nsa_indexer
    from sglang.srt.layers.attention.nsa_backend import (
        NativeSparseAttnBackend,
        NSAFlashMLAMetadata,
        NSAMetadata,
    )
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang_cp_shared_kv.model_executor import (
        owner_filtered_writes,
        peer_page_reads,
        per_owner_decode,
    )
    from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import CpSharedKVRuntime
    from sglang_cp_shared_kv.testing.hook_sandbox import applied_hooks
    from sglang_cp_shared_kv.testing.nsa_cpu_kernels import cpu_kernels
    from sglang_cp_shared_kv.testing.runtime_check import make_nsa_pool

    if device == "cuda":
        torch.cuda.set_device(0)
    case = make_case(world_size, seq_lens, device)
    batch = case.batch
    layout = batch.layout(rank)
    with ExitStack() as stack:
        names = kernels_in_this_process(stack, device)
        if device != "cuda":
            stack.enter_context(cpu_kernels())
        stack.enter_context(
            applied_hooks(
                owner_filtered_writes.register_hooks,
                peer_page_reads.register_hooks,
                per_owner_decode.register_forward_hooks,
            )
        )
        pool = make_nsa_pool((batch.physical_pages - 1) * PAGE, "fp8", 1, device)
        scratch = make_nsa_pool(world_size * (batch.physical_pages - 1) * PAGE, "fp8", 1, device)
        shard_rows = batch.shard_rows(rank)
        kv_bytes = pool.kv_buffer[0].view(torch.uint8)
        kv_bytes[: shard_rows.numel(), 0] = case.kv_rows[shard_rows]
        own_last = layout.owned_by_this_rank(case.last_locs)
        physical_last = layout.physical_locs_or_dummy(case.last_locs).long()
        kv_bytes[physical_last[own_last]] = 0  # the decode store must write them
        pages = layout.logical_page_of(torch.arange(batch.physical_pages, device=device))
        pool.index_k_with_scale_buffer[0][: batch.physical_pages] = case.index_pages[pages]
        runtime = CpSharedKVRuntime(pool, layout, scratch, torch.distributed.group.WORLD)
        if per_owner_decode.attach(runtime, "flashmla_kv") is None:
            raise RuntimeError("per-owner decode did not attach")

        seq_lens_i32 = batch.seq_lens.to(torch.int32)
        nsa_seqlens = seq_lens_i32.clamp(max=topk)
        backend = object.__new__(NativeSparseAttnBackend)
        backend.nsa_kv_cache_store_fp8, backend.nsa_prefill_impl = True, "flashmla_kv"
        backend.flashmla_kv_num_q_heads, backend.real_page_size = HEADS, PAGE
        backend.kv_cache_dim, backend.nsa_index_topk = 656, topk
        zeros = torch.zeros(1, dtype=torch.int32, device=device)
        if names["real_flash_mla"]:
            from sgl_kernel.flash_mla import get_mla_metadata

            flashmla = NSAFlashMLAMetadata(*get_mla_metadata(nsa_seqlens, HEADS, 1, HEADS, True, topk))
        else:
            flashmla = NSAFlashMLAMetadata(zeros, zeros)
        schedule = None
        if names["deep_gemm"] is not None:
            dg = names["deep_gemm"]
            schedule = dg.get_paged_mqa_logits_metadata(seq_lens_i32, PAGE, dg.get_num_sms())
        backend.forward_metadata = NSAMetadata(
            page_size=PAGE, cache_seqlens_int32=seq_lens_i32, max_seq_len_q=1,
            max_seq_len_k=int(seq_lens_i32.max()), cu_seqlens_q=zeros, cu_seqlens_k=zeros,
            page_table_1=batch.token_locs().to(torch.int32), real_page_table=batch.page_table,
            nsa_cache_seqlens_int32=nsa_seqlens, nsa_cu_seqlens_q=zeros, nsa_cu_seqlens_k=zeros,
            nsa_extend_seq_lens_list=[1] * len(seq_lens), nsa_seqlens_expanded=seq_lens_i32,
            flashmla_metadata=flashmla, paged_mqa_schedule_metadata=schedule,
        )
        forward_batch = SimpleNamespace(
            forward_mode=ForwardMode.DECODE, token_to_kv_pool=pool, hisparse_coordinator=None,
            out_cache_loc=case.last_locs,
        )
        if mode == "eager":
            peer_page_reads.remap_forward_metadata(None, backend, forward_batch)
        else:
            _capture_then_replay(backend, per_owner_decode.per_owner_of(pool), stale=mode == "graph-stale")
        planned = runtime.plan is not None
        layer = SimpleNamespace(layer_id=0, tp_q_head_num=HEADS, head_dim=576)
        k_nope = case.new_kv[:, None, :512].contiguous()
        k_rope = case.new_kv[:, None, 512:].contiguous()
        pool.set_mla_kv_buffer(layer, case.last_locs, k_nope, k_rope)
        metadata = backend.get_indexer_metadata(0, forward_batch)
        indexer = object.__new__(nsa_indexer.Indexer)
        indexer.index_topk = topk
        indexer.sm_count = names["deep_gemm"].get_num_sms() if names["deep_gemm"] is not None else 1
        indices = nsa_indexer.Indexer._get_topk_paged(
            indexer, forward_batch, 0, case.q_index, case.weights[:, :, None], metadata
        )
        out = backend._forward_flashmla_kv(
            q_all=case.q, kv_cache=pool.get_key_buffer(0), v_head_dim=512, sm_scale=SM_SCALE,
            layer=layer, metadata=backend.forward_metadata, page_table_1=indices,
        )
        return {
            "kernels": {k: v for k, v in names.items() if isinstance(v, str)},
            "out": out.cpu(),
            "indices": indices.cpu(),
            "planned": planned,
            "scratch_untouched": not bool(scratch.kv_buffer[0].view(torch.uint8).any()),
            "stored_locs": case.last_locs[own_last].cpu(),
            "stored_rows": kv_bytes[physical_last[own_last], 0].cpu(),
        }


def _capture_then_replay(backend, state, stale: bool) -> None:
    """The decode-graph hooks around ``backend.forward_metadata`` (the batch to run): capture with
    sglang's capture-time contents, then the replay's copy into the static metadata and refresh."""
    import dataclasses

    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang_cp_shared_kv.model_executor import per_owner_decode, per_owner_decode_graphs as graphs

    real = backend.forward_metadata
    bs, width = real.real_page_table.shape
    backend.decode_cuda_graph_metadata = {
        "page_table": torch.zeros((bs, width * PAGE), dtype=torch.int32, device=real.real_page_table.device)
    }
    setattr(backend, per_owner_decode._STATE_ATTR, state)
    setattr(backend, graphs._BOUND_ATTR, True)
    graphs.init_cuda_graph_state_after(None, backend, bs, bs)
    schedule = real.paged_mqa_schedule_metadata
    static = dataclasses.replace(
        real,
        real_page_table=torch.zeros_like(real.real_page_table),
        cache_seqlens_int32=torch.ones_like(real.cache_seqlens_int32),
        paged_mqa_schedule_metadata=None if schedule is None else schedule.clone(),
    )
    backend.forward_metadata = static
    graphs.capture_metadata_after(None, backend, bs, bs, None, None, None, ForwardMode.DECODE, None)
    # Replay: sglang copies the batch into its static metadata, then the hook refreshes ours.
    static.real_page_table.copy_(real.real_page_table)
    static.cache_seqlens_int32.copy_(real.cache_seqlens_int32)
    if schedule is not None:
        static.paged_mqa_schedule_metadata.copy_(schedule)
    if not stale:
        graphs.replay_metadata_after(None, backend, bs)


def replicated_reference(case, results, topk: int, logits_fn=None, attention_fn=None):
    """(expected output [B, H, 512] float32, selected logical locs [B, k]) of a replicated pool
    holding the rows the owners stored. ``logits_fn`` / ``attention_fn`` default to the references."""
    batch = case.batch
    rows = case.kv_rows.clone()
    for result in results:
        rows[result["stored_locs"].to(rows.device)] = result["stored_rows"].to(rows.device)
    if logits_fn is None:
        logits = ref.paged_mqa_logits_reference(
            case.q_index, case.weights, case.index_pages, batch.page_table, batch.seq_lens, PAGE
        )
    else:
        logits = logits_fn(case.q_index, case.weights, case.index_pages, batch.page_table, batch.seq_lens)
    from sglang_cp_shared_kv.model_executor.decode_topk_merge import replicated_topk_positions

    positions = replicated_topk_positions(logits.float(), batch.seq_lens, topk)
    locs = torch.where(positions >= 0, batch.token_locs().gather(1, positions.clamp(min=0).long()), -1)
    if attention_fn is None:
        out, _ = ref.sparse_mla_decode_reference(case.q.float(), ref.kv_rows_as_float(rows), locs, SM_SCALE)
    else:
        out, _ = attention_fn(case.q, rows, locs, SM_SCALE, batch.seq_lens)
    return out.float(), locs


def compare(case, results, expected, locs, rel_tol: float) -> dict:
    """Every rank's output equal and close to ``expected``; indices cover ``locs`` once; no plan,
    scratch untouched; the stored decode rows dequantize to the decode tokens' KV."""
    batch = case.batch
    first = results[0]["out"]
    covered = []
    for rank, result in enumerate(results):
        idx = result["indices"]
        covered += batch.shard_rows(rank).cpu()[idx[idx >= 0].long()].tolist()
    stored = torch.cat([r["stored_rows"] for r in results])
    stored_locs = torch.cat([r["stored_locs"] for r in results])
    order = torch.argsort(stored_locs)
    want = case.new_kv.cpu().float()[torch.argsort(case.last_locs.cpu())]
    got = ref.kv_rows_as_float(stored[order])
    diff = (first[:, 0].float() - expected.cpu()).flatten(1).norm(dim=1)
    rel_err = float((diff / expected.cpu().flatten(1).norm(dim=1).clamp_min(1e-12)).max())
    return {
        "same_on_ranks": all(torch.equal(r["out"], first) for r in results),
        "rel_err": rel_err,
        "indices_cover_selection": sorted(covered) == sorted(locs[locs >= 0].cpu().tolist()),
        "no_plan": not any(r["planned"] for r in results),
        "scratch_untouched": all(r["scratch_untouched"] for r in results),
        "decode_rows_stored": stored_locs.numel() == case.last_locs.numel()
        and bool(torch.allclose(got, want, rtol=0.1, atol=0.1)),
        "passed_tolerance": rel_err <= rel_tol,
    }


def passed(comparison: dict) -> bool:
    return all(v for k, v in comparison.items() if k != "rel_err")

