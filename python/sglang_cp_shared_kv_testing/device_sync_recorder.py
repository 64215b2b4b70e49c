"""Record the torch ops that would make the host wait for the GPU, on tensors of a stand-in device.

A CPU machine cannot run ``torch.cuda.set_sync_debug_mode``; instead the code under test runs with
its "GPU" tensors on ``meta`` (shapes only) inside ``DeviceSyncRecorder``, a ``TorchDispatchMode``
that sees every aten op and records those that synchronise on CUDA when one of their tensors is on
the stand-in device:

* values read back to the host: ``_local_scalar_dense`` (``.item()``, ``int(t)``, ``.tolist()``),
  ``equal``, ``is_nonzero``, any copy from the device to the CPU;
* ops whose output size depends on the values: ``nonzero``, ``unique*``, ``masked_select``, boolean
  mask indexing (``index`` / ``index_put`` with a bool index), ``bincount``, ``repeat_interleave``
  without ``output_size``;
* host-to-device copies that are not ``non_blocking`` (``.to(device)`` from pageable memory blocks
  the host), and ``torch.tensor`` / ``torch.as_tensor`` of host data straight onto the device (seen
  by a ``TorchFunctionMode``: that copy happens below the dispatcher).

``recorded`` lists ``(op, why)``; ``host_to_device_copies`` counts the non-blocking uploads. With
``raise_at_first`` the first recorded op raises ``DeviceSyncError`` (naming it) before it runs, so a
test fails on the op itself rather than on whatever ``meta`` makes of it.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_aten = torch.ops.aten

_READ_BACK = {"_local_scalar_dense", "equal", "is_nonzero"}
_VALUE_SIZED = {
    "nonzero", "nonzero_static", "_unique", "_unique2", "unique_dim", "unique_consecutive",
    "unique_dim_consecutive", "masked_select", "bincount", "argwhere",
}  # fmt: skip
_COPIES = {"_to_copy", "copy_", "to"}


class DeviceSyncError(AssertionError):
    pass


class DeviceSyncRecorder(TorchDispatchMode):
    def __init__(self, device_type: str = "meta", raise_at_first: bool = False):
        super().__init__()
        self.device_type = device_type
        self.raise_at_first = raise_at_first
        self.recorded: List[Tuple[str, str]] = []
        self.host_to_device_copies = 0
        self._factories = _FactoryRecorder(self)

    def __enter__(self):
        self._factories.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._factories.__exit__(*exc)

    def _on_device(self, tensors) -> bool:
        return any(t.device.type == self.device_type for t in tensors)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if self._on_device(tensors):
            self._judge(name, func, args, kwargs, tensors)
        elif name in _COPIES and _copies_to(self.device_type, name, args, kwargs):
            self._judge_upload(name, kwargs)
        self.raise_if_recorded()
        return func(*args, **kwargs)

    def raise_if_recorded(self) -> None:
        if self.raise_at_first and self.recorded:
            op, why = self.recorded[0]
            raise DeviceSyncError(f"{op}: {why}")

    def _judge(self, name, func, args, kwargs, tensors) -> None:
        if name in _READ_BACK:
            self.recorded.append((name, "reads a device value on the host"))
        elif name in _VALUE_SIZED:
            self.recorded.append((name, "output size depends on device values"))
        elif name == "repeat_interleave" and kwargs.get("output_size") is None:
            self.recorded.append((name, "repeat_interleave without output_size"))
        elif name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
                self.recorded.append((name, "boolean mask indexing"))
        elif name in _COPIES:
            if _copies_to("cpu", name, args, kwargs):
                self.recorded.append((name, "copies device memory to the host"))
            elif any(t.device.type == "cpu" for t in tensors):
                self._judge_upload(name, kwargs)

    def _judge_upload(self, name, kwargs) -> None:
        if kwargs.get("non_blocking", False):
            self.host_to_device_copies += 1
        else:
            self.recorded.append((name, "blocking host-to-device copy (pageable source)"))


def _copies_to(device_type: str, name: str, args, kwargs) -> bool:
    """Whether this copy op writes a tensor on ``device_type``."""
    if name == "copy_":
        return args[0].device.type == device_type
    target = kwargs.get("device")
    return target is not None and torch.device(target).type == device_type


class _FactoryRecorder(TorchFunctionMode):
    """``torch.tensor(data, device=<device>)``: a blocking upload the dispatcher never shows."""

    def __init__(self, recorder: DeviceSyncRecorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == self.recorder.device_type:
                self.recorder.recorded.append((func.__name__, "host data copied to the device, blocking"))
                self.recorder.raise_if_recorded()
        return func(*args, **kwargs)
