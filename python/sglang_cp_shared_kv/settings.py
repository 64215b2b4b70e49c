"""Every setting of the plugin in one place: the flag, its ``ServerArgs`` field, each environment variable.

A leaf module (it imports nothing of this package) so that every other module can ask it. Every
environment variable the plugin reads is declared here with its default, parsed here by one rule,
into one frozen ``CpSharedKVSettings``; nothing else in the package reads ``os.environ``
(``test_module_structure`` pins it). docs/configuration.md is the user's table of the same.

One rule for booleans, the one sglang's own ``EnvBool`` uses (so that our reading of sglang's
``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER`` is sglang's): ``1 true yes y`` are on, ``0 false no n``
are off, case-insensitive; unset, empty or blank is the default; anything else (``on``, ``2``, and
``"1 "`` or ``" true"``, which ``EnvBool`` reads as its default) is an error naming the variable.

sglang's own variables that pick a tree cache shared KV does not track
(``SGLANG_EXPERIMENTAL_CPP_RADIX_TREE``, ``SGLANG_ENABLE_UNIFIED_RADIX_TREE``) are read here with the
same rule, so that startup refuses them before the weights load; they are not described (an
accepted launch has them off).

When they are judged: while ``ServerArgs`` is built with the flag on (``server_args``, by the rules
of ``startup_rules``), so a bad value stops the launch before any weight loads, every bad value
listed in one error. Scheduler processes inherit the launching process's environment, so every rank
reads the same settings, once: where the model runner's spec is built (``current_settings``).

Defaults are the ``DEFAULT_*`` constants below; changing one is a one-line change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Mapping, Optional, Tuple

# ---- the flag ----
CP_SHARED_KV_FLAG = "--enable-nsa-prefill-cp-shared-kv"
CP_SHARED_KV_FIELD = "enable_nsa_prefill_cp_shared_kv"
# The flag's mirror in the environment: the launching process sets it once the flag validated on,
# so that scheduler processes (spawned later, before any ServerArgs exists there) register the
# runtime hooks (plugin.py). Not a user setting.
CP_SHARED_KV_ENV = "SGLANG_CP_SHARED_KV"

# ---- environment variables ----
DECODE_PATH_ENV = "SGLANG_CP_SHARED_KV_DECODE"
GRAPH_DECODE_ENV = "SGLANG_CP_SHARED_KV_DECODE_CUDA_GRAPH"
MTP_ENV = "SGLANG_CP_SHARED_KV_MTP"
PREFETCH_SLOT_TOKENS_ENV = "SGLANG_CP_SHARED_KV_PREFETCH_SLOT_TOKENS"
PREFILL_SCRATCH_TOKENS_ENV = "SGLANG_CP_SHARED_KV_PREFILL_SCRATCH_TOKENS"
REQ_TO_PAGE_MIRROR_CHECK_ENV = "SGLANG_CP_SHARED_KV_CHECK_PAGE_MIRROR"
MERGE_ONE_EXCHANGE_ENV = "SGLANG_CP_SHARED_KV_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES"
# sglang's own variable (read by its PD transfer code on both servers); judged here with its rule.
ALL_CP_RANKS_ENV = "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"
# sglang's own variables choosing its tree cache (the scheduler's init_cache_with_memory_pool):
# the C++ radix tree, and the unified radix tree (without HiCache). Both must stay off.
CPP_RADIX_TREE_ENV = "SGLANG_EXPERIMENTAL_CPP_RADIX_TREE"
UNIFIED_RADIX_TREE_ENV = "SGLANG_ENABLE_UNIFIED_RADIX_TREE"

SETTINGS_ENVS = (
    DECODE_PATH_ENV,
    GRAPH_DECODE_ENV,
    MTP_ENV,
    PREFETCH_SLOT_TOKENS_ENV,
    PREFILL_SCRATCH_TOKENS_ENV,
    REQ_TO_PAGE_MIRROR_CHECK_ENV,
    MERGE_ONE_EXCHANGE_ENV,
    ALL_CP_RANKS_ENV,
    CPP_RADIX_TREE_ENV,
    UNIFIED_RADIX_TREE_ENV,
)

PER_OWNER = "per_owner"
GATHER = "gather"
# per owner where it has served clean at every CP size with this server's NSA decode impl, else gather
AUTO = "auto"
DECODE_PATHS = (AUTO, GATHER, PER_OWNER)
PREFETCH_SLOT_AUTO = "auto"
MERGE_ONE_EXCHANGE_OFF = "off"  # every merge by the scaled sum (two collectives per layer)

# ---- defaults (one constant each) ----
DEFAULT_DECODE_PATH = AUTO
DEFAULT_DECODE_CUDA_GRAPH = True  # graphs where decode runs per owner (startup_rules.cuda_graph_problem)
DEFAULT_MTP = False
DEFAULT_PREFETCH_SLOT_TOKENS = 0  # 0: no slot 1, no layer-ahead prefetch
DEFAULT_PREFILL_SCRATCH_TOKENS = None  # None: context length + one chunk (startup_rules.scratch_sizing)
DEFAULT_CHECK_PAGE_MIRROR = False
# Per-owner decode's merge in one all-gather (partial + LSE) instead of the scaled sum's two
# collectives, while it receives at most this many bytes more per rank and layer than the scaled sum
# (``per_owner_decode.attention_lse_merge.choose_merge_exchange``). Off by default (None: the scaled
# sum, the merge every served run used) until the one exchange has been timed and served on GPUs.
# MODELED_...: the value to start from, modeled, not measured: the collective it saves costs about
# 15 us of launch and NVLink latency (10-20 us), and an all-gather receives about 200 GB/s per rank
# on H200 NVLink (150-300), so 15 us buys 3 MB. With GLM-5's attention output that is every batch at
# CP 2 (both forms move the same bytes), up to 30 decode tokens at CP 4 and up to 8 at CP 8.
DEFAULT_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES = None
MODELED_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES = 3_000_000
DEFAULT_ALL_CP_RANKS_TRANSFER = False  # sglang's default
DEFAULT_CPP_RADIX_TREE = False  # sglang's default
DEFAULT_UNIFIED_RADIX_TREE = False  # sglang's default

TRUE_SPELLINGS = ("1", "true", "yes", "y")
FALSE_SPELLINGS = ("0", "false", "no", "n")


@dataclass(frozen=True)
class CpSharedKVSettings:
    """The environment's settings, parsed. Token counts are logical tokens.

    ``prefetch_slot_tokens``: requested tokens of the gather scratch's slot 1 (0: off), meaningful
    unless ``prefetch_slot_auto``; ``prefill_scratch_tokens``: slot 0's size when sized for prefill
    batches (None: the default rule); ``merge_one_exchange_max_extra_bytes``: bytes per rank and
    layer the one-exchange merge may receive beyond the scaled sum's (None: never one exchange)."""

    decode_path: str = DEFAULT_DECODE_PATH
    decode_cuda_graph: bool = DEFAULT_DECODE_CUDA_GRAPH
    mtp: bool = DEFAULT_MTP
    prefetch_slot_auto: bool = False
    prefetch_slot_tokens: int = DEFAULT_PREFETCH_SLOT_TOKENS
    prefill_scratch_tokens: Optional[int] = DEFAULT_PREFILL_SCRATCH_TOKENS
    check_page_mirror: bool = DEFAULT_CHECK_PAGE_MIRROR
    merge_one_exchange_max_extra_bytes: Optional[int] = DEFAULT_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES
    all_cp_ranks_transfer: bool = DEFAULT_ALL_CP_RANKS_TRANSFER
    cpp_radix_tree: bool = DEFAULT_CPP_RADIX_TREE  # sglang's; must be off (server_args)
    unified_radix_tree: bool = DEFAULT_UNIFIED_RADIX_TREE  # sglang's; off unless HiCache is on

    def describe(self) -> str:
        """One line of every setting, for the startup summary and ``check_launch``."""
        prefetch = (
            PREFETCH_SLOT_AUTO
            if self.prefetch_slot_auto
            else (f"{self.prefetch_slot_tokens} tokens" if self.prefetch_slot_tokens else "off")
        )
        scratch = (
            "default" if self.prefill_scratch_tokens is None else f"{self.prefill_scratch_tokens} tokens"
        )
        one_exchange = self.merge_one_exchange_max_extra_bytes
        merge = MERGE_ONE_EXCHANGE_OFF if one_exchange is None else f"up to {one_exchange} extra bytes"
        return (
            f"decode={self.decode_path}, decode CUDA graphs={_on_off(self.decode_cuda_graph)}, "
            f"MTP opt-in={_on_off(self.mtp)}, prefetch slot={prefetch}, prefill scratch={scratch}, "
            f"page-mirror check={_on_off(self.check_page_mirror)}, one-exchange merge={merge}, "
            f"all CP ranks transfer={_on_off(self.all_cp_ranks_transfer)}"
        )


