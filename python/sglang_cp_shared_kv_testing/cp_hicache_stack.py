"""Build one rank's real CP HiCache stack, on the CPU or on CUDA: the one builder of every test, the
simulation, the GPU checks and the benchmarks.

``build_cp_hicache_stack`` returns sglang's real ``NSATokenToKVPool`` shard of ``physical_pages`` pages,
our ``CPSharedPagedTokenToKVPoolAllocator`` over ``cp_size`` x that, a real ``ReqToTokenPool``,
``CacheInitParams``, a minimal server-args object and a real ``CpHiRadixCache``, whose constructor runs
sglang's NSA assembler (KV + indexer host pools, ``HybridCacheController``) and adopts the controller as
our ``CpHybridCacheController``, with the host-row-width hook applied as on the server.
``build_stock_hicache_stack`` builds the same pool holding every token with sglang's own allocator and
``HiRadixCache``: what stock CP keeps on each rank (a full replica), for comparisons and the GPU smoke.
With ``draft_layers`` either also builds an MTP draft pool (the target's rows, that many layers) and
registers it with HiCache through sglang's own ``Scheduler._maybe_register_hicache_draft``
(``register_draft_pool``; the CP stack with the plugin's hook, as on a shared-KV server);
``HiCacheStack.draft_view()`` points the byte-pattern helpers at it.

Pools: ``TINY_NSA`` (small latent dims, the real 128-dim indexer; unit tests and the simulation) or
``glm5_nsa(kv_format, layers)`` (GLM-5 / DeepSeek-V3.2 rows: bf16 576 values, fp8 656 bytes).

Devices: on CUDA host pools are pinned and registered as the server does; registered host memory must
never be freed and reallocated in one process (``cudaErrorHostMemoryAlreadyRegistered``), so CUDA stacks
are kept alive until the process ends. On the CPU the host pools are plain, the ``sgl_kernel`` CPU shim
is installed, and only the io backend "direct" with host layout "layer_first" transfers (the shim's only
kernel); CUDA streams and events run through ``torch.cpu``'s no-op types.

Ranks: pass the gloo group of the CP ranks as ``group`` (size ``cp_size``; ``multi_rank.run_ranks``) and
the agreement all-reduces run for real. Or pass a one-process group (``multi_rank.single_process_group``)
to build any rank's view in one process: the cache then takes its CP rank from ``cp_rank``
(``SimulatedRankCpHiRadixCache`` overrides only ``_attn_cp_rank_and_size``) and all-reduces over one
process are the identity. Feed every view the same calls. ``TreeNode.counter`` is process-global and
every cache construction resets it: in one process, build all views before driving any of them.

Helpers: cross-rank checks (``tree_signature``, ``owned_host_slots_in_tree``) and byte patterns standing
in for the owner-filtered writes (``SequenceBytes``: random KV rows per token and indexer pages per page
of a sequence, drawn from a seed so every rank draws the same bytes and writes and checks its own part).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from sglang_cp_shared_kv_testing import sgl_kernel_cpu_shim

sgl_kernel_cpu_shim.install()  # a no-op where the real sgl_kernel loads (GPU machines)

from sglang.srt.mem_cache import memory_pool_host  # noqa: E402
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool, ReqToTokenPool  # noqa: E402

from sglang_cp_shared_kv.mem_cache import nsa_host_kv_row_width  # noqa: E402
from sglang_cp_shared_kv.mem_cache.allocator import (  # noqa: E402
    CPSharedPagedTokenToKVPoolAllocator,
)
from sglang_cp_shared_kv.mem_cache.cp_hiradix_cache import CpHiRadixCache  # noqa: E402
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout  # noqa: E402
from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks  # noqa: E402

# NSATokenToKVPool requires page_size 64 and index_head_dim 128 (outside ROCm).
NSA_PAGE_SIZE = 64
NSA_INDEX_HEAD_DIM = 128
# Host layouts sglang 0.5.11 supports for NSA, per io backend.
HOST_LAYOUTS = {"kernel": ("layer_first", "page_first"), "direct": ("layer_first", "page_first_direct")}


@dataclass(frozen=True)
class NsaPoolShape:
    """Row format and depth of an ``NSATokenToKVPool``."""

    dtype: torch.dtype = torch.bfloat16
    kv_lora_rank: int = 16
    qk_rope_head_dim: int = 8
    kv_cache_dim: Optional[int] = None  # bytes-or-values per row as the pool counts it; None: the sum
    layer_num: int = 2


TINY_NSA = NsaPoolShape()
# GLM-5 / DeepSeek-V3.2 NSA latent rows: bf16 576 values (1152 B); fp8 512 fp8 nope + 16 B scales +
# 64 bf16 rope = 656 B.
KV_FORMATS = {"bf16": (torch.bfloat16, 576), "fp8": (torch.float8_e4m3fn, 656)}


def glm5_nsa(kv_format: str, layer_num: int) -> NsaPoolShape:
    dtype, kv_cache_dim = KV_FORMATS[kv_format]
    return NsaPoolShape(dtype, 512, 64, kv_cache_dim, layer_num)


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
    served_model_name: str = "cp-hicache-stack"
    extra_metric_labels: Optional[Dict[str, str]] = None
    enable_nsa_prefill_cp_shared_kv: bool = True


@dataclass
class HiCacheStack:
    """One rank's stack. ``layout`` is ``None`` for the stock stack (every loc is a physical row)."""

    cache: HiRadixCache
    allocator: PagedTokenToKVPoolAllocator
    kv_pool: NSATokenToKVPool  # this rank's device pool (a shard under CP)
    req_to_token_pool: ReqToTokenPool
    params: CacheInitParams
    server_args: HiCacheServerArgs = field(repr=False)
    draft_pool: Optional[NSATokenToKVPool] = None  # the MTP draft's pool, registered with HiCache

    def draft_view(self) -> "HiCacheStack":
        """This stack with the draft pool as its ``kv_pool``: the byte-pattern helpers then write and
        check the draft's KV rows and indexer pages (at the same logical locs, on the same owners)."""
        if self.draft_pool is None:
            raise ValueError("this stack has no draft pool (build it with draft_layers > 0)")
        return dataclasses.replace(self, kv_pool=self.draft_pool, draft_pool=None)

    @property
    def layout(self) -> Optional[CpSharedKVLayout]:
        return getattr(self.allocator, "layout", None)

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

    def index_page_bytes(self) -> int:
        """Bytes of one indexer page (every token's K values and scales), as the pool holds it."""
        return self.kv_pool.index_k_with_scale_buffer[0].shape[1]

    def owned_rows(self, logical_locs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(positions of ``logical_locs`` this rank owns, their physical device rows)."""
        if self.layout is None:
            return torch.arange(len(logical_locs), device=logical_locs.device), logical_locs
        mask = self.layout.owned_by_this_rank(logical_locs)
        positions = torch.nonzero(mask).flatten()
        return positions, self.layout.physical_locs_or_dummy(logical_locs[mask])


class SimulatedRankCpHiRadixCache(CpHiRadixCache):
    """``CpHiRadixCache`` seeing itself as ``simulated_cp_rank`` of ``simulated_cp_size`` although its
    group has one process (see module docstring). Set the two class attributes on a subclass."""

    simulated_cp_rank: int = 0
    simulated_cp_size: int = 1

    def _attn_cp_rank_and_size(self, params):
        return self.simulated_cp_rank, self.simulated_cp_size


_KEEP_ALIVE: list = []  # CUDA stacks: their registered host memory must never be freed


def build_cp_hicache_stack(
    *,
    cp_size: int,
    cp_rank: int,
    group: dist.ProcessGroup,
    physical_pages: int,
    device: str = "cpu",
    shape: NsaPoolShape = TINY_NSA,
    io_backend: str = "direct",
    host_layout: str = "layer_first",
    write_policy: str = "write_through",
    hicache_ratio: float = 2.0,
    eviction_policy: str = "lru",
    is_eagle: bool = False,
    max_running_requests: int = 8,
    max_context_len: int = 4096,
    draft_layers: int = 0,
    storage_backend: Optional[str] = None,
    storage_extra_config: Optional[str] = None,
) -> HiCacheStack:
    """One rank's CP shared-KV stack; ``physical_pages`` real pages per rank (plus the dummy page 0).

    ``draft_layers`` > 0: an MTP draft pool of that many layers (NextN: 1), the target's shard size
    and rows, registered with HiCache as the scheduler does it (``register_draft_pool``).
    ``is_eagle``: the tree keyed by token bigrams, as the scheduler builds it for an MTP server
    (``--speculative-algorithm EAGLE / NEXTN``); stories through the scheduler's entry points that
    stand for an MTP server pass it (the simulation's ``eagle_keys``).
    ``storage_backend`` (``file`` / ``mooncake``, with ``storage_extra_config`` JSON): the L3 tier
    (``--hicache-storage-backend`` / ``--hicache-storage-backend-extra-config``)."""
    pool = nsa_pool(shape, physical_pages * NSA_PAGE_SIZE, device)
    allocator = CPSharedPagedTokenToKVPoolAllocator(
        size=cp_size * pool.size,
        page_size=NSA_PAGE_SIZE,
        dtype=shape.dtype,
        device=device,
        kvcache=pool,
        need_sort=False,
        layout=CpSharedKVLayout(cp_size, cp_rank, NSA_PAGE_SIZE),
    )
    cache_class = CpHiRadixCache
    group_size = dist.get_world_size(group=group)
    if group_size != cp_size:
        if group_size != 1:
            raise ValueError(
                f"group has {group_size} ranks; pass one of cp_size ({cp_size}) ranks, or a "
                "1-process group to simulate one rank's view"
            )
        cache_class = type(
            f"SimulatedRank{cp_rank}Of{cp_size}CpHiRadixCache",
            (SimulatedRankCpHiRadixCache,),
            {"simulated_cp_rank": cp_rank, "simulated_cp_size": cp_size},
        )
    # As on the server, the CP cache comes with the hook that sizes KV host rows like device rows.
    with applied_hooks(nsa_host_kv_row_width.register_hooks):
        stack = _build(
            cache_class, allocator, pool, group, device, io_backend, host_layout, write_policy,
            hicache_ratio, eviction_policy, is_eagle, max_running_requests, max_context_len,
            storage_backend, storage_extra_config,
        )  # fmt: skip
    if draft_layers:
        draft_shape = dataclasses.replace(shape, layer_num=draft_layers)
        register_draft_pool(stack, nsa_pool(draft_shape, pool.size, device))
    return stack


def build_stock_hicache_stack(
    *,
    pages: int,
    group: dist.ProcessGroup,
    device: str = "cpu",
    shape: NsaPoolShape = TINY_NSA,
    io_backend: str = "direct",
    host_layout: str = "layer_first",
    write_policy: str = "write_through",
    hicache_ratio: float = 2.0,
    eviction_policy: str = "lru",
    max_running_requests: int = 8,
    max_context_len: int = 4096,
    draft_layers: int = 0,
) -> HiCacheStack:
    """Stock sglang 0.5.11: a pool of ``pages`` pages holding every token, its allocator, HiRadixCache
    (and with ``draft_layers`` a draft pool registered by stock's scheduler code)."""
    pool = nsa_pool(shape, pages * NSA_PAGE_SIZE, device)
    allocator = PagedTokenToKVPoolAllocator(
        pool.size, NSA_PAGE_SIZE, shape.dtype, device, kvcache=pool, need_sort=False
    )
    stack = _build(
        HiRadixCache, allocator, pool, group, device, io_backend, host_layout, write_policy,
        hicache_ratio, eviction_policy, False, max_running_requests, max_context_len,
    )  # fmt: skip
    if draft_layers:
        register_draft_pool(
            stack, nsa_pool(dataclasses.replace(shape, layer_num=draft_layers), pool.size, device),
            with_plugin_hooks=False,
        )  # fmt: skip
    return stack


def draft_load_one_page_off(load, page_size: int):
    """A planted bug for the checks: ``load`` (a draft host group's ``load_to_device_per_layer``)
    wrapped so that the first restored page of every load lands one physical page further on."""
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer

    def one_page_off(device_pool, host_indices, device_indices, layer_id, io_backend, pool_transfers=None):
        if host_indices.numel():
            device_indices = device_indices.clone()
            device_indices[:page_size] += page_size
            pool_transfers = [
                PoolTransfer(name=t.name, host_indices=t.host_indices, device_indices=device_indices)
                for t in pool_transfers or []
            ]
        return load(device_pool, host_indices, device_indices, layer_id, io_backend, pool_transfers)

    return one_page_off


def register_draft_pool(
    stack: HiCacheStack, draft_pool: NSATokenToKVPool, with_plugin_hooks: bool = True
) -> None:
    """Register ``draft_pool`` with the stack's HiCache through sglang's own
    ``Scheduler._maybe_register_hicache_draft`` (called on a stand-in scheduler holding what it reads),
    with our AROUND hook applied (``with_plugin_hooks``) as on a shared-KV server, or stock's alone."""
    from sglang.srt.managers.scheduler import Scheduler

    from sglang_cp_shared_kv.managers import cp_hicache_draft_pool

    scheduler = types.SimpleNamespace(
        enable_hierarchical_cache=True,
        tree_cache=stack.cache,
        page_size=NSA_PAGE_SIZE,
        server_args=stack.server_args,
        _get_draft_kv_pool=lambda: (draft_pool, None),
    )
    hooks = [cp_hicache_draft_pool.register_hooks] if with_plugin_hooks else []
    host_pools = unpinned_host_pools() if draft_pool.device == "cpu" else contextlib.nullcontext()
    with applied_hooks(*hooks), host_pools:
        # Looked up inside the block: the hook patches the class attribute.
        Scheduler._maybe_register_hicache_draft(scheduler)
    stack.draft_pool = draft_pool


def nsa_pool(shape: NsaPoolShape, physical_tokens: int, device: str) -> NSATokenToKVPool:
    return NSATokenToKVPool(
        size=physical_tokens,
        page_size=NSA_PAGE_SIZE,
        kv_lora_rank=shape.kv_lora_rank,
        dtype=shape.dtype,
        qk_rope_head_dim=shape.qk_rope_head_dim,
        layer_num=shape.layer_num,
        device=device,
        index_head_dim=NSA_INDEX_HEAD_DIM,
        enable_memory_saver=False,
        kv_cache_dim=shape.kv_cache_dim or shape.kv_lora_rank + shape.qk_rope_head_dim,
    )


def _build(
    cache_class, allocator, pool, group, device, io_backend, host_layout, write_policy,
    hicache_ratio, eviction_policy, is_eagle, max_running_requests, max_context_len,
    storage_backend=None, storage_extra_config=None,
) -> HiCacheStack:  # fmt: skip
    req_to_token_pool = ReqToTokenPool(
        size=max_running_requests,
        max_context_len=max_context_len,
        device=device,
        enable_memory_saver=False,
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=NSA_PAGE_SIZE,
        is_eagle=is_eagle,
        tp_cache_group=group,
        attn_cp_cache_group=group,
        attn_tp_cache_group=None,
        eviction_policy=eviction_policy,
    )
    server_args = HiCacheServerArgs(
        hicache_ratio=hicache_ratio,
        hicache_mem_layout=host_layout,
        hicache_io_backend=io_backend,
        hicache_write_policy=write_policy,
        hicache_storage_backend=storage_backend,
        hicache_storage_backend_extra_config=storage_extra_config,
    )
    # On the CPU there is no CUDA to register pinned host memory with.
    with unpinned_host_pools() if device == "cpu" else contextlib.nullcontext():
        cache = cache_class(params, server_args)
    stack = HiCacheStack(
        cache=cache,
        allocator=allocator,
        kv_pool=pool,
        req_to_token_pool=req_to_token_pool,
        params=params,
        server_args=server_args,
    )
    if device != "cpu":
        _KEEP_ALIVE.append(stack)
    return stack


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


@contextlib.contextmanager
def host_rows_as_wide_as_device_rows():
    """Build KV host pools whose rows are as wide as the device rows, for a stack without our hook.

    sglang 0.5.11's NSA assembler builds the KV host pool without ``override_kv_cache_dim``: with fp8 KV
    its host rows are 576 B for 656 B device rows, and every KV row comes back corrupted (see
    docs/cp-hicache.md). The CP stack gets the fix from ``nsa_host_kv_row_width`` as on the server; the stock
    stack gets it here when a comparison needs correct rows on both sides.
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


class SequenceBytes:
    """Random KV rows (one per token) and indexer pages (one per page) of one sequence, per layer.

    Drawn on the CPU from ``seed``: every rank of a group draws the same bytes and keeps its own part.
    Row and page widths are the stack's own (``kv_row_bytes``, ``index_page_bytes``).
    """

    def __init__(self, stack: HiCacheStack, num_tokens: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        layers = stack.kv_pool.layer_num
        self.kv = torch.randint(
            0, 256, (layers, num_tokens, stack.kv_row_bytes()), dtype=torch.uint8, generator=generator
        )
        self.index = torch.randint(
            0,
            256,
            (layers, num_tokens // NSA_PAGE_SIZE, stack.index_page_bytes()),
            dtype=torch.uint8,
            generator=generator,
        )

    def write_owned(self, stack: HiCacheStack, logical_locs: torch.Tensor) -> int:
        """Write this rank's positions of the sequence (at ``logical_locs``) into its device rows: the
        KV row of each owned token, the indexer page of each owned page. Returns the owned tokens."""
        positions, rows = stack.owned_rows(logical_locs)
        positions = positions.cpu()
        pool = stack.kv_pool
        for layer in range(pool.layer_num):
            _kv_rows(pool, layer)[rows] = self.kv[layer][positions].to(rows.device)
            pages = rows[::NSA_PAGE_SIZE] // NSA_PAGE_SIZE
            seq_pages = positions[::NSA_PAGE_SIZE] // NSA_PAGE_SIZE
            pool.index_k_with_scale_buffer[layer][pages] = self.index[layer][seq_pages].to(rows.device)
        return len(positions)

    def owned_mismatches(self, stack: HiCacheStack, logical_locs: torch.Tensor) -> Tuple[int, int]:
        """(owned KV rows, owned indexer pages) whose bytes differ from the sequence's, over layers
        (0, 0: every owned byte is where the layout says it must be)."""
        positions, rows = stack.owned_rows(logical_locs)
        positions = positions.cpu()
        pool = stack.kv_pool
        kv_bad = index_bad = 0
        for layer in range(pool.layer_num):
            got = _kv_rows(pool, layer)[rows].cpu()
            kv_bad += int((got != self.kv[layer][positions]).any(dim=1).sum())
            got = pool.index_k_with_scale_buffer[layer][rows[::NSA_PAGE_SIZE] // NSA_PAGE_SIZE].cpu()
            expected = self.index[layer][positions[::NSA_PAGE_SIZE] // NSA_PAGE_SIZE]
            index_bad += int((got != expected).any(dim=1).sum())
        return kv_bad, index_bad


def write_owned_pattern(stack: HiCacheStack, logical_locs: torch.Tensor, seed: int = 0) -> int:
    """``SequenceBytes(seed)`` of a sequence at ``logical_locs``, this rank's part written."""
    return SequenceBytes(stack, len(logical_locs), seed).write_owned(stack, logical_locs)


def count_owned_pattern_mismatches(
    stack: HiCacheStack, logical_locs: torch.Tensor, seed: int = 0
) -> int:
    """Owned KV rows plus owned indexer pages of ``logical_locs`` that differ from what
    ``write_owned_pattern`` wrote with ``seed`` for a sequence of the same length."""
    return sum(SequenceBytes(stack, len(logical_locs), seed).owned_mismatches(stack, logical_locs))


def host_page_pattern(host_pool, page: int, salt: int) -> torch.Tensor:
    """Page ``page``'s bytes in ``host_pool``'s flat page format (what storage holds of one page),
    drawn from ``page`` and ``salt`` alone: the same for every rank and every process. Tests of L3
    storage write it into a host pool directly (the CPU shim has no device <-> host copy for the
    page-first layouts Mooncake needs)."""
    like = host_pool.get_dummy_flat_data_page()
    generator = torch.Generator().manual_seed(1000 * salt + page)
    raw = torch.randint(0, 256, (like.numel() * like.element_size(),), dtype=torch.uint8, generator=generator)
    return raw.view(like.dtype).view(like.shape)


def host_page_bytes(host_pool, slot: int) -> torch.Tensor:
    """The flat page of ``host_pool`` at host ``slot`` (its first slot), as bytes."""
    return host_pool.get_data_page(slot, flat=True).contiguous().view(torch.uint8).reshape(-1)


def clear_device_pool(stack: HiCacheStack, kv_byte: int = 0, index_byte: int = 0) -> None:
    """Overwrite this rank's device KV rows and indexer pages (as if freed pages had been reused)."""
    for layer in range(stack.kv_pool.layer_num):
        _kv_rows(stack.kv_pool, layer).fill_(kv_byte)
        stack.kv_pool.index_k_with_scale_buffer[layer].fill_(index_byte)


def _kv_rows(pool: NSATokenToKVPool, layer: int) -> torch.Tensor:
    buffer = pool.kv_buffer[layer]
    return buffer.view(torch.uint8).view(buffer.shape[0], -1)


def settle_write_acks(cache, max_checks: int = 4) -> None:
    """``writing_check`` until no write is in flight. Stock applies the acks a check agreed on at that
    check; CpHiRadixCache at the next one (non-blocking acks), so tests and benchmarks that need every
    finished write acknowledged call this instead of one ``writing_check``. The number of checks depends
    only on the tree, so every rank makes the same ones."""
    for _ in range(max_checks):
        cache.writing_check()
        if not cache.ongoing_write_through:
            return
    raise AssertionError(f"{len(cache.ongoing_write_through)} writes still in flight after {max_checks} checks")
