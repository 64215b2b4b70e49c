"""One rank of an end-to-end check of the CP shared KV runtime against a replicated pool.

Every rank of a CP group (processes joined by a ``torch.distributed`` group) runs ``run_rank`` with
the same seed. It builds this rank's ``NSATokenToKVPool`` shard with a ``CpSharedKVRuntime`` and a
replicated pool of the full logical size that no runtime serves, then replays three forwards of a
small serving story through sglang's own store methods with our hooks applied (``apply_hooks``):

1. EXTEND of two fresh requests (every page is new: nothing to gather);
2. EXTEND of a request whose first page is a cached prefix of another, plus the second chunk of a
   request whose first chunk ended mid-page (old, new and mixed pages), with padded tokens;
3. DECODE of the three requests (one opens a new page) plus a padded request (req_to_token row 0).

After each layer's stores it compares, bit for bit, what the kernels would read (the remapped
``NSAMetadata`` tables into the getters' buffers) with the replicated pool, and at the end this
rank's physical rows with the replicated rows of the logical locs they hold. Used by the gloo
unit test and ``scripts/gpu/check_cp_shared_kv_runtime.py``.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist

from sglang.srt.layers.attention.nsa.nsa_indexer import Indexer
from sglang.srt.layers.attention.nsa_backend import NSAMetadata
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror import ReqToPageMirror
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror_writers import ROWS_ATTR
from sglang_cp_shared_kv.model_executor import owner_filtered_writes, peer_page_reads
from sglang_cp_shared_kv.model_executor import sync_debug as sync_debug_exemptions
from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import CpSharedKVRuntime
from sglang_cp_shared_kv.model_executor.gather_scratch import create_gather_scratch
from sglang_cp_shared_kv.testing.cuda_sync_counter import CudaSyncCounter
from sglang_cp_shared_kv.testing.nsa_cpu_kernels import IndexerStub, get_k_and_s_torch

PAGE_SIZE = 64
KV_DIMS = {"bf16": (torch.bfloat16, 576), "fp8": (torch.float8_e4m3fn, 656)}


@dataclass
class RankResult:
    rows_compared: int = 0
    mismatches: int = 0
    # With sync_debug: synchronizing CUDA calls during the forwards, by owner (CudaSyncCounter), and
    # where; the gloo bounces exempted (sync_debug.exempted).
    syncs: Optional[dict] = None
    sync_sites: List[str] = field(default_factory=list)
    exempted_bounces: int = 0

    def compare(self, actual: torch.Tensor, expected: torch.Tensor) -> None:
        """Row-wise bit comparison (dim 0 = rows)."""
        actual = actual.contiguous().view(torch.uint8).reshape(actual.shape[0], -1)
        expected = expected.contiguous().view(torch.uint8).reshape(expected.shape[0], -1)
        self.rows_compared += actual.shape[0]
        self.mismatches += int((actual != expected).any(dim=1).sum())


def apply_hooks() -> None:
    """Patch sglang with our write and read hooks (process-wide: call in a dedicated process).

    Registrations inherited from a forked parent are dropped first, so only these hooks apply.
    """
    HookRegistry.reset()
    owner_filtered_writes.register_hooks(HookRegistry)
    peer_page_reads.register_hooks(HookRegistry)
    HookRegistry.apply_hooks()


class _Story:
    """Requests, their logical pages (as the shared allocator would hand them out) and forwards."""

    def __init__(self, layout: CpSharedKVLayout, physical_pages: int, rng: random.Random, device):
        self.layout = layout
        # Allocatable logical pages: cp_size .. cp_size*(physical_pages+1)-1 (pages below are dummy).
        self.free_pages = list(range(layout.cp_size, layout.cp_size * (physical_pages + 1)))
        rng.shuffle(self.free_pages)
        self.req_to_token_pool = SimpleNamespace(
            req_to_token=torch.zeros((4, 512), dtype=torch.int32, device=device)
        )
        self.req_to_token = self.req_to_token_pool.req_to_token
        # The plan's host mirror, fed from host data as the server's writers feed it.
        self.mirror = ReqToPageMirror.attach(self.req_to_token_pool, PAGE_SIZE)
        self.seq_lens = [0, 0, 0, 0]  # row 0 is sglang's padding row

    def append(self, req: int, num_tokens: int) -> list:
        """Allocate ``num_tokens`` new logical locs for ``req`` (page-aligned positions)."""
        locs = []
        for position in range(self.seq_lens[req], self.seq_lens[req] + num_tokens):
            if position % PAGE_SIZE == 0:
                page = self.free_pages.pop()
                self.mirror.write(req, position // PAGE_SIZE, [page])
            else:
                page = int(self.mirror.pages[req, position // PAGE_SIZE])
            locs.append(page * PAGE_SIZE + position % PAGE_SIZE)
        start = self.seq_lens[req]
        self.req_to_token[req, start : start + num_tokens] = torch.tensor(locs, dtype=torch.int32)
        self.seq_lens[req] += num_tokens
        return locs

    def share_prefix(self, dst: int, src: int, num_tokens: int) -> None:
        self.req_to_token[dst, :num_tokens] = self.req_to_token[src, :num_tokens]
        pages = -(-num_tokens // PAGE_SIZE)
        self.mirror.write(dst, 0, self.mirror.pages[src, :pages].copy())
        self.seq_lens[dst] = num_tokens


def _forward_batch(story, mode, reqs, new_counts, out_locs, pool, device):
    return SimpleNamespace(
        forward_mode=mode,
        seq_lens_cpu=torch.tensor([story.seq_lens[r] if r else 1 for r in reqs]),
        extend_seq_lens_cpu=list(new_counts),
        req_pool_indices=torch.tensor(reqs, dtype=torch.int64, device=device),
        req_to_token_pool=story.req_to_token_pool,
        **{ROWS_ATTR: np.array(reqs, dtype=np.int64)},
        out_cache_loc=torch.tensor(out_locs, dtype=torch.int64, device=device),
        token_to_kv_pool=pool,
    )


def nsa_metadata_for(page_table_1: torch.Tensor) -> NSAMetadata:
    """A real ``NSAMetadata`` whose index tables come from ``page_table_1``; other fields are dummies."""
    unused = torch.zeros(1, dtype=torch.int32, device=page_table_1.device)
    return NSAMetadata(
        page_size=PAGE_SIZE,
        cache_seqlens_int32=unused,
        max_seq_len_q=1,
        max_seq_len_k=page_table_1.shape[1],
        cu_seqlens_q=unused,
        cu_seqlens_k=unused,
        page_table_1=page_table_1,
        real_page_table=page_table_1[:, ::PAGE_SIZE] // PAGE_SIZE,
        nsa_cache_seqlens_int32=unused,
        nsa_cu_seqlens_q=unused,
        nsa_cu_seqlens_k=unused,
        nsa_extend_seq_lens_list=[],
        nsa_seqlens_expanded=unused,
    )


def make_nsa_pool(size, dtype_name, num_layers, device) -> NSATokenToKVPool:
    dtype, kv_cache_dim = KV_DIMS[dtype_name]
    return NSATokenToKVPool(
        size=size,
        page_size=PAGE_SIZE,
        kv_lora_rank=512,
        dtype=dtype,
        qk_rope_head_dim=64,
        layer_num=num_layers,
        device=device,
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=kv_cache_dim,
    )


def run_rank(
    cp_rank: int,
    cp_size: int,
    group: dist.ProcessGroup,
    *,
    device: str,
    dtype_name: str,
    act_quant,
    seed: int = 0,
    num_layers: int = 2,
    physical_pages: int = 6,
    sync_debug: bool = False,
) -> RankResult:
    """Run the story on this rank (hooks must be applied); return what was compared.

    ``sync_debug``: each forward's part on this rank's shard (the plan and table remap, every layer's
    hooked stores, the hooked getters' reads) runs inside a ``CudaSyncCounter``; inputs are made
    before it, the replica's stores and every comparison after it.
    """
    layout = CpSharedKVLayout(cp_size, cp_rank, PAGE_SIZE)
    shard = make_nsa_pool(physical_pages * PAGE_SIZE, dtype_name, num_layers, device)
    # Logical page ids reach cp_size * (physical_pages + 1) - 1 (ids below cp_size are dummies),
    # so the replica needs that many pages of rows.
    replica_pages = cp_size * (physical_pages + 1)
    replica = make_nsa_pool((replica_pages - 1) * PAGE_SIZE, dtype_name, num_layers, device)
    CpSharedKVRuntime(shard, layout, create_gather_scratch(shard, cp_size), group)
    rng = random.Random(seed)
    data = torch.Generator().manual_seed(seed)
    story = _Story(layout, physical_pages, rng, device)
    result = RankResult()
    backend = SimpleNamespace(forward_metadata=None)
    indexer = IndexerStub()

    counter = CudaSyncCounter()
    exempted_before = sync_debug_exemptions.exempted

    def run_forward(mode, reqs, new_counts, out_locs):
        batch = _forward_batch(story, mode, reqs, new_counts, out_locs, shard, device)
        replica_batch = _forward_batch(story, mode, reqs, new_counts, out_locs, replica, device)
        seq_lens = batch.seq_lens_cpu.tolist()
        logical_table = story.req_to_token[batch.req_pool_indices, : max(seq_lens)]
        backend.forward_metadata = nsa_metadata_for(logical_table)
        num_tokens = len(out_locs)
        inputs = [
            tuple(
                torch.randn(*shape, generator=data).to(torch.bfloat16).to(device)
                for shape in ((num_tokens, 1, 512), (num_tokens, 1, 64), (num_tokens, 128))
            )
            for _ in range(num_layers)
        ]
        # Padded requests (req_to_token row 0) read the dummy page, as in stock sglang: not compared.
        rows = [row for row, req in enumerate(reqs) if req != 0]
        reads = _Reads(rows, [seq_lens[row] for row in rows], logical_table)
        shard_reads = []
        with counter if sync_debug else contextlib.nullcontext():
            peer_page_reads.remap_forward_metadata(None, backend, batch)
            metadata = backend.forward_metadata
            for layer_id, (nope, rope, key) in enumerate(inputs):
                _store(batch, layer_id, nope, rope, key, indexer, act_quant)
                shard_reads.append(reads.of_scratch(shard, layer_id, metadata))
        for layer_id, (nope, rope, key) in enumerate(inputs):
            _store(replica_batch, layer_id, nope, rope, key, indexer, act_quant)
            reads.compare(shard, replica, layer_id, metadata, shard_reads[layer_id], result)

    # 1. Two fresh requests.
    run_forward(ForwardMode.EXTEND, [1, 2], [70, 128], story.append(1, 70) + story.append(2, 128))
    # 2. Request 3 hits request 1's first page as cached prefix; request 1's second chunk starts
    #    mid-page; three padded tokens (loc 0).
    story.share_prefix(3, 1, PAGE_SIZE)
    out_locs = story.append(1, 40) + story.append(3, 50) + [0, 0, 0]
    run_forward(ForwardMode.EXTEND, [1, 3], [40, 50], out_locs)
    # 3. Decode; request 2 opens a new page; one padded request (row 0).
    out_locs = story.append(1, 1) + story.append(2, 1) + story.append(3, 1) + [0]
    run_forward(ForwardMode.DECODE, [1, 2, 3, 0], [1, 1, 1, 1], out_locs)

    _check_shard(layout, shard, replica, num_layers, result)
    if sync_debug:
        result.syncs = counter.counts() if counter.available else None
        result.sync_sites = [f"{owner}: {site}" for owner, site in counter.sites]
        result.exempted_bounces = sync_debug_exemptions.exempted - exempted_before
    return result


def _store(pool_batch, layer_id, nope, rope, key, indexer, act_quant) -> None:
    """One layer's two stores, through sglang's own methods (hooked for the shard)."""
    pool = pool_batch.token_to_kv_pool
    pool.set_mla_kv_buffer(SimpleNamespace(layer_id=layer_id), pool_batch.out_cache_loc, nope, rope)
    Indexer._store_index_k_cache(indexer, pool_batch, layer_id, key, act_quant=act_quant)


class _Reads:
    """What the kernels read in one forward, from the shard's hooked getters and from the replica.

    ``of_scratch`` is the shard side (inside the sync check): the attention rows through the
    remapped ``page_table_1``, the prefill indexer's ragged read (sglang's getter, remapped
    ``real_page_table``) and the decode indexer's buffer (a clone: the next layer reuses the
    scratch). ``compare`` emulates the paged decode read on both and compares everything.
    """

    def __init__(self, rows, real_lens, logical_table):
        device = logical_table.device
        self.rows, self.real_lens, self.logical_table = rows, real_lens, logical_table
        self.seq_len_tensor = torch.tensor(real_lens, device=device)
        self.rows_t = torch.tensor(rows, device=device)
        self.totals = (sum(real_lens), max(real_lens))

    def of_scratch(self, shard, layer_id, metadata):
        scratch_kv = shard.get_key_buffer(layer_id)
        kv = [
            scratch_kv[metadata.page_table_1[row, :seq_len].long()]
            for row, seq_len in zip(self.rows, self.real_lens)
        ]
        scratch_pages = metadata.real_page_table[self.rows_t]
        ragged = shard.get_index_k_scale_buffer(
            layer_id, self.seq_len_tensor, scratch_pages, *self.totals
        )
        paged_buffer = shard.get_index_k_with_scale_buffer(layer_id).clone()
        return kv, ragged, paged_buffer

    def compare(self, shard, replica, layer_id, metadata, shard_reads, result) -> None:
        kv, (k, s), paged_buffer = shard_reads
        replica_kv = replica.get_key_buffer(layer_id)
        for row, seq_len, got in zip(self.rows, self.real_lens, kv):
            result.compare(got, replica_kv[self.logical_table[row, :seq_len].long()])
        scratch_pages = metadata.real_page_table[self.rows_t]
        logical_pages = self.logical_table[self.rows_t, ::PAGE_SIZE] // PAGE_SIZE
        k_ref, s_ref = replica.get_index_k_scale_buffer(
            layer_id, self.seq_len_tensor, logical_pages, *self.totals
        )
        result.compare(torch.cat([k, s], dim=1), torch.cat([k_ref, s_ref], dim=1))
        # Decode indexer read (paged): the whole buffer from the hooked getter, addressed by page.
        k, s = get_k_and_s_torch(shard, paged_buffer, scratch_pages, self.seq_len_tensor, *self.totals)
        buffer = replica.get_index_k_with_scale_buffer(layer_id)
        k_ref, s_ref = get_k_and_s_torch(
            replica, buffer, logical_pages, self.seq_len_tensor, *self.totals
        )
        result.compare(torch.cat([k, s], dim=1), torch.cat([k_ref, s_ref], dim=1))


def _check_shard(layout, shard, replica, num_layers, result) -> None:
    """Each real physical row holds exactly the replicated row of the logical loc it stores."""
    pages = torch.arange(1, shard.size // PAGE_SIZE + 1, device=shard.kv_buffer[0].device)
    logical_pages = layout.logical_page_of(pages)
    physical_locs = layout.rows_of_pages(pages * PAGE_SIZE)
    logical_locs = layout.rows_of_pages(logical_pages * PAGE_SIZE)
    for layer in range(num_layers):
        result.compare(shard.kv_buffer[layer][physical_locs], replica.kv_buffer[layer][logical_locs])
        result.compare(
            shard.index_k_with_scale_buffer[layer][pages],
            replica.index_k_with_scale_buffer[layer][logical_pages],
        )
