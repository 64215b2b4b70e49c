"""Every startup rule of shared KV and the decisions taken at startup: pure functions of the server
arguments and the settings.

A leaf (it imports ``settings`` and sglang, nothing of the runtime), so that every judge of a launch
asks the same functions: ``server_args`` while ``ServerArgs`` is built (the flag's validation, one
``ValueError`` listing every problem), ``check_launch`` on a machine without a GPU, and the model
runner's spec (``model_executor.cp_shared_kv_spec``), built once per server where the capacity is
installed. Each function takes the ``ServerArgs`` as sglang's ``__post_init__`` left it and the
``CpSharedKVSettings`` in force (never the environment), and returns problems (one sentence each,
naming its setting) or a decision:

* ``cp_shared_kv_problems``: every reason the flag cannot run with these arguments;
* ``decide_decode_path``: whether decode runs per owner or gathers pages, and why (``DecodePath``);
* ``decide_scratch``: how large the gather scratch's slots are (``ScratchDecision``).

Every input is a server argument or a setting of the launching process, which every scheduler
inherits, so every rank takes the same decisions.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import List, Optional

from sglang_cp_shared_kv.settings import (
    ALL_CP_RANKS_ENV,
    AUTO,
    CP_SHARED_KV_FLAG,
    CPP_RADIX_TREE_ENV,
    DECODE_PATH_ENV,
    GATHER,
    GRAPH_DECODE_ENV,
    MTP_ENV,
    PER_OWNER,
    PREFILL_SCRATCH_TOKENS_ENV,
    UNIFIED_RADIX_TREE_ENV,
    CpSharedKVSettings,
)

logger = logging.getLogger(__name__)

# The NSA indexer stores K in 64-token pages; a shared-KV page must be exactly one indexer page so
# that KV and indexer K of a page live on the same rank. sglang sets 64 for DSA models on CUDA.
CP_SHARED_KV_PAGE_SIZE = 64

# ---- one node: the CP sizes the models split at ----
# Where GLM-5 and DeepSeek-V3.2 split: with NSA prefill CP every attention rank holds all heads
# (attn_tp_size = tp / cp = 1), but the routed experts split over the whole TP group, and sglang's
# FusedMoE asserts ``moe_intermediate_size % moe_tp_size == 0`` (2048 for both models), and its fp8
# block-quantized experts need the per-rank width divisible by the 128-wide block (Fp8MoEMethod).
# 2048 / tp is 1024, 512, 256 at tp 2, 4, 8; no other size from 2 to 8 divides 2048.
CP_SHARED_KV_TP_SIZES = (2, 4, 8)
TP_SIZES_TEXT = "2, 4 or 8"


def wants_round_robin_nsa_cp(server_args) -> bool:
    """NSA prefill CP asked for in the mode shared KV supports (other modes are refused later)."""
    return (
        server_args.enable_nsa_prefill_context_parallel
        and server_args.nsa_prefill_cp_mode == "round-robin-split"
    )


def single_node_tp_problem(server_args) -> Optional[str]:
    """Why NSA prefill CP with the flag cannot run at this ``--nnodes`` / ``--tp`` (None: it can).
    Judged before sglang's own ``tp_size == 8`` assert (``server_args`` lifts it for these sizes)."""
    if server_args.nnodes != 1:
        return (
            f"{CP_SHARED_KV_FLAG} with --enable-nsa-prefill-context-parallel runs within one node: "
            f"--nnodes {server_args.nnodes} is not supported (use --nnodes 1, --tp {TP_SIZES_TEXT})"
        )
    if server_args.tp_size not in CP_SHARED_KV_TP_SIZES:
        return (
            f"{CP_SHARED_KV_FLAG} with --enable-nsa-prefill-context-parallel needs --tp "
            f"{TP_SIZES_TEXT} on one node (the CP group is the TP group; GLM-5's and "
            f"DeepSeek-V3.2's experts, moe_intermediate_size 2048 in 128-wide blocks, split only "
            f"at those sizes), got --tp {server_args.tp_size}"
        )
    return None


# ---- the decode path (docs/runtime.md, section 4) ----
# Per owner (``model_executor.per_owner_decode``): each rank scores and attends over its own pool,
# no page gather, the gather scratch only holds a prefill forward, and decode runs under CUDA graphs.
# Through the gather: every decode forward gathers the pages it reads into the scratch, which must
# then hold one layer of the whole logical capacity, and graphs are refused (the gather's size
# follows the batch).
#
# ``SGLANG_CP_SHARED_KV_DECODE=auto`` (the default) decodes per owner with the NSA decode impls that
# have served clean at CP 2, 4 and 8 (audited against stock, one-GPU test mode, 2026-12-03: ``fa3``,
# sglang's decode impl for bf16 KV on Hopper) and gathers otherwise: with ``flashmla_kv`` (fp8 KV;
# served clean per owner at CP 2 and 4, not yet at 8), with impls per-owner decode does not serve,
# and with MTP (the draft's decode steps gather). ``per_owner`` asks for it with any impl it serves
# (and refuses MTP); ``gather`` keeps every decode on the gather. Measured on one H200 at GLM-5
# widths per-owner decode costs a fixed 44-82 us per layer at batch 1 as a CUDA graph and 370-770 us
# eagerly, whatever the context, against a gather whose on-GPU work alone grows with the batch's
# pages.
#
# The decision is needed before the model runner exists (the scratch is reserved before sglang
# sizes the pool, and the CUDA-graph rule is judged on ``ServerArgs``), so it is taken from
# ``SGLANG_CP_SHARED_KV_DECODE``, the NSA decode impl sglang resolved into ``--nsa-decode-backend``
# (which its NSA backend takes as its decode impl), ``--speculative-algorithm``,
# ``SGLANG_NSA_FUSE_TOPK`` and the PD mode (a ``--disaggregation-mode prefill`` server never
# decodes). A decode forward that reaches the gather while the scratch was sized for prefill raises
# (``CpSharedKVRuntime.begin_forward``).

