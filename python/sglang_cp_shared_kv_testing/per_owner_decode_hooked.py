"""Per-owner decode forwards through sglang's own decode methods, on one rank of a gloo group.

Shared by ``test_per_owner_decode_gloo.py`` (CPU, kernels replaced by torch references) and
``scripts/gpu/check_cp_per_owner_decode.py`` (CUDA, the real kernels where they import). Every rank
rebuilds the same replicated pool (``make_case``), holds its shard in a real ``NSATokenToKVPool``
(fp8 or bf16 KV), applies our hooks and runs what decode forwards run, for every step of a
``Scenario``: the backend's metadata hook, then per layer ``get_indexer_metadata`` +
``Indexer._get_topk_paged`` (top-k layers; ``skip_topk`` layers reuse the previous layer's
indices, as sglang's model does) and ``NativeSparseAttnBackend.forward_decode`` (the decode token's
owner-filtered store, ``get_key_buffer``, the impl's kernel call). ``replicated_reference``
computes what a replicated pool gives, from the rows the owners stored.

A scenario covers what a served decode meets: several layers in one forward (with ``skip_topk``
layers), requests shorter than ``topk`` and of a single page (a rank owning none of their
selected rows), padded requests (``req_to_token`` row 0: logical page 0, seq len 1, loc 0) and
consecutive decode steps (each step appends one token per request).

``Scenario.plant`` plants one bug in this rank's run (never in the served code); the comparison must
then fail:
  skip-layer-unmerged   a ``skip_topk`` layer returns this rank's partial without the merge
  short-pad-row-0       the selection's padding (requests shorter than top-k) attends row 0
  padded-row-owned      the dummy page (padded requests) counts as owned by rank 0
  empty-partial-counted an empty partial's non-finite LSE enters the global LSE
  stale-tables          the second step reuses the first step's owner tables
  fa3-no-compaction     fa3 gets the owned indices in place (-1 between them) and their count
  lse-natural           the kernel's LSE taken as natural log whatever its base
  packed-lse-misread    the one-exchange merge reads each rank's LSE from the wrong bytes of the
                        gathered buffer (the last two partial values; the torch form, which CPU runs)

``Scenario.merge_one_exchange_max_extra_bytes`` is the setting the spec carries (default: the
modeled value, one exchange at these batch sizes; None: the scaled sum, the settings' default); every rank reports the
merge forms it ran (``merge_forms``).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
from contextlib import ExitStack
from types import SimpleNamespace
from typing import Optional, Tuple
from unittest import mock

import torch

from sglang_cp_shared_kv.settings import MODELED_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES
from sglang_cp_shared_kv_testing import nsa_decode_reference as ref
from sglang_cp_shared_kv_testing.decode_topk_reference import (
    replicated_topk_positions,
    same_selection_up_to_ties,
)
from sglang_cp_shared_kv_testing.cuda_sync_counter import CudaSyncCounter
from sglang_cp_shared_kv_testing.per_owner_decode_cases import random_batch

HEADS, INDEX_HEADS, PAGE = 64, 32, 64
SM_SCALE = 576**-0.5
KV_DIM = {"fp8": 656, "bf16": 576}
PLANTS = (
    "none",
    "skip-layer-unmerged",
    "short-pad-row-0",
    "padded-row-owned",
    "empty-partial-counted",
    "stale-tables",
    "fa3-no-compaction",
    "lse-natural",
    "packed-lse-misread",
)


@dataclasses.dataclass(frozen=True)
class Scenario:
    seq_lens: Tuple[int, ...]  # tokens of each real request at the first step
    topk: int = 128
    kv_dtype: str = "fp8"  # "fp8" | "bf16"
    decode_impl: str = "flashmla_kv"
    padded: int = 0  # padded requests appended to the batch
    layers: Tuple[str, ...] = ("topk",)  # per layer: "topk", or "skip" (reuses the previous indices)
    steps: int = 1
    # "decode": per_owner_decode's forward hooks + attach(); "plugin": the plugin's runtime hooks,
    # per-owner decode attached by ModelRunner.init_attention_backend's AFTER hooks.
    hooks: str = "decode"
    # "eager": the backend's metadata hook; "graph-replay": the decode-graph hooks as a captured graph
    # sees them (static tables built at capture from capture-time contents, then the batch copied into
    # the static metadata and refreshed by the replay hook); "graph-stale": without that refresh.
    graph: str = "eager"
    # The spec's setting: bytes the one-exchange merge may add per layer (None: the scaled sum).
    merge_one_exchange_max_extra_bytes: Optional[int] = MODELED_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES
    plant: str = "none"
    seed: int = 7
    # Count the host waits for the GPU of every decode step (``CudaSyncCounter``; CUDA only): the
    # plugin's own must be 0 (gloo's host staging of the collectives is exempted as deliberate).
    sync_debug: bool = False
    # The serve smoke's value audit on every layer, writing into this directory (its test drives
    # it through sglang's decode methods here), and one of the smoke plugin's planted bugs.
    value_audit_dir: Optional[str] = None
    smoke_plant: Optional[str] = None

    def __post_init__(self):
        if self.layers[0] != "topk":
            raise ValueError("the first layer computes top-k")
        if self.plant not in PLANTS:
            raise ValueError(f"unknown plant {self.plant!r}")

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens) + self.padded

    def step_seq_lens(self, step: int) -> torch.Tensor:
        """[B] int64 tokens each request attends to at ``step`` (padded requests: 1, as sglang)."""
        return torch.tensor([s + step for s in self.seq_lens] + [1] * self.padded)


def make_case(cp_size: int, scenario: Scenario, device: str) -> SimpleNamespace:
    """The replicated pool and queries (identical wherever built with the same arguments)."""
    g = torch.Generator().manual_seed(scenario.seed + cp_size)
    final = [s + scenario.steps - 1 for s in scenario.seq_lens] + [1] * scenario.padded
    padded = [False] * len(scenario.seq_lens) + [True] * scenario.padded
    batch = random_batch(g, cp_size, PAGE, final, padded)
    rows = batch.logical_pages * PAGE
    b, layers = scenario.batch_size, len(scenario.layers)
    kv = [torch.randn(rows, 576, generator=g).to(torch.bfloat16) for _ in range(layers)]
    index_k = [torch.randn(rows, 128, generator=g).to(torch.float8_e4m3fn) for _ in range(layers)]
    index_scale = [torch.rand(rows, generator=g) + 0.5 for _ in range(layers)]

    def per_step_layer(make):
        return [[make().to(device) for _ in range(layers)] for _ in range(scenario.steps)]

    new_kv = per_step_layer(lambda: torch.randn(b, 576, generator=g).to(torch.bfloat16))
    q_index = per_step_layer(lambda: torch.randn(b, INDEX_HEADS, 128, generator=g).to(torch.float8_e4m3fn))
    weights = per_step_layer(lambda: torch.rand(b, INDEX_HEADS, generator=g) * 0.1)
    q = per_step_layer(lambda: (torch.randn(b, HEADS, 576, generator=g) * 3.0).to(torch.bfloat16))
    token_locs = batch.token_locs()
    real = torch.tensor([not p for p in padded])
    last_locs = []
    for step in range(scenario.steps):
        positions = scenario.step_seq_lens(step) - 1
        locs = token_locs.gather(1, positions[:, None]).reshape(-1)
        last_locs.append(torch.where(real, locs, 0).to(device))  # padded tokens store to loc 0
    batch.page_table = batch.page_table.to(device)
    batch.seq_lens = batch.seq_lens.to(device)
    return SimpleNamespace(
        scenario=scenario,
        batch=batch,
        real=real.to(device),
        kv_rows=[pool_rows(x.to(device), scenario.kv_dtype) for x in kv],
        new_kv=new_kv,
        last_locs=last_locs,
        index_pages=[ref.index_pages(k.to(device), s.to(device), PAGE) for k, s in zip(index_k, index_scale)],
        q_index=q_index,
        weights=weights,
        q=q,
    )


def pool_rows(kv: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """[N, 576] bf16 latent + rope as the pool stores it: fp8 656-byte rows or the bf16 rows."""
    return ref.fp8_kv_rows(kv) if kv_dtype == "fp8" else kv.to(torch.bfloat16)


def rows_as_float(rows: torch.Tensor) -> torch.Tensor:
    return ref.kv_rows_as_float(rows) if rows.dtype == torch.uint8 else rows.float()


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
    module.flash_mla_sparse_fwd = ref.flash_mla_sparse_fwd_reference
    module.get_mla_metadata = lambda *args, **kwargs: (torch.zeros(1), torch.zeros(1))
    return module


def real_fa3_problem(device: str):
    """None when sglang's fa3 (``nsa_backend.flash_attn_with_kvcache``) runs here, else why not."""
    if device != "cuda":
        return "cpu"
    try:
        from sglang.srt.layers.attention import nsa_backend

        rows = torch.zeros(4, 1, 1, 576, dtype=torch.bfloat16, device="cuda")
        nsa_backend.flash_attn_with_kvcache(
            q=torch.zeros(1, HEADS, 64, dtype=torch.bfloat16, device="cuda"),
            k_cache=rows[..., 512:], v_cache=rows[..., :512],
            qv=torch.zeros(1, HEADS, 512, dtype=torch.bfloat16, device="cuda"),
            page_table=torch.zeros(1, 1, dtype=torch.int32, device="cuda"),
            cache_seqlens=torch.ones(1, dtype=torch.int32, device="cuda"),
            cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
            max_seqlen_q=1, softmax_scale=SM_SCALE, causal=True, return_softmax_lse=True,
        )
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001  (not staged, not built for this GPU, ...)
        return repr(error)
    return None


