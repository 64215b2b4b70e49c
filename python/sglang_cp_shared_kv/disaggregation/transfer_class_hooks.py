"""Transfer-class hooks: sglang picks the PD transfer classes through its
``disaggregation.utils.get_kv_class``; these hooks answer with ours.

``PrefillBootstrapQueue`` asks it for the KV manager and for one sender per request. An AROUND hook
answers mooncake's with the shared-KV subclasses (``mooncake/conn.py``); every other backend and
class is stock (the startup rule in ``startup_rules.py`` refuses other backends). The subclasses
check ``--enable-nsa-prefill-cp-shared-kv`` on the manager's ``ServerArgs`` and act as stock with
it off, and the hook itself is registered only in processes launched with the flag (plugin.py).
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookType

GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"
INIT_KV_MANAGER = "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager"


def register_hooks(registry) -> None:
    registry.register(GET_KV_CLASS, get_kv_class_around, HookType.AROUND)
    registry.register(INIT_KV_MANAGER, init_kv_manager_around, HookType.AROUND)


def init_kv_manager_around(original, queue, *args, **kwargs):
    """The KV manager built here translates through the layout of the server's spec, which the
    queue's pool carries in its state (sglang hands the manager only the pool's buffers)."""
    from sglang_cp_shared_kv.disaggregation.mooncake.conn import managers_built_for
    from sglang_cp_shared_kv.model_executor.cp_shared_kv_state import state_of

    state = state_of(queue.token_to_kv_pool)
    with managers_built_for(None if state is None else state.spec.layout):
        return original(queue, *args, **kwargs)


def get_kv_class_around(original, transfer_backend, class_type):
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend

    if transfer_backend == TransferBackend.MOONCAKE:
        from sglang_cp_shared_kv.disaggregation.mooncake.conn import (
            CpSharedKVMooncakeKVManager,
            CpSharedKVMooncakeKVSender,
        )

        if class_type == KVClassType.MANAGER:
            return CpSharedKVMooncakeKVManager
        if class_type == KVClassType.SENDER:
            return CpSharedKVMooncakeKVSender
    return original(transfer_backend, class_type)