# NSA decode impls (``--nsa-decode-backend``) that ``per_owner_decode`` serves; kept equal to what it
# attaches for (a unit test compares them), here so that the rules need not import the runtime.
PER_OWNER_DECODE_IMPLS = ("flashmla_kv", "flashmla_sparse", "fa3")
# The impls ``auto`` decodes per owner with: served clean at CP 2, 4 and 8 (docs/gpu.md, served-audit
# table). flashmla_kv has served clean at CP 2 and 4 only; flashmla_sparse has not been served.
AUTO_PER_OWNER_DECODE_IMPLS = ("fa3",)


@dataclass(frozen=True)
class DecodePath:
    """How this server decodes, decided once (``decide_decode_path``).

    ``impl``: the NSA decode impl sglang resolved (``--nsa-decode-backend``, which its NSA backend
    takes as its decode impl); ``gather_reason``: why decode with it gathers pages (a sentence naming
    the setting), None: per-owner decode attaches; ``pd_prefill``: a PD prefill server, which runs
    no decode forward (whatever the impl: its scratch holds prefill batches, its graphs replay
    nothing that gathers)."""

    impl: Optional[str]
    gather_reason: Optional[str]
    pd_prefill: bool = False

    @property
    def per_owner(self) -> bool:
        return self.gather_reason is None

    @property
    def decode_gather_reason(self) -> Optional[str]:
        """Why this server's decode forwards gather pages; None when they run per owner or when the
        server runs none (a PD prefill server)."""
        return None if self.pd_prefill else self.gather_reason


def is_pd_prefill_server(server_args) -> bool:
    return getattr(server_args, "disaggregation_mode", None) == "prefill"


def decide_decode_path(server_args, settings: CpSharedKVSettings) -> DecodePath:
    """The one decision of the decode path (same inputs on every rank)."""
    return DecodePath(
        impl=server_args.nsa_decode_backend,
        gather_reason=impl_gather_reason(
            settings, server_args.nsa_decode_backend, server_args.speculative_algorithm
        ),
        pd_prefill=is_pd_prefill_server(server_args),
    )


def impl_gather_reason(
    settings: CpSharedKVSettings, impl: Optional[str], speculative_algorithm: Optional[str] = None
) -> Optional[str]:
    """Why decode with this NSA decode impl gathers pages, or None when it runs per owner (the rule
    of ``decide_decode_path``). ``speculative_algorithm`` matters to ``auto`` only: with an explicit
    ``per_owner`` MTP is refused instead (``mtp_combination_problems``), never quietly moved to the
    gather."""
    path = settings.decode_path
    if path == GATHER:
        return f"{DECODE_PATH_ENV}={GATHER}"
    if impl not in PER_OWNER_DECODE_IMPLS:
        served = ", ".join(PER_OWNER_DECODE_IMPLS)
        return f"--nsa-decode-backend {impl} (per-owner decode serves {served})"
    if path == AUTO and impl not in AUTO_PER_OWNER_DECODE_IMPLS:
        return (
            f"{DECODE_PATH_ENV}={AUTO} (the default) decodes per owner with "
            f"{', '.join(AUTO_PER_OWNER_DECODE_IMPLS)} only, not yet with --nsa-decode-backend {impl} "
            f"(not served clean at every CP size; {DECODE_PATH_ENV}={PER_OWNER} asks for it)"
        )
    if path == AUTO and speculative_algorithm is not None:
        return (
            f"--speculative-algorithm {speculative_algorithm} with {DECODE_PATH_ENV}={AUTO} (the "
            f"default): the draft's decode steps gather pages"
        )
    from sglang.srt.environ import envs

    if not envs.SGLANG_NSA_FUSE_TOPK.get():
        return "SGLANG_NSA_FUSE_TOPK is off (per-owner decode needs the fused top-k)"
    return None


def cuda_graph_problem(server_args, settings: CpSharedKVSettings, decode: DecodePath) -> Optional[str]:
    """Why this server cannot run decode CUDA graphs (a message naming the settings), or None.

    Decode graphs replay fixed shapes: per-owner decode has them (static owner tables, fixed-size
    exchanges), the page gather does not (its size follows the batch's pages). On by default where
    decode runs per owner; ``SGLANG_CP_SHARED_KV_DECODE_CUDA_GRAPH=0`` turns them off (the server
    then needs --disable-cuda-graph)."""
    if server_args.disable_cuda_graph:
        return None
    if not settings.decode_cuda_graph:
        return (
            f"{CP_SHARED_KV_FLAG} requires --disable-cuda-graph with {GRAPH_DECODE_ENV}=0 (decode "
            "CUDA graphs off)"
        )
    reason = decode.decode_gather_reason
    if reason is not None:
        return (
            f"{CP_SHARED_KV_FLAG} requires --disable-cuda-graph while decode gathers pages ({reason}): "
            f"graphs cannot replay the per-forward, variable-size page gather"
        )
    # Per-owner decode graphs have served clean at every CP size the flag accepts (2, 4 and 8;
    # one-GPU test mode, 2026-12-03), with padded replays: no CP-size or capture-list rule.
    return None