def kernels_in_this_process(stack: ExitStack, device: str) -> dict:
    """Real deep_gemm / flash_mla / fa3 on CUDA where they import, torch references otherwise;
    returns what each role uses."""
    from sglang.srt.layers.attention import nsa_backend
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
            # noqa: F401
            from sgl_kernel.flash_mla import (
                flash_mla_sparse_fwd,
                flash_mla_with_kvcache,
            )

            real_flash_mla = True
            names["attention (flashmla)"] = "sgl_kernel.flash_mla"
        except Exception as error:  # noqa: BLE001
            names["attention (flashmla)"] = f"torch reference (flash_mla not importable: {error!r})"
    else:
        names["attention (flashmla)"] = "torch reference (cpu)"
    if not real_flash_mla:
        from sglang_cp_shared_kv_testing import sgl_kernel_cpu_shim

        sgl_kernel_cpu_shim.install()
        module = _reference_flash_mla()
        stack.enter_context(mock.patch.dict(sys.modules, {"sgl_kernel.flash_mla": module}))
        stack.enter_context(mock.patch.object(sys.modules["sgl_kernel"], "flash_mla", module, create=True))
    fa3_problem = real_fa3_problem(device)
    if fa3_problem is None:
        names["attention (fa3)"] = "nsa_backend.flash_attn_with_kvcache"
    else:
        names["attention (fa3)"] = f"torch reference ({fa3_problem})"
        stack.enter_context(
            mock.patch.object(nsa_backend, "flash_attn_with_kvcache", ref.fa3_paged_decode_reference)
        )
    names["real_flash_mla"] = real_flash_mla
    names["deep_gemm"] = deep_gemm
    return names


