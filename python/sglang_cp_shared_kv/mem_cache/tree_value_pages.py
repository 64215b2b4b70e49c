"""Host page ids of radix-tree node values, so a cached prefix's pages are known without the device.

A request's cached prefix (``req.prefix_indices``, written into ``req_to_token`` by the next extend)
is the concatenation of the values of the tree nodes from the root to ``req.last_node``, a device
tensor. Every node value is a copy of a ``req_to_token`` row slice (``cache_finished_req`` /
``cache_unfinished_req`` insert ``req_to_token[row, :len]``), a HiCache load-back allocation, or a
half of a split node's value. Each node therefore carries ``cp_value_pages``, the logical page of each
of its pages (values are whole pages: keys are page-aligned), set wherever ``node.value`` is assigned:

* insert: from the inserting row's mirrored pages (``inserting_from``, set around the two
  ``cache_*_req`` calls), for every node on the key path whose value is new (``record_inserted_values``);
* split: the two halves of the split node's pages (``split_value_pages``);
* load-back: the allocator's host record of the new locs (``CpHiRadixCache.load_back``).

Key shapes: a node's key counts logical units, tokens or, on the tree of an MTP server
(``is_eagle``), token bigrams; unit ``i`` holds the KV loc of row position ``i`` in both, so depths
and page cuts are positions. Children are read as the tree reads them (``record_inserted_values``).

``cp_value_pages_of`` remembers the value tensor the pages describe; pages are valid only while
``node.value is node.cp_value_pages_of``, so a value replaced anywhere else (or evicted to ``None``)
is never read with stale pages: ``path_pages`` raises instead. Only trees of a server whose
``req_to_token`` is mirrored (``tracks_value_pages``) keep them.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import numpy as np

from sglang_cp_shared_kv.mem_cache.req_to_page_mirror import mirror_of
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG

_EMPTY = np.zeros(0, dtype=np.int32)


def tracks_value_pages(tree) -> bool:
    return mirror_of(getattr(tree, "req_to_token_pool", None)) is not None


def set_value_pages(node, pages: np.ndarray) -> None:
    node.cp_value_pages = pages
    node.cp_value_pages_of = node.value


def value_pages(node) -> Optional[np.ndarray]:
    """The node's page ids if they describe its current value, else None."""
    value = node.value
    if value is None or getattr(node, "cp_value_pages_of", None) is not value:
        return None
    return node.cp_value_pages


def path_pages(node) -> np.ndarray:
    """Page ids of the values from the root (exclusive) down to ``node``: a matched prefix's pages."""
    parts = []
    while node is not None and node.parent is not None:
        pages = value_pages(node)
        if pages is None:
            raise RuntimeError(
                f"{FLAG}: radix node {node.id} has no host page ids for its value (evicted, or its "
                f"value was assigned outside the tracked paths); the plan cannot know its pages"
            )
        parts.append(pages)
        node = node.parent
    if not parts:
        return _EMPTY
    return np.concatenate(parts[::-1]) if len(parts) > 1 else parts[0]


def split_value_pages(new_node, child, pages: Optional[np.ndarray], split_len: int, page_size: int):
    """After ``_split_node``: ``new_node`` got the first ``split_len`` tokens of ``child``'s value."""
    if pages is None:
        return
    cut = split_len // page_size
    if new_node.value is not None:
        set_value_pages(new_node, pages[:cut])
    if child.value is not None:
        set_value_pages(child, pages[cut:])


@contextlib.contextmanager
def inserting_from(tree, row_pages: np.ndarray) -> Iterator[None]:
    """Inserts inside the block insert values copied from a row whose page ids are ``row_pages``
    (position 0 onward)."""
    tree.cp_inserting_pages = row_pages
    try:
        yield
    finally:
        tree.cp_inserting_pages = None


def record_inserted_values(tree, key) -> None:
    """After an insert of the page-aligned ``key``: give every node on its path whose value is new
    (no valid pages) the inserted row's pages at the node's depth.

    The walk reads children exactly as the tree does: the tree's own key conversion (an EAGLE tree,
    ``is_eagle``, keys by token bigrams; the insert already converted this key, so it is a no-op
    there) and ``RadixKey.child_key`` (page size, ``extra_key``). Depth counts the key's logical
    units, which are row positions in both shapes: bigram ``i`` (tokens ``i, i+1``) holds the KV loc
    of position ``i``, so a bigram key of ``n`` tokens covers positions ``[0, n - 1)`` and its pages
    are ``row_pages[depth // page_size ...]`` as for plain keys.
    """
    page_size = tree.page_size
    rest, _ = key.maybe_to_bigram_view(getattr(tree, "is_eagle", False))
    row_pages = getattr(tree, "cp_inserting_pages", None)
    node, depth = tree.root_node, 0
    while len(rest) > 0:
        child = node.children.get(rest.child_key(page_size))
        if child is None:
            return
        length = len(child.key)
        if child.value is not None and value_pages(child) is None:
            if row_pages is None or (depth + length) // page_size > len(row_pages):
                raise RuntimeError(
                    f"{FLAG}: radix insert of a value whose host page ids are unknown (an insert "
                    f"outside cache_finished_req / cache_unfinished_req)"
                )
            set_value_pages(child, row_pages[depth // page_size : (depth + length) // page_size])
        node, depth, rest = child, depth + length, rest[length:]