# ---- the gather scratch's slots (docs/runtime.md, section 3) ----
# A forward that gathers reads every page its requests reference, one layer at a time, from the
# scratch. A decode forward that gathers references every running request's whole context, so with
# gathering decode slot 0 must hold one layer of the whole logical capacity (``cp_size x`` the
# physical pool). When decode runs per owner only extend forwards gather, and an extend forward
# references, per request, its prefix plus this forward's chunk (``len(fill_ids)`` tokens). Slot 0
# then only has to hold what admission lets into one prefill batch:
#
# * size (``scratch_sizing`` below): ``SGLANG_CP_SHARED_KV_PREFILL_SCRATCH_TOKENS`` if set, else
#   ``context_len + chunked_prefill_size`` (``+ max_prefill_tokens`` without chunked prefill): one
#   request of the longest context plus one chunk's worth of other requests; rounded up to pages
#   and at most the logical capacity (``model_executor.gather_scratch``, once the pool is sized);
# * bound (``1 + model_executor.scratch_sizing.request_scratch_pages`` per request): what one prefill batch
#   can need, which admission (``managers.prefill_scratch_admission``) keeps every batch within.
#
# Slot 0 keeps the full logical capacity when a decode forward may gather (``decode_gather_reason``)
# and with ``--enable-mixed-chunk`` (running decode requests, whole contexts, join the extend batch).
# Slot 1 (the layer-ahead prefetch) is requested here and capped at the logical capacity there.


@dataclass(frozen=True)
class ScratchSizing:
    """Slot 0's size rule. ``prefill_tokens`` None: the whole logical capacity (``reason`` says why)."""

    prefill_tokens: Optional[int]
    reason: str

    @property
    def prefill_only(self) -> bool:
        return self.prefill_tokens is not None


@dataclass(frozen=True)
class ScratchDecision:
    """What the gather scratch holds on this server, decided once (``decide_scratch``).

    ``slot0``: slot 0's rule (prefill batches only, or the logical capacity);
    ``prefetch_slot_requested_tokens``: slot 1's request before the capacity cap (0: no slot 1)."""

    slot0: ScratchSizing
    prefetch_slot_requested_tokens: int


def decide_scratch(
    server_args, settings: CpSharedKVSettings, decode: DecodePath, context_len: int
) -> ScratchDecision:
    """The one decision of the scratch's slots (same inputs on every rank)."""
    return ScratchDecision(
        slot0=scratch_sizing(server_args, settings, decode, context_len),
        prefetch_slot_requested_tokens=configured_prefetch_slot_tokens(
            settings, context_len, server_args.chunked_prefill_size
        ),
    )


def default_prefill_scratch_tokens(
    context_len: int, chunked_prefill_size: Optional[int], max_prefill_tokens: Optional[int]
) -> int:
    """One request of the full context plus one chunk (or, without chunked prefill, one prefill
    budget) of other requests."""
    if chunked_prefill_size is not None and chunked_prefill_size > 0:
        extra = chunked_prefill_size
    elif max_prefill_tokens is not None and max_prefill_tokens > 0:
        extra = max_prefill_tokens
    else:
        extra = context_len
    return context_len + extra


def logical_capacity_reason(server_args, decode: DecodePath) -> Optional[str]:
    """Why slot 0 must hold the whole logical capacity, or None: sized for prefill batches only."""
    gather_reason = decode.decode_gather_reason
    if gather_reason is not None:
        return f"decode gathers pages: {gather_reason}"
    if server_args.enable_mixed_chunk:
        return "--enable-mixed-chunk: running decode requests join extend batches"
    return None


def scratch_sizing(
    server_args, settings: CpSharedKVSettings, decode: DecodePath, context_len: int
) -> ScratchSizing:
    """Slot 0's rule for this server."""
    reason = logical_capacity_reason(server_args, decode)
    if reason is not None:
        return ScratchSizing(None, reason)
    tokens = settings.prefill_scratch_tokens
    if tokens is not None:
        return ScratchSizing(tokens, f"{PREFILL_SCRATCH_TOKENS_ENV}={tokens}")
    tokens = default_prefill_scratch_tokens(
        context_len, server_args.chunked_prefill_size, server_args.max_prefill_tokens
    )
    return ScratchSizing(
        tokens,
        f"context length {context_len} + chunked prefill {server_args.chunked_prefill_size}",
    )


def configured_prefetch_slot_tokens(
    settings: CpSharedKVSettings, context_len: int, chunked_prefill_size: Optional[int]
) -> int:
    """Requested tokens of slot 1 before the capacity cap (``SGLANG_CP_SHARED_KV_PREFETCH_SLOT_TOKENS``;
    unset or 0: no slot 1, no layer-ahead prefetch, the default until the prefetch has been served
    and timed across GPUs; docs/runtime.md, section 3).

    ``auto``: one request of the full context length plus one chunk of new tokens, +25% for the
    padding of unbalanced owners (``1 + cp_size * n`` scratch pages for the gathered region).
    """
    if not settings.prefetch_slot_auto:
        return settings.prefetch_slot_tokens
    chunk = chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else context_len
    return (context_len + chunk) * 5 // 4