def _make_backend(scenario: Scenario, names: dict, device: str):
    from sglang.srt.layers.attention.nsa_backend import NativeSparseAttnBackend

    backend = object.__new__(NativeSparseAttnBackend)
    backend.nsa_decode_impl = scenario.decode_impl
    backend.nsa_kv_cache_store_fp8 = scenario.kv_dtype == "fp8"
    backend.nsa_prefill_impl = "flashmla_kv" if scenario.kv_dtype == "fp8" else "flashmla_sparse"
    backend.flashmla_kv_num_q_heads, backend.real_page_size = HEADS, PAGE
    backend.kv_cache_dim, backend.nsa_index_topk = KV_DIM[scenario.kv_dtype], scenario.topk
    backend.num_splits, backend.device_sm_major = 0, 9
    return backend


def _forward_metadata(scenario: Scenario, batch, step: int, names: dict, device: str):
    from sglang.srt.layers.attention.nsa_backend import NSAFlashMLAMetadata, NSAMetadata

    seq_lens_i32 = scenario.step_seq_lens(step).to(device=device, dtype=torch.int32)
    nsa_seqlens = seq_lens_i32.clamp(max=scenario.topk)
    b = scenario.batch_size
    zeros = torch.zeros(1, dtype=torch.int32, device=device)
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=device)
    cu_k = torch.nn.functional.pad(nsa_seqlens.cumsum(0, dtype=torch.int32), (1, 0))
    if names["real_flash_mla"] and scenario.decode_impl == "flashmla_kv":
        from sgl_kernel.flash_mla import get_mla_metadata

        flashmla = NSAFlashMLAMetadata(*get_mla_metadata(nsa_seqlens, HEADS, 1, HEADS, True, scenario.topk))
    else:
        flashmla = NSAFlashMLAMetadata(zeros, zeros)
    schedule = None
    if names["deep_gemm"] is not None:
        dg = names["deep_gemm"]
        schedule = dg.get_paged_mqa_logits_metadata(seq_lens_i32, PAGE, dg.get_num_sms())
    return NSAMetadata(
        page_size=PAGE, cache_seqlens_int32=seq_lens_i32, max_seq_len_q=1,
        max_seq_len_k=int(seq_lens_i32.max()), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        page_table_1=batch.token_locs().to(torch.int32), real_page_table=batch.page_table,
        nsa_cache_seqlens_int32=nsa_seqlens, nsa_cu_seqlens_q=cu_q, nsa_cu_seqlens_k=cu_k,
        nsa_max_seqlen_q=1, nsa_extend_seq_lens_list=[1] * b, nsa_seqlens_expanded=seq_lens_i32,
        flashmla_metadata=flashmla, paged_mqa_schedule_metadata=schedule,
    )


