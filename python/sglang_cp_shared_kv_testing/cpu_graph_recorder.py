"""A CUDA graph's replay semantics on CPU, for checks: one run recorded op by op, replayed on the same tensors.

A captured CUDA graph replays exactly the kernels its capture run issued, on the memory they used.
Tensors that existed before the capture are the graph's inputs (static buffers that someone
refreshes before each replay); whatever the capture run read but did not compute keeps, in every
replay, the value it had at capture. A CPU test that reruns the Python of a forward cannot see that
difference: the rerun recomputes everything. ``RecordedRun`` records the aten ops of one run
(``TorchDispatchMode``) and ``replay`` runs them again in order, each on its recorded arguments,
copying each result into the tensor the op produced at capture. A replay therefore sees the current
contents of tensors created before the recording and nothing else, as a graph does.

Ops whose result shares storage with the tensor recorded (views, in-place ops) are re-run for their
effect and not copied. No Python runs between the ops of a replay, so a run that branches on tensor
values on the host (a sync, refused in per-forward code anyway) replays its capture-time branch.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _tensors(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class RecordedRun(TorchDispatchMode):
    """``with RecordedRun() as run: outputs = forward()``, then ``run.replay()`` rewrites ``outputs``
    (and every tensor the run created) as a replay of the captured graph would."""

    def __init__(self):
        super().__init__()
        self.ops: List[Tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    def replay(self) -> None:
        for func, args, kwargs, recorded in self.ops:
            fresh = func(*args, **kwargs)
            for old, new in zip(_tensors(recorded), _tensors(fresh)):
                if not _same_storage(old, new):
                    old.copy_(new)
