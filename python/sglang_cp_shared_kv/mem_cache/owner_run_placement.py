"""How many consecutive pages of a request the shared-KV allocator places on one owner.

By default page ``j`` of a request lives on owner ``j % cp_size`` (runs of one page). On a PD
prefill server a rank sends only the pages it owns, and mooncake merges only pages adjacent in the
decode's page list into one transfer block, so one-page runs cost one block per page per layer.
There the allocator places runs of ``owner_run_pages`` pages on one owner (``(j // run) %
cp_size``), and a rank's blocks are runs of that many pages (``disaggregation/transfer_blocks.py``
counts them). Any placement is correct: every rank stores the owned rows of the whole all-gathered
chunk. The capacity hook (``model_executor/cp_shared_kv_capacity.py``) asks it when it builds
the allocator (``CPSharedPagedTokenToKVPoolAllocator``), which places the runs.
"""

from __future__ import annotations

from typing import Optional

# Pages of a request placed on one owner in a row on a PD prefill server (1024 tokens at page 64):
# a block of 16 pages carries 672 KB of fp8 GLM-5 KV per layer, so the per-request cost of the engine
# (tens of microseconds over TCP) is small against the bytes.
PD_PREFILL_OWNER_RUN_PAGES = 16


def owner_run_pages(server_args, cp_size: int, page_size: int) -> int:
    """Consecutive pages of a request the allocator places on one owner: 1 (round-robin) unless the
    server is a PD prefill server, where runs shorten the transfer (module docstring). A run never
    exceeds ``chunk pages / cp_size``, so every chunk of a chunked prefill still reaches every rank
    and the allocator's per-chunk balance does not break the runs."""
    if getattr(server_args, "disaggregation_mode", "null") != "prefill" or cp_size <= 1:
        return 1
    run = PD_PREFILL_OWNER_RUN_PAGES
    chunk_tokens: Optional[int] = getattr(server_args, "chunked_prefill_size", None)
    if chunk_tokens is not None and chunk_tokens > 0:
        run = min(run, chunk_tokens // page_size // cp_size)
    return max(1, run)