# ---- every reason the flag cannot run ----


def cp_shared_kv_problems(server_args, settings: CpSharedKVSettings) -> List[str]:
    """One message per offending setting, each naming its flag (the decode path decided once)."""
    decode = decide_decode_path(server_args, settings)
    problems = []
    if not server_args.enable_nsa_prefill_context_parallel:
        problems.append(f"{CP_SHARED_KV_FLAG} requires --enable-nsa-prefill-context-parallel")
    problems += storage_problems(server_args)
    if server_args.enable_hisparse:
        problems.append("--enable-hisparse: the HiSparse NSA KV pool is not supported")
    if server_args.enable_lmcache:
        problems.append("--enable-lmcache: LMCache reads the device pool by logical loc")
    if server_args.enable_return_routed_experts:
        problems.append(
            "--enable-return-routed-experts: its host buffer is indexed by loc and sized physically"
        )
    problems += disaggregation_problems(server_args, settings)
    if server_args.pp_size > 1:
        problems.append(f"--pipeline-parallel-size {server_args.pp_size}: only 1 is supported")
    if server_args.nnodes != 1:
        problems.append(
            f"--nnodes {server_args.nnodes}: shared KV runs NSA prefill CP within one node "
            f"(--tp {TP_SIZES_TEXT})"
        )
    if server_args.disable_radix_cache:
        problems.append(
            "--disable-radix-cache (the radix cache is off, set directly or by an option that turns it "
            f"off, e.g. --enable-mis): {CP_SHARED_KV_FLAG} has not been audited with the radix cache off; "
            "keep the radix cache on"
        )
    problems += tree_cache_problems(server_args, settings)
    problems += runtime_problems(server_args, settings, decode)
    problems += prefill_scratch_problems(server_args, settings)
    problems += attention_backend_problems(server_args)
    problems += hicache_problems(server_args)
    problems += _platform_problems(server_args)
    problems += _model_problems(server_args)
    return problems


NSA_ATTENTION_BACKEND = "nsa"


def attention_backend_problems(server_args) -> list[str]:
    """Prefill and decode must both run sglang's NSA backend: the peer-page plan is built only in a
    hook on ``NativeSparseAttnBackend.init_forward_metadata`` (another backend's first read finds no
    plan; a mix would let a prefill read the last decode's plan).

    Judged after ``__post_init__``: for an NSA model with no backend flag sglang sets
    ``attention_backend = "nsa"`` (``_handle_model_specific_adjustments``); with only one of
    ``--prefill-attention-backend`` / ``--decode-attention-backend`` given, the other side falls back
    to ``attention_backend``, which sglang then defaults for the platform (fa3 on Hopper), not to nsa.
    ``get_attention_backends`` is what the model runner builds from. A side left None is unresolved
    (``--model-path dummy`` skips the defaults) and is not judged.
    """
    prefill, decode = server_args.get_attention_backends()
    if all(b in (None, NSA_ATTENTION_BACKEND) for b in (prefill, decode)):
        return []
    return [
        f"{CP_SHARED_KV_FLAG} needs the NSA attention backend for prefill and decode (the peer-page plan "
        f"is built by NativeSparseAttnBackend), but prefill resolves to {prefill} and decode to "
        f"{decode}: leave --attention-backend, --prefill-attention-backend and "
        f"--decode-attention-backend unset (sglang picks nsa for NSA models) or set them to nsa"
    ]


# The host pool layouts both NSA host pools of sglang 0.5.11 allocate: ``MLATokenToKVPoolHost`` (KV)
# takes layer_first, page_first, page_first_direct and page_first_kv_split; ``NSAIndexerPoolHost``
# (indexer K, sized from the KV host pool) only the first three. Anything else raises
# "Unsupported layout" when the scheduler builds HiCache, after the model has loaded.
NSA_HICACHE_MEM_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


# ---- HiCache L3 storage (docs/hicache-storage.md) ----
# Pages go to storage under owner-free keys, written by their owner and read by whichever rank owns
# them in the reader's placement. Served backends and the host layouts each needs: ``file``
# (HiCacheFile, a generic page copy: any NSA layout) and ``mooncake`` (Mooncake Store, zero-copy from
# the host pool: page-first layouts only; sglang rewrites layer_first to one of them for mooncake).
STORAGE_BACKEND_LAYOUTS = {
    "file": ("layer_first", "page_first", "page_first_direct"),
    "mooncake": ("page_first", "page_first_direct"),
}


def storage_layout_problem(backend: str, host_layout: str):
    """Why ``backend`` cannot run with shared KV on ``host_layout`` (None: it can), naming the setting."""
    if backend not in STORAGE_BACKEND_LAYOUTS:
        return (
            f"--hicache-storage-backend {backend}: {CP_SHARED_KV_FLAG} serves only "
            + " and ".join(STORAGE_BACKEND_LAYOUTS)
            + " (their MLA keys carry no TP rank, so pages are stored under owner-free keys)"
        )
    layouts = STORAGE_BACKEND_LAYOUTS[backend]
    if host_layout not in layouts:
        return (
            f"--hicache-mem-layout {host_layout}: --hicache-storage-backend {backend} with "
            f"{CP_SHARED_KV_FLAG} needs " + " or ".join(layouts)
        )
    return None


