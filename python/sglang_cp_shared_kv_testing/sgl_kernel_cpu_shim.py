"""Test-only stand-in for ``sgl_kernel`` on machines without ``libcuda.so.1``.

``sglang.srt.mem_cache.memory_pool_host`` imports ``sgl_kernel.kvcacheio`` at module level, and the
real package cannot load without a CUDA driver. ``install()`` registers a tiny ``sgl_kernel``
whose only working function is ``transfer_kv_direct`` (copy rows by index, layer by layer), which is
what HiCache's ``io_backend="direct"`` uses with the ``layer_first`` host layout. Every other kernel
raises when called, so a test can never silently pass through a fake CUDA path.

It is installed only when the real ``sgl_kernel`` fails to import; on a GPU machine it is a no-op,
and ``scripts/gpu`` checks ``transfer_kv_direct_reference`` against the real kernel.
"""

from __future__ import annotations

import sys
import types
from typing import List

import torch

SHIM_MODULE_ATTR = "__sglang_cp_shared_kv_cpu_shim__"


def transfer_kv_direct_reference(
    src_layers: List[torch.Tensor],
    dst_layers: List[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """``dst[dst_indices] = src[src_indices]`` for every layer pair (rows along dim 0)."""
    if len(src_layers) != len(dst_layers):
        raise ValueError("transfer_kv_direct: src_layers and dst_layers differ in length")
    if src_indices.numel() != dst_indices.numel():
        raise ValueError("transfer_kv_direct: src_indices and dst_indices differ in length")
    if src_indices.numel() == 0:
        return
    for src, dst in zip(src_layers, dst_layers):
        rows = src.index_select(0, src_indices.to(src.device, torch.int64))
        dst.index_copy_(0, dst_indices.to(dst.device, torch.int64), rows.to(dst.device))


def _unavailable(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is a CUDA kernel; the CPU test shim only provides "
            "transfer_kv_direct (use io_backend='direct' with the layer_first layout)"
        )

    kernel.__name__ = name
    return kernel


_KVCACHEIO_KERNELS = (
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
)


def _real_sgl_kernel_loads() -> bool:
    try:
        import sgl_kernel.kvcacheio  # noqa: F401
    except Exception:
        for name in [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]:
            del sys.modules[name]
        return False
    return True


def is_installed() -> bool:
    return getattr(sys.modules.get("sgl_kernel"), SHIM_MODULE_ATTR, False)


def install() -> bool:
    """Register the shim if the real sgl_kernel cannot load. Returns True if the shim is active."""
    if is_installed():
        return True
    if "sgl_kernel" in sys.modules or _real_sgl_kernel_loads():
        return False
    package = types.ModuleType("sgl_kernel")
    package.__path__ = []  # a package, so ``import sgl_kernel.kvcacheio`` resolves from sys.modules
    setattr(package, SHIM_MODULE_ATTR, True)
    kvcacheio = types.ModuleType("sgl_kernel.kvcacheio")
    kvcacheio.transfer_kv_direct = transfer_kv_direct_reference
    for name in _KVCACHEIO_KERNELS:
        setattr(kvcacheio, name, _unavailable(name))
    package.kvcacheio = kvcacheio
    sys.modules["sgl_kernel"] = package
    sys.modules["sgl_kernel.kvcacheio"] = kvcacheio
    return True
