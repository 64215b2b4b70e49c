"""``--enable-nsa-prefill-cp-shared-kv`` in sglang's ``ServerArgs``: the CLI flag, its fail-fast
validation, and its environment carrier.

The rules themselves are pure functions in ``startup_rules``; this module is the sglang-facing side:
it adds the flag, asks the rules, and raises the one ``ValueError`` that lists every problem.

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
import logging

from sglang.srt.plugins.hook_registry import HookType
from sglang_cp_shared_kv.settings import (
    CP_SHARED_KV_ENV,
    CP_SHARED_KV_FIELD,
    CP_SHARED_KV_FLAG,
    GRAPH_DECODE_ENV,
    MTP_ENV,
    cp_shared_kv_enabled,
    cp_shared_kv_enabled_in_env,
    current_settings_and_problems,
    export_cp_shared_kv_env,
)
from sglang_cp_shared_kv.startup_rules import (
    CP_SHARED_KV_PAGE_SIZE,
    TP_SIZES_TEXT,
    cp_shared_kv_problems,
    single_node_tp_problem,
    wants_round_robin_nsa_cp,
)

logger = logging.getLogger(__name__)

_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"

# sglang 0.5.11 asserts tp_size == 8 for NSA prefill CP ("multi-machine CP support suffers from
# precision issues"). The round-robin split has no such reason on one node; with our flag we accept
# the CP sizes of one node's GPUs that the models split at (``startup_rules.CP_SHARED_KV_TP_SIZES``),
# and refuse more than one node.
SGLANG_NSA_CP_TP_SIZE = 8


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
        f"Requires --enable-nsa-prefill-context-parallel (round-robin-split), --tp {TP_SIZES_TEXT} on "
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
    problem = single_node_tp_problem(server_args)
    if problem is not None:  # before sglang's own assert, which would only say tp_size must be 8
        raise ValueError(problem)
    return lift_single_node_cp_tp_rule(original, server_args, *args, **kwargs)


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

    # Bad environment values first, then every rule judged with them at their defaults, so that
    # one launch attempt lists everything.
    settings, problems = current_settings_and_problems()
    problems += cp_shared_kv_problems(server_args, settings)
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
