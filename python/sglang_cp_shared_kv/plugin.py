"""Entry point of the ``sglang.srt.plugins`` group: wires the plugin into sglang through HookRegistry.

sglang calls ``register()`` in every process (CLI, engine, each scheduler subprocess) before it
builds anything. Two tiers of hooks:

* Server-argument hooks are always registered: they add ``--enable-nsa-prefill-cp-shared-kv`` and
  validate it. With the flag off they only add the (default False) flag.
* Runtime hooks (capacity, allocator, CP HiRadixCache, owner-filtered writes, peer-page reads,
  per-owner decode and its CUDA graphs, the host mirror of ``req_to_token``, load-back quota,
  prefill admission within the gather scratch, PD prefill transfer classes) are registered
  only in processes started after the flag was validated on: the validation sets ``CP_SHARED_KV_ENV`` in the launching process, and
  spawned scheduler processes inherit it. With the flag off no runtime hook exists, so the serving
  path is stock sglang.

Every hook of both tiers, and every other change the plugin makes in sglang, is a row of
``sglang_surface.SGLANG_SURFACE``; ``register`` first checks that the targets of the tiers it
registers exist in the installed sglang and stops the process naming those that do not.

No test-only hook lives here: the end-to-end smoke brings its own test plugin
(``scripts/smoke_plugin``), visible only to the servers it launches.
"""

from __future__ import annotations

import logging

from sglang.srt.plugins.hook_registry import HookRegistry

from sglang_cp_shared_kv.server_args import register_server_args_hooks
from sglang_cp_shared_kv.settings import cp_shared_kv_enabled_in_env
from sglang_cp_shared_kv.sglang_surface import require_hook_targets

logger = logging.getLogger(__name__)


def register(registry=HookRegistry) -> None:
    flag_on = cp_shared_kv_enabled_in_env()
    # Before any registration: stop here, not start with hooks sglang could not apply.
    require_hook_targets(flag_on)
    register_server_args_hooks(registry)
    if flag_on:
        register_runtime_hooks(registry)


def register_runtime_hooks(registry=HookRegistry) -> None:
    """Hooks that change what the server does; only with the flag on (see module docstring)."""
    from sglang_cp_shared_kv.disaggregation import transfer_class_hooks
    from sglang_cp_shared_kv.managers import (
        cp_hicache_draft_pool,
        cp_hicache_storage_prefetch,
        prefill_load_back_quota,
        prefill_scratch_admission,
    )
    from sglang_cp_shared_kv.mem_cache import (
        cp_hiradix_cache,
        nsa_host_kv_row_width,
        req_to_page_mirror_spec_writers,
        req_to_page_mirror_writers,
    )
    from sglang_cp_shared_kv.model_executor import (
        cp_shared_kv_capacity,
        cp_shared_kv_runtime,
        draft_decode_steps,
        forward_dispatch,
        owner_filtered_writes,
        peer_page_reads,
        startup_wiring,
    )
    from sglang_cp_shared_kv.model_executor.per_owner_decode import (
        cuda_graphs as per_owner_decode_graphs,
    )
    from sglang_cp_shared_kv.model_executor.per_owner_decode import (
        decode_forward as per_owner_decode,
    )

    # The model runner's spec (built once), the scratch's reservation and the logical capacity.
    cp_shared_kv_capacity.register_hooks(registry)
    cp_hiradix_cache.register_hooks(registry)
    # The host pools sglang's NSA assembler builds for the CP cache must hold whole fp8 NSA rows.
    nsa_host_kv_row_width.register_hooks(registry)
    # The MTP draft's KV and indexer host pools, backed up and restored with the target's pages.
    cp_hicache_draft_pool.register_hooks(registry)
    cp_hicache_storage_prefetch.register_hooks(registry)
    prefill_load_back_quota.register_hooks(registry)
    # Prefill batches within a gather scratch sized for prefill only (decode per owner).
    prefill_scratch_admission.register_hooks(registry)
    # The attach, in one module and its order, once the attention backend exists: the runtime (or
    # the MTP draft pool's), per-owner decode, the startup summary.
    startup_wiring.register_hooks(registry)
    cp_shared_kv_runtime.register_hooks(registry)
    # The plan's host mirror of req_to_token: every writer of the table (EAGLE's too), and the
    # tree's value pages.
    req_to_page_mirror_writers.register_hooks(registry)
    req_to_page_mirror_spec_writers.register_hooks(registry)
    owner_filtered_writes.register_hooks(registry)
    peer_page_reads.register_hooks(registry)
    # Per forward, once: draft step, per owner or gather (the one dispatcher).
    forward_dispatch.register_hooks(registry)
    # The MTP draft's multi-step decode: one plan per draft step, selected when the step runs.
    draft_decode_steps.register_hooks(registry)
    # Decode per owner's forward hooks (attached by startup_wiring where the decision says so).
    per_owner_decode.register_hooks(registry)
    # Decode CUDA graphs over per-owner decode's static tables (inert without both).
    per_owner_decode_graphs.register_hooks(registry)
    transfer_class_hooks.register_hooks(registry)
    logger.info("sglang-cp-shared-kv: runtime hooks registered (NSA prefill CP shared KV on)")