def storage_problems(server_args) -> list[str]:
    """L3 storage settings refused with shared KV, each naming its flag."""
    backend = server_args.hicache_storage_backend
    if backend is None:
        return []
    problems = []
    if not server_args.enable_hierarchical_cache:
        problems.append(
            f"--hicache-storage-backend {backend}: needs --enable-hierarchical-cache (the host tier)"
        )
    problem = storage_layout_problem(backend, server_args.hicache_mem_layout)
    if problem:
        problems.append(problem)
    policy = getattr(server_args, "hicache_storage_prefetch_policy", "best_effort")
    if policy != "best_effort":
        # Our prefetch is synchronous and always completes before the request is scheduled, so the
        # policy would be silently ignored: only stock's default is accepted.
        problems.append(
            f"--hicache-storage-prefetch-policy {policy}: {CP_SHARED_KV_FLAG} prefetches from storage "
            "synchronously when a request arrives (it always completes); leave the default best_effort"
        )
    if getattr(server_args, "speculative_algorithm", None) is not None:
        # The draft pool's pages would have to be stored and restored with the target's; not yet.
        problems.append(
            f"--hicache-storage-backend {backend} with --speculative-algorithm "
            f"{server_args.speculative_algorithm}: {CP_SHARED_KV_FLAG} does not store the MTP "
            "draft pool's pages in L3 storage (host-only HiCache with MTP is supported)"
        )
    return problems


def parse_storage_extra_config(raw):
    """``--hicache-storage-backend-extra-config`` read as sglang 0.5.11's HiCache reads it when the
    scheduler builds the cache (``HiRadixCache._parse_storage_backend_extra_config``: JSON, or
    ``@path`` to a ``.json`` / ``.toml`` / ``.yaml`` file; the same type checks of
    ``prefetch_threshold`` and the timeouts, the same messages): ``(the backend's config without
    stock's prefetch keys, prefetch_threshold tokens)``. Raises where sglang raises.

    A copy, because importing sglang's cache module loads its GPU kernels, which a launching
    process (or ``check_launch`` on a machine without a GPU) must not need; ``test_server_args``
    holds it to sglang's on every case it judges."""
    extra = {}
    if raw:
        if raw.startswith("@"):
            path = raw[1:]
            ext = os.path.splitext(path)[1].lower()
            with open(path, "rb" if ext == ".toml" else "r") as f:
                if ext == ".json":
                    extra = json.load(f)
                elif ext == ".toml":
                    import tomllib

                    extra = tomllib.load(f)
                elif ext in (".yaml", ".yml"):
                    import yaml

                    extra = yaml.safe_load(f)
                else:
                    raise ValueError(f"Unsupported config file {path} (config format: {ext})")
        else:
            extra = json.loads(raw)
    if not isinstance(extra, dict):  # sglang fails on its first pop
        raise ValueError(f"the extra config is a {type(extra).__name__}, not an object")
    extra = dict(extra)
    prefetch_threshold = extra.pop("prefetch_threshold", 256)  # tokens
    timeout_base = extra.pop("prefetch_timeout_base", 1)
    timeout_per_ki_token = extra.pop("prefetch_timeout_per_ki_token", 0.25)
    pass_prefix_keys = extra.pop("hicache_storage_pass_prefix_keys", False)
    if not isinstance(prefetch_threshold, int):
        raise ValueError(f"prefetch_threshold must be int, got {type(prefetch_threshold).__name__}")
    if not isinstance(timeout_base, (int, float)):
        raise ValueError(f"prefetch_timeout_base must be number, got {type(timeout_base).__name__}")
    if not isinstance(timeout_per_ki_token, (int, float)):
        raise ValueError(
            f"prefetch_timeout_per_ki_token must be number, got {type(timeout_per_ki_token).__name__}"
        )
    if not isinstance(pass_prefix_keys, bool):
        raise ValueError(
            f"hicache_storage_pass_prefix_keys must be bool, got {type(pass_prefix_keys).__name__}"
        )
    return extra, prefetch_threshold


def storage_extra_config_problems(server_args) -> list[str]:
    """The extra config fails sglang's own parse: judged now, not when the scheduler builds HiCache
    after the weights load (every HiCache server parses it, with storage or without)."""
    raw = getattr(server_args, "hicache_storage_backend_extra_config", None)
    if not raw:
        return []
    try:
        parse_storage_extra_config(raw)
    except Exception as error:  # noqa: BLE001 - whatever sglang's parse raises, said with its name
        return [
            f"--hicache-storage-backend-extra-config {raw!r}: sglang's HiCache cannot read it "
            f"({type(error).__name__}: {error}); pass a JSON object, or @ a .json / .toml / .yaml file"
        ]
    return []


