"""Build one rank's real CP HiCache stack on the CPU, for unit tests and multi-process simulations.

``build_cpu_cp_hicache`` returns sglang's real ``NSATokenToKVPool`` (device "cpu"; small layer count and
latent dims, the real 128-dim indexer), our ``CPSharedPagedTokenToKVPoolAllocator``, a real
``ReqToTokenPool``, ``CacheInitParams``, a minimal server-args object and a real ``CpHiRadixCache`` with
its real host pools (KV + NSA indexer, ``pin_memory=False``, io backend "direct", host layout
"layer_first"), with the ``sgl_kernel`` CPU shim installed. Only CUDA streams/events are not real: sglang
runs them through ``torch.cpu``'s no-op stream and event types on a machine without CUDA.

Two ways to use it:

* One process per rank: pass the gloo group of the CP ranks as ``group`` (its size must be ``cp_size``).
  Agreement all-reduces run for real.
* One process, any rank's view of an N-rank layout: pass a 1-process group (``single_process_group()``).
  The cache then takes its CP rank from ``cp_rank`` instead of the group (``SimulatedRankCpHiRadixCache``
  overrides only ``_attn_cp_rank_and_size``); all-reduces over a 1-process group are the identity, so
  nothing else is replaced. Each view has its own pools; feed every view the same calls.

``TreeNode.counter`` is process-global and every cache construction resets it: in one process, build all
views before driving any of them.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
import torch.distributed as dist

from sglang_cp_shared_kv.testing import sgl_kernel_cpu_shim

sgl_kernel_cpu_shim.install()

from sglang.srt.mem_cache import memory_pool_host  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool, ReqToTokenPool  # noqa: E402

from sglang_cp_shared_kv.mem_cache.allocator import (  # noqa: E402
    CPSharedPagedTokenToKVPoolAllocator,
)
from sglang_cp_shared_kv.mem_cache import nsa_host_kv_row_width  # noqa: E402
from sglang_cp_shared_kv.mem_cache.cp_hiradix_cache import CpHiRadixCache  # noqa: E402
from sglang_cp_shared_kv.testing.hook_sandbox import applied_hooks  # noqa: E402

# NSATokenToKVPool requires page_size 64 and index_head_dim 128 (outside ROCm).
NSA_PAGE_SIZE = 64
NSA_INDEX_HEAD_DIM = 128


@dataclass
class HiCacheServerArgs:
    """The ``ServerArgs`` fields ``HiRadixCache`` and its NSA assembler read, with test defaults."""

    hicache_ratio: float = 2.0
    hicache_size: int = 0
    hicache_mem_layout: str = "layer_first"
    hicache_io_backend: str = "direct"
    hicache_write_policy: str = "write_through"
    hicache_storage_backend: Optional[str] = None
    hicache_storage_backend_extra_config: Optional[str] = None
    hicache_storage_prefetch_policy: str = "best_effort"
    served_model_name: str = "cpu-hicache-fixture"
    extra_metric_labels: Optional[Dict[str, str]] = None
    enable_nsa_prefill_cp_shared_kv: bool = True


@dataclass
class CpuHiCacheStack:
    cache: CpHiRadixCache
    allocator: CPSharedPagedTokenToKVPoolAllocator
    kv_pool: NSATokenToKVPool  # this rank's physical device pool
    req_to_token_pool: ReqToTokenPool
    params: CacheInitParams
    server_args: HiCacheServerArgs = field(repr=False)

    @property
    def layout(self):
        return self.allocator.layout

    @property
    def controller(self):
        return self.cache.cache_controller


class SimulatedRankCpHiRadixCache(CpHiRadixCache):
    """``CpHiRadixCache`` seeing itself as ``simulated_cp_rank`` of ``simulated_cp_size`` although its
    group has one process (see module docstring). Set the two class attributes on a subclass."""

    simulated_cp_rank: int = 0
    simulated_cp_size: int = 1

    def _attn_cp_rank_and_size(self, params):
        return self.simulated_cp_rank, self.simulated_cp_size


def single_process_group() -> dist.ProcessGroup:
    """The world group of a 1-process gloo job, initialising one (file:// rendezvous) if needed."""
    if not dist.is_initialized():
        fd, path = tempfile.mkstemp(prefix="cpu_hicache_gloo_")
        os.close(fd)
        os.unlink(path)
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise ValueError("single_process_group() needs a 1-process job; pass your own group instead")
    return dist.group.WORLD


def build_cpu_cp_hicache(
    *,
    cp_size: int,
    cp_rank: int,
    group: dist.ProcessGroup,
    physical_pages: int,
    page_size: int = NSA_PAGE_SIZE,
    write_policy: str = "write_through",
    host_layout: str = "layer_first",
    hicache_ratio: float = 2.0,
    layer_num: int = 2,
    kv_lora_rank: int = 16,
    qk_rope_head_dim: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    eviction_policy: str = "lru",
    is_eagle: bool = False,
    max_running_requests: int = 8,
    max_context_len: int = 4096,
) -> CpuHiCacheStack:
    """One rank's stack; ``physical_pages`` real pages per rank (plus sglang's dummy page 0).

    On a machine without CUDA only ``host_layout="layer_first"`` transfers (the shim implements
    ``transfer_kv_direct`` only); ``page_size`` must be 64 (``NSATokenToKVPool``).
    """
    if page_size != NSA_PAGE_SIZE:
        raise ValueError(f"NSATokenToKVPool needs page_size {NSA_PAGE_SIZE}, got {page_size}")
    physical_size = physical_pages * page_size
    kv_pool = NSATokenToKVPool(
        size=physical_size,
        page_size=page_size,
        kv_lora_rank=kv_lora_rank,
        dtype=dtype,
        qk_rope_head_dim=qk_rope_head_dim,
        layer_num=layer_num,
        device="cpu",
        index_head_dim=NSA_INDEX_HEAD_DIM,
        enable_memory_saver=False,
        kv_cache_dim=kv_lora_rank + qk_rope_head_dim,
    )
    allocator = CPSharedPagedTokenToKVPoolAllocator(
        size=cp_size * physical_size,
        page_size=page_size,
        dtype=dtype,
        device="cpu",
        kvcache=kv_pool,
        need_sort=False,
        cp_size=cp_size,
        cp_rank=cp_rank,
    )
    req_to_token_pool = ReqToTokenPool(
        size=max_running_requests,
        max_context_len=max_context_len,
        device="cpu",
        enable_memory_saver=False,
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        is_eagle=is_eagle,
        tp_cache_group=group,
        attn_cp_cache_group=group,
        attn_tp_cache_group=None,
        eviction_policy=eviction_policy,
    )
    server_args = HiCacheServerArgs(
        hicache_ratio=hicache_ratio,
        hicache_mem_layout=host_layout,
        hicache_write_policy=write_policy,
    )
    cache_class = CpHiRadixCache
    if dist.get_world_size(group=group) != cp_size:
        if dist.get_world_size(group=group) != 1:
            raise ValueError(
                f"group has {dist.get_world_size(group=group)} ranks; pass one of cp_size "
                f"({cp_size}) ranks, or a 1-process group to simulate one rank's view"
            )
        cache_class = type(
            f"SimulatedRank{cp_rank}Of{cp_size}CpHiRadixCache",
            (SimulatedRankCpHiRadixCache,),
            {"simulated_cp_rank": cp_rank, "simulated_cp_size": cp_size},
        )
    # The server registers the host-row-width hook with the CP cache (cp_hiradix_cache.register_hooks).
    with unpinned_host_pools(), applied_hooks(nsa_host_kv_row_width.register_hooks):
        cache = cache_class(params, server_args)
    return CpuHiCacheStack(
        cache=cache,
        allocator=allocator,
        kv_pool=kv_pool,
        req_to_token_pool=req_to_token_pool,
        params=params,
        server_args=server_args,
    )


@contextlib.contextmanager
def unpinned_host_pools():
    """Build host pools with ``pin_memory=False``: sglang's NSA assembler leaves the default (True),
    which registers the buffer with CUDA."""
    classes = (memory_pool_host.MLATokenToKVPoolHost, memory_pool_host.NSAIndexerPoolHost)
    originals = {cls: cls.__dict__["__init__"] for cls in classes}

    def unpinned(original):
        def __init__(self, *args, **kwargs):
            kwargs["pin_memory"] = False
            original(self, *args, **kwargs)

        return __init__

    for cls, original in originals.items():
        cls.__init__ = unpinned(original)
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.__init__ = original


# ---- cross-rank checks ----


def tree_signature(cache: CpHiRadixCache) -> list:
    """The rank-independent state of the tree, node by node in a fixed order: key, logical locs (or
    None if evicted), host_len, lock_ref. Must be equal on every rank of a CP group."""
    signature = []
    stack = [(cache.root_node, ())]
    while stack:
        node, path = stack.pop()
        for child_key in sorted(node.children, key=repr):
            child = node.children[child_key]
            child_path = path + (tuple(child.key.token_ids[:2]),)
            signature.append(
                (
                    child_path,
                    len(child.key),
                    None if child.evicted else child.value.tolist(),
                    child.host_len,
                    child.lock_ref,
                )
            )
            stack.append((child, child_path))
    return signature


def owned_host_slots_in_tree(cache: CpHiRadixCache) -> int:
    """Physical host slots the tree's nodes hold on this rank (host pool usage, absent other users)."""
    slots, stack = 0, [cache.root_node]
    while stack:
        node = stack.pop()
        for child in node.children.values():
            if child.cp_hicache is not None:
                slots += child.cp_hicache.num_owned
            stack.append(child)
    return slots


# ---- byte patterns standing in for the owner-filtered KV / indexer writes ----


def write_owned_pattern(stack: CpuHiCacheStack, logical_locs: torch.Tensor, seed: int = 0) -> int:
    """Write, into this rank's physical device rows, a byte pattern keyed by sequence position for
    every position of ``logical_locs`` (a sequence's locs, position 0 first) this rank owns: the KV row
    of each owned token and the indexer page of each owned page. Returns the owned token count."""
    positions, physical = _owned_rows(stack, logical_locs)
    pool = stack.kv_pool
    for layer in range(pool.layer_num):
        kv_rows = _kv_row_bytes(pool, layer)
        kv_rows[physical] = _kv_pattern(positions, layer, kv_rows.shape[1], seed)
        index_pages = pool.index_k_with_scale_buffer[layer]
        page_size = pool.page_size
        index_pages[physical[::page_size] // page_size] = _index_pattern(
            positions[::page_size] // page_size, layer, index_pages.shape[1], seed
        )
    return len(positions)


def count_owned_pattern_mismatches(
    stack: CpuHiCacheStack, logical_locs: torch.Tensor, seed: int = 0
) -> int:
    """Owned KV rows plus owned indexer pages of ``logical_locs`` whose bytes differ from
    ``write_owned_pattern``'s (0: every owned byte is where the layout says it must be)."""
    positions, physical = _owned_rows(stack, logical_locs)
    pool = stack.kv_pool
    page_size = pool.page_size
    mismatches = 0
    for layer in range(pool.layer_num):
        kv_rows = _kv_row_bytes(pool, layer)
        expected = _kv_pattern(positions, layer, kv_rows.shape[1], seed)
        mismatches += int((kv_rows[physical] != expected).any(dim=1).sum())
        index_pages = pool.index_k_with_scale_buffer[layer]
        expected = _index_pattern(positions[::page_size] // page_size, layer, index_pages.shape[1], seed)
        got = index_pages[physical[::page_size] // page_size]
        mismatches += int((got != expected).any(dim=1).sum())
    return mismatches


def clear_device_pool(stack: CpuHiCacheStack) -> None:
    """Zero this rank's device KV and indexer buffers (as if the freed pages had been reused)."""
    for layer in range(stack.kv_pool.layer_num):
        stack.kv_pool.kv_buffer[layer].zero_()
        stack.kv_pool.index_k_with_scale_buffer[layer].zero_()


def _owned_rows(stack: CpuHiCacheStack, logical_locs: torch.Tensor):
    mask = stack.layout.owned_by_this_rank(logical_locs)
    positions = torch.nonzero(mask).flatten()
    return positions, stack.layout.physical_locs_or_dummy(logical_locs[mask])


def _kv_row_bytes(pool: NSATokenToKVPool, layer: int) -> torch.Tensor:
    buffer = pool.kv_buffer[layer]
    return buffer.view(torch.uint8).view(buffer.shape[0], -1)


def _kv_pattern(positions: torch.Tensor, layer: int, width: int, seed: int) -> torch.Tensor:
    byte = torch.arange(width, dtype=torch.int64)
    return ((seed * 131 + positions[:, None] * 7 + layer * 13 + byte) % 251).to(torch.uint8)


def _index_pattern(seq_pages: torch.Tensor, layer: int, width: int, seed: int) -> torch.Tensor:
    byte = torch.arange(width, dtype=torch.int64)
    return ((seed * 17 + seq_pages[:, None] * 29 + layer * 3 + byte) % 253).to(torch.uint8)