class SettingsError(ValueError):
    """Bad environment values; ``problems`` has one sentence per variable, each naming it."""

    def __init__(self, problems: List[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


def _on_off(value: bool) -> str:
    return "on" if value else "off"


def parse_bool(name: str, raw: Optional[str], default: bool) -> bool:
    """The one boolean rule (module docstring); ``ValueError`` naming ``name`` otherwise."""
    if raw is None or not raw.strip():
        return default
    value = raw.lower()  # no strip: EnvBool reads "1 " as its default
    if value in TRUE_SPELLINGS:
        return True
    if value in FALSE_SPELLINGS:
        return False
    raise ValueError(
        f"{name} must be one of {'/'.join(TRUE_SPELLINGS)} (on) or {'/'.join(FALSE_SPELLINGS)} "
        f"(off), got {raw!r}"
    )


def _parse_decode_path(raw: Optional[str]) -> str:
    if raw is None or not raw.strip():
        return DEFAULT_DECODE_PATH
    value = raw.strip().lower()
    if value not in DECODE_PATHS:
        raise ValueError(f"{DECODE_PATH_ENV} must be {AUTO!r}, {PER_OWNER!r} or {GATHER!r}, got {raw!r}")
    return value


def _parse_prefetch(raw: Optional[str]) -> Tuple[bool, int]:
    if raw is None or not raw.strip():
        return False, DEFAULT_PREFETCH_SLOT_TOKENS
    if raw.strip().lower() == PREFETCH_SLOT_AUTO:
        return True, 0
    tokens = _int_or_none(raw)
    if tokens is None or tokens < 0:
        raise ValueError(
            f"{PREFETCH_SLOT_TOKENS_ENV} must be a token count >= 0 or {PREFETCH_SLOT_AUTO!r}, got {raw!r}"
        )
    return False, tokens


def _parse_prefill_scratch(raw: Optional[str]) -> Optional[int]:
    if raw is None or not raw.strip():
        return DEFAULT_PREFILL_SCRATCH_TOKENS
    tokens = _int_or_none(raw)
    if tokens is None or tokens <= 0:
        raise ValueError(f"{PREFILL_SCRATCH_TOKENS_ENV} must be a token count > 0, got {raw!r}")
    return tokens


def _parse_merge_one_exchange(raw: Optional[str]) -> Optional[int]:
    if raw is None or not raw.strip():
        return DEFAULT_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES
    if raw.strip().lower() == MERGE_ONE_EXCHANGE_OFF:
        return None
    extra_bytes = _int_or_none(raw)
    if extra_bytes is None or extra_bytes < 0:
        raise ValueError(
            f"{MERGE_ONE_EXCHANGE_ENV} must be a byte count >= 0 or {MERGE_ONE_EXCHANGE_OFF!r}, got {raw!r}"
        )
    return extra_bytes


def _int_or_none(raw: str) -> Optional[int]:
    try:
        return int(raw.strip())
    except ValueError:
        return None


def parse_settings(environ: Mapping[str, str]) -> Tuple[CpSharedKVSettings, List[str]]:
    """Every setting of ``environ``, a bad value replaced by its default, and one problem per bad value.

    The lenient form lets startup judge every rule (``startup_rules``) with the defaults while it
    lists the bad values (``server_args``); everyone else uses ``current_settings`` (strict)."""
    problems: List[str] = []
    values = {}

    def parse(field: str, parser, *args) -> None:
        try:
            values[field] = parser(*args)
        except ValueError as error:
            problems.append(str(error))

    def parse_flag(field: str, name: str, default: bool) -> None:
        parse(field, parse_bool, name, environ.get(name), default)

    parse("decode_path", _parse_decode_path, environ.get(DECODE_PATH_ENV))
    parse_flag("decode_cuda_graph", GRAPH_DECODE_ENV, DEFAULT_DECODE_CUDA_GRAPH)
    parse_flag("mtp", MTP_ENV, DEFAULT_MTP)
    try:
        auto, tokens = _parse_prefetch(environ.get(PREFETCH_SLOT_TOKENS_ENV))
        values.update(prefetch_slot_auto=auto, prefetch_slot_tokens=tokens)
    except ValueError as error:
        problems.append(str(error))
    parse("prefill_scratch_tokens", _parse_prefill_scratch, environ.get(PREFILL_SCRATCH_TOKENS_ENV))
    parse_flag("check_page_mirror", REQ_TO_PAGE_MIRROR_CHECK_ENV, DEFAULT_CHECK_PAGE_MIRROR)
    parse("merge_one_exchange_max_extra_bytes", _parse_merge_one_exchange, environ.get(MERGE_ONE_EXCHANGE_ENV))
    parse_flag("all_cp_ranks_transfer", ALL_CP_RANKS_ENV, DEFAULT_ALL_CP_RANKS_TRANSFER)
    parse_flag("cpp_radix_tree", CPP_RADIX_TREE_ENV, DEFAULT_CPP_RADIX_TREE)
    parse_flag("unified_radix_tree", UNIFIED_RADIX_TREE_ENV, DEFAULT_UNIFIED_RADIX_TREE)
    return CpSharedKVSettings(**values), problems


def current_settings() -> CpSharedKVSettings:
    """This process's settings, read from its environment now; ``SettingsError`` listing every bad
    value. Startup reads them: the model runner's spec keeps what it read
    (``model_executor.cp_shared_kv_spec``) and everything after asks the spec, so the environment
    is read once per process where the runtime serves (``test_module_structure`` pins the readers).
    """
    settings, problems = current_settings_and_problems()
    if problems:
        raise SettingsError(problems)
    return settings


def current_settings_and_problems() -> Tuple[CpSharedKVSettings, List[str]]:
    """``parse_settings`` of this process's environment."""
    return parse_settings({name: os.environ.get(name) for name in SETTINGS_ENVS})


# ---- the flag on ``ServerArgs`` and its environment mirror ----


def cp_shared_kv_enabled(server_args) -> bool:
    """The flag on this ``ServerArgs``. Runtime hooks check it as well as the environment (which only
    decides whether they are registered), so a stray ``SGLANG_CP_SHARED_KV`` cannot turn them on."""
    return bool(getattr(server_args, CP_SHARED_KV_FIELD, False))


def cp_shared_kv_enabled_in_env() -> bool:
    """True in processes launched after the flag validated on (see ``CP_SHARED_KV_ENV``)."""
    return os.environ.get(CP_SHARED_KV_ENV) == "1"


def export_cp_shared_kv_env(enabled: bool) -> None:
    """Set (or clear) the flag's mirror for the processes this one spawns next."""
    if enabled:
        os.environ[CP_SHARED_KV_ENV] = "1"
    else:
        os.environ.pop(CP_SHARED_KV_ENV, None)
