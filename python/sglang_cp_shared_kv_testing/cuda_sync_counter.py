"""Count the CUDA calls that make the host wait for the GPU inside a block, and say whose they are.

``CudaSyncCounter`` turns on ``torch.cuda.set_sync_debug_mode("warn")`` for the block and catches each
"synchronizing CUDA operation" warning with the Python stack that raised it. The innermost frame in
our packages or in sglang decides whose sync it is: ``ours`` (``sglang_cp_shared_kv``), ``harness``
(``sglang_cp_shared_kv_testing``: the check's own stand-ins) or ``stock``
(sglang). Syncs exempted with ``model_executor.sync_debug.sync_debug_exempt`` are not seen. Without
CUDA the counter records nothing (``available`` is False).
"""

from __future__ import annotations

import collections
import traceback
import warnings
from typing import Dict, List, Tuple

import torch

_SYNC_WARNING = "synchronizing CUDA operation"
_OURS, _HARNESS, _STOCK = "/sglang_cp_shared_kv/", "/sglang_cp_shared_kv_testing/", "/sglang/"


class CudaSyncCounter:
    def __init__(self):
        self.available = torch.cuda.is_available()
        self.sites: List[Tuple[str, str]] = []  # (owner, "file:line in function")

    def counts(self) -> Dict[str, int]:
        counts = collections.Counter(owner for owner, _ in self.sites)
        return {owner: counts.get(owner, 0) for owner in ("ours", "harness", "stock")}

    def __enter__(self):
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        self._show = warnings.showwarning
        warnings.showwarning = self._record
        if self.available:
            self._mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.available:
            torch.cuda.set_sync_debug_mode(self._mode)
        self._warnings.__exit__(*exc)
        return False

    def _record(self, message, category, filename, lineno, file=None, line=None):
        if _SYNC_WARNING not in str(message):
            return self._show(message, category, filename, lineno, file, line)
        for frame in reversed(traceback.extract_stack()[:-1]):
            path = frame.filename.replace("\\", "/")
            if _HARNESS in path:
                owner = "harness"
            elif _OURS in path:
                owner = "ours"
            elif _STOCK in path:
                owner = "stock"
            else:
                continue
            self.sites.append((owner, f"{'/'.join(path.rsplit('/', 2)[-2:])}:{frame.lineno} in {frame.name}"))
            return None
        self.sites.append(("stock", f"{filename}:{lineno} (no sglang frame)"))
        return None
