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
    backed-up node's ``cp_hicache.host_indices`` or an injected hoard.
  - Logical accounting recomputed from the tree: ``evictable_size_``, ``protected_size_``, host
    lengths, both leaf sets, every ``lock_ref`` (recounted from its holders: running requests, write-through
    and load-back acks in flight), and one pending ack per in-flight write / load.
  - Bytes: every device-resident token this rank owns (tree nodes, loaded-back ones included, and running
    requests) holds the pattern of its token in its KV row and indexer slot, and every backed-up position
    it owns holds it in its host slot.

The byte oracle: ``write_owned_kv`` stores, for each token, a pattern that depends only on the token id,
the way the runtime's owner-filtered write stores KV: owned logical locs at their physical row, every
other loc into its slot of the dummy physical page 0. The workload makes token ids unique per
(prefix, position), so a token id names the KV a row must hold.
"""

from __future__ import annotations

import collections
import hashlib
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Tuple

import torch

from sglang_cp_shared_kv.testing import sgl_kernel_cpu_shim

sgl_kernel_cpu_shim.install()

from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: E402

if TYPE_CHECKING:
    from sglang_cp_shared_kv.testing.cp_hicache_simulation_workload import CpHiCacheWorkload
    from sglang_cp_shared_kv.testing.cpu_hicache_fixture import CpuHiCacheStack

# NSA indexer K per token: 128 fp8 values in the page's value block, one fp32 scale in its scale block.
_INDEX_VALUE_BYTES = 128
_INDEX_SCALE_BYTES = 4


# ---- byte oracle ----


def _token_pattern(token_ids: torch.Tensor, salt: int, width: int) -> torch.Tensor:
    """``width`` bytes per token: ``a + j * b (mod 256)`` for byte j, with ``a`` and an odd ``b`` hashed
    from (token, salt), so two tokens share a row only if both hashes collide."""
    mixed = (token_ids * 2_654_435_761 + salt * 40_503) % 1_000_000_007
    a = (mixed % 256).to(torch.uint8)
    b = ((mixed // 256) % 128 * 2 + 1).to(torch.uint8)
    ramp = torch.arange(width, dtype=torch.uint8)
    return a[:, None] + ramp[None, :] * b[:, None]


def kv_row_pattern(token_ids: torch.Tensor, layer: int, row_bytes: int) -> torch.Tensor:
    """The MLA KV row bytes of each token (uint8, ``[len(token_ids), row_bytes]``)."""
    return _token_pattern(token_ids, 2 * layer, row_bytes)


def indexer_token_pattern(token_ids: torch.Tensor, layer: int) -> torch.Tensor:
    """The NSA indexer bytes of each token, values then scale (uint8, ``[len(token_ids), 132]``)."""
    return _token_pattern(token_ids, 2 * layer + 1, _INDEX_VALUE_BYTES + _INDEX_SCALE_BYTES)


def write_owned_kv(
    stack: CpuHiCacheStack, logical_locs: torch.Tensor, token_ids: torch.Tensor
) -> None:
    """Store the tokens' KV and indexer bytes on this rank as the runtime's owner-filtered write does."""
    rows = stack.layout.physical_locs_or_dummy(logical_locs.to(torch.int64))
    pool = stack.kv_pool
    for layer in range(pool.layer_num):
        kv = _kv_rows(pool.kv_buffer[layer])
        kv[rows] = kv_row_pattern(token_ids, layer, kv.shape[1])
        values, scales = _indexer_slots(pool.index_k_with_scale_buffer[layer], pool.page_size)
        pattern = indexer_token_pattern(token_ids, layer)
        page, slot = rows // pool.page_size, rows % pool.page_size
        values[page, slot] = pattern[:, :_INDEX_VALUE_BYTES]
        scales[page, slot] = pattern[:, _INDEX_VALUE_BYTES:]


def owned_kv_mismatches(
    stack: CpuHiCacheStack, logical_locs: torch.Tensor, token_ids: torch.Tensor
) -> List[int]:
    """Logical locs this rank owns whose device KV row or indexer slot lacks its token's pattern."""
    owned = stack.layout.owned_by_this_rank(logical_locs)
    locs, tokens = logical_locs[owned], token_ids[owned]
    rows = stack.layout.logical_locs_to_physical(locs)
    pool = stack.kv_pool
    bad = _rows_mismatching(
        rows, tokens, pool.layer_num, pool.page_size,
        lambda layer: pool.kv_buffer[layer], lambda layer: pool.index_k_with_scale_buffer[layer],
    )  # fmt: skip
    return locs[bad].tolist()


