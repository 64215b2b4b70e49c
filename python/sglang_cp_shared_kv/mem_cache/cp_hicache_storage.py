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
* a page is whole or absent: a store skips a page only when both its objects are whole (the file
  backend checks their sizes; an object of another size, e.g. truncated by a crash, is written
  again, KV and indexer together), and a read that fails for one page (missing, short, a backend
  error) is a miss from that page on, never of the pages before it.

Backends (``--hicache-storage-backend``): ``file`` (sglang's ``HiCacheFile``: KV through the generic
page copy, any NSA host layout) and ``mooncake`` (Mooncake Store: KV zero-copy from the host pool, which
needs a ``page_first`` / ``page_first_direct`` host layout). The indexer rides both as
``PoolTransfer(INDEXER)`` objects, as stock's NSA controller stores it.

All calls are synchronous on the scheduler thread (no storage threads, no control queues): the number
of storage operations is then trivially the same on every rank, which stock's queue drain (a MIN over
queue sizes) needs and which an overlapped version would have to restore.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import List, Optional, Sequence

import torch

from sglang.srt.environ import envs
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheFile,
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from sglang_cp_shared_kv.mem_cache.cp_hicache_storage_keys import StorageNamespace
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG
from sglang_cp_shared_kv.startup_rules import storage_layout_problem

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
        self.pages_written = 0  # pages this rank wrote (KV and indexer both confirmed written)
        self.pages_found_stored = 0  # pages this rank was to store and found whole (not written)
        self.pages_read = 0  # this rank's pages restored into its host pool

    # ---- queries ----

    def hit_pages(self, keys: Sequence[str]) -> int:
        """Length of the prefix of ``keys`` whose pages have both their KV and indexer objects
        (the file backend: whole ones, asked about one object at a time up to the first miss)."""
        if not keys:
            return 0
        result = self.backend.batch_exists_v2(
            list(keys), [PoolTransfer(name=PoolName.INDEXER, keys=list(keys))]
        )
        return int(result.kv_hit_pages)

    # ---- write (host -> storage) ----

    def write_pages(self, keys: Sequence[str], host_indices: torch.Tensor) -> int:
        """Store the pages at ``host_indices`` (``page_size`` slots per key) under ``keys``; the
        number of pages whole in storage afterwards. A page found whole is not written again
        (``pages_found_stored``); any other is written whole, KV and indexer together
        (``pages_written`` counts those both confirmed). A non-writer stores nothing.

        Never raises: a backend error leaves its pages unstored, which only shortens later hits.
        """
        if not self.writes or not keys:
            return 0
        self._check_whole_pages(keys, host_indices)
        keys = list(keys)
        found = self._pages_stored(keys)
        todo = [page for page, stored in enumerate(found) if not stored]
        written = 0
        if todo:
            todo_keys = [keys[page] for page in todo]
            todo_indices = self._pages_of(host_indices, todo)
            try:
                indexer_ok = self.backend.batch_set_v2(
                    [PoolTransfer(name=PoolName.INDEXER, host_indices=todo_indices, keys=todo_keys)]
                )[PoolName.INDEXER]
                kv_ok = self._kv_set(todo_keys, todo_indices)
                written = sum(bool(a) and bool(b) for a, b in zip(kv_ok, indexer_ok))
            except Exception:
                logger.exception("CP HiCache storage: write of %d pages failed", len(todo))
        self.pages_written += written
        self.pages_found_stored += len(keys) - len(todo)
        return written + len(keys) - len(todo)

    def _pages_stored(self, keys: List[str]) -> List[bool]:
        """Per page, whether both its objects are whole in storage already. The file backend
        checks sizes; Mooncake Store holds whole objects only and skips keys it holds itself, so
        its pages are always (re)offered."""
        if isinstance(self.backend, CpHiCacheFile):
            return [self.backend.page_stored(key) for key in keys]
        return [False] * len(keys)

    def _pages_of(self, host_indices: torch.Tensor, pages: List[int]) -> torch.Tensor:
        if len(pages) * self.page_size == host_indices.numel():
            return host_indices
        return host_indices.view(-1, self.page_size)[pages].reshape(-1)

    # ---- read (storage -> host) ----

    def read_pages(self, keys: Sequence[str], host_indices: torch.Tensor) -> int:
        """Restore ``keys`` into ``host_indices``; the number of leading pages whose KV and indexer
        both came back (the rest may hold partial bytes and must not be used). A page that fails is
        a miss from that page on: a backend error in the batch is retried page by page, up to the
        first page that fails again."""
        if not keys:
            return 0
        self._check_whole_pages(keys, host_indices)
        keys = list(keys)
        try:
            ok = self._read_batch(keys, host_indices)
        except Exception:
            logger.exception("CP HiCache storage: read of %d pages failed; reading page by page", len(keys))
            ok = []
            for page, key in enumerate(keys):
                try:
                    page_ok = self._read_batch([key], self._pages_of(host_indices, [page]))[0]
                except Exception:
                    logger.exception("CP HiCache storage: read of page %d of %d failed", page, len(keys))
                    page_ok = False
                ok.append(page_ok)
                if not page_ok:
                    break
        read = _leading_true(ok)
        self.pages_read += read
        return read

    def _read_batch(self, keys: List[str], host_indices: torch.Tensor) -> List[bool]:
        indexer_ok = self.backend.batch_get_v2(
            [PoolTransfer(name=PoolName.INDEXER, host_indices=host_indices, keys=keys)]
        )[PoolName.INDEXER]
        kv_ok = self._kv_get(keys, host_indices)
        return [bool(a) and bool(b) for a, b in zip(kv_ok, indexer_ok)]

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
            page = self.backend.get(key, self.kv_host.get_dummy_flat_data_page())  # None: a miss
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


