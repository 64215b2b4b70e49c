"""Test-only sglang plugin of the end-to-end smoke (``scripts/glm5_cp_hicache_smoke.py``).

This is not part of the installed product. sglang discovers plugins through the
``sglang.srt.plugins`` entry points of the distributions on ``sys.path``; this folder holds a
dist-info of its own, and only the servers the smoke launches get the folder on their
``PYTHONPATH``. What each hook does is chosen by the smoke through environment variables that it
sets for those servers alone:

* ``SMOKE_DUMMY_INIT_ENV=1``: unit-gain dummy weights (``dummy_weights``), so the KV cache matters.
* ``SMOKE_LIFT_TP_RULE_ENV=1``: the *reference* server (shared KV off) runs NSA prefill CP at the
  smoke's ``--tp`` too (the product lifts sglang's ``tp_size == 8`` rule only with its flag on).
* ``SMOKE_AUDIT_DIR_ENV=<dir>``: the KV audits (``kv_audit``), the smoke's oracle;
  ``SMOKE_AUDIT_LAYERS_ENV=<n>`` limits both audits to the first ``n`` layers (layer 0 decides the
  pool audit; dumps and per-layer gathers of every layer of a GLM-5-width model would not fit a run).
  With it, ``tree_dump`` writes every rank's radix tree and host-slot ledger whenever
  ``/server_info`` reaches the schedulers (the soak compares them across ranks);
  ``SMOKE_AUDIT_POOL_ENV`` limits the pool dumps: ``0`` none, a regex the requests whose rid
  matches it (the read audits stay).
* ``SMOKE_PLANT_ENV=<bug>``: a deliberate bug (``planted_bugs``), to show the oracle catches it.
* ``SMOKE_ONE_GPU_ENV=1``: every rank of the server on device 0, each its own NCCL host
  (``one_gpu``; the launcher's side: ``sglang_cp_shared_kv_testing.e2e.one_gpu``).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal

from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang_cp_shared_kv_testing.e2e.one_gpu import ONE_GPU_PLUGIN_ENV

SMOKE_DUMMY_INIT_ENV = "SGLANG_CP_SHARED_KV_SMOKE_DUMMY_INIT"
SMOKE_LIFT_TP_RULE_ENV = "SGLANG_CP_SHARED_KV_SMOKE_LIFT_TP_RULE"
SMOKE_AUDIT_DIR_ENV = "SGLANG_CP_SHARED_KV_SMOKE_AUDIT_DIR"
SMOKE_AUDIT_LAYERS_ENV = "SGLANG_CP_SHARED_KV_SMOKE_AUDIT_LAYERS"
SMOKE_PLANT_ENV = "SGLANG_CP_SHARED_KV_SMOKE_PLANT"
# Which finished requests the pool audit dumps: all (unset), none ("0"), or those whose rid matches
# this regex (the soak samples: all of its requests would fill the disk). The read audits stay on.
SMOKE_AUDIT_POOL_ENV = "SGLANG_CP_SHARED_KV_SMOKE_AUDIT_POOL"
SMOKE_ONE_GPU_ENV = ONE_GPU_PLUGIN_ENV

logger = logging.getLogger(__name__)


def register() -> None:
    # A hung server can be asked where every thread is: `pkill -USR1 -f sglang::scheduler` prints
    # each scheduler's Python stacks to its log (the runners do so before a budget kill).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if os.environ.get(SMOKE_ONE_GPU_ENV) == "1":
        from cp_shared_kv_smoke_hooks import one_gpu

        one_gpu.register_hooks(HookRegistry)
    if os.environ.get(SMOKE_DUMMY_INIT_ENV) == "1":
        from cp_shared_kv_smoke_hooks import dummy_weights

        dummy_weights.register_hooks(HookRegistry)
    if os.environ.get(SMOKE_LIFT_TP_RULE_ENV) == "1":
        HookRegistry.register(
            "sglang.srt.server_args.ServerArgs._handle_model_specific_adjustments",
            _lift_tp_rule_for_the_reference,
            HookType.AROUND,
        )
    if os.environ.get(SMOKE_AUDIT_DIR_ENV):
        from cp_shared_kv_smoke_hooks import kv_audit

        kv_audit.register_hooks(HookRegistry, os.environ[SMOKE_AUDIT_DIR_ENV])
        from cp_shared_kv_smoke_hooks import tree_dump

        tree_dump.register_hooks(HookRegistry, os.environ[SMOKE_AUDIT_DIR_ENV])
    if os.environ.get(SMOKE_PLANT_ENV):
        from cp_shared_kv_smoke_hooks import planted_bugs

        planted_bugs.register_hooks(HookRegistry, os.environ[SMOKE_PLANT_ENV])
    logger.warning("cp-shared-kv smoke hooks loaded (test-only plugin)")


def _lift_tp_rule_for_the_reference(original, server_args, *args, **kwargs):
    """Shared KV off only: with the flag on, the product's own hook does this (and checks more)."""
    from sglang_cp_shared_kv.server_args import lift_single_node_cp_tp_rule
    from sglang_cp_shared_kv.settings import cp_shared_kv_enabled
    from sglang_cp_shared_kv.startup_rules import wants_round_robin_nsa_cp

    if cp_shared_kv_enabled(server_args) or not wants_round_robin_nsa_cp(server_args):
        return original(server_args, *args, **kwargs)
    return lift_single_node_cp_tp_rule(original, server_args, *args, **kwargs)

