"""Drive sglang's own writers of ``req_to_token`` the way the scheduler does, on a real tree cache.

``SchedulerWrites`` runs the scheduler's steps of a prefill / colocated server on one tree cache
(``ChunkCache``, ``RadixCache`` or ``CpHiRadixCache``) with our allocator: match (and HiCache
load-back, with the adder's locking), ``mem_cache.common.alloc_for_extend`` for a batch (chunked
prefill: any chunk end), ``cache_unfinished_req`` after a chunk or a prefill, ``alloc_for_decode``
steps, ``cache_finished_req`` + slot free. Batches are duck-typed ``ScheduleBatch``es with the
fields those functions read. ``write_cache_indices`` takes its host path (``attention_backend``
``torch_native`` in the global server args it reads): on a GPU server the Triton kernel writes the
same values.

With the mirror hooks applied (``req_to_page_mirror_writers``) and a mirror attached to the
``ReqToTokenPool``, ``mismatches()`` compares the mirror with the device table for every running
request and every tree node's host page ids with its value: the exactness check of the mirror.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import List, Optional
from unittest import mock

import torch

from sglang.srt.mem_cache import common
from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror import mirror_of
from sglang_cp_shared_kv.mem_cache.tree_value_pages import value_pages


@contextlib.contextmanager
def host_write_path():
    """The global server args ``mem_cache.common`` reads: its host write path, page 64, no spec."""
    args = SimpleNamespace(
        attention_backend="torch_native",
        page_size=64,
        speculative_algorithm=None,
        strip_thinking_cache=False,
    )
    with mock.patch.object(common, "get_global_server_args", return_value=args):
        yield


class SchedulerWrites:
    request_class = None  # a SimRequest subclass for admitted requests (default SimRequest)

    def __init__(self, tree, req_to_token_pool, allocator, page_size: int = 64):
        self.tree, self.pool, self.allocator = tree, req_to_token_pool, allocator
        self.page_size = page_size
        self.running: list = []  # SimRequest
        self.next_rid = 0

    @property
    def is_hicache(self) -> bool:
        return hasattr(self.tree, "load_back")

    # ---- scheduler steps ----

    def admit(self, tokens: List[int], extra_key: Optional[str] = None):
        """A new request: match (at most len - 1 tokens, the request's ``extra_key`` namespace, as
        ``Req.init_next_round_input`` does), lock, load back a host hit."""
        from sglang_cp_shared_kv_testing.cp_hicache_simulation_workload import SimRequest

        req = (self.request_class or SimRequest)(self.next_rid, list(tokens), 0, self.pool)
        req.extra_key = extra_key
        self.next_rid += 1
        match = self.tree.match_prefix(
            MatchPrefixParams(key=RadixKey(tokens[: len(tokens) - 1], extra_key), req=req)
        )
        req.prefix_indices = match.device_indices
        req.last_node, req.last_host_node = match.last_device_node, match.last_host_node
        req.host_hit_length = match.host_hit_length or 0
        if req.last_node is not None:
            adder_lock = req.last_node
            self.tree.inc_lock_ref(adder_lock)
            if req.host_hit_length > 0:
                loaded, req.last_node = self.tree.init_load_back(
                    InitLoadBackParams(
                        last_host_node=req.last_host_node,
                        host_hit_length=req.host_hit_length,
                        req=req,
                    )
                )
                req.prefix_indices = torch.cat([req.prefix_indices, loaded])
            self.tree.inc_lock_ref(req.last_node)
            self.tree.dec_lock_ref(adder_lock)
        req.cache_protected_len = len(req.prefix_indices)
        return req

    def extend(self, reqs: list, fill_lens: List[int]) -> torch.Tensor:
        """One extend forward's allocation and ``req_to_token`` write (``alloc_for_extend``)."""
        prefix_lens = [len(r.prefix_indices) for r in reqs]
        extend_lens = [f - p for f, p in zip(fill_lens, prefix_lens)]
        for req, fill_len in zip(reqs, fill_lens):
            req.fill_ids = req.origin_input_ids[:fill_len]
        seq_lens = torch.tensor(fill_lens, dtype=torch.int64)
        batch = SimpleNamespace(
            reqs=reqs,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            extend_num_tokens=sum(extend_lens),
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens.clone(),
            device=self.pool.device,
            req_to_token_pool=self.pool,
            tree_cache=self.tree,
            token_to_kv_pool_allocator=self.allocator,
            maybe_evict_swa=lambda: None,
        )
        with host_write_path():
            out_cache_loc, _, _ = common.alloc_for_extend(batch)
        for req, fill_len in zip(reqs, fill_lens):
            req.kv_allocated_len = req.kv_committed_len = fill_len
            req.is_chunked = int(fill_len < len(req.origin_input_ids))
            if req not in self.running:
                self.running.append(req)
        return out_cache_loc

    def after_extend(self, req) -> None:
        """What the scheduler does with a request after its extend: cache the chunk or the prompt."""
        if req.is_chunked:
            self.tree.cache_unfinished_req(req, chunked=True)
        else:
            self.tree.cache_unfinished_req(req)

    def decode(self, reqs: Optional[list] = None, token: int = 7) -> torch.Tensor:
        """One decode step's allocation and write (``alloc_for_decode``)."""
        reqs = [r for r in self.running if not r.is_chunked] if reqs is None else reqs
        seq_lens = torch.tensor([r.kv_allocated_len for r in reqs], dtype=torch.int64)
        batch = SimpleNamespace(
            reqs=reqs,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens.clone(),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64),
            req_to_token_pool=self.pool,
            tree_cache=self.tree,
            token_to_kv_pool_allocator=self.allocator,
            model_config=SimpleNamespace(is_encoder_decoder=False),
            maybe_evict_swa=lambda: None,
        )
        with host_write_path():
            locs = common.alloc_for_decode(batch, token_per_req=1)
        for req in reqs:
            req.output_ids.append(token)
            req.kv_allocated_len += 1
            req.kv_committed_len += 1
        return locs

    def finish(self, req) -> None:
        self.tree.cache_finished_req(req)
        self.pool.free(req)
        self.running.remove(req)

    # ---- the exactness check ----

    def mismatches(self) -> List[str]:
        """Mirror rows vs ``req_to_token`` for every running request; node page ids vs values."""
        return mirror_mismatches(self.tree, self.pool, self.running, self.page_size)


