"""Compile our Triton kernels for an H200 on a machine without a GPU, through their real launches.

Triton's interpreter (``triton_interpreted``) checks what a kernel computes, not that it compiles:
it runs the kernel's Python over numpy, so a kernel the compiler rejects (a loop-carried variable
that changes type, a block that is not a power of two, a dtype the target lacks) passes there and
fails only at its first launch on a GPU, inside a served forward. Here every launch compiles instead
of running: the wrappers are called as decode calls them, Triton's own binder specializes their
arguments (dtypes, integers equal to 1 or divisible by 16, pointer alignment) and the compiler builds
a cubin for ``sm_90`` (H100/H200, warps of 32) with the ``ptxas`` the Triton wheel ships. Nothing is
launched and no CUDA driver is loaded.

    python -m sglang_cp_shared_kv_testing.triton_gpu_compile

prints one JSON object: every specialization compiled (kernel, signature, cubin bytes, warps, shared
memory) and every compiler error; ``"passed"`` when each kernel compiled at least once and none
failed. Run it in a process of its own: it replaces Triton's active driver for the process.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from typing import Callable, Dict, Iterator, List
from unittest import mock

import torch

H200 = ("cuda", 90, 32)  # backend, compute capability, warp size

# GLM-5 decode as per-owner decode runs it: top-k 2048, 64 heads of 512 values (bf16 partials).
TOP_K, HEADS, HEAD_DIM = 2048, 64, 512
# Batches of 1 (Triton specializes an integer 1), odd and multiples of 16; CP 2, 4, 8; context
# widths that are and are not multiples of 16 (the logits' and tables' strides).
BATCHES = (1, 7, 16, 48)
CP_SIZES = (2, 4, 8)
WIDTHS = (8192, 8191)


class _TargetOnlyDriver:
    """The part of a Triton driver a compile asks for: the device, its stream and the target."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


@contextlib.contextmanager
def compiling_launches(target=H200) -> Iterator[Dict[str, List[dict]]]:
    """Within: ``kernel[grid](...)`` compiles for ``target`` and returns without launching. Yields
    ``{"compiled": [...], "errors": [...]}``, filled as launches compile or fail (a failing launch
    is recorded and returns None, so later launches still compile)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver as driver_config
    from triton.runtime.jit import JITFunction

    record: Dict[str, List[dict]] = {"compiled": [], "errors": []}

    def compile_only(kernel, grid) -> Callable:
        def launch(*args, **kwargs):
            try:
                compiled = kernel.run(*args, grid=grid, warmup=True, **kwargs)
            except Exception as error:  # the compiler's verdict is the result
                record["errors"].append({"kernel": kernel.fn.__name__, "error": f"{type(error).__name__}: {error}"})
                return None
            entry = {
                "kernel": kernel.fn.__name__,
                "signature": dict(compiled.src.signature),
                "cubin_bytes": len(compiled.asm["cubin"]),
                "num_warps": compiled.metadata.num_warps,
                "shared_bytes": compiled.metadata.shared,
            }
            if entry not in record["compiled"]:
                record["compiled"].append(entry)
            return compiled

        return launch

    previous = driver_config._active
    driver_config.set_active(_TargetOnlyDriver(GPUTarget(*target)))
    try:
        with mock.patch.object(JITFunction, "__getitem__", compile_only):
            yield record
    finally:
        driver_config._active = previous


def launch_per_owner_decode_kernels(batch: int, cp_size: int, width: int) -> None:
    """Every fused per-owner decode kernel, through its wrapper, with the dtypes and layouts decode
    passes (host tensors: only their dtypes, strides and alignment reach the compiler)."""
    from sglang_cp_shared_kv.model_executor.per_owner_decode import attention_lse_merge as merge
    from sglang_cp_shared_kv.model_executor.per_owner_decode import fused_kernels as kernels

    table = torch.zeros(batch, width, dtype=torch.int32)
    columns = torch.zeros(batch, TOP_K, dtype=torch.int32)
    kernels.gather_candidates(columns, torch.zeros(batch, width), table, table)
    for cp_rank in (0, 1):  # Triton specializes a rank of 1
        kernels.owned_selection(torch.zeros(cp_size, batch, TOP_K), columns, columns, cp_rank)
    out = torch.zeros(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    lse = torch.zeros(batch, HEADS)
    kernels.scaled_partial(out, lse, torch.zeros(cp_size, batch, HEADS))
    gathered = merge.pack_partial(out, lse).unsqueeze(0).expand(cp_size, -1, -1, -1).contiguous()
    kernels.merge_gathered(gathered, HEAD_DIM)


PER_OWNER_DECODE_KERNELS = (
    "_gather_candidates_kernel",
    "_owned_selection_kernel",
    "_scaled_partial_kernel",
    "_merge_gathered_kernel",
)


def compile_per_owner_decode_kernels(target=H200) -> dict:
    with compiling_launches(target) as record:
        for batch in BATCHES:
            for cp_size in CP_SIZES:
                for width in WIDTHS:
                    launch_per_owner_decode_kernels(batch, cp_size, width)
    compiled_kernels = {entry["kernel"] for entry in record["compiled"]}
    missing = [name for name in PER_OWNER_DECODE_KERNELS if name not in compiled_kernels]
    return {
        "target": list(target),
        "compiled": record["compiled"],
        "errors": record["errors"],
        "never_compiled": missing,
        "passed": not record["errors"] and not missing,
    }


def compile_in_fresh_process(timeout_s: float) -> dict:
    """``main``'s verdict from a process of its own (not interpreted: Triton must compile)."""
    from sglang_cp_shared_kv_testing.triton_interpreted import run_json_check

    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    return run_json_check(["-m", __name__], timeout_s, env)


def main() -> int:
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # compile for real, leave no cache behind
        result = compile_per_owner_decode_kernels()
    print(json.dumps(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
