"""Everything the plugin changes in sglang, in one table, and the startup check that it still fits.

``SGLANG_SURFACE`` lists every sglang attribute the plugin hooks, replaces or sets, keyed by the
sglang target (not by the module of ours that does it): every hook registration, the class swap
of the HiCache controller, the functions swapped for the length of one call (three kernels, and
one of sglang's while ``check_launch`` builds the arguments), and the attributes set on sglang's
objects. The table is data; the ``register_hooks`` functions register, and tests hold the
two equal (``test/registered/unit/test_sglang_surface.py``: every hook target resolves, the hooks
registered are exactly the table's, every attribute the package sets is in it).
``docs/sglang-surface.md`` is rendered from it (``scripts/render_sglang_surface.py``).

Why a check at startup: sglang's ``HookRegistry.apply_hooks`` logs a target it cannot resolve and
goes on, so a plugin on another sglang would start with some hooks silently missing.
``require_hook_targets`` resolves the hook targets of the tiers a process registers, before any is
registered, and stops the process naming every missing one and the sglang installed. It costs no
import of its own: ``apply_hooks`` imports the same modules right after ``plugin.register``.
"""

from __future__ import annotations

import pkgutil
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, List, Tuple

from sglang_cp_shared_kv.settings import CP_SHARED_KV_FIELD

# The sglang release the table was read from (the package pins it).
SGLANG_VERSION = "0.5.11"


class Kind(Enum):
    BEFORE = "before hook"
    AFTER = "after hook"
    AROUND = "around hook"
    REPLACE = "replace hook"
    CLASS_SWAP = "class swap"  # ``obj.__class__ = subclass`` on an object sglang built
    SET_DURING_CALL = "set during a call"  # a module attribute swapped and restored around one call
    ADDS_ATTRIBUTE = "adds an attribute"  # a name sglang's class does not have
    SETS_ATTRIBUTE = "sets sglang's attribute"  # one of sglang's own attributes, overwritten

    @property
    def is_hook(self) -> bool:
        """Registered with ``HookRegistry`` (``HookType`` of the same name)."""
        return self in (Kind.BEFORE, Kind.AFTER, Kind.AROUND, Kind.REPLACE)


class Scope(Enum):
    """Which processes make the change."""

    EVERY_PROCESS = "every process"  # the server-argument hooks: they add and check the flag
    FLAG_ON = "flag on"  # processes started after the flag was validated on (plugin.py)
    LAUNCH_CHECK = "check_launch"  # the launch check's own process, while it builds the arguments


@dataclass(frozen=True)
class SurfaceRow:
    owner: str  # dotted sglang module or class
    attribute: str
    kind: Kind
    reason: str
    scope: Scope = Scope.FLAG_ON

    @property
    def target(self) -> str:
        return f"{self.owner}.{self.attribute}"


_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
_KV_MIXIN = "sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin"
_MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
_FORWARD_BATCH = "sglang.srt.model_executor.forward_batch_info.ForwardBatch"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
_POOL = "sglang.srt.mem_cache.memory_pool.NSATokenToKVPool"
_REQ_TO_TOKEN_POOL = "sglang.srt.mem_cache.memory_pool.ReqToTokenPool"
_RADIX = "sglang.srt.mem_cache.radix_cache.RadixCache"
_TREE_NODE = "sglang.srt.mem_cache.radix_cache.TreeNode"
_HIRADIX = "sglang.srt.mem_cache.hiradix_cache.HiRadixCache"
_NSA_BACKEND_MODULE = "sglang.srt.layers.attention.nsa_backend"
_BACKEND = f"{_NSA_BACKEND_MODULE}.NativeSparseAttnBackend"
_MULTI_STEP_BACKEND = f"{_NSA_BACKEND_MODULE}.NativeSparseAttnMultiStepBackend"
_EAGLE_VERIFY = "sglang.srt.speculative.eagle_info.EagleVerifyInput"
_ASSEMBLER = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"
_CACHE_INIT_PARAMS = "sglang.srt.mem_cache.cache_init_params.CacheInitParams"
_CONTROLLER = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController"
_EAGLE_WORKER = "sglang.srt.speculative.eagle_worker.EAGLEWorker"
_EAGLE_V2 = "sglang.srt.speculative.eagle_info_v2.EagleDraftInputV2Mixin"
_INDEXER = "sglang.srt.layers.attention.nsa.nsa_indexer.Indexer"
_BOOTSTRAP_QUEUE = "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue"
_FLASH_MLA = "sgl_kernel.flash_mla"
_MEM_CACHE_COMMON = "sglang.srt.mem_cache.common"
_HIRADIX_MODULE = "sglang.srt.mem_cache.hiradix_cache"
_DISAGGREGATION_UTILS = "sglang.srt.disaggregation.utils"
_SERVER_ARGS_MODULE = "sglang.srt.server_args"

