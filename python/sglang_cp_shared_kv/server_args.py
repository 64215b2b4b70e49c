"""``--enable-nsa-prefill-cp-shared-kv``: the flag, its fail-fast validation, and its environment carrier.

Why an environment variable: ``plugin.register()`` runs in every process before any ``ServerArgs``
exists there, so it cannot read the flag to decide whether to add the runtime hooks. The launching
process validates the flag while it builds ``ServerArgs`` and exports ``SGLANG_CP_SHARED_KV=1``;
scheduler processes are spawned later, inherit it, and register the runtime hooks (see plugin.py).

Why these hooks: ``ServerArgs`` is a dataclass and our flag is not one of its fields.

* ``add_cli_args`` (AFTER) adds the argparse flag, so ``sglang serve`` and
  ``python -m sglang.launch_server`` accept it, and the latter lists it in ``--help``.
* ``__init__`` (AROUND) accepts the keyword (``Engine(**kwargs)`` builds ``ServerArgs(**kwargs)``),
  stores it as an instance attribute before the dataclass ``__init__`` runs ``__post_init__``, and
  validates afterwards, once sglang has settled every value (``__post_init__`` rewrites
  ``page_size`` and ``attn_cp_size`` for DSA models).
* ``from_cli_args`` (AROUND) keeps dataclass fields only and so drops ours: copy the parsed value
  onto the built object and validate again.
* ``check_server_args`` (BEFORE) runs in the engine right before it spawns schedulers: validate
  again in case the attribute was set on an object that was already built.
* ``_handle_model_specific_adjustments`` (AROUND) lets NSA prefill CP run at ``--tp`` 2, 4 or 8 on
  one node when our flag is on (see ``lift_single_node_cp_tp_rule``).

The value is a plain instance attribute, so it survives pickling to the scheduler processes.
"""

from __future__ import annotations

import argparse
import contextvars
import json
import logging
import os

from sglang.srt.plugins.hook_registry import HookType
from sglang_cp_shared_kv.speculative.mtp_opt_in import mtp_combination_problems, mtp_opted_in
from sglang_cp_shared_kv.settings import (
    ALL_CP_RANKS_ENV,
    CPP_RADIX_TREE_ENV,
    PREFILL_SCRATCH_TOKENS_ENV,
    UNIFIED_RADIX_TREE_ENV,
    CP_SHARED_KV_ENV,
    CP_SHARED_KV_FIELD,
    CP_SHARED_KV_FLAG,
    GRAPH_DECODE_ENV,
    MTP_ENV,
    cp_shared_kv_enabled,
    cp_shared_kv_enabled_in_env,
    current_settings,
    current_settings_and_problems,
    export_cp_shared_kv_env,
    judged_with,
)

logger = logging.getLogger(__name__)

# The NSA indexer stores K in 64-token pages; a shared-KV page must be exactly one indexer page so
# that KV and indexer K of a page live on the same rank. sglang sets 64 for DSA models on CUDA.
CP_SHARED_KV_PAGE_SIZE = 64

_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"

# sglang 0.5.11 asserts tp_size == 8 for NSA prefill CP ("multi-machine CP support suffers from
# precision issues"). The round-robin split has no such reason on one node; with our flag we accept
# the CP sizes of one node's GPUs that the models split at, and refuse more than one node.
SGLANG_NSA_CP_TP_SIZE = 8
# Where GLM-5 and DeepSeek-V3.2 split: with NSA prefill CP every attention rank holds all heads
# (attn_tp_size = tp / cp = 1), but the routed experts split over the whole TP group, and sglang's
# FusedMoE asserts ``moe_intermediate_size % moe_tp_size == 0`` (2048 for both models), and its fp8
# block-quantized experts need the per-rank width divisible by the 128-wide block (Fp8MoEMethod).
# 2048 / tp is 1024, 512, 256 at tp 2, 4, 8; no other size from 2 to 8 divides 2048.
CP_SHARED_KV_TP_SIZES = (2, 4, 8)
_TP_SIZES_TEXT = "2, 4 or 8"