class CpHiCacheFile(HiCacheFile):
    """sglang's file backend (``HiCacheFile``: one file per object, the same names) with whole
    objects: every object has a known size (``object_bytes``, per pool: one host page), and

    * ``set`` overwrites, atomically: written to a temporary file, then renamed over the name, so a
      reader or a crash never leaves a partial object under it (stock writes in place and skips
      any key whose file exists, so a truncated object stayed for good);
    * ``get`` reads an object only if it has its size; a short read or any ``OSError`` is a miss
      (stock raises on a short read, which failed the whole batch);
    * ``page_stored`` says whether a page's objects are all whole (what ``write_pages`` skips);
    * ``batch_exists_v2`` asks about the keys given, one ``stat`` per object in page order up to
      the first page not whole: O(pages asked). Stock lists the whole directory per query (8 ms at
      20K files, 87 ms at 200K, on the scheduler thread of every rank, per request).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, file_path: str, object_bytes: dict):
        super().__init__(storage_config, file_path=file_path)
        self.object_bytes = dict(object_bytes)  # PoolName -> bytes of one page's object

    def object_whole(self, key: str, pool: PoolName = PoolName.KV) -> bool:
        try:
            size = os.stat(self._get_component_path(key, pool)).st_size
        except OSError:
            return False
        return size == self.object_bytes[pool]

    def page_stored(self, key: str) -> bool:
        return all(self.object_whole(key, pool) for pool in self.object_bytes)

    def exists(self, key: str) -> bool:
        return self.object_whole(key)

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None) -> PoolTransferResult:
        pools = [PoolName.KV]
        for transfer in pool_transfers or []:
            if transfer.hit_policy != PoolHitPolicy.ALL_PAGES:
                raise ValueError(f"{type(self).__name__} serves ALL_PAGES pools, not {transfer.hit_policy}")
            pools.append(transfer.name)
        hits = 0
        for key in keys:
            if not all(self.object_whole(key, pool) for pool in pools):
                break
            hits += 1
        return PoolTransferResult(hits, {pool: hits for pool in pools} if hits else {})

    def get(self, key: str, target_location: torch.Tensor, target_sizes=None):
        path = os.path.join(self.file_path, f"{self._get_suffixed_key(key)}.bin")
        expected = target_location.numel() * target_location.element_size()
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if size != expected:
                    logger.warning("CP HiCache storage: %s holds %d bytes, not %d: a miss", path, size, expected)
                    return None
                buffer = memoryview(target_location.view(torch.uint8).contiguous().numpy())
                if f.readinto(buffer) != expected:
                    logger.warning("CP HiCache storage: short read of %s: a miss", path)
                    return None
            return target_location
        except OSError as error:
            if not isinstance(error, FileNotFoundError):
                logger.warning("CP HiCache storage: reading %s failed (%s): a miss", path, error)
            return None

    def set(self, key: str, value=None, target_location=None, target_sizes=None) -> bool:
        path = os.path.join(self.file_path, f"{self._get_suffixed_key(key)}.bin")
        partial = f"{path}.{os.getpid()}.partial"
        try:
            value.contiguous().view(dtype=torch.uint8).numpy().tofile(partial)
            os.replace(partial, path)
            return True
        except Exception as error:
            logger.error("CP HiCache storage: writing %s failed: %s", path, error)
            with contextlib.suppress(OSError):
                os.remove(partial)
            return False


def _leading_true(flags: Sequence[bool]) -> int:
    for i, flag in enumerate(flags):
        if not flag:
            return i
    return len(flags)


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
        object_bytes = {
            PoolName.KV: _page_bytes(kv_host),
            PoolName.INDEXER: _page_bytes(indexer_host),
        }
        backend = CpHiCacheFile(config, file_path=path, object_bytes=object_bytes)
    else:
        from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

        backend = MooncakeStore(config, kv_host)
        backend.register_mem_pool_host(kv_host)
    backend.register_mem_host_pool_v2(indexer_host, PoolName.INDEXER)
    return backend


def _page_bytes(host_pool) -> int:
    """Bytes of one page's storage object of ``host_pool`` (what sglang's file backend writes)."""
    page = host_pool.get_dummy_flat_data_page()
    return page.numel() * page.element_size()
