"""Wiring: sglang picks the transfer classes through ``disaggregation.utils.get_kv_class``.

``PrefillBootstrapQueue`` asks it for the KV manager and for one sender per request. An AROUND hook
answers mooncake's with the shared-KV subclasses (``mooncake/conn.py``); every other backend and
class is stock (the startup rule in ``server_args.py`` refuses other backends). The subclasses
check ``--enable-nsa-prefill-cp-shared-kv`` on the manager's ``ServerArgs`` and act as stock with
it off, and the hook itself is registered only in processes launched with the flag (plugin.py).
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookType

GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"


def register_hooks(registry) -> None:
    registry.register(GET_KV_CLASS, get_kv_class_around, HookType.AROUND)


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