def register_server_args_hooks(registry) -> None:
    registry.register(f"{_SERVER_ARGS}.add_cli_args", _add_cli_args_after, HookType.AFTER)
    registry.register(f"{_SERVER_ARGS}.__init__", _init_around, HookType.AROUND)
    registry.register(f"{_SERVER_ARGS}.from_cli_args", _from_cli_args_around, HookType.AROUND)
    registry.register(
        f"{_SERVER_ARGS}.check_server_args", _check_server_args_before, HookType.BEFORE
    )
    registry.register(
        f"{_SERVER_ARGS}._handle_model_specific_adjustments",
        _model_specific_adjustments_around,
        HookType.AROUND,
    )


def _add_cli_args_after(result, parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        CP_SHARED_KV_FLAG,
        action="store_true",
        default=False,
        help="With --enable-nsa-prefill-context-parallel (NSA models: DeepSeek-V3.2, GLM-5): keep one "
        "KV cache shared by the context-parallel group, each rank storing every cp_size-th page, "
        "instead of a full replica per rank; works with HiCache (--enable-hierarchical-cache; L3 "
        "storage with --hicache-storage-backend file or mooncake) and as the prefill server of a PD "
        "pair (mooncake). "
        f"Requires --enable-nsa-prefill-context-parallel (round-robin-split), --tp {_TP_SIZES_TEXT} on "
        "one node, the NSA attention backend for prefill and decode (sglang's default for NSA models), "
        f"--disable-cuda-graph where decode gathers pages (decode runs per owner under CUDA graphs "
        f"with the bf16 KV's fa3 decode impl by default; {GRAPH_DECODE_ENV}=0 turns graphs off) and "
        "--disable-piecewise-cuda-graph, the radix cache on, and page size "
        f"{CP_SHARED_KV_PAGE_SIZE} (what sglang sets for NSA models on CUDA). Speculative decoding: "
        f"MTP with the NextN layer, top-k 1, is opt-in ({MTP_ENV}=1); other algorithms are refused. "
        "Environment settings: docs/configuration.md. Provided by the "
        "sglang-cp-shared-kv plugin.",
    )


# The parsed flag while ``from_cli_args`` builds ``ServerArgs`` from dataclass fields only: sglang's
# ``__post_init__`` (``_handle_model_specific_adjustments``) must already see it.
_flag_from_cli = contextvars.ContextVar("cp_shared_kv_flag_from_cli", default=False)


def _init_around(original, server_args, *args, **kwargs) -> None:
    setattr(server_args, CP_SHARED_KV_FIELD, kwargs.pop(CP_SHARED_KV_FIELD, _flag_from_cli.get()))
    original(server_args, *args, **kwargs)
    validate_cp_shared_kv_server_args(server_args)


def _from_cli_args_around(original, cls, args: argparse.Namespace):
    token = _flag_from_cli.set(getattr(args, CP_SHARED_KV_FIELD, False))
    try:
        server_args = original(cls, args)
    finally:
        _flag_from_cli.reset(token)
    setattr(server_args, CP_SHARED_KV_FIELD, getattr(args, CP_SHARED_KV_FIELD, False))
    validate_cp_shared_kv_server_args(server_args)
    return server_args


def _check_server_args_before(server_args) -> None:
    validate_cp_shared_kv_server_args(server_args)


def _model_specific_adjustments_around(original, server_args, *args, **kwargs):
    if not cp_shared_kv_enabled(server_args) or not wants_round_robin_nsa_cp(server_args):
        return original(server_args, *args, **kwargs)
    if server_args.nnodes != 1:
        raise ValueError(
            f"{CP_SHARED_KV_FLAG} with --enable-nsa-prefill-context-parallel runs within one node: "
            f"--nnodes {server_args.nnodes} is not supported (use --nnodes 1, --tp {_TP_SIZES_TEXT})"
        )
    if server_args.tp_size not in CP_SHARED_KV_TP_SIZES:
        raise ValueError(
            f"{CP_SHARED_KV_FLAG} with --enable-nsa-prefill-context-parallel needs --tp "
            f"{_TP_SIZES_TEXT} on one node (the CP group is the TP group; GLM-5's and "
            f"DeepSeek-V3.2's experts, moe_intermediate_size 2048 in 128-wide blocks, split only "
            f"at those sizes), got --tp {server_args.tp_size}"
        )
    return lift_single_node_cp_tp_rule(original, server_args, *args, **kwargs)