def _attach(scenario: Scenario, runtime, pool, backend):
    """Attach per-owner decode as the scenario's hooks do (the spec opted in, as a server's is with
    ``SGLANG_CP_SHARED_KV_DECODE=per_owner``); returns the state (None: gather)."""
    from sglang_cp_shared_kv.model_executor.per_owner_decode import (
        decode_forward as per_owner_decode,
    )

    if scenario.hooks == "decode":
        return per_owner_decode.attach(runtime.state)
    init_attention_backend(pool, backend)
    return per_owner_decode.per_owner_of(pool)


def init_attention_backend(pool, backend) -> None:
    """``ModelRunner.init_attention_backend`` (with whatever hooks are applied) on a model runner
    holding ``pool`` whose backend is ``backend``, the flag on. Where a runtime is already attached
    to ``pool``, the startup's attach keeps it and attaches only per-owner decode, by the decision
    of the pool's spec."""
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang_cp_shared_kv.settings import CP_SHARED_KV_FIELD

    runner = object.__new__(ModelRunner)
    runner.server_args = SimpleNamespace(
        enable_pdmux=False, enable_two_batch_overlap=False, **{CP_SHARED_KV_FIELD: True}
    )
    runner.model_config = SimpleNamespace(context_len=pool.size)
    runner.is_draft_worker = False
    runner.token_to_kv_pool = pool
    runner._get_attention_backend = lambda: backend
    ModelRunner.init_attention_backend(runner)


def _apply_plants(stack: ExitStack, scenario: Scenario, rank: int, state) -> dict:
    """Patch this process for ``scenario.plant``; returns flags the forward loop reads."""
    from sglang_cp_shared_kv.model_executor.per_owner_decode import (
        attention_lse_merge,
        decode_topk_merge,
        owner_decode_tables,
    )
    from sglang_cp_shared_kv.model_executor.per_owner_decode import decode_forward as per_owner_decode

    plant, flags = scenario.plant, {}
    if plant == "skip-layer-unmerged":
        flags["unmerged_skip_layers"] = True
    elif plant == "short-pad-row-0":
        owned = decode_topk_merge.owned_attention_indices

        def padding_reads_row_0(selection, candidates, cp_rank):
            # a request with fewer than k tokens: its selection's empty slots read row 0
            short = selection.chosen_mask().sum(dim=(1, 2)) < candidates.physical_rows.shape[1]
            padding = (candidates.physical_rows < 0) & short[:, None]
            return torch.where(padding, 0, owned(selection, candidates, cp_rank)).to(torch.int32)

        stack.enter_context(mock.patch.object(per_owner_decode, "owned_attention_indices", padding_reads_row_0))
    elif plant == "padded-row-owned":
        build = owner_decode_tables.build_owner_decode_tables

        def dummy_owned(layout, real_page_table, seq_lens):
            if layout.cp_rank == 0:  # logical page 0 (padding) taken for one of rank 0's pages
                real_page_table = torch.where(real_page_table == 0, layout.cp_size, real_page_table)
            return build(layout, real_page_table, seq_lens)

        stack.enter_context(mock.patch.object(per_owner_decode, "build_owner_decode_tables", dummy_owned))
    elif plant == "empty-partial-counted":

        def counting_empty(lses):
            peak = lses.amax(dim=0)
            return peak + torch.log(torch.exp(lses - peak).sum(dim=0))

        stack.enter_context(mock.patch.object(attention_lse_merge, "global_lse", counting_empty))
    elif plant == "stale-tables":
        build = owner_decode_tables.build_owner_decode_tables
        first = {}

        def stale(layout, real_page_table, seq_lens):
            if "tables" not in first:
                first["tables"] = build(layout, real_page_table, seq_lens)
            return first["tables"]

        stack.enter_context(mock.patch.object(per_owner_decode, "build_owner_decode_tables", stale))
    elif plant == "fa3-no-compaction":

        def in_place(indices):
            return indices, (indices >= 0).sum(dim=1, dtype=torch.int32)

        stack.enter_context(mock.patch.object(per_owner_decode, "compact_owned_indices", in_place))
    elif plant == "lse-natural" and state is not None:
        state.lse_base = math.e if state.lse_base == 2 else 2.0
    elif plant == "packed-lse-misread":

        def misread(gathered, dim):
            n, tokens, heads, _ = gathered.shape
            lses = gathered[..., dim - 2 : dim].contiguous().view(torch.float32).reshape(n, tokens, heads)
            return gathered[..., :dim], lses

        stack.enter_context(mock.patch.object(attention_lse_merge, "unpack_gathered", misread))
    return flags