def hicache_problems(server_args) -> list[str]:
    """HiCache settings that fail for certain once the scheduler builds the host pools."""
    if not server_args.enable_hierarchical_cache:
        return []
    problems = storage_extra_config_problems(server_args)
    layout = server_args.hicache_mem_layout  # after sglang's io-backend rewrite (_handle_hicache)
    if layout not in NSA_HICACHE_MEM_LAYOUTS:
        problems.append(
            f"--hicache-mem-layout {layout}: sglang's NSA host pools (MLA KV and indexer K) support only "
            + ", ".join(NSA_HICACHE_MEM_LAYOUTS)
        )
    # Stock ``HostKVCache.__init__`` asserts host slots > device slots, with host slots
    # ``(int(device * hicache_ratio) // page + 1) * page``. The device pool is whole pages
    # (pool_configurator rounds max_total_num_tokens down to the page size), so that holds exactly
    # when hicache_ratio >= 1 (at 1 the host pool is the device pool plus one page). With
    # --hicache-size the host pool is hicache_size GB over the per-token bytes, and the device pool
    # size is only known once the model has loaded and memory was profiled: not checked here.
    if server_args.hicache_size <= 0 and server_args.hicache_ratio < 1:  # stock: host_size > 0 wins
        problems.append(
            f"--hicache-ratio {server_args.hicache_ratio}: the host pool must be larger than the device "
            "pool (sglang's HiCache asserts it when the scheduler starts); use --hicache-ratio 1 or "
            "more, or size the host pool with --hicache-size"
        )
    return problems


def _platform_problems(server_args) -> list[str]:
    """Device and page size; unset values (a ``dummy`` model path resolves nothing) are not judged.

    The page size judged is the one that runs: for an NSA model on CUDA sglang sets 64 whatever
    ``--page-size`` said (with a warning), so a different value is refused only where sglang left it
    (a model path it resolves nothing for)."""
    from sglang.srt.utils import is_hip

    problems = []
    if server_args.device is not None and server_args.device != "cuda":
        problems.append(f"--device {server_args.device}: only CUDA is supported")
    elif is_hip():
        problems.append("ROCm: the HIP KV write path bypasses the owner filter; only CUDA is supported")
    page_size = server_args.page_size
    if page_size is not None and (
        isinstance(page_size, bool)
        or not isinstance(page_size, int)
        or page_size != CP_SHARED_KV_PAGE_SIZE
    ):
        problems.append(
            f"--page-size {page_size!r}: must be {CP_SHARED_KV_PAGE_SIZE} (one NSA indexer page per "
            "shared-KV page)"
        )
    return problems


def _model_problems(server_args) -> list[str]:
    """The model must be NSA and sglang must have set up NSA prefill CP for it.

    ``__post_init__`` loads the model config for every real model path (an unloadable config has
    already failed there) and caches it as ``model_config``. It skips that for ``--model-path
    dummy``/``none`` and for remote-instance model paths, and so do we.
    """
    from sglang.srt.configs.model_config import is_deepseek_nsa

    model_config = vars(server_args).get("model_config")
    if model_config is None:
        if server_args.model_path.lower() not in ("dummy", "none"):
            logger.warning(
                "%s: model config of %s is not loaded; its architecture is not checked",
                CP_SHARED_KV_FLAG,
                server_args.model_path,
            )
        return []
    hf_config = model_config.hf_config
    architectures = getattr(hf_config, "architectures", None) or ["<unknown>"]
    if not is_deepseek_nsa(hf_config):
        return [
            f"--model-path {server_args.model_path}: {architectures[0]} is not an NSA model "
            "(DeepSeek-V3.2 / GLM-5 with index_topk)"
        ]
    if server_args.enable_nsa_prefill_context_parallel and server_args.attn_cp_size <= 1:
        return [
            f"--model-path {server_args.model_path}: sglang did not set up NSA prefill context "
            f"parallelism for {architectures[0]} (attn_cp_size is {server_args.attn_cp_size})"
        ]
    return []


# ---- the tree cache and the prefill scratch ----


def tree_cache_problems(server_args, settings: CpSharedKVSettings) -> list[str]:
    """Tree caches the shared KV runtime does not track (its host mirror of ``req_to_token`` is
    written by hooks on sglang's radix cache and HiCache only): sglang picks them in the scheduler's
    ``init_cache_with_memory_pool``, after the weights load, where they were refused until now."""
    problems = []
    if settings.cpp_radix_tree:
        problems.append(
            f"{CPP_RADIX_TREE_ENV} is on: sglang would build its C++ radix tree (RadixCacheCpp), "
            f"whose writes {CP_SHARED_KV_FLAG} does not track; unset it"
        )
    if settings.unified_radix_tree and not server_args.enable_hierarchical_cache:
        problems.append(
            f"{UNIFIED_RADIX_TREE_ENV} is on: without --enable-hierarchical-cache sglang would build "
            f"its unified radix tree, whose writes {CP_SHARED_KV_FLAG} does not track; unset it"
        )
    if getattr(server_args, "enable_streaming_session", False):
        problems.append(
            "--enable-streaming-session: sglang wraps the tree cache in a StreamingSession, whose "
            f"writes {CP_SHARED_KV_FLAG} does not track; drop it"
        )
    return problems


def prefill_scratch_problems(server_args, settings: CpSharedKVSettings) -> list[str]:
    """``SGLANG_CP_SHARED_KV_PREFILL_SCRATCH_TOKENS`` below the context length: admission aborts every
    request whose context does not fit it (``prefill_scratch_admission``), so one of 1 token would
    abort every request over one page. Judged where the context length is known (the model's
    config, or ``--context-length``); sglang refuses longer requests itself."""
    tokens = settings.prefill_scratch_tokens
    if tokens is None:
        return []
    model_config = vars(server_args).get("model_config")
    context_len = getattr(model_config, "context_len", None) or getattr(server_args, "context_length", None)
    if context_len is None or tokens >= context_len:
        return []
    return [
        f"{PREFILL_SCRATCH_TOKENS_ENV}={tokens} is less than the context length {context_len}: every "
        f"request whose context does not fit would be aborted at admission; set at least "
        f"{context_len}, unset it (context length + chunked prefill size), or lower --context-length"
    ]