def wants_round_robin_nsa_cp(server_args) -> bool:
    """NSA prefill CP asked for in the mode shared KV supports (other modes are refused later)."""
    return (
        server_args.enable_nsa_prefill_context_parallel
        and server_args.nsa_prefill_cp_mode == "round-robin-split"
    )


def lift_single_node_cp_tp_rule(original, server_args, *args, **kwargs):
    """Run sglang's ``_handle_model_specific_adjustments`` so that its ``tp_size == 8`` assert for NSA
    prefill CP passes at the real ``--tp``, with every value it settles derived from the real one.

    In the round-robin branch tp_size is read only by that assert, by ``attn_cp_size = tp_size //
    dp_size`` and by a log line (the other readers sit in branches of other models and of
    in-seq-split). So the method runs with tp_size set to 8, then tp_size is restored and
    attn_cp_size recomputed from it. A single node only: callers check ``nnodes`` first.
    """
    real_tp_size = server_args.tp_size
    if real_tp_size == SGLANG_NSA_CP_TP_SIZE:
        return original(server_args, *args, **kwargs)
    server_args.tp_size = SGLANG_NSA_CP_TP_SIZE
    try:
        result = original(server_args, *args, **kwargs)
    finally:
        server_args.tp_size = real_tp_size
    if server_args.attn_cp_size > 1:  # sglang set up NSA prefill CP (an NSA model on CUDA)
        server_args.attn_cp_size = real_tp_size // server_args.dp_size
        logger.info(
            "NSA prefill CP at --tp %d on one node (sglang 0.5.11 accepts only 8): attn_cp_size=%d",
            real_tp_size,
            server_args.attn_cp_size,
        )
    return result


def validate_cp_shared_kv_server_args(server_args) -> None:
    """Raise ``ValueError`` for combinations stage 1 cannot serve; export or clear the env carrier."""
    enabled = getattr(server_args, CP_SHARED_KV_FIELD, False)
    if not isinstance(enabled, bool):
        raise ValueError(f"{CP_SHARED_KV_FLAG} must be True or False, got {enabled!r}")
    if not enabled:
        if cp_shared_kv_enabled_in_env():
            logger.warning(
                "%s=1 is set but %s is off: unsetting it so no shared-KV hook runs",
                CP_SHARED_KV_ENV,
                CP_SHARED_KV_FLAG,
            )
        export_cp_shared_kv_env(False)
        return

    problems = cp_shared_kv_problems(server_args)
    if problems:
        raise ValueError(
            f"{CP_SHARED_KV_FLAG} cannot be used here:\n  - " + "\n  - ".join(problems)
        )
    export_cp_shared_kv_env(True)
    # Validation runs several times per launch (__init__, from_cli_args, check_server_args): debug
    # only; the startup summary is logged once per server when the runtime attaches.
    logger.debug(
        "%s: accepted (attn_cp_size=%s, page_size=%s)",
        CP_SHARED_KV_FLAG,
        server_args.attn_cp_size,
        server_args.page_size,
    )


def cp_shared_kv_problems(server_args) -> list[str]:
    """Every reason the flag cannot run with ``server_args`` and this environment, one sentence each
    naming its setting: bad environment values first, then every rule judged with the bad values at
    their defaults (so one launch attempt lists everything)."""
    settings, setting_problems = current_settings_and_problems()
    with judged_with(settings):
        return setting_problems + _unsupported_combinations(server_args)


def _unsupported_combinations(server_args) -> list[str]:
    """One message per offending setting, each naming its flag."""
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
    problems += disaggregation_problems(server_args)
    if server_args.pp_size > 1:
        problems.append(f"--pipeline-parallel-size {server_args.pp_size}: only 1 is supported")
    if server_args.nnodes != 1:
        problems.append(
            f"--nnodes {server_args.nnodes}: shared KV runs NSA prefill CP within one node "
            f"(--tp {_TP_SIZES_TEXT})"
        )
    if server_args.disable_radix_cache:
        problems.append(
            "--disable-radix-cache (the radix cache is off, set directly or by an option that turns it "
            f"off, e.g. --enable-mis): {CP_SHARED_KV_FLAG} has not been audited with the radix cache off; "
            "keep the radix cache on"
        )
    problems += tree_cache_problems(server_args)
    problems += runtime_problems(server_args)
    problems += prefill_scratch_problems(server_args)
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


