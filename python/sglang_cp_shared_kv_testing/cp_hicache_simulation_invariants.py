"""What must hold on every rank of a simulated CP HiCache group after every step, and the byte oracle.

Two kinds of checks (``docs/simulation.md`` lists them all):

* **Shared state** (``shared_state``): everything the CP ranks must hold identically because each of
  them runs the same scheduler on the same batches: the logical tree (keys, logical locs, ``host_len``,
  locks, hit counts, recorded page owners, leaf sets), logical accounting, the allocator's free lists,
  the HiCache ack queues and the simulated requests. The harness all-gathers its digest; a rank whose
  digest differs from rank 0's has diverged.
* **Rank-local** (``RankInvariants.violations``): this rank's own resources and bytes.

  - *Logical* device pages: every page the allocator can hand out is owned exactly once, by a free
    list, a device-resident tree node or a running request.
  - *Physical* host slots: every slot of this rank's host pool is owned exactly once, by the free list, a
    backed-up node's ``cp_hicache.host_indices``.
  - Logical accounting recomputed from the tree: ``evictable_size_``, ``protected_size_``, host
    lengths, both leaf sets, every ``lock_ref`` (recounted from its holders: running requests,
    write-through and load-back acks in flight), and one pending ack per in-flight write / load.
  - Bytes: every device-resident token this rank owns (tree nodes, loaded-back ones included, and running
    requests) holds the pattern of its token in its KV row and indexer slot, and every backed-up position
    it owns holds it in its host slot.
  - The peer-page plan's host mirror of ``req_to_token`` (fed by the writer hooks around sglang's own
    ``alloc_for_extend`` / ``alloc_for_decode`` / ``cache_*_req``, which the workload calls): every
    running request's mirrored pages equal the table, every device node's host page ids its value.

The byte oracle: ``write_owned_kv`` stores, for each token, a pattern that depends only on the token id,
the way the runtime's owner-filtered write stores KV: owned logical locs at their physical row, every
other loc into its slot of the dummy physical page 0. The workload makes token ids unique per
(prefix, position), so a token id names the KV a row must hold.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import os
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from sglang_cp_shared_kv_testing import sgl_kernel_cpu_shim

sgl_kernel_cpu_shim.install()

from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: E402

from sglang_cp_shared_kv.mem_cache.req_to_page_mirror import mirror_of  # noqa: E402
from sglang_cp_shared_kv_testing.scheduler_writes import mirror_mismatches  # noqa: E402

if TYPE_CHECKING:
    from sglang_cp_shared_kv_testing.cp_hicache_simulation_workload import CpHiCacheWorkload
    from sglang_cp_shared_kv_testing.cp_hicache_stack import HiCacheStack

# NSA indexer K per token: 128 fp8 values in the page's value block, one fp32 scale in its scale block.
_INDEX_VALUE_BYTES = 128
_INDEX_SCALE_BYTES = 4


# ---- byte oracle ----


def _token_hashes(token_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Two byte hashes of each token: an offset ``a`` and an odd stride ``b``."""
    mixed = (token_ids * 2_654_435_761) % 1_000_000_007
    return (mixed % 256).to(torch.uint8), ((mixed // 256) % 128 * 2 + 1).to(torch.uint8)


def _pattern(hashes, salt: int, width: int) -> torch.Tensor:
    """``width`` bytes per token: ``a + salt + j * b (mod 256)`` for byte j. Two tokens share a row
    only if both hashes collide; ``salt`` tells layers and buffers apart."""
    a, b = hashes
    ramp = torch.arange(width, dtype=torch.uint8)
    return (a + salt)[:, None] + ramp[None, :] * b[:, None]


# The MTP draft pool's bytes (``draft=True`` below) are salted apart from every target layer's, so a
# draft row that got a target row's bytes (or the reverse) is caught as well.
_DRAFT_SALT = 19


def kv_row_pattern(hashes, layer: int, row_bytes: int, salt: int = 0) -> torch.Tensor:
    """The MLA KV row bytes of each token (uint8, ``[tokens, row_bytes]``)."""
    return _pattern(hashes, 37 * layer + salt, row_bytes)


def indexer_token_pattern(hashes, layer: int, salt: int = 0) -> torch.Tensor:
    """The NSA indexer bytes of each token, values then scale (uint8, ``[tokens, 132]``)."""
    return _pattern(hashes, 37 * layer + 101 + salt, _INDEX_VALUE_BYTES + _INDEX_SCALE_BYTES)


def write_owned_kv(
    stack: HiCacheStack, logical_locs: torch.Tensor, token_ids: torch.Tensor
) -> None:
    """Store the tokens' KV and indexer bytes on this rank as the runtime's owner-filtered write does,
    into the target's pool and, if the stack has one, the draft's (the same rows)."""
    rows = stack.layout.physical_locs_or_dummy(logical_locs.to(torch.int64))
    hashes = _token_hashes(token_ids)
    pools = [(stack.kv_pool, 0)]
    if stack.draft_pool is not None:
        pools.append((stack.draft_pool, _DRAFT_SALT))
    for pool, salt in pools:
        for layer in range(pool.layer_num):
            kv = _kv_rows(pool.kv_buffer[layer])
            kv[rows] = kv_row_pattern(hashes, layer, kv.shape[1], salt)
            values, scales = _indexer_slots(pool.index_k_with_scale_buffer[layer], pool.page_size)
            pattern = indexer_token_pattern(hashes, layer, salt)
            page, slot = rows // pool.page_size, rows % pool.page_size
            values[page, slot] = pattern[:, :_INDEX_VALUE_BYTES]
            scales[page, slot] = pattern[:, _INDEX_VALUE_BYTES:]


def owned_kv_mismatches(
    stack: HiCacheStack, logical_locs: torch.Tensor, token_ids: torch.Tensor, draft: bool = False
) -> List[int]:
    """Logical locs this rank owns whose device KV row or indexer slot (of the draft's pool with
    ``draft``) lacks its token's pattern."""
    owned = stack.layout.owned_by_this_rank(logical_locs)
    locs, tokens = logical_locs[owned], token_ids[owned]
    rows = stack.layout.physical_locs_or_dummy(locs)  # owned locs: their physical rows
    pool = stack.draft_pool if draft else stack.kv_pool
    bad = _rows_mismatching(
        rows, tokens, pool.layer_num, pool.page_size,
        lambda layer: pool.kv_buffer[layer], lambda layer: pool.index_k_with_scale_buffer[layer],
        _DRAFT_SALT if draft else 0,
    )  # fmt: skip
    return locs[bad].tolist()


def host_kv_mismatches(
    stack: HiCacheStack, host_slots: torch.Tensor, token_ids: torch.Tensor, draft: bool = False
) -> List[int]:
    """Physical host slots of this rank whose KV row or indexer slot (in the draft's host pools with
    ``draft``) lacks its token's pattern."""
    controller = stack.controller
    host_group = controller.mem_pool_host_draft if draft else controller.mem_pool_host
    kv_host = host_group.get_pool(PoolName.KV)
    index_host = host_group.get_pool(PoolName.INDEXER)
    bad = _rows_mismatching(
        host_slots, token_ids, kv_host.layer_num, index_host.page_size,
        lambda layer: kv_host.kv_buffer[layer],
        lambda layer: index_host.index_k_with_scale_buffer[layer],
        _DRAFT_SALT if draft else 0,
    )  # fmt: skip
    return host_slots[bad].tolist()


def _rows_mismatching(
    rows, tokens, layer_num, page_size, kv_buffer, index_buffer, salt=0
) -> torch.Tensor:
    bad = torch.zeros(len(rows), dtype=torch.bool)
    page, slot = rows // page_size, rows % page_size
    hashes = _token_hashes(tokens)
    for layer in range(layer_num):
        kv = _kv_rows(kv_buffer(layer))
        bad |= (kv[rows] != kv_row_pattern(hashes, layer, kv.shape[1], salt)).any(dim=1)
        values, scales = _indexer_slots(index_buffer(layer), page_size)
        pattern = indexer_token_pattern(hashes, layer, salt)
        bad |= (values[page, slot] != pattern[:, :_INDEX_VALUE_BYTES]).any(dim=1)
        bad |= (scales[page, slot] != pattern[:, _INDEX_VALUE_BYTES:]).any(dim=1)
    return bad


def _kv_rows(buffer: torch.Tensor) -> torch.Tensor:
    return buffer.view(torch.uint8).view(buffer.shape[0], -1)


def _indexer_slots(buffer: torch.Tensor, page_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Views ``[page, slot, byte]`` of the value and scale blocks of an indexer buffer whose pages
    hold ``page_size`` x 128 fp8 values, then ``page_size`` fp32 scales."""
    pages = buffer.view(buffer.shape[0], -1)
    split = page_size * _INDEX_VALUE_BYTES
    values = pages[:, :split].view(-1, page_size, _INDEX_VALUE_BYTES)
    scales = pages[:, split:].view(-1, page_size, _INDEX_SCALE_BYTES)
    return values, scales


# ---- tree walking ----


def walk_tree(cache) -> Iterator[Tuple[object, int]]:
    """(node, depth) for every node below the root, pre-order, children in key order."""
    stack = [(child, 1) for _, child in _children_in_key_order(cache.root_node)]
    while stack:
        node, depth = stack.pop()
        yield node, depth
        stack += [(child, depth + 1) for _, child in _children_in_key_order(node)]


def _children_in_key_order(node):
    # Reversed: the walk pops from the end of its stack.
    return sorted(node.children.items(), key=lambda item: item[0], reverse=True)


def _tokens_of(nodes) -> torch.Tensor:
    """The key token ids of ``nodes``, concatenated (one tensor construction for all of them)."""
    return torch.tensor(
        list(itertools.chain.from_iterable(n.key.token_ids[: len(n.key)] for n in nodes)),
        dtype=torch.int64,
    )


def _is_backed(node) -> bool:
    return node.host_len > 0 and node.cp_hicache is not None


# ---- shared state ----


def shared_state(workload: CpHiCacheWorkload) -> Dict[str, object]:
    """Everything every rank must hold identically, as plain Python values, by component.

    Page-granular where the rank-local checks already prove page structure: a node's logical locs
    by page head, its recorded owners by page. A key is (length, first token id, hash of its ids):
    Python hashes int tuples the same way in every process.
    """
    stack = workload.stack
    cache, allocator, controller = stack.cache, stack.allocator, stack.controller
    page = stack.layout.page_size
    tree = []
    for node, depth in walk_tree(cache):
        tokens = node.key.token_ids[: len(node.key)]
        tree.append(
            (
                node.id,
                depth,
                node.parent.id,
                (len(tokens), tokens[0], hash(tuple(tokens))),
                None if node.evicted else node.value[::page].tolist(),
                node.host_len,
                None if node.cp_hicache is None else node.cp_hicache.owner_ranks[::page].tolist(),
                node.lock_ref,
                node.hit_count,
                node.priority,
                node in cache.evictable_leaves,
                node in cache.evictable_host_leaves,
            )
        )
    return {
        "tree": tree,
        "logical sizes (evictable, protected, host tokens)": (
            cache.evictable_size_,
            cache.protected_size_,
            cache.host_logical_tokens,
        ),
        "host ledger (free slots by rank)": cache.host_ledger.free.tolist(),
        "allocator free pages by owner": [p.tolist() for p in allocator.free_pages_by_owner],
        "allocator released pages by owner": [
            p.tolist() for p in allocator.release_pages_by_owner
        ],
        "write acks (ongoing ids, queued ack ids)": (
            sorted(cache.ongoing_write_through),
            [list(ack.node_ids) for ack in controller.ack_write_queue],
            [op.node_ids for op in controller.write_queue],
        ),
        "load acks (ongoing ids, queued ack ids)": (
            sorted(cache.ongoing_load_back),
            [list(ack.node_ids) for ack in controller.ack_load_queue],
            [op.node_ids for op in controller.load_queue],
        ),
        "requests": workload.request_summary(),
        "request slots": list(stack.req_to_token_pool.free_slots),
        **_storage_state(cache),
    }


def _storage_state(cache) -> Dict[str, object]:
    """With a storage tier: the storage decisions every rank takes together."""
    if getattr(cache, "cp_storage", None) is None:
        return {}
    return {"storage (nodes offered, prefetches)": (cache.storage_node_writes, cache.storage_prefetches)}


def digest(state: Dict[str, object]) -> bytes:
    return hashlib.sha256(repr(sorted(state.items())).encode()).digest()


def first_difference(mine: Dict[str, object], reference: Dict[str, object]) -> str:
    """The first component (and for the tree, the first node) where ``mine`` differs from rank 0's."""
    for component, reference_value in reference.items():
        value = mine.get(component)
        if value == reference_value:
            continue
        if component == "tree":
            for index, (a, b) in enumerate(zip(value, reference_value)):
                if a != b:
                    return (
                        f"tree node #{index} differs: here {_describe_node(a)}, "
                        f"rank 0 {_describe_node(b)}"
                    )
            return f"tree has {len(value)} nodes here, {len(reference_value)} on rank 0"
        return f"{component}: here {_short(value)}, rank 0 {_short(reference_value)}"
    return "digest differs but no component does"


_NODE_FIELDS = (
    "id", "depth", "parent", "key (len, first id, hash)", "value page heads", "host_len",
    "owner of each page", "lock_ref", "hit_count", "priority", "evictable_leaf",
    "evictable_host_leaf",
)  # fmt: skip


def _describe_node(record) -> str:
    return "{" + ", ".join(f"{k}={_short(v, 80)}" for k, v in zip(_NODE_FIELDS, record)) + "}"


def _short(value, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ---- rank-local invariants ----


class RankInvariants:
    """This rank's checks (module docstring); ``violations()`` returns ``(invariant, detail)`` pairs."""

    def __init__(self, workload: CpHiCacheWorkload):
        self.workload = workload
        self.stack = workload.stack
        self.cache = workload.stack.cache
        self.cp_rank = workload.stack.layout.cp_rank
        self.page_size = workload.stack.layout.page_size

    def violations(self) -> List[Tuple[str, str]]:
        nodes = [node for node, _ in walk_tree(self.cache)]
        checks = (
            ("tree-structure", self._tree_structure),
            ("logical-accounting", self._logical_accounting),
            ("lock-refs", self._lock_refs),
            ("ack-cardinality", self._acks),
            ("device-pages", self._device_pages),
            ("host-slots", self._host_slots),
            ("host-metadata", self._host_metadata),
            ("device-bytes", self._device_bytes),
            ("host-bytes", self._host_bytes),
            ("draft-device-bytes", self._draft_device_bytes),
            ("draft-host-bytes", self._draft_host_bytes),
            ("req-to-token-mirror", self._req_to_token_mirror),
            ("storage-pairs", self._storage_pairs),
        )
        found = []
        for name, check in checks:
            detail = check(nodes)
            if detail:
                found.append((name, detail))
        return found

    def baseline_violations(self) -> List[Tuple[str, str]]:
        """After a full drain: an empty tree, and every device page and host slot free again."""
        cache, allocator = self.cache, self.stack.allocator
        host = self.stack.controller.mem_pool_host
        problems = []
        if cache.root_node.children:
            problems.append(f"{len(cache.root_node.children)} subtrees left under the root")
        free_by_owner = [len(p) + len(r) for p, r in zip(
            allocator.free_pages_by_owner, allocator.release_pages_by_owner
        )]  # fmt: skip
        if free_by_owner != [allocator.num_physical_pages] * allocator.cp_size:
            problems.append(
                f"free logical pages by owner {free_by_owner}, expected "
                f"{allocator.num_physical_pages} each"
            )
        if host.available_size() != host.size:
            problems.append(f"{host.size - host.available_size()} physical host slots still in use")
        if cache.evictable_size_ or cache.protected_size_ or cache.host_logical_tokens:
            problems.append(
                f"logical sizes not zero: evictable {cache.evictable_size_}, protected "
                f"{cache.protected_size_}, host {cache.host_logical_tokens}"
            )
        return [("baseline", "; ".join(problems))] if problems else []

    def _storage_pairs(self, nodes) -> Optional[str]:
        """With a storage tier: no page's KV object in storage without its indexer object (each rank
        stores the indexer first, so a peer still writing cannot trip this)."""
        storage = getattr(self.cache, "cp_storage", None)
        if storage is None:
            return None
        alone = kv_objects_without_indexer(storage.backend.file_path)
        if alone:
            return f"{len(alone)} KV objects in storage without their indexer object, e.g. {min(alone)}"
        return None

    def _req_to_token_mirror(self, nodes) -> Optional[str]:
        """The peer-page plan's host mirror equals ``req_to_token`` for every running request, and
        every device node's host page ids its value (``req_to_page_mirror``)."""
        if mirror_of(self.stack.req_to_token_pool) is None:
            return None
        problems = mirror_mismatches(
            self.cache, self.stack.req_to_token_pool, self.workload.running, self.page_size
        )
        return "; ".join(problems[:3]) if problems else None

    # ---- structure and accounting ----

    def _tree_structure(self, nodes) -> Optional[str]:
        page = self.page_size
        for node in [self.cache.root_node] + nodes:
            if type(node.children) is not dict:
                return f"node {node.id} has {type(node.children).__name__} children (ghost-child risk)"
            for child_key, child in node.children.items():
                if child.parent is not node:
                    return f"node {child.id} is under node {node.id} but its parent is {child.parent.id}"
                if child_key != child.key.child_key(page):
                    return f"node {child.id} is filed under a key that is not its first page"
        for node in nodes:
            length = len(node.key)
            if length == 0 or length % page:
                return f"node {node.id} key has {length} tokens (not whole pages)"
            if not node.evicted:
                if len(node.value) != length:
                    return f"node {node.id} holds {len(node.value)} locs for {length} tokens"
            else:
                if not _is_backed(node):
                    return f"node {node.id} is evicted from the device without a host backup"
                if any(not child.evicted for child in node.children.values()):
                    return f"node {node.id} is evicted but has a child on the device"
                if node.lock_ref:
                    return f"node {node.id} is evicted but locked ({node.lock_ref})"
            if _is_backed(node):
                if node.host_len != length or node.cp_hicache.logical_len != length:
                    return (
                        f"node {node.id}: host_len {node.host_len}, metadata logical_len "
                        f"{node.cp_hicache.logical_len}, key {length} tokens"
                    )
            elif node.host_len or node.cp_hicache is not None:
                return f"node {node.id} is half backed up (host_len {node.host_len})"
        on_device = [n for n in nodes if not n.evicted]
        if on_device and not _whole_pages(torch.cat([n.value for n in on_device]), page):
            bad = next(n for n in on_device if not _whole_pages(n.value, page))
            return f"node {bad.id} value is not whole logical pages"
        return None

    def _logical_accounting(self, nodes) -> Optional[str]:
        cache = self.cache
        on_device = [n for n in nodes if not n.evicted]
        evictable = sum(len(n.key) for n in on_device if n.lock_ref == 0)
        protected = sum(len(n.key) for n in on_device if n.lock_ref > 0)
        host_tokens = sum(n.host_len for n in nodes)
        got = (cache.evictable_size_, cache.protected_size_, cache.host_logical_tokens)
        if got != (evictable, protected, host_tokens):
            return (
                f"(evictable_size_, protected_size_, host_logical_tokens) = {got}, the tree says "
                f"{(evictable, protected, host_tokens)}"
            )
        leaves = {
            n for n in on_device
            if n.lock_ref == 0 and all(c.evicted for c in n.children.values())
        }  # fmt: skip
        if leaves != cache.evictable_leaves:
            return f"evictable_leaves {_ids(cache.evictable_leaves)}, the tree says {_ids(leaves)}"
        host_leaves = {
            n for n in nodes
            if n.evicted and n.lock_ref == 0 and not any(_is_backed(c) for c in n.children.values())
        }  # fmt: skip
        if host_leaves != cache.evictable_host_leaves:
            return (
                f"evictable_host_leaves {_ids(cache.evictable_host_leaves)}, the tree says "
                f"{_ids(host_leaves)}"
            )
        return None

    def _lock_refs(self, nodes) -> Optional[str]:
        cache = self.cache
        holders = [req.last_node for req in self.workload.running]
        if cache.cache_controller.write_policy != "write_back":
            holders += list(cache.ongoing_write_through.values())
        holders += list(cache.ongoing_load_back.values())
        expected = collections.Counter()
        for node in holders:
            while node is not cache.root_node:
                expected[node.id] += 1
                node = node.parent
        for node in nodes:
            if node.lock_ref != expected[node.id]:
                return (
                    f"node {node.id} lock_ref {node.lock_ref}, but {expected[node.id]} holders "
                    "(requests, write-through and load-back in flight) lie at or below it"
                )
        if cache.root_node.lock_ref != 1:
            return f"root lock_ref {cache.root_node.lock_ref}"
        return None

    def _acks(self, nodes) -> Optional[str]:
        cache, controller = self.cache, self.stack.controller
        pending_writes = [i for ack in controller.ack_write_queue for i in ack.node_ids]
        pending_writes += [i for op in controller.write_queue for i in op.node_ids]
        if sorted(pending_writes) != sorted(cache.ongoing_write_through):
            return (
                f"write acks pending for nodes {sorted(pending_writes)}, writes in flight "
                f"{sorted(cache.ongoing_write_through)}"
            )
        pending_loads = [i for ack in controller.ack_load_queue for i in ack.node_ids]
        pending_loads += [i for op in controller.load_queue for i in op.node_ids]
        if sorted(pending_loads) != sorted(cache.ongoing_load_back):
            return (
                f"load acks pending for nodes {sorted(pending_loads)}, load-backs in flight "
                f"{sorted(cache.ongoing_load_back)}"
            )
        if controller.load_queue:
            return f"{len(controller.load_queue)} load-backs queued but never started"
        return None

    # ---- resources ----

    def _device_pages(self, nodes) -> Optional[str]:
        """Logical pages: each page the allocator can hand out has exactly one owner."""
        allocator, page = self.stack.allocator, self.page_size
        cp_size = allocator.cp_size
        first, end = cp_size, cp_size * (allocator.num_physical_pages + 1)
        sources = []  # (holder, logical page ids)
        for rank in range(cp_size):
            for lists, what in (
                (allocator.free_pages_by_owner, "free list"),
                (allocator.release_pages_by_owner, "release list"),
            ):
                pages = lists[rank]
                if bool((self.stack.layout.owner_of_page(pages) != rank).any()):
                    return f"a logical page of another owner is on the {what} of owner {rank}"
                sources.append((f"{what} of owner {rank}", torch.from_numpy(pages)))
        sources += [(f"node {n.id}", n.value[::page] // page) for n in nodes if not n.evicted]
        sources += [
            (f"request {r.rid}", torch.unique(r.private_locs() // page)) for r in self.workload.running
        ]
        all_pages = torch.cat([pages for _, pages in sources])
        if len(all_pages) and (int(all_pages.min()) < first or int(all_pages.max()) >= end):
            outside = int(all_pages[(all_pages < first) | (all_pages >= end)][0])
            return f"logical page {outside} outside [{first}, {end}) is {_holders(sources, outside)}"
        counts = torch.bincount(all_pages - first, minlength=end - first)
        bad = torch.nonzero(counts != 1).flatten()
        if len(bad) == 0:
            return None
        logical_page = int(bad[0]) + first
        return (
            f"{len(bad)} logical pages wrong; page {logical_page} (cp owner "
            f"{logical_page % cp_size}) is {_holders(sources, logical_page)}"
        )

    def _host_slots(self, nodes) -> Optional[str]:
        """Physical host slots of this rank: each has exactly one owner."""
        host = self.stack.controller.mem_pool_host
        sources = [("free list", host.anchor_entry.host_pool.free_slots)]
        sources += [(f"node {n.id}", n.cp_hicache.host_indices) for n in nodes if _is_backed(n)]
        slots = torch.cat([s.to(torch.int64) for _, s in sources])
        if len(slots) and (int(slots.min()) < 0 or int(slots.max()) >= host.size):
            outside = int(slots[(slots < 0) | (slots >= host.size)][0])
            return f"host slot {outside} outside [0, {host.size}) is {_holders(sources, outside)}"
        counts = torch.bincount(slots, minlength=host.size)
        bad = torch.nonzero(counts != 1).flatten()
        if len(bad) == 0:
            return None
        slot = int(bad[0])
        return f"{len(bad)} physical host slots wrong; slot {slot} is {_holders(sources, slot)}"

    def _host_metadata(self, nodes) -> Optional[str]:
        """This rank holds exactly the positions whose recorded owner it is; owners are per page."""
        backed = [n for n in nodes if _is_backed(n)]
        if not backed:
            return None
        metas = [n.cp_hicache for n in backed]
        ledger = self.workload.stack.cache.host_ledger
        for node, meta in zip(backed, metas):
            # The slots kept since the write (through splits) are the ones its owners give.
            counted = ledger.slots_of_pages(meta.owner_ranks.numpy()[:: self.page_size])
            if meta.slots_by_rank is None or not np.array_equal(meta.slots_by_rank, counted):
                kept = None if meta.slots_by_rank is None else meta.slots_by_rank.tolist()
                return f"node {node.id}: keeps host slots by rank {kept}, its owners give {counted.tolist()}"
        owners = torch.cat([m.owner_ranks for m in metas]).to(torch.int64).view(-1, self.page_size)
        offsets = torch.tensor([0] + [m.logical_len for m in metas[:-1]]).cumsum(0).tolist()
        held = torch.cat([m.owned_positions + offset for m, offset in zip(metas, offsets)])
        mine = torch.nonzero(owners.flatten() == self.cp_rank).flatten()
        if bool((owners == owners[:, :1]).all()) and torch.equal(held, mine):
            return None
        for node, meta in zip(backed, metas):
            node_owners = meta.owner_ranks.to(torch.int64).view(-1, self.page_size)
            if not bool((node_owners == node_owners[:, :1]).all()):
                return f"node {node.id}: recorded owners change inside a page"
            node_mine = torch.nonzero(meta.owner_ranks == self.cp_rank).flatten()
            if not torch.equal(node_mine, meta.owned_positions):
                return (
                    f"node {node.id}: holds {meta.num_owned} positions on host, but the recorded "
                    f"owners give this rank {len(node_mine)}"
                )
        return "owned positions do not match the recorded owners"

    # ---- bytes ----

    def _draft_device_bytes(self, nodes) -> Optional[str]:
        """The draft pool's rows, where the stack has one: as ``_device_bytes`` (a loaded-back
        prefix's draft rows must hold what they held before eviction)."""
        if self.stack.draft_pool is None:
            return None
        return self._device_bytes(nodes, draft=True)

    def _draft_host_bytes(self, nodes) -> Optional[str]:
        if self.stack.draft_pool is None:
            return None
        return self._host_bytes(nodes, draft=True)

    def _device_bytes(self, nodes, draft: bool = False) -> Optional[str]:
        on_device = [n for n in nodes if not n.evicted]
        locs = [n.value for n in on_device]
        tokens = [_tokens_of(on_device)]
        where = [(f"node {n.id}", len(n.value)) for n in on_device]
        for req in self.workload.running:
            req_locs, req_tokens = req.kv_locs_and_tokens()
            locs.append(req_locs)
            tokens.append(req_tokens)
            where.append((f"request {req.rid}", len(req_locs)))
        if not locs:
            return None
        bad = owned_kv_mismatches(self.stack, torch.cat(locs), torch.cat(tokens), draft)
        if not bad:
            return None
        first = bad[0]
        owner = next(name for name, loc in zip(_expand(where), torch.cat(locs).tolist()) if loc == first)
        pool = "draft " if draft else ""
        return (
            f"{len(bad)} owned device locs hold wrong {pool}KV bytes; first: logical loc {first} "
            f"of {owner}"
        )

    def _host_bytes(self, nodes, draft: bool = False) -> Optional[str]:
        backed = [n for n in nodes if _is_backed(n) and n.cp_hicache.num_owned]
        if not backed:
            return None
        metas = [n.cp_hicache for n in backed]
        offsets = torch.tensor([0] + [m.logical_len for m in metas[:-1]]).cumsum(0).tolist()
        positions = torch.cat([m.owned_positions + offset for m, offset in zip(metas, offsets)])
        tokens = _tokens_of(backed)[positions]
        all_slots = torch.cat([m.host_indices for m in metas])
        where = [(f"node {n.id}", m.num_owned) for n, m in zip(backed, metas)]
        bad = host_kv_mismatches(self.stack, all_slots, tokens, draft)
        if not bad:
            return None
        owner = next(name for name, s in zip(_expand(where), all_slots.tolist()) if s == bad[0])
        pool = "draft " if draft else ""
        return (
            f"{len(bad)} owned host slots hold wrong {pool}KV bytes; first: slot {bad[0]} of {owner}"
        )


def kv_objects_without_indexer(directory: str) -> List[str]:
    """Keys of a ``HiCacheFile`` directory whose KV object (``<key>_<model>.bin``) has no indexer
    object (``<key>.indexer_<model>.bin``). The indexer is looked up by name, not in the listing: a
    listing taken while a peer rank creates files may show its KV object and miss the indexer object
    it created just before."""
    alone = []
    for name in os.listdir(directory):
        parts = name.split("_", 2)  # <namespace tag>, <page hash>[.indexer], <model>.bin
        if len(parts) != 3 or not name.endswith(".bin") or parts[1].endswith(".indexer"):
            continue
        key = f"{parts[0]}_{parts[1]}"
        if not os.path.exists(os.path.join(directory, f"{key}.indexer_{parts[2]}")):
            alone.append(key)
    return alone


def _whole_pages(locs: torch.Tensor, page_size: int) -> bool:
    pages = locs.view(-1, page_size)
    return bool((pages == pages[:, :1] + torch.arange(page_size)).all()) and not bool(
        (pages[:, 0] % page_size).any()
    )


def _holders(sources, item: int) -> str:
    holders = [name for name, items in sources if bool((items == item).any())]
    return "owned by nobody (leaked)" if not holders else "owned by " + " and ".join(holders)


def _ids(nodes) -> List[int]:
    return sorted(n.id for n in nodes)


def _expand(where: List[Tuple[str, int]]) -> Iterator[str]:
    for name, count in where:
        for _ in range(count):
            yield name