def mirrored_cp_stack(
    cache_class, physical_pages: int = 40, cp_size: int = 2, page_size: int = 64, is_eagle: bool = False
) -> SchedulerWrites:
    """Rank 0 of a CP group on CPU: a tiny NSA pool of ``physical_pages``, the shared allocator over
    ``cp_size`` x its pages, ``req_to_token`` with its host mirror, and a ``cache_class`` tree.

    ``is_eagle``: the tree keys its children by token bigrams, as the scheduler builds it for
    ``--speculative-algorithm EAGLE / NEXTN``."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from sglang_cp_shared_kv.mem_cache.allocator import CPSharedPagedTokenToKVPoolAllocator
    from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
    from sglang_cp_shared_kv.mem_cache.req_to_page_mirror import ReqToPageMirror
    from sglang_cp_shared_kv_testing.cp_hicache_stack import TINY_NSA, nsa_pool

    pool = nsa_pool(TINY_NSA, physical_pages * page_size, "cpu")
    allocator = CPSharedPagedTokenToKVPoolAllocator(
        cp_size * pool.size, page_size, TINY_NSA.dtype, "cpu", pool, False,
        CpSharedKVLayout(cp_size, 0, page_size),
    )
    req_to_token_pool = ReqToTokenPool(8, 2048, "cpu", False)
    ReqToPageMirror.attach(req_to_token_pool, page_size)
    params = CacheInitParams(
        disable=False, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=allocator,
        page_size=page_size, is_eagle=is_eagle,
    )  # fmt: skip
    return SchedulerWrites(cache_class(params), req_to_token_pool, allocator, page_size)


def mirror_mismatches(tree, req_to_token_pool, running, page_size: int) -> List[str]:
    """The mirror's exactness: every running request's mirrored pages against ``req_to_token`` (every
    position below ``kv_allocated_len``), and every device node's host page ids against its value."""
    mirror = mirror_of(req_to_token_pool)
    problems = mirror.mismatches(
        req_to_token_pool.req_to_token,
        [r.req_pool_idx for r in running],
        [r.kv_allocated_len for r in running],
    )
    root = getattr(tree, "root_node", None)
    stack = list(root.children.values()) if root is not None else []
    while stack:
        node = stack.pop()
        stack += node.children.values()
        if node.value is None:
            continue
        pages = value_pages(node)
        expected = (node.value[::page_size] // page_size).tolist()
        if pages is None or pages.tolist() != expected:
            problems.append(f"node {node.id}: host pages {pages} for value pages {expected}")
    return problems