def run_rank(rank: int, world_size: int, scenario: Scenario, device: str) -> dict:
    """This rank's decode steps; returns its outputs, indices, stored rows and what it observed."""
    from sglang.srt.layers.attention.nsa import nsa_indexer
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang_cp_shared_kv import plugin
    from sglang_cp_shared_kv.model_executor import (
        forward_dispatch,
        owner_filtered_writes,
        peer_page_reads,
    )
    from sglang_cp_shared_kv.model_executor.per_owner_decode import decode_forward as per_owner_decode
    from sglang_cp_shared_kv.settings import PER_OWNER, CpSharedKVSettings
    from sglang_cp_shared_kv_testing.shared_kv_state import attach_runtime
    from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks
    from sglang_cp_shared_kv_testing.nsa_cpu_kernels import cpu_kernels
    from sglang_cp_shared_kv_testing.runtime_check import make_nsa_pool

    if device == "cuda":
        torch.cuda.set_device(0)
    case = make_case(world_size, scenario, device)
    batch = case.batch
    layout = batch.layout(rank)
    num_layers = len(scenario.layers)
    if scenario.hooks == "decode":
        hooks = (
            owner_filtered_writes.register_hooks,
            peer_page_reads.register_hooks,
            forward_dispatch.register_hooks,
            per_owner_decode.register_forward_hooks,
        )
    else:
        hooks = (plugin.register_runtime_hooks,)
    hooks += smoke_plugin_hooks(scenario)
    with ExitStack() as stack:
        names = kernels_in_this_process(stack, device)
        if device != "cuda":
            stack.enter_context(cpu_kernels())
        stack.enter_context(applied_hooks(*hooks))
        pool_tokens = (batch.physical_pages - 1) * PAGE
        pool = make_nsa_pool(pool_tokens, scenario.kv_dtype, num_layers, device)
        scratch = make_nsa_pool(world_size * pool_tokens, scenario.kv_dtype, 1, device)
        shard_rows = batch.shard_rows(rank)
        all_last = torch.cat(case.last_locs)
        own_last = layout.owned_by_this_rank(all_last)
        physical_last = layout.physical_locs_or_dummy(all_last).long()
        pages = layout.logical_page_of(torch.arange(batch.physical_pages, device=device))
        for layer_id in range(num_layers):
            kv = pool.kv_buffer[layer_id]
            kv = kv.view(torch.uint8) if scenario.kv_dtype == "fp8" else kv
            kv[: shard_rows.numel(), 0] = case.kv_rows[layer_id][shard_rows]
            kv[physical_last[own_last]] = 0  # the decode stores must write them
            pool.index_k_with_scale_buffer[layer_id][: batch.physical_pages] = case.index_pages[layer_id][pages]
        settings = CpSharedKVSettings(
            decode_path=PER_OWNER, merge_one_exchange_max_extra_bytes=scenario.merge_one_exchange_max_extra_bytes
        )
        runtime = attach_runtime(
            pool, layout, scratch, torch.distributed.group.WORLD, settings=settings,
            decode_impl=scenario.decode_impl,
        )  # fmt: skip
        backend = _make_backend(scenario, names, device)
        state = _attach(scenario, runtime, pool, backend)
        if state is None:
            raise RuntimeError(f"per-owner decode did not attach for {scenario.decode_impl}")
        flags = _apply_plants(stack, scenario, rank, state)
        merge_forms = set()
        choose = per_owner_decode.choose_merge_exchange

        def recording_choice(*args):
            merge_forms.add(choose(*args))
            return choose(*args)

        stack.enter_context(mock.patch.object(per_owner_decode, "choose_merge_exchange", recording_choice))
        indexer = object.__new__(nsa_indexer.Indexer)
        indexer.index_topk = scenario.topk
        indexer.sm_count = names["deep_gemm"].get_num_sms() if names["deep_gemm"] is not None else 1
        outs, indices_seen, planned, empty_partials = [], [], [], 0
        syncs = stack.enter_context(CudaSyncCounter()) if scenario.sync_debug else None
        for step in range(scenario.steps):
            backend.forward_metadata = _forward_metadata(scenario, batch, step, names, device)
            # As sglang's batch: real requests in req_to_token rows 1.., padded ones in row 0.
            real_rows = case.real.cpu()
            forward_batch = SimpleNamespace(
                forward_mode=ForwardMode.DECODE, token_to_kv_pool=pool, hisparse_coordinator=None,
                out_cache_loc=case.last_locs[step], batch_size=scenario.batch_size,
                req_pool_indices=torch.where(real_rows, torch.arange(1, scenario.batch_size + 1), 0).to(device),
                seq_lens_cpu=scenario.step_seq_lens(step),
                req_to_token_pool=SimpleNamespace(req_to_token=torch.cat(
                    [torch.zeros_like(batch.token_locs()[:1]), batch.token_locs()]
                )),
            )
            if scenario.graph == "eager":
                forward_dispatch.dispatch_forward_metadata(None, backend, forward_batch)
            else:
                _capture_then_replay(backend, runtime.state, stale=scenario.graph == "graph-stale")
            planned.append(runtime.plan is not None)
            indices = None
            step_outs, step_indices = [], []
            for layer_id, kind in enumerate(scenario.layers):
                if kind == "topk":
                    metadata = backend.get_indexer_metadata(layer_id, forward_batch)
                    indices = nsa_indexer.Indexer._get_topk_paged(
                        indexer, forward_batch, layer_id, case.q_index[step][layer_id],
                        case.weights[step][layer_id][:, :, None], metadata,
                    )
                # real requests of which this rank attends no row (padded ones: every rank)
                empty_partials += int(((indices < 0).all(dim=1) & case.real).sum())
                layer = SimpleNamespace(
                    layer_id=layer_id, tp_q_head_num=HEADS, head_dim=576, v_head_dim=512,
                    scaling=SM_SCALE, logit_cap=0.0, is_cross_attention=False,
                )
                new_kv = case.new_kv[step][layer_id]
                k_nope = new_kv[:, None, :512].contiguous()
                unmerged = flags.get("unmerged_skip_layers") and kind == "skip"
                with mock.patch.object(state, "merge", lambda out, lse: out) if unmerged else ExitStack():
                    out = backend.forward_decode(
                        q=case.q[step][layer_id].reshape(-1, HEADS * 576), k=k_nope, v=k_nope,
                        layer=layer, forward_batch=forward_batch, save_kv_cache=True,
                        k_rope=new_kv[:, None, 512:].contiguous(), topk_indices=indices,
                    )
                step_outs.append(out.reshape(scenario.batch_size, HEADS, 512).cpu())
                step_indices.append(indices.cpu())
            outs.append(step_outs)
            indices_seen.append(step_indices)
        stored = []
        for layer_id in range(num_layers):
            kv = pool.kv_buffer[layer_id]
            kv = kv.view(torch.uint8) if scenario.kv_dtype == "fp8" else kv
            stored.append(kv[physical_last[own_last], 0].cpu())
        return {
            "syncs": None if syncs is None else syncs.counts(),
            "our_sync_sites": [] if syncs is None else [site for owner, site in syncs.sites if owner == "ours"],
            "kernels": {k: v for k, v in names.items() if isinstance(v, str)},
            "out": outs,  # [step][layer] [B, H, 512]
            "indices": indices_seen,  # [step][layer] [B, k] physical rows of this rank, -1 elsewhere
            "planned": any(planned),
            "merge_forms": sorted(merge_forms),
            "empty_partials": empty_partials,
            "scratch_untouched": not bool(scratch.kv_buffer[0].view(torch.uint8).any()),
            "stored_locs": all_last[own_last].cpu(),
            "stored_rows": stored,  # [layer] rows of stored_locs
        }