def tree_cache_problems(server_args) -> list[str]:
    """Tree caches the shared KV runtime does not track (its host mirror of ``req_to_token`` is
    written by hooks on sglang's radix cache and HiCache only): sglang picks them in the scheduler's
    ``init_cache_with_memory_pool``, after the weights load, where they were refused until now."""
    settings = current_settings()
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


def prefill_scratch_problems(server_args) -> list[str]:
    """``SGLANG_CP_SHARED_KV_PREFILL_SCRATCH_TOKENS`` below the context length: admission aborts every
    request whose context does not fit it (``prefill_scratch_admission``), so one of 1 token would
    abort every request over one page. Judged where the context length is known (the model's
    config, or ``--context-length``); sglang refuses longer requests itself."""
    tokens = current_settings().prefill_scratch_tokens
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


def runtime_problems(server_args) -> list[str]:
    """What the shared-KV runtime (owner-filtered writes, per-forward peer-page gather) cannot serve.
    The runtime checks them again when it attaches to the pool (``cp_shared_kv_runtime``)."""
    from sglang_cp_shared_kv.model_executor.decode_path import cuda_graph_problem

    reasons = []
    graph_problem = cuda_graph_problem(server_args, CP_SHARED_KV_FLAG)
    if graph_problem is not None:
        reasons.append(graph_problem)
    if not server_args.disable_piecewise_cuda_graph:
        # sglang already turns them off for GLM-5 / DeepseekV32 architectures; a V3.2 checkpoint
        # that resolves to DeepseekV3ForCausalLM would capture extend forwards in graphs.
        reasons.append(f"{CP_SHARED_KV_FLAG} requires --disable-piecewise-cuda-graph")
    if server_args.nsa_prefill_cp_mode != "round-robin-split":
        reasons.append(f"{CP_SHARED_KV_FLAG} supports only --nsa-prefill-cp-mode round-robin-split")
    reasons += speculative_problems(server_args)
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
# (``model_executor/cp_shared_kv_draft_pool.py``). Served clean at CP 2 only: accepted only with the
# opt-in (``speculative/mtp_opt_in.py``).
_SPEC_MODES_TEXT = (
    "MTP with shared KV has served clean at CP 2 only, not yet at CP 4 or 8 nor on a PD prefill "
    "server (target verify, the draft extends of spec v1 and v2 and the draft's multi-step decode "
    "are planned, one plan per draft step, and EAGLE's writes of req_to_token are mirrored on the "
    "host; checked on one GPU at CP 2/4/8 through sglang's classes)"
)
SUPPORTED_SPECULATIVE_ALGORITHMS = ("EAGLE", "NEXTN")  # sglang turns NEXTN into EAGLE


def speculative_problems(server_args) -> list[str]:
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
    try:
        opted_in = mtp_opted_in()
    except ValueError as error:
        problems.append(str(error))
    else:
        if not opted_in:
            problems.append(
                f"--speculative-algorithm {algorithm}: MTP with {CP_SHARED_KV_FLAG} is opt-in, set "
                f"{MTP_ENV}=1: {_SPEC_MODES_TEXT}"
            )
    return problems + mtp_combination_problems(server_args, CP_SHARED_KV_FLAG)


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


def disaggregation_problems(server_args) -> list[str]:
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
    if not current_settings().all_cp_ranks_transfer:
        problems.append(
            f"{ALL_CP_RANKS_ENV} is off or unset: --disaggregation-mode prefill with {CP_SHARED_KV_FLAG} "
            f"needs {ALL_CP_RANKS_ENV}=1 on the prefill and the decode server (every CP rank sends "
            "the pages it owns)"
        )
    return problems