# ---- the shared-KV runtime ----


def runtime_problems(server_args, settings: CpSharedKVSettings, decode: DecodePath) -> list[str]:
    """What the shared-KV runtime (owner-filtered writes, per-forward peer-page gather) cannot serve.
    The model runner's spec judges them again where it is built (``cp_shared_kv_spec``), in the
    scheduler process."""
    reasons = []
    graph_problem = cuda_graph_problem(server_args, settings, decode)
    if graph_problem is not None:
        reasons.append(graph_problem)
    if not server_args.disable_piecewise_cuda_graph:
        # sglang already turns them off for GLM-5 / DeepseekV32 architectures; a V3.2 checkpoint
        # that resolves to DeepseekV3ForCausalLM would capture extend forwards in graphs.
        reasons.append(f"{CP_SHARED_KV_FLAG} requires --disable-piecewise-cuda-graph")
    if server_args.nsa_prefill_cp_mode != "round-robin-split":
        reasons.append(f"{CP_SHARED_KV_FLAG} supports only --nsa-prefill-cp-mode round-robin-split")
    reasons += speculative_problems(server_args, settings, decode)
    if server_args.enable_two_batch_overlap:
        reasons.append(f"{CP_SHARED_KV_FLAG} does not support --enable-two-batch-overlap (one plan per forward)")
    if server_args.enable_pdmux:
        reasons.append(f"{CP_SHARED_KV_FLAG} does not support --enable-pdmux")
    if server_args.enable_torch_compile:
        reasons.append(f"{CP_SHARED_KV_FLAG} does not support --enable-torch-compile")
    if (
        server_args.kv_cache_dtype.startswith("fp8")
        and server_args.nsa_prefill_backend in ("flashmla_sparse", "flashmla_auto")
        and "trtllm" not in (server_args.nsa_prefill_backend, server_args.nsa_decode_backend)
    ):
        reasons.append(
            f"{CP_SHARED_KV_FLAG} does not support fp8 KV with --nsa-prefill-backend "
            f"{server_args.nsa_prefill_backend} (its RAGGED top-k checks logical locs against the "
            f"physical pool size); use flashmla_kv"
        )
    return reasons


# ---- speculative decoding (docs/speculative-decoding.md) ----
# What can be made to work: EAGLE (``NEXTN``, which sglang maps to EAGLE) with top-k 1 and the model's
# own NextN layer as the draft. Its draft pool is an ``NSATokenToKVPool`` of one layer (KV and indexer
# K) that stock sglang sizes at the target's physical tokens and indexes by the shared allocator's
# logical locs, so it is sharded by the same layout as the target's
# (``model_executor/cp_shared_kv_draft_pool.py``). Every forward mode MTP runs is planned and checked
# on one GPU through sglang's own classes, and MTP has served clean with shared KV at CP 2 (one-GPU
# test mode, 2026-12-03), not yet at CP 4 or 8 nor on a PD prefill server, so the server refuses it
# unless ``SGLANG_CP_SHARED_KV_MTP=1`` opts in. The opt-in lifts only that rule; the settings MTP
# cannot be combined with stay refused whatever it says (``mtp_combination_problems``).
_SPEC_MODES_TEXT = (
    "MTP with shared KV has served clean at CP 2 only, not yet at CP 4 or 8 nor on a PD prefill "
    "server (target verify, the draft extends of spec v1 and v2 and the draft's multi-step decode "
    "are planned, one plan per draft step, and EAGLE's writes of req_to_token are mirrored on the "
    "host; checked on one GPU at CP 2/4/8 through sglang's classes)"
)
SUPPORTED_SPECULATIVE_ALGORITHMS = ("EAGLE", "NEXTN")  # sglang turns NEXTN into EAGLE


def speculative_problems(server_args, settings: CpSharedKVSettings, decode: DecodePath) -> list[str]:
    """One message per speculative setting the shared KV cache cannot serve, each naming its flag.

    Judged after ``__post_init__`` (``NEXTN`` is then ``EAGLE``, and for DeepSeek-V3.2 / GLM-5 an
    unset ``--speculative-draft-model-path`` is the model path: the built-in NextN layer)."""
    algorithm = server_args.speculative_algorithm
    if algorithm is None:
        return []
    problems = []
    if algorithm not in SUPPORTED_SPECULATIVE_ALGORITHMS:
        problems.append(
            f"--speculative-algorithm {algorithm}: {CP_SHARED_KV_FLAG} can only serve EAGLE (or "
            "NEXTN) with the model's built-in NextN layer as the draft"
        )
    topk = getattr(server_args, "speculative_eagle_topk", None)
    if topk is not None and topk > 1:
        problems.append(
            f"--speculative-eagle-topk {topk}: {CP_SHARED_KV_FLAG} supports only "
            "--speculative-eagle-topk 1 (a draft tree branches pages per request)"
        )
    if getattr(server_args, "enable_multi_layer_eagle", False):
        problems.append(
            f"--enable-multi-layer-eagle: {CP_SHARED_KV_FLAG} supports a single-layer NextN draft only"
        )
    draft_path = getattr(server_args, "speculative_draft_model_path", None)
    if draft_path is not None and draft_path != getattr(server_args, "model_path", None):
        problems.append(
            f"--speculative-draft-model-path {draft_path}: {CP_SHARED_KV_FLAG} supports only the "
            "model's built-in NextN layer as the draft (leave --speculative-draft-model-path unset)"
        )
    # --enable-hierarchical-cache is no reason of its own: the CP HiCache controller backs up and
    # restores the draft's KV and indexer K with the target's pages (managers/cp_hicache_draft_pool.py),
    # which sglang 0.5.11's NSA controller does not.
    if algorithm not in SUPPORTED_SPECULATIVE_ALGORITHMS:
        return problems
    if not settings.mtp:
        problems.append(
            f"--speculative-algorithm {algorithm}: MTP with {CP_SHARED_KV_FLAG} is opt-in, set "
            f"{MTP_ENV}=1: {_SPEC_MODES_TEXT}"
        )
    return problems + mtp_combination_problems(server_args, decode)


