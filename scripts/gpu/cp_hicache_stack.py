"""One rank's HiCache stack, built the way a server builds it, on CUDA or on the CPU.

Shared by ``check_cp_hicache_gpu.py`` and ``benchmark/bench_cp_hicache_transfer.py``:

* ``build_cp_stack``: a CUDA (or CPU) ``NSATokenToKVPool`` shard of ``physical_pages`` pages, our
  ``CPSharedPagedTokenToKVPoolAllocator`` over ``cp_size`` x that, and a real ``CpHiRadixCache``, whose
  constructor runs sglang's NSA assembler (KV + indexer host pools, ``HybridCacheController``) and adopts
  the controller as our ``CpHybridCacheController``. Its CP rank comes from ``group``; a 1-process group
  with ``cp_size > 1`` simulates rank ``cp_rank`` (the fixture's ``SimulatedRankCpHiRadixCache``).
* ``build_stock_stack``: the same pool holding every token, sglang's ``PagedTokenToKVPoolAllocator`` and
  the stock ``HiRadixCache``: what stock CP keeps on each rank (a full replica).

Host pools are pinned and registered with CUDA on a GPU, plain on the CPU. Registered host memory must
never be freed and reallocated in the same process (``cudaErrorHostMemoryAlreadyRegistered``), so every
stack built here is kept alive until the process ends.

Byte patterns: ``SequenceBytes`` draws random KV rows (per token) and indexer pages (per 64-token page) for
a sequence; a rank writes the ones it owns into its physical device rows and later counts the owned rows
that differ, wherever the sequence's (new) logical locs put them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from sglang_cp_shared_kv.testing import sgl_kernel_cpu_shim

sgl_kernel_cpu_shim.install()  # no-op where the real sgl_kernel loads (GPU machines)

from sglang.srt.mem_cache import memory_pool_host  # noqa: E402
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool, ReqToTokenPool  # noqa: E402

from sglang_cp_shared_kv.mem_cache.allocator import (  # noqa: E402
    CPSharedPagedTokenToKVPoolAllocator,
)
from sglang_cp_shared_kv.mem_cache import nsa_host_kv_row_width  # noqa: E402
from sglang_cp_shared_kv.mem_cache.cp_hiradix_cache import CpHiRadixCache  # noqa: E402
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout  # noqa: E402
from sglang_cp_shared_kv.testing.hook_sandbox import applied_hooks  # noqa: E402
from sglang_cp_shared_kv.testing.cpu_hicache_fixture import (  # noqa: E402
    HiCacheServerArgs,
    SimulatedRankCpHiRadixCache,
    unpinned_host_pools,
)

PAGE_SIZE = 64
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
INDEX_HEAD_DIM = 128
# GLM-5 / DeepSeek-V3.2 NSA latent rows: bf16 576 values (1152 B); fp8 512 fp8 nope + 16 B scales +
# 64 bf16 rope = 656 B. The indexer keeps 132 B per token (128 fp8 + one fp32 scale) per layer.
KV_FORMATS = {"bf16": (torch.bfloat16, 576), "fp8": (torch.float8_e4m3fn, 656)}
INDEXER_BYTES_PER_TOKEN = 132
# Host layouts sglang 0.5.11 supports for NSA, per io backend.
HOST_LAYOUTS = {"kernel": ("layer_first", "page_first"), "direct": ("layer_first", "page_first_direct")}

_KEEP_ALIVE: list = []


@dataclass
class Stack:
    cache: HiRadixCache
    allocator: PagedTokenToKVPoolAllocator
    kv_pool: NSATokenToKVPool
    layout: Optional[CpSharedKVLayout]  # None for the stock stack (every loc is a physical row)

    @property
    def controller(self):
        return self.cache.cache_controller

    @property
    def kv_host(self):
        return self.controller.mem_pool_host.anchor_entry.host_pool

    def kv_row_bytes(self) -> int:
        """Bytes of one device latent row (the size a host row must have)."""
        buffer = self.kv_pool.kv_buffer[0]
        return buffer.shape[-1] * buffer.element_size()

    def physical(self, logical_locs: torch.Tensor):
        """(node-local positions this rank owns, their physical device rows)."""
        if self.layout is None:
            return torch.arange(len(logical_locs), device=logical_locs.device), logical_locs
        mask = self.layout.owned_by_this_rank(logical_locs)
        positions = torch.nonzero(mask).flatten()
        return positions, self.layout.physical_locs_or_dummy(logical_locs[mask])


def _nsa_pool(kv_format: str, physical_tokens: int, layers: int, device: str) -> NSATokenToKVPool:
    dtype, kv_cache_dim = KV_FORMATS[kv_format]
    return NSATokenToKVPool(
        size=physical_tokens,
        page_size=PAGE_SIZE,
        kv_lora_rank=KV_LORA_RANK,
        dtype=dtype,
        qk_rope_head_dim=QK_ROPE_HEAD_DIM,
        layer_num=layers,
        device=device,
        index_head_dim=INDEX_HEAD_DIM,
        enable_memory_saver=False,
        kv_cache_dim=kv_cache_dim,
    )


def _server_args(io_backend: str, host_layout: str, write_policy: str, hicache_ratio: float):
    args = HiCacheServerArgs(
        hicache_ratio=hicache_ratio,
        hicache_mem_layout=host_layout,
        hicache_write_policy=write_policy,
    )
    args.hicache_io_backend = io_backend
    return args


def _params(allocator, group, device: str) -> CacheInitParams:
    req_to_token_pool = ReqToTokenPool(
        size=4, max_context_len=8, device=device, enable_memory_saver=False
    )
    return CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=PAGE_SIZE,
        is_eagle=False,
        tp_cache_group=group,
        attn_cp_cache_group=group,
        attn_tp_cache_group=None,
        eviction_policy="lru",
    )


@contextlib.contextmanager
def _host_memory(device: str):
    # On the CPU there is no CUDA to register pinned memory with.
    with unpinned_host_pools() if device == "cpu" else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def host_rows_as_wide_as_device_rows():
    """Build KV host pools whose rows are as wide as the device rows.

    sglang 0.5.11's NSA assembler builds the KV host pool without ``override_kv_cache_dim``: with fp8 KV
    its host rows are 576 B for 656 B device rows, and every KV row comes back corrupted (see
    docs/gpu.md). The benchmark measures both stacks with correct rows; the check does not use this.
    """
    cls = memory_pool_host.MLATokenToKVPoolHost
    original = cls.__dict__["__init__"]

    def __init__(self, device_pool, *args, **kwargs):
        kwargs.setdefault("override_kv_cache_dim", device_pool.kv_cache_dim)
        original(self, device_pool, *args, **kwargs)

    cls.__init__ = __init__
    try:
        yield
    finally:
        cls.__init__ = original


def build_cp_stack(
    *,
    device: str,
    kv_format: str,
    io_backend: str,
    host_layout: str,
    cp_size: int,
    cp_rank: int,
    group: dist.ProcessGroup,
    physical_pages: int,
    layers: int,
    write_policy: str = "write_through",
    hicache_ratio: float = 2.0,
) -> Stack:
    """One rank's CP shared-KV stack; ``physical_pages`` real pages (plus the dummy page 0)."""
    pool = _nsa_pool(kv_format, physical_pages * PAGE_SIZE, layers, device)
    allocator = CPSharedPagedTokenToKVPoolAllocator(
        size=cp_size * physical_pages * PAGE_SIZE,
        page_size=PAGE_SIZE,
        dtype=pool.dtype,
        device=device,
        kvcache=pool,
        need_sort=False,
        cp_size=cp_size,
        cp_rank=cp_rank,
    )
    cache_class = CpHiRadixCache
    if dist.get_world_size(group=group) != cp_size:
        cache_class = type(
            f"SimulatedRank{cp_rank}Of{cp_size}",
            (SimulatedRankCpHiRadixCache,),
            {"simulated_cp_rank": cp_rank, "simulated_cp_size": cp_size},
        )
    # As on the server, the CP cache comes with the hook that sizes KV host rows like device rows.
    with _host_memory(device), applied_hooks(nsa_host_kv_row_width.register_hooks):
        cache = cache_class(
            _params(allocator, group, device),
            _server_args(io_backend, host_layout, write_policy, hicache_ratio),
        )
    stack = Stack(cache=cache, allocator=allocator, kv_pool=pool, layout=allocator.layout)
    _KEEP_ALIVE.append(stack)
    return stack