def smoke_plugin_hooks(scenario: Scenario) -> tuple:
    """The serve smoke plugin's value audit and planted bug, as the scenario asks (test-only code
    from the checkout's ``scripts/smoke_plugin``)."""
    if scenario.value_audit_dir is None and scenario.smoke_plant is None:
        return ()
    from pathlib import Path

    from sglang_cp_shared_kv_testing.repo_scripts import REPO_ROOT

    plugin_dir = str(REPO_ROOT / "scripts" / "smoke_plugin")
    if plugin_dir not in sys.path:
        sys.path.insert(0, plugin_dir)
    from cp_shared_kv_smoke_hooks import planted_bugs, value_audit

    hooks = ()
    if scenario.value_audit_dir is not None:
        audit_dir = Path(scenario.value_audit_dir)
        hooks += (lambda registry: value_audit.register_hooks(registry, audit_dir, lambda pool: len(pool.kv_buffer)),)
    if scenario.smoke_plant is not None:
        hooks += (lambda registry: planted_bugs.register_hooks(registry, scenario.smoke_plant),)
    return hooks


def _capture_then_replay(backend, pool_state, stale: bool) -> None:
    """The decode-graph hooks around ``backend.forward_metadata`` (the batch to run), with the pool's
    state bound as ``bind_graph_decode`` binds it: capture with sglang's capture-time contents, then
    the replay's copy into the static metadata and refresh."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang_cp_shared_kv.model_executor.per_owner_decode import (
        decode_forward as per_owner_decode,
    )
    from sglang_cp_shared_kv.model_executor.per_owner_decode import cuda_graphs as graphs

    real = backend.forward_metadata
    bs, width = real.real_page_table.shape
    backend.decode_cuda_graph_metadata = {
        "page_table": torch.zeros((bs, width * PAGE), dtype=torch.int32, device=real.real_page_table.device)
    }
    setattr(backend, per_owner_decode._STATE_ATTR, pool_state.per_owner)
    setattr(backend, graphs._BOUND_ATTR, pool_state)
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


def replicated_reference(case, results, logits_fn=None, attention_fn=None):
    """Per step and layer: (expected output [B, H, 512] float32, selected logical locs [B, k], their
    positions, the indexer scores [B, L] and lengths the selection came from) of a replicated pool holding the rows
    the owners stored. ``logits_fn`` / ``attention_fn`` default to
    the torch references; ``attention_fn(q, rows, locs, sm_scale, seq_lens, kv_dtype)``."""
    scenario, batch = case.scenario, case.batch
    rows = []
    for layer_id in range(len(scenario.layers)):
        layer_rows = case.kv_rows[layer_id].clone()
        for result in results:
            locs = result["stored_locs"].to(layer_rows.device)
            layer_rows[locs] = result["stored_rows"][layer_id].to(layer_rows.device)
        rows.append(layer_rows)
    expected = []
    for step in range(scenario.steps):
        seq_lens = scenario.step_seq_lens(step).to(batch.page_table.device)
        step_expected, locs, scored = [], None, None
        for layer_id, kind in enumerate(scenario.layers):
            if kind == "topk":
                args = (case.q_index[step][layer_id], case.weights[step][layer_id],
                        case.index_pages[layer_id], batch.page_table, seq_lens)
                logits = (ref.paged_mqa_logits_reference(*args, PAGE) if logits_fn is None
                          else logits_fn(*args))
                positions = replicated_topk_positions(logits.float(), seq_lens, scenario.topk)
                positions = torch.where(case.real[:, None], positions, -1)  # padded: nothing
                locs = torch.where(
                    positions >= 0, batch.token_locs().gather(1, positions.clamp(min=0).long()), -1
                )
                scored = (positions.cpu(), logits.float().cpu(), torch.where(case.real, seq_lens, 0).cpu())
            q = case.q[step][layer_id]
            if attention_fn is None:
                out, _ = ref.sparse_mla_decode_reference(q.float(), rows_as_float(rows[layer_id]), locs, SM_SCALE)
            else:
                out, _ = attention_fn(q, rows[layer_id], locs, SM_SCALE, seq_lens, scenario.kv_dtype)
            out = torch.where(case.real[:, None, None], out.float(), 0.0)
            step_expected.append((out.cpu(), locs.cpu(), *scored))
        expected.append(step_expected)
    return expected


def compare(case, results, expected, rel_tol: float) -> dict:
    """Every rank's outputs equal; real requests close to ``expected`` and padded ones exactly 0;
    every rank's indices cover the selection once; no plan, scratch untouched; the stored decode
    rows are the decode tokens' KV."""
    scenario, batch = case.scenario, case.batch
    real = case.real.cpu()
    same, covered, rel_err, padded_zero, finite = True, True, 0.0, True, True
    for step in range(scenario.steps):
        for layer_id in range(len(scenario.layers)):
            first = results[0]["out"][step][layer_id]
            same &= all(torch.equal(r["out"][step][layer_id], first) for r in results)
            want, locs, positions, scores, lens = expected[step][layer_id]
            finite &= bool(torch.isfinite(first).all())
            padded_zero &= bool((first[~real] == 0).all())
            diff = (first[real].float() - want[real]).flatten(1).norm(dim=1)
            err = diff / want[real].flatten(1).norm(dim=1).clamp_min(1e-12)
            rel_err = max(rel_err, float(err.max()) if err.numel() else 0.0)
            # The ranks' rows, as request positions, must be one top-k (each token once, up to
            # ties at the k-th score: the reference's torch.topk and our radix selects may keep
            # different tied tokens).
            attended = torch.full((scenario.batch_size, len(results) * scenario.topk), -1, dtype=torch.int64)
            token_locs = batch.token_locs().cpu()
            for row in range(scenario.batch_size):
                position_of = {int(loc): p for p, loc in enumerate(token_locs[row, : int(lens[row])].tolist())}
                found = []
                for rank, result in enumerate(results):
                    idx = result["indices"][step][layer_id][row]
                    found += [position_of.get(int(loc), -2) for loc in batch.shard_rows(rank).cpu()[idx[idx >= 0].long()]]
                covered &= -2 not in found  # a row outside the request
                attended[row, : len(found)] = torch.tensor(found, dtype=torch.int64)
            covered &= bool(same_selection_up_to_ties(attended, positions, scores, lens, scenario.topk).all())
    stored_ok = True
    locs_all = torch.cat(case.last_locs).cpu()
    real_tokens = locs_all != 0
    stored_locs = torch.cat([r["stored_locs"] for r in results])
    stored_ok &= sorted(stored_locs[stored_locs != 0].tolist()) == sorted(locs_all[real_tokens].tolist())
    for layer_id in range(len(scenario.layers)):
        want_rows = pool_rows(
            torch.cat([case.new_kv[s][layer_id].cpu() for s in range(scenario.steps)]), scenario.kv_dtype
        )
        want = dict(zip(locs_all[real_tokens].tolist(), rows_as_float(want_rows[real_tokens])))
        for result in results:
            got = rows_as_float(result["stored_rows"][layer_id])
            for loc, row in zip(result["stored_locs"].tolist(), got):
                if loc != 0:
                    stored_ok &= bool(torch.allclose(row, want[loc], rtol=0.1, atol=0.1))
    return {
        "same_on_ranks": same,
        "rel_err": rel_err,
        "finite": finite,
        "padded_rows_zero": padded_zero,
        "indices_cover_selection": covered,
        "no_plan": not any(r["planned"] for r in results),
        "scratch_untouched": all(r["scratch_untouched"] for r in results),
        "decode_rows_stored": stored_ok,
        "passed_tolerance": rel_err <= rel_tol,
        **({"no_syncs_of_ours": all(r["syncs"]["ours"] == 0 for r in results)} if scenario.sync_debug else {}),
    }


