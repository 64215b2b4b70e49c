"""HiCache's third tier (L3 storage) under CP shared KV: this rank's pages in, any rank's pages out.

A logical page lives whole on one CP rank (KV rows and indexer page), so its bytes are a replica's page
and go to storage under an owner-free key (``cp_hicache_storage_keys``). This module is the page I/O of
one rank, between its host pools and a sglang storage backend; the cache (``CpHiRadixCache``) decides
which pages, when, and keeps every rank in step:

* write: the rank that owns a page stores its KV and its indexer page (disjoint keys across CP ranks, no
  race); within a CP rank only attention-TP rank 0 writes (its TP peers hold the same bytes).
* read: any rank reads whichever pages it owns in the *reader's* placement, whoever wrote them.
* hit: a page counts only if both its KV object and its indexer object exist. Stock's restore counts KV
  pages only (``completed_tokens``), so KV could come back without its indexer page; here it cannot.

Backends (``--hicache-storage-backend``): ``file`` (sglang's ``HiCacheFile``: KV through the generic
page copy, any NSA host layout) and ``mooncake`` (Mooncake Store: KV zero-copy from the host pool, which
needs a ``page_first`` / ``page_first_direct`` host layout). The indexer rides both as
``PoolTransfer(INDEXER)`` objects, as stock's NSA controller stores it.

All calls are synchronous on the scheduler thread (no storage threads, no control queues): the number
of storage operations is then trivially the same on every rank, which stock's queue drain (a MIN over
queue sizes) needs and which an overlapped version would have to restore.
"""

from __future__ import annotations

import json
import logging
import os
from typing import List, Optional, Sequence

import torch

from sglang.srt.environ import envs
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheFile,
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolName,
    PoolTransfer,
)

from sglang_cp_shared_kv.mem_cache.cp_hicache_storage_keys import StorageNamespace
from sglang_cp_shared_kv.server_args import CP_SHARED_KV_FLAG as FLAG
from sglang_cp_shared_kv.server_args import STORAGE_BACKEND_LAYOUTS, storage_layout_problem  # noqa: F401

logger = logging.getLogger(__name__)

class CpStoragePageIO:
    """One rank's storage I/O of whole pages: KV from/to the KV host pool, indexer K from/to the
    indexer host pool, at the same host slots (the indexer pool shares the KV pool's slots)."""

    def __init__(
        self,
        backend: HiCacheStorage,
        backend_name: str,
        kv_host,
        indexer_host,
        namespace: StorageNamespace,
        writes: bool,
    ):
        self.backend = backend
        self.backend_name = backend_name
        self.kv_host = kv_host
        self.indexer_host = indexer_host
        self.namespace = namespace
        self.page_size = namespace.page_size
        # Attention-TP rank 0 of each CP rank writes; every rank reads and queries.
        self.writes = writes
        self.pages_written = 0  # this rank's pages stored (KV and indexer both confirmed)
        self.pages_read = 0  # this rank's pages restored into its host pool

    # ---- queries ----

    def hit_pages(self, keys: Sequence[str]) -> int:
        """Length of the prefix of ``keys`` whose pages have both their KV and indexer objects."""
        if not keys:
            return 0
        result = self.backend.batch_exists_v2(
            list(keys), [PoolTransfer(name=PoolName.INDEXER, keys=list(keys))]
        )
        return int(result.kv_hit_pages)

    # ---- write (host -> storage) ----

    def write_pages(self, keys: Sequence[str], host_indices: torch.Tensor) -> int:
        """Store the pages at ``host_indices`` (``page_size`` slots per key) under ``keys``; the
        number of leading pages whose KV and indexer both went out. A non-writer stores nothing."""
        if not self.writes or not keys:
            return 0
        self._check_whole_pages(keys, host_indices)
        indexer_ok = self.backend.batch_set_v2(
            [PoolTransfer(name=PoolName.INDEXER, host_indices=host_indices, keys=list(keys))]
        )[PoolName.INDEXER]
        kv_ok = self._kv_set(list(keys), host_indices)
        stored = _leading_true([a and b for a, b in zip(kv_ok, indexer_ok)])
        self.pages_written += stored
        return stored

    # ---- read (storage -> host) ----

    def read_pages(self, keys: Sequence[str], host_indices: torch.Tensor) -> int:
        """Restore ``keys`` into ``host_indices``; the number of leading pages whose KV and indexer
        both came back (the rest may hold partial bytes and must not be used)."""
        if not keys:
            return 0
        self._check_whole_pages(keys, host_indices)
        try:
            indexer_ok = self.backend.batch_get_v2(
                [PoolTransfer(name=PoolName.INDEXER, host_indices=host_indices, keys=list(keys))]
            )[PoolName.INDEXER]
            kv_ok = self._kv_get(list(keys), host_indices)
        except Exception:  # a backend error is a miss of every page, never a crash of one rank
            logger.exception("CP HiCache storage: read of %d pages failed", len(keys))
            return 0
        read = _leading_true([bool(a) and bool(b) for a, b in zip(kv_ok, indexer_ok)])
        self.pages_read += read
        return read

    # ---- KV, per backend ----

    def _kv_set(self, keys: List[str], host_indices: torch.Tensor) -> List[bool]:
        if self.backend_name == "mooncake":
            return list(self.backend.batch_set_v1(keys, host_indices))
        return [
            self.backend.set(key, self.kv_host.get_data_page(self._slot(host_indices, i), flat=True))
            for i, key in enumerate(keys)
        ]

    def _kv_get(self, keys: List[str], host_indices: torch.Tensor) -> List[bool]:
        if self.backend_name == "mooncake":
            return [bool(ok) for ok in self.backend.batch_get_v1(keys, host_indices)]
        results = []
        for i, key in enumerate(keys):
            try:
                page = self.backend.get(key, self.kv_host.get_dummy_flat_data_page())
            except OSError:  # e.g. a short read of a truncated file
                page = None
            if page is None:
                results.append(False)
                continue
            self.kv_host.set_from_flat_data_page(self._slot(host_indices, i), page)
            results.append(True)
        return results

    def _slot(self, host_indices: torch.Tensor, page: int) -> int:
        return int(host_indices[page * self.page_size])

    def _check_whole_pages(self, keys: Sequence[str], host_indices: torch.Tensor) -> None:
        if host_indices.numel() != len(keys) * self.page_size:
            raise ValueError(
                f"{len(keys)} pages need {len(keys) * self.page_size} host slots, got "
                f"{host_indices.numel()}"
            )