def build_stock_stack(
    *,
    device: str,
    kv_format: str,
    io_backend: str,
    host_layout: str,
    group: dist.ProcessGroup,
    pages: int,
    layers: int,
    write_policy: str = "write_through",
    hicache_ratio: float = 2.0,
) -> Stack:
    """Stock sglang 0.5.11: a pool of ``pages`` pages holding every token, stock HiRadixCache."""
    pool = _nsa_pool(kv_format, pages * PAGE_SIZE, layers, device)
    allocator = PagedTokenToKVPoolAllocator(
        pages * PAGE_SIZE, PAGE_SIZE, pool.dtype, device, kvcache=pool, need_sort=False
    )
    with _host_memory(device):
        cache = HiRadixCache(
            _params(allocator, group, device),
            _server_args(io_backend, host_layout, write_policy, hicache_ratio),
        )
    stack = Stack(cache=cache, allocator=allocator, kv_pool=pool, layout=None)
    _KEEP_ALIVE.append(stack)
    return stack


class SequenceBytes:
    """Random KV rows (one per token) and indexer pages (one per 64 tokens) of one sequence, per layer.

    Drawn on the CPU from ``seed``: every rank of a group draws the same bytes and keeps its own part.
    """

    def __init__(self, num_tokens: int, kv_row_bytes: int, layers: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        index_page_bytes = PAGE_SIZE * INDEXER_BYTES_PER_TOKEN
        self.kv = torch.randint(
            0, 256, (layers, num_tokens, kv_row_bytes), dtype=torch.uint8, generator=generator
        )
        self.index = torch.randint(
            0,
            256,
            (layers, num_tokens // PAGE_SIZE, index_page_bytes),
            dtype=torch.uint8,
            generator=generator,
        )

    def write_owned(self, stack: Stack, logical_locs: torch.Tensor) -> int:
        """Write this rank's positions into its device rows; returns the owned token count."""
        positions, rows = stack.physical(logical_locs)
        positions_cpu = positions.cpu()
        pool = stack.kv_pool
        for layer in range(pool.layer_num):
            _kv_rows(pool, layer)[rows] = self.kv[layer][positions_cpu].to(rows.device)
            page_rows = rows[::PAGE_SIZE] // PAGE_SIZE
            seq_pages = positions_cpu[::PAGE_SIZE] // PAGE_SIZE
            pool.index_k_with_scale_buffer[layer][page_rows] = self.index[layer][seq_pages].to(
                rows.device
            )
        return len(positions)

    def count_owned_mismatches(self, stack: Stack, logical_locs: torch.Tensor) -> tuple[int, int]:
        """(owned KV rows, owned indexer pages) whose bytes differ, summed over layers."""
        positions, rows = stack.physical(logical_locs)
        positions_cpu = positions.cpu()
        pool = stack.kv_pool
        kv_bad = index_bad = 0
        for layer in range(pool.layer_num):
            got = _kv_rows(pool, layer)[rows].cpu()
            kv_bad += int((got != self.kv[layer][positions_cpu]).any(dim=1).sum())
            page_rows = rows[::PAGE_SIZE] // PAGE_SIZE
            got = pool.index_k_with_scale_buffer[layer][page_rows].cpu()
            expected = self.index[layer][positions_cpu[::PAGE_SIZE] // PAGE_SIZE]
            index_bad += int((got != expected).any(dim=1).sum())
        return kv_bad, index_bad


def poison_device_pool(stack: Stack) -> None:
    """Overwrite every device KV row and indexer page (as if freed pages had been reused)."""
    for layer in range(stack.kv_pool.layer_num):
        _kv_rows(stack.kv_pool, layer).fill_(0xA5)
        stack.kv_pool.index_k_with_scale_buffer[layer].fill_(0x5A)


def _kv_rows(pool: NSATokenToKVPool, layer: int) -> torch.Tensor:
    buffer = pool.kv_buffer[layer]
    return buffer.view(torch.uint8).view(buffer.shape[0], -1)