def passed(comparison: dict) -> bool:
    return all(v for k, v in comparison.items() if k != "rel_err")


def run_rank_scenarios(rank: int, world_size: int, scenarios, device: str) -> list:
    """``run_rank`` for each scenario in turn, in one process (one interpreter start for all)."""
    return [run_rank(rank, world_size, scenario, device) for scenario in scenarios]


def run_ranks_for(cp_size: int, scenarios, device: str, timeout_s: float = 600) -> list:
    """Every rank's results of each scenario: [rank][scenario]."""
    from sglang_cp_shared_kv_testing.multi_rank import run_ranks

    return run_ranks(run_rank_scenarios, cp_size, (list(scenarios), device), timeout_s=timeout_s)


def run_scenarios(cp_size: int, scenarios, device: str, rel_tol: float, logits_fn=None,
                  attention_fn=None, timeout_s: float = 600) -> list:
    """All ranks of each scenario (same ``cp_size``) and the comparison: [(results, comparison)]."""
    per_rank = run_ranks_for(cp_size, scenarios, device, timeout_s=timeout_s)
    out = []
    for i, scenario in enumerate(scenarios):
        results = [rank_results[i] for rank_results in per_rank]
        case = make_case(cp_size, scenario, device)
        expected = replicated_reference(case, results, logits_fn=logits_fn, attention_fn=attention_fn)
        out.append((results, compare(case, results, expected, rel_tol)))
    return out


def run_scenario(cp_size: int, scenario: Scenario, device: str, rel_tol: float, **kwargs):
    """One scenario: (results, comparison)."""
    return run_scenarios(cp_size, [scenario], device, rel_tol, **kwargs)[0]