def host_kv_mismatches(
    stack: CpuHiCacheStack, host_slots: torch.Tensor, token_ids: torch.Tensor
) -> List[int]:
    """Physical host slots of this rank whose KV row or indexer slot lacks its token's pattern."""
    host_group = stack.controller.mem_pool_host
    kv_host = host_group.get_pool(PoolName.KV)
    index_host = host_group.get_pool(PoolName.INDEXER)
    bad = _rows_mismatching(
        host_slots, token_ids, kv_host.layer_num, index_host.page_size,
        lambda layer: kv_host.kv_buffer[layer],
        lambda layer: index_host.index_k_with_scale_buffer[layer],
    )  # fmt: skip
    return host_slots[bad].tolist()


def _rows_mismatching(rows, tokens, layer_num, page_size, kv_buffer, index_buffer) -> torch.Tensor:
    bad = torch.zeros(len(rows), dtype=torch.bool)
    page, slot = rows // page_size, rows % page_size
    for layer in range(layer_num):
        kv = _kv_rows(kv_buffer(layer))
        bad |= (kv[rows] != kv_row_pattern(tokens, layer, kv.shape[1])).any(dim=1)
        values, scales = _indexer_slots(index_buffer(layer), page_size)
        pattern = indexer_token_pattern(tokens, layer)
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


def _node_tokens(node) -> torch.Tensor:
    return torch.tensor(node.key.token_ids[: len(node.key)], dtype=torch.int64)


def _is_backed(node) -> bool:
    return node.host_len > 0 and node.cp_hicache is not None


# ---- shared state ----


def shared_state(workload: CpHiCacheWorkload) -> Dict[str, object]:
    """Everything every rank must hold identically, as plain Python values, by component."""
    stack = workload.stack
    cache, allocator, controller = stack.cache, stack.allocator, stack.controller
    tree = []
    for node, depth in walk_tree(cache):
        tree.append(
            (
                node.id,
                depth,
                node.parent.id,
                tuple(node.key.token_ids[: len(node.key)]),
                None if node.evicted else node.value.tolist(),
                node.host_len,
                None if node.cp_hicache is None else node.cp_hicache.owner_ranks.tolist(),
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
    }


def digest(state: Dict[str, object]) -> str:
    return hashlib.sha256(repr(sorted(state.items())).encode()).hexdigest()


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
    "id", "depth", "parent", "key", "value", "host_len", "owner_ranks", "lock_ref", "hit_count",
    "priority", "evictable_leaf", "evictable_host_leaf",
)  # fmt: skip