def mtp_combination_problems(server_args, decode: DecodePath) -> List[str]:
    """Settings MTP with shared KV cannot run with, one message each naming both settings."""
    algorithm = server_args.speculative_algorithm
    problems = []
    if not server_args.disable_cuda_graph:
        # The draft's graphs (EAGLEDraftCudaGraphRunner) capture the step backends' metadata, which
        # the page gather cannot replay (peer_page_reads refuses it, but only once the model loaded).
        problems.append(
            f"--speculative-algorithm {algorithm} with {CP_SHARED_KV_FLAG} requires "
            "--disable-cuda-graph: the draft's decode steps and the target verify gather pages, which "
            "CUDA graphs cannot replay"
        )
    if not decode.pd_prefill and logical_capacity_reason(server_args, decode) is None:
        # The draft's decode steps gather over the whole batch (draft_decode_steps); per-owner
        # decode sizes the gather scratch for prefill batches only.
        problems.append(
            f"--speculative-algorithm {algorithm} with {DECODE_PATH_ENV}={PER_OWNER}: the draft's "
            "decode steps gather the pages of every request, but per-owner decode sizes the gather "
            f"scratch for prefill batches only; use {DECODE_PATH_ENV}={GATHER} or auto (the default, "
            "which gathers under MTP) with MTP"
        )
    return problems


# ---- PD disaggregation ----
# Supported: ``--disaggregation-mode prefill`` with ``--disaggregation-transfer-backend mooncake`` and
# ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1`` (on both servers), docs/pd-disaggregation.md.
#
# Why the others are refused:
#
# * ``--disaggregation-mode decode``: decode-side shared KV is out of scope; the decode server is stock
#   sglang (no plugin flag).
# * nixl: its decode side (0.5.11 ``NixlKVManager.update_transfer_status`` / ``TransferStatus``) counts
#   KV chunk notifications per PP rank, not per sender; all CP ranks of a prefill share PP rank 0, so it
#   cannot tell when every CP rank's pages have landed (and with all CP ranks sending it expects
#   ``attn_cp_size`` PP ranks that never report, so requests wait until the timeout).
# * mori, ascend: not ported (their senders filter a contiguous page range per CP rank, like stock
#   mooncake, and index the pool by logical page).
# * ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER`` unset or false: then only CP rank 0 sends and the
#   decode asks only rank 0, but rank 0 holds ``1/cp_size`` of the pages. The decode server must set it
#   too; this check sees only the prefill server's environment.

SUPPORTED_BACKEND = "mooncake"


def disaggregation_problems(server_args, settings: CpSharedKVSettings) -> list[str]:
    """Messages for the PD settings the flag cannot serve (empty: supported, or PD off)."""
    mode = server_args.disaggregation_mode
    if mode in (None, "null"):
        return []
    if mode == "decode":
        return [
            f"--disaggregation-mode decode: {CP_SHARED_KV_FLAG} is supported on the prefill server "
            "only; run the decode server without it (it receives whole pages from every CP rank)"
        ]
    if mode != "prefill":
        return [f"--disaggregation-mode {mode}: unknown mode"]

    problems = []
    backend = server_args.disaggregation_transfer_backend
    if backend == "nixl":
        problems.append(
            "--disaggregation-transfer-backend nixl: not supported with "
            f"{CP_SHARED_KV_FLAG}; nixl's decode side counts KV arrivals per PP rank, not per CP "
            f"rank, so it cannot wait for every CP rank's pages; use --disaggregation-transfer-backend "
            f"{SUPPORTED_BACKEND}"
        )
    elif backend != SUPPORTED_BACKEND:
        problems.append(
            f"--disaggregation-transfer-backend {backend}: not supported with {CP_SHARED_KV_FLAG}; "
            f"use --disaggregation-transfer-backend {SUPPORTED_BACKEND}"
        )
    if not settings.all_cp_ranks_transfer:
        problems.append(
            f"{ALL_CP_RANKS_ENV} is off or unset: --disaggregation-mode prefill with {CP_SHARED_KV_FLAG} "
            f"needs {ALL_CP_RANKS_ENV}=1 on the prefill and the decode server (every CP rank sends "
            "the pages it owns)"
        )
    return problems