SGLANG_SURFACE: Tuple[SurfaceRow, ...] = (
    # ---- server arguments (every process; with the flag off they only add it) ----
    SurfaceRow(_SERVER_ARGS, "add_cli_args", Kind.AFTER,
               "adds the plugin's flag to sglang's parser", Scope.EVERY_PROCESS),
    SurfaceRow(_SERVER_ARGS, "__init__", Kind.AROUND,
               "takes the flag as a keyword (Engine) and validates the arguments",
               Scope.EVERY_PROCESS),
    SurfaceRow(_SERVER_ARGS, "from_cli_args", Kind.AROUND,
               "the parsed flag reaches the dataclass before __post_init__ reads it; validates",
               Scope.EVERY_PROCESS),
    SurfaceRow(_SERVER_ARGS, "check_server_args", Kind.BEFORE,
               "validates again where sglang checks its arguments", Scope.EVERY_PROCESS),
    SurfaceRow(_SERVER_ARGS, "_handle_model_specific_adjustments", Kind.AROUND,
               "NSA prefill CP at --tp 2 and 4 on one node (sglang 0.5.11 asserts tp 8)",
               Scope.EVERY_PROCESS),
    SurfaceRow(_SERVER_ARGS, CP_SHARED_KV_FIELD, Kind.ADDS_ATTRIBUTE,
               "the flag's value, set by __init__ / from_cli_args", Scope.EVERY_PROCESS),
    SurfaceRow(_SERVER_ARGS, "tp_size", Kind.SETS_ATTRIBUTE,
               "8 while _handle_model_specific_adjustments runs, then restored",
               Scope.EVERY_PROCESS),
    SurfaceRow(_SERVER_ARGS, "attn_cp_size", Kind.SETS_ATTRIBUTE,
               "recomputed from the real --tp after _handle_model_specific_adjustments",
               Scope.EVERY_PROCESS),
    # ---- capacity and the allocator ----
    SurfaceRow(_KV_MIXIN, "init_memory_pool", Kind.AROUND,
               "stock physical sizing, then the shared allocator over the logical capacity"),
    SurfaceRow(_MODEL_RUNNER, "token_to_kv_pool_allocator", Kind.SETS_ATTRIBUTE,
               "the shared allocator (CPSharedPagedTokenToKVPoolAllocator) replaces stock's"),
    SurfaceRow(_MODEL_RUNNER, "max_total_num_tokens", Kind.SETS_ATTRIBUTE,
               "the logical capacity, cp_size x the physical pool"),
    # ---- startup wiring and the runtime ----
    SurfaceRow(_KV_MIXIN, "_profile_available_bytes", Kind.AFTER,
               "holds back the gather scratch's bytes from the KV budget"),
    SurfaceRow(_MODEL_RUNNER, "init_attention_backend", Kind.AFTER,
               "attaches the runtime (or the MTP draft pool's), per-owner decode, startup line"),
    SurfaceRow(_MODEL_RUNNER, "_dummy_run", Kind.AROUND,
               "its batch has no host rows: the plan reads them all as row 0"),
    SurfaceRow(_POOL, "_cp_shared_kv_state", Kind.ADDS_ATTRIBUTE,
               "the pool's one state object: the spec, the runtime, the req_to_token mirror, per-owner decode"),
    # ---- CP HiCache ----
    SurfaceRow(_HIRADIX_MODULE, "HiRadixCache", Kind.REPLACE,
               "CpHiRadixCache: host copies of owned pages only, one tree agreed by all ranks"),
    SurfaceRow(_ASSEMBLER, "build_kv_host_pool", Kind.AROUND,
               "NSA KV host rows as wide as the device pool's (whole fp8 rows)"),
    SurfaceRow(_SCHEDULER, "_maybe_register_hicache_draft", Kind.AROUND,
               "the MTP draft's KV and indexer host pools join the CP controller"),
    SurfaceRow(_SCHEDULER, "_prefetch_kvcache", Kind.AROUND,
               "the CP cache's synchronous L3 prefetch"),
    SurfaceRow(_ADDER, "add_one_req", Kind.AROUND,
               "load-back quota: records which adder admits which request"),
    SurfaceRow(_HIRADIX, "init_load_back", Kind.AROUND,
               "load-back quota: passes the adder's remaining budget as mem_quota"),
    SurfaceRow(_CACHE_INIT_PARAMS, "attn_cp_rank", Kind.SETS_ATTRIBUTE,
               "the attention CP rank, which sglang 0.5.11 leaves 0, for the NSA assembler"),
    SurfaceRow(_CACHE_INIT_PARAMS, "attn_cp_size", Kind.SETS_ATTRIBUTE,
               "the attention CP size, which sglang 0.5.11 leaves 1, for the NSA assembler"),
    SurfaceRow(_SERVER_ARGS, "hicache_storage_backend", Kind.SETS_ATTRIBUTE,
               "None on the copy stock HiRadixCache is built with: L3 is the CP cache's own"),
    SurfaceRow(_CONTROLLER, "__class__", Kind.CLASS_SWAP,
               "CpHybridCacheController (adds layout): host writes and loads of owned pages"),
    SurfaceRow(_TREE_NODE, "host_len", Kind.ADDS_ATTRIBUTE,
               "logical tokens backed up on the host, equal on every rank (host_value stays None)"),
    SurfaceRow(_TREE_NODE, "cp_hicache", Kind.ADDS_ATTRIBUTE,
               "this rank's host positions and slots of the node (CpHiCacheNodeMetadata)"),
    # ---- prefill admission within the gather scratch ----
    SurfaceRow(_ADDER, "add_one_req", Kind.AROUND,
               "caps a prefill batch at what the prefill-only scratch holds"),
    SurfaceRow(_ADDER, "add_chunked_req", Kind.AROUND,
               "counts the continuing chunked request's scratch pages first"),
    SurfaceRow(_ADDER, "_cp_shared_kv_scratch_pages_used", Kind.ADDS_ATTRIBUTE,
               "scratch pages the batch being built has admitted"),
    # ---- the host mirror of req_to_token and the tree's value pages ----
    SurfaceRow(_MEM_CACHE_COMMON, "alloc_for_extend", Kind.AROUND,
               "mirror writer: an extend's prefix and new pages"),
    SurfaceRow(_MEM_CACHE_COMMON, "alloc_for_decode", Kind.AROUND,
               "mirror writer: a decode token's page"),
    SurfaceRow(_RADIX, "cache_unfinished_req", Kind.AROUND,
               "mirror writer: the row after the tree took the request's prefix"),
    SurfaceRow(_RADIX, "cache_finished_req", Kind.AROUND,
               "the tree's value pages of the row it inserts"),
    SurfaceRow(_RADIX, "insert", Kind.AROUND,
               "the tree's value pages of new nodes"),
    SurfaceRow(_RADIX, "_split_node", Kind.AROUND,
               "the tree's value pages of both halves of a split"),
    SurfaceRow(_RADIX, "cp_inserting_pages", Kind.ADDS_ATTRIBUTE,
               "the inserted row's page ids while cache_*_req inserts"),
    SurfaceRow(_TREE_NODE, "cp_value_pages", Kind.ADDS_ATTRIBUTE,
               "the page ids of the node's value, for the plan"),
    SurfaceRow(_TREE_NODE, "cp_value_pages_of", Kind.ADDS_ATTRIBUTE,
               "the value those page ids describe (stale when it changed)"),
    SurfaceRow(_REQ_TO_TOKEN_POOL, "_cp_req_to_page_mirror", Kind.ADDS_ATTRIBUTE,
               "the host mirror of req_to_token the plan reads page ids from"),
    SurfaceRow(_FORWARD_BATCH, "init_new", Kind.AFTER,
               "keeps the batch's req_to_token rows on the host"),
    SurfaceRow(_FORWARD_BATCH, "cp_req_pool_indices_cpu", Kind.ADDS_ATTRIBUTE,
               "the batch's req_to_token rows on the host, for the plan"),
    SurfaceRow(_SCHEDULER, "init_cache_with_memory_pool", Kind.AFTER,
               "refuses tree caches whose writes are not mirrored"),
    SurfaceRow(_EAGLE_WORKER, "_draft_preprocess_decode", Kind.AROUND,
               "mirror writer (MTP, spec v1): the draft steps' locs"),
    SurfaceRow(_EAGLE_VERIFY, "prepare_for_verify", Kind.AROUND,
               "mirror writer (MTP, spec v1): the draft tokens' locs"),
    SurfaceRow(_EAGLE_VERIFY, "verify", Kind.AROUND,
               "MTP, spec v1: refuses a rewrite of accepted tokens the mirror cannot follow"),
    SurfaceRow(_EAGLE_V2, "prepare_for_decode", Kind.AROUND,
               "mirror writer (MTP, spec v2): every request's over-allocation"),
    # ---- owner-filtered writes ----
    SurfaceRow(_POOL, "set_mla_kv_buffer", Kind.AROUND,
               "keeps owned MLA rows (physical), others sink into page 0; fills the scratch"),
    SurfaceRow(_INDEXER, "_store_index_k_cache", Kind.AROUND,
               "keeps owned indexer K rows (physical), others sink into page 0"),
    SurfaceRow(_FORWARD_BATCH, "out_cache_loc", Kind.SETS_ATTRIBUTE,
               "physical or scratch locs around the indexer store, restored after it"),
    SurfaceRow(_FORWARD_BATCH, "token_to_kv_pool", Kind.SETS_ATTRIBUTE,
               "the scratch slot around a gathering indexer store, restored after it"),
    SurfaceRow(_POOL, "set_kv_buffer", Kind.AROUND,
               "refused: unused by NSA, it would bypass the owner filter"),
    # ---- reads of peer pages (the gathering path) ----
    SurfaceRow(_POOL, "get_key_buffer", Kind.AROUND,
               "attention reads the layer's gather scratch slot"),
    SurfaceRow(_POOL, "get_index_k_with_scale_buffer", Kind.AROUND,
               "the paged indexer reads the scratch"),
    SurfaceRow(_POOL, "get_index_k_scale_buffer", Kind.AROUND,
               "the ragged indexer reads the scratch"),
    SurfaceRow(_POOL, "get_index_k_continuous", Kind.AROUND,
               "refused while the runtime serves the pool (in-seq-split CP, non-CUDA indexer)"),
    SurfaceRow(_POOL, "get_index_k_scale_continuous", Kind.AROUND,
               "refused while the runtime serves the pool"),
    SurfaceRow(_POOL, "get_mla_kv_buffer", Kind.AROUND,
               "refused while the runtime serves the pool (dense MHA path)"),
    SurfaceRow(_BACKEND, "init_forward_metadata_capture_cuda_graph", Kind.BEFORE,
               "refuses graph capture unless decode graphs run per owner"),
    SurfaceRow(_BACKEND, "init_forward_metadata_replay_cuda_graph", Kind.BEFORE,
               "refuses graph replay unless decode graphs run per owner"),
    SurfaceRow(_BACKEND, "init_forward_metadata_replay_cuda_graph_from_precomputed", Kind.BEFORE,
               "refuses graph replay unless decode graphs run per owner"),
    SurfaceRow(_BACKEND, "forward_metadata", Kind.SETS_ATTRIBUTE,
               "a gathering forward's index tables remapped to scratch locs and pages"),
    # ---- per forward ----
    SurfaceRow(_BACKEND, "init_forward_metadata", Kind.AFTER,
               "the one dispatcher: draft step, per owner or gather"),
    SurfaceRow(_MULTI_STEP_BACKEND, "init_forward_metadata", Kind.AROUND,
               "MTP: plans every draft step"),
    SurfaceRow(_MODEL_RUNNER, "forward", Kind.BEFORE,
               "MTP: a draft step runs on its own plan"),
    # ---- per-owner decode ----
    SurfaceRow(_BACKEND, "get_indexer_metadata", Kind.AFTER,
               "per owner: the indexer scores this rank's pages"),
    SurfaceRow(_BACKEND, "_forward_flashmla_kv", Kind.AROUND,
               "per owner: the kernel's LSE kept, outputs merged across ranks"),
    SurfaceRow(_BACKEND, "_forward_flashmla_sparse", Kind.AROUND,
               "per owner: the kernel's LSE kept, outputs merged across ranks"),
    SurfaceRow(_BACKEND, "_forward_fa3", Kind.AROUND,
               "per owner: owned indices first, the kernel's LSE kept, outputs merged"),
    SurfaceRow(_FLASH_MLA, "flash_mla_with_kvcache", Kind.SET_DURING_CALL,
               "wrapped during _forward_flashmla_kv to keep its LSE"),
    SurfaceRow(_FLASH_MLA, "flash_mla_sparse_fwd", Kind.SET_DURING_CALL,
               "wrapped during _forward_flashmla_sparse to keep its LSE"),
    SurfaceRow(_NSA_BACKEND_MODULE, "flash_attn_with_kvcache", Kind.SET_DURING_CALL,
               "wrapped during _forward_fa3 to keep its LSE"),
    SurfaceRow(_BACKEND, "_cp_per_owner_decode", Kind.ADDS_ATTRIBUTE,
               "the forward's per-owner state, which the attention hooks find"),
    # ---- per-owner decode under CUDA graphs ----
    SurfaceRow(_MODEL_RUNNER, "init_device_graphs", Kind.BEFORE,
               "binds per-owner decode to the backend about to be captured"),
    SurfaceRow(_BACKEND, "init_cuda_graph_state", Kind.AFTER,
               "the owner tables' static buffers"),
    SurfaceRow(_BACKEND, "init_forward_metadata_capture_cuda_graph", Kind.AFTER,
               "a captured forward runs per owner over the static tables"),
    SurfaceRow(_BACKEND, "init_forward_metadata_replay_cuda_graph", Kind.AFTER,
               "refreshes the static tables from the replay's page table"),
    SurfaceRow(_BACKEND, "init_forward_metadata_replay_cuda_graph_from_precomputed", Kind.AFTER,
               "refreshes the static tables from the replay's page table"),
    SurfaceRow(_BACKEND, "_cp_per_owner_graph_bound", Kind.ADDS_ATTRIBUTE,
               "per-owner decode is bound for capture"),
    SurfaceRow(_BACKEND, "_cp_per_owner_graph_buffers", Kind.ADDS_ATTRIBUTE,
               "the graphs' static owner tables"),
    # ---- PD prefill ----
    SurfaceRow(_DISAGGREGATION_UTILS, "get_kv_class", Kind.AROUND,
               "mooncake's KV manager and sender become the shared-KV subclasses"),
    SurfaceRow(_BOOTSTRAP_QUEUE, "_init_kv_manager", Kind.AROUND,
               "the KV manager translates through the pool's layout"),
    # ---- the launch check ----
    SurfaceRow(_SERVER_ARGS_MODULE, "get_device_memory_capacity", Kind.SET_DURING_CALL,
               "an H200's memory while the arguments are built (sglang's memory-sized defaults)",
               Scope.LAUNCH_CHECK),
)


