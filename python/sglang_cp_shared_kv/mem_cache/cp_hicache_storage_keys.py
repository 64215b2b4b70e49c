"""Owner-free storage keys of logical pages under CP shared KV.

With shared KV a logical page lives whole on one CP rank (its KV rows and its indexer page), so the bytes
of that page are exactly the bytes a replica would hold: which rank owns it is a placement detail, not
part of the content. A page's storage key is therefore the stock page-hash chain (sglang's
``get_hash_str``: SHA-256 of the page's tokens, chained on the previous page's hash) and a namespace
that names everything that makes the bytes of two servers' pages incompatible, and nothing else:

    key(page i) = "<namespace tag>_<sha256 chain of pages 0..i>"

The namespace holds the model, the KV dtype and row width (fp8 NSA rows are 656 bytes, bf16 1152), the
indexer page width, the page size, the layer count and the host layout (a page copied out of a
``layer_first`` host pool is layer-major, out of a ``page_first`` one token-major). It holds no CP rank,
CP size or TP rank: any rank of any CP size can read a page another placement wrote.

An ``extra_key`` of the radix key (LoRA id, cache salt) changes the KV of every page: it seeds the chain.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import List, Optional, Sequence

from sglang.srt.mem_cache.utils import get_hash_str


@dataclass(frozen=True)
class StorageNamespace:
    """What makes two servers' page bytes incompatible (see the module docstring)."""

    model: str
    kv_dtype: str  # e.g. "torch.float8_e4m3fn"
    kv_row_bytes: int  # one token's latent row in one layer, as the host pool holds it
    indexer_page_bytes: int  # one page of NSA indexer K (values and scales) in one layer
    page_size: int  # tokens per page
    layer_num: int
    host_layout: str  # the host pool's --hicache-mem-layout

    def __post_init__(self):
        for name in ("kv_row_bytes", "indexer_page_bytes", "page_size", "layer_num"):
            if getattr(self, name) <= 0:
                raise ValueError(f"StorageNamespace.{name} must be > 0, got {getattr(self, name)}")

    def describe(self) -> str:
        """The namespace in words (startup log line)."""
        return (
            f"model={self.model} kv={self.kv_dtype}x{self.kv_row_bytes}B indexer={self.indexer_page_bytes}B/page "
            f"page={self.page_size} layers={self.layer_num} layout={self.host_layout}"
        )

    def tag(self) -> str:
        """A short, file-name-safe digest of every field: the key prefix."""
        digest = hashlib.sha256(self.describe().encode()).hexdigest()[:16]
        return f"cpkv{digest}"


def page_hash_chain(
    token_ids: Sequence, page_size: int, prior_hash: Optional[str] = None
) -> List[str]:
    """Stock's chained SHA-256 of each whole page of ``token_ids`` (a trailing partial page is left out)."""
    hashes = []
    last = prior_hash
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        last = get_hash_str(list(token_ids[start : start + page_size]), last)
        hashes.append(last)
    return hashes


def chain_seed(extra_key) -> Optional[str]:
    """The chain's prior hash for a radix key's ``extra_key`` (None: no extra key, stock's chain)."""
    if extra_key is None:
        return None
    return hashlib.sha256(f"extra_key:{extra_key}".encode()).hexdigest()


def storage_keys(namespace: StorageNamespace, page_hashes: Sequence[str]) -> List[str]:
    """The owner-free storage key of each page."""
    tag = namespace.tag()
    return [f"{tag}_{page_hash}" for page_hash in page_hashes]