def _leading_true(flags: Sequence[bool]) -> int:
    for i, flag in enumerate(flags):
        if not flag:
            return i
    return len(flags)


def parse_extra_config(extra_config: Optional[str]) -> dict:
    """``--hicache-storage-backend-extra-config`` as a dict (JSON, or ``@path`` to a JSON file)."""
    if not extra_config:
        return {}
    if extra_config.startswith("@"):
        with open(extra_config[1:]) as f:
            return json.load(f)
    return json.loads(extra_config)


def file_backend_directory(extra_config: dict) -> str:
    """The file backend's directory as ``HiCacheFile`` resolves it: the environment variable, else
    ``file_path`` of the extra config, else stock's default."""
    return (
        envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.get()
        or extra_config.get("file_path")
        or "/tmp/hicache"
    )


def build_storage_backend(
    backend_name: str,
    kv_host,
    indexer_host,
    *,
    model_name: Optional[str],
    attn_tp_rank: int,
    attn_tp_size: int,
    attn_cp_rank: int,
    attn_cp_size: int,
    extra_config: dict,
) -> HiCacheStorage:
    """The sglang backend, configured as one MLA-style store (keys carry no TP / CP rank) with the
    indexer host pool registered for ``PoolTransfer(INDEXER)``."""
    problem = storage_layout_problem(backend_name, kv_host.layout)
    if problem:
        raise ValueError(f"{FLAG}: {problem}")
    config = HiCacheStorageConfig(
        tp_rank=attn_tp_rank,
        tp_size=attn_tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=attn_cp_rank,
        attn_cp_size=attn_cp_size,
        # MLA-style: neither backend puts a TP rank into an MLA key, so keys stay owner-free.
        is_mla_model=True,
        enable_storage_metrics=False,
        is_page_first_layout=kv_host.layout == "page_first",
        model_name=model_name,
        extra_config=dict(extra_config),
    )
    if backend_name == "file":
        path = file_backend_directory(extra_config)
        # Created here, race-free: HiCacheFile creates it on every TP rank 0 (``exists`` then
        # ``makedirs``), and every CP rank is a TP rank 0, so concurrent CP ranks raised FileExistsError.
        os.makedirs(path, exist_ok=True)
        backend = HiCacheFile(config, file_path=path)
    else:
        from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

        backend = MooncakeStore(config, kv_host)
        backend.register_mem_pool_host(kv_host)
    backend.register_mem_host_pool_v2(indexer_host, PoolName.INDEXER)
    return backend
