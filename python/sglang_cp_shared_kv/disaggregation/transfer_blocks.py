"""How many transfer blocks a shared-KV prefill rank hands mooncake, and how many at once.

The stock mooncake sender merges page pairs contiguous on both sides into one block
(``group_concurrent_contiguous``) and submits every layer's blocks of a chunk in one
``batch_transfer_sync`` call (the NSA indexer-K pages of the whole request in a second one). A block
is one transfer request of the engine; over TCP each costs a request on a lane of the peer's
connection, whatever its size. A shared-KV rank sends only the pages it owns, so its blocks end
wherever the request's pages change owner:

* **Owner runs.** With the allocator's default placement (page ``j`` of a request on owner
  ``j % cp_size``) no two owned pages are adjacent in the decode's page list: one block per page
  per layer (GLM-5, 8K prompt, cp 2: 9,984 blocks per rank, against 156 for a stock rank). On a PD
  prefill server the allocator therefore places runs of ``owner_run_pages`` consecutive pages of a
  request on one owner (``(j // run) % cp_size``; the policy is the allocator's,
  ``mem_cache/owner_run_placement.py``), and a rank's blocks are runs of that many pages.
* **Calls of bounded size.** Mooncake's TCP transport queues at most
  ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` (default 1024) requests per peer of one engine, plus as
  many again waiting up to 1 s for admission (``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER``,
  ``MC_TCP_ADMISSION_TIMEOUT_MS``); a batch submitted faster than its lanes drain gets the rest
  rejected ("TCP lane queue-full rejection") and the whole call fails. The sender therefore submits at
  most ``MAX_BLOCKS_PER_TRANSFER_CALL`` blocks per call: the transfer threads of one rank
  (``SGLANG_DISAGGREGATION_QUEUE_SIZE``, 4 by default) then never exceed the default queue together.
"""

from __future__ import annotations

from typing import Iterator, List, Sequence, Tuple

# At most this many blocks per engine call: 4 transfer threads x 256 = mooncake TCP's default
# per-peer queue (1024).
MAX_BLOCKS_PER_TRANSFER_CALL = 256

def bounded_calls(
    blocks: Sequence[Tuple[int, int, int]], max_blocks: int = MAX_BLOCKS_PER_TRANSFER_CALL
) -> Iterator[List[Tuple[int, int, int]]]:
    """``blocks`` in order, in consecutive slices of at most ``max_blocks`` (one per engine call)."""
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    for start in range(0, len(blocks), max_blocks):
        yield list(blocks[start : start + max_blocks])