def _describe_node(record) -> str:
    fields = dict(zip(_NODE_FIELDS, record))
    fields["key"] = f"{len(fields['key'])} tokens from {fields['key'][:2]}"
    if fields["value"] is not None:
        fields["value"] = f"{len(fields['value'])} locs from {fields['value'][:1]}"
    if fields["owner_ranks"] is not None:
        fields["owner_ranks"] = _short(fields["owner_ranks"][:: max(1, len(fields["owner_ranks"]) // 8)])
    return "{" + ", ".join(f"{k}={v}" for k, v in fields.items()) + "}"


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
                pages = node.value.view(-1, page)
                if not bool((pages == pages[:, :1] + torch.arange(page)).all()) or bool(
                    (pages[:, 0] % page).any()
                ):
                    return f"node {node.id} value is not whole logical pages"
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
        owners: Dict[int, List[str]] = collections.defaultdict(list)
        for rank in range(cp_size):
            for lists, what in (
                (allocator.free_pages_by_owner, "free list"),
                (allocator.release_pages_by_owner, "release list"),
            ):
                for logical_page in lists[rank].tolist():
                    owners[logical_page].append(f"{what} of owner {rank}")
                    if logical_page % cp_size != rank:
                        return f"logical page {logical_page} is on the {what} of owner {rank}"
        for node in nodes:
            if not node.evicted:
                for logical_page in (node.value[::page] // page).tolist():
                    owners[logical_page].append(f"node {node.id}")
        for req in self.workload.running:
            private = req.private_locs()
            for logical_page in torch.unique(private // page).tolist():
                owners[logical_page].append(f"request {req.rid}")
        for logical_page in range(first, end):
            holders = owners.pop(logical_page, [])
            if len(holders) != 1:
                state = "leaked (no owner)" if not holders else "owned by " + " and ".join(holders)
                return f"logical page {logical_page} (cp owner {logical_page % cp_size}) {state}"
        if owners:
            logical_page, holders = next(iter(owners.items()))
            return f"logical page {logical_page} outside [{first}, {end}) owned by {holders}"
        return None

    def _host_slots(self, nodes) -> Optional[str]:
        """Physical host slots of this rank: each has exactly one owner."""
        host = self.stack.controller.mem_pool_host
        owner_count = torch.zeros(host.size, dtype=torch.int64)
        sources = [("free list", host.anchor_entry.host_pool.free_slots)]
        sources += [(f"node {n.id}", n.cp_hicache.host_indices) for n in nodes if _is_backed(n)]
        sources += [("injected hoard", slots) for slots in self.workload.hoarded_host_slots]
        for _, slots in sources:
            if len(slots) and (int(slots.min()) < 0 or int(slots.max()) >= host.size):
                return f"host slot outside [0, {host.size})"
            owner_count.index_add_(0, slots.to(torch.int64), torch.ones(len(slots), dtype=torch.int64))
        bad = torch.nonzero(owner_count != 1).flatten()
        if len(bad) == 0:
            return None
        slot = int(bad[0])
        holders = [name for name, slots in sources if bool((slots == slot).any())]
        state = "leaked (no owner)" if not holders else "owned by " + " and ".join(holders)
        return f"{len(bad)} physical host slots wrong; slot {slot} {state}"

    def _host_metadata(self, nodes) -> Optional[str]:
        page = self.page_size
        for node in nodes:
            if not _is_backed(node):
                continue
            meta = node.cp_hicache
            owners = meta.owner_ranks.to(torch.int64).view(-1, page)
            if not bool((owners == owners[:, :1]).all()):
                return f"node {node.id}: recorded owners change inside a page"
            mine = torch.nonzero(meta.owner_ranks == self.cp_rank).flatten()
            if not torch.equal(mine, meta.owned_positions):
                return (
                    f"node {node.id}: holds {meta.num_owned} positions on host, but the recorded "
                    f"owners give this rank {len(mine)}"
                )
        return None

    # ---- bytes ----

    def _device_bytes(self, nodes) -> Optional[str]:
        locs, tokens, where = [], [], []
        for node in nodes:
            if not node.evicted:
                locs.append(node.value)
                tokens.append(_node_tokens(node))
                where.append((f"node {node.id}", len(node.value)))
        for req in self.workload.running:
            req_locs, req_tokens = req.kv_locs_and_tokens()
            locs.append(req_locs)
            tokens.append(req_tokens)
            where.append((f"request {req.rid}", len(req_locs)))
        if not locs:
            return None
        bad = owned_kv_mismatches(self.stack, torch.cat(locs), torch.cat(tokens))
        if not bad:
            return None
        first = bad[0]
        owner = next(name for name, loc in zip(_expand(where), torch.cat(locs).tolist()) if loc == first)
        return f"{len(bad)} owned device locs hold wrong KV bytes; first: logical loc {first} of {owner}"

    def _host_bytes(self, nodes) -> Optional[str]:
        slots, tokens, where = [], [], []
        for node in nodes:
            if _is_backed(node) and node.cp_hicache.num_owned:
                slots.append(node.cp_hicache.host_indices)
                tokens.append(_node_tokens(node)[node.cp_hicache.owned_positions])
                where.append((f"node {node.id}", node.cp_hicache.num_owned))
        if not slots:
            return None
        all_slots = torch.cat(slots)
        bad = host_kv_mismatches(self.stack, all_slots, torch.cat(tokens))
        if not bad:
            return None
        owner = next(name for name, s in zip(_expand(where), all_slots.tolist()) if s == bad[0])
        return f"{len(bad)} owned host slots hold wrong KV bytes; first: slot {bad[0]} of {owner}"


def _ids(nodes) -> List[int]:
    return sorted(n.id for n in nodes)


def _expand(where: List[Tuple[str, int]]) -> Iterator[str]:
    for name, count in where:
        for _ in range(count):
            yield name