class SglangSurfaceMismatch(SystemExit):
    """The installed sglang lacks hook targets of the table. A ``SystemExit`` on purpose: sglang's
    ``load_plugins`` catches any ``Exception`` a plugin raises, logs it and starts without it."""


def unresolved_targets(rows: Iterable[SurfaceRow]) -> List[str]:
    """Targets of ``rows`` whose owner does not import, or has no such attribute, in this sglang."""
    missing = []
    for row in rows:
        try:
            owner = pkgutil.resolve_name(row.owner)
        except (ImportError, AttributeError):
            owner = None
        if owner is None or not hasattr(owner, row.attribute):
            missing.append(row.target)
    return list(dict.fromkeys(missing))


def require_hook_targets(flag_on: bool) -> None:
    """Stop the process unless every hook target it will register resolves (module docstring)."""
    scopes = (Scope.EVERY_PROCESS, Scope.FLAG_ON) if flag_on else (Scope.EVERY_PROCESS,)
    missing = unresolved_targets(r for r in SGLANG_SURFACE if r.kind.is_hook and r.scope in scopes)
    if missing:
        raise SglangSurfaceMismatch(
            f"sglang-cp-shared-kv was written for sglang {SGLANG_VERSION}; the installed sglang "
            f"{_installed_sglang_version()} lacks {len(missing)} of its hook targets: "
            f"{', '.join(missing)}. Install sglang=={SGLANG_VERSION}, or leave the plugin out "
            f"(SGLANG_PLUGINS names the plugins sglang loads). Every target: docs/sglang-surface.md"
        )


def _installed_sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "(no distribution metadata)"
