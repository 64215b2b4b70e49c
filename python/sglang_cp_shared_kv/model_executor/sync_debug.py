"""Exempt a deliberate host round trip from ``torch.cuda.set_sync_debug_mode``.

The per-forward path never waits for the GPU; the runtime check proves it by running whole forwards
under sync debugging. One host round trip is deliberate and not part of a serving path: CP ranks that
share one GPU in the checks talk over gloo, which moves host memory, so the gather bounces the scratch
region through the host (``peer_page_gather``), and per-owner decode's exchanges bounce their
candidates and partials (``attention_lse_merge.process_group_collectives``). ``sync_debug_exempt()``
turns sync debugging off for exactly that bounce and restores the previous mode (``exempted`` counts
the bounces); it does nothing without CUDA.

It lives in the product, not in the tests' package (``sglang_cp_shared_kv_testing``): the gather and the merge enter it on every bounce
over a gloo group, with no debug switch (on NCCL, the serving transport, they never bounce), and
product code imports no test helper (``test_module_structure``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


exempted = 0  # bounces run under sync_debug_exempt in this process


@contextlib.contextmanager
def sync_debug_exempt() -> Iterator[None]:
    global exempted
    exempted += 1
    if not torch.cuda.is_available():
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
