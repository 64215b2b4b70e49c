"""A failed transfer fails its request, and only it.

Stock sglang 0.5.11's mooncake transfer worker treats a non-zero result of ``send_kvcache`` as a dead
decode instance: it adds the mooncake session to ``failed_sessions`` and from then on fails every
request to that decode instance ("Decode instance could be dead") until the decode re-registers. It
ignores the result of ``maybe_send_extra`` (the NSA indexer-K pages), so a failed indexer-K send is
reported to the decode as Success and decode selects its top-k on stale keys.

On a shared-KV prefill server a transfer can fail for one request's reasons (pages that cannot be
paired, an engine call refused by a full mooncake TCP queue) while the decode instance is healthy.
So every part of a request's transfer (KV and MTP draft KV in ``send_kvcache``, indexer K and draft
indexer K in ``maybe_send_extra``) reports its failure here instead of to the stock worker:

1. ``fail`` records the reason (``record_failure``, what the prefill scheduler reports) and marks
   ``(room, decode session)`` failed; the part returns 0, so the stock worker marks no session.
2. Every later part of that request on this rank sends nothing (``has_failed``).
3. On the request's last chunk ``send_aux`` sees the mark (``take``) and returns -1: the stock worker
   then sets the room Failed and tells the decode Failed, once, instead of Success. No metadata is
   sent. The decode counts one Failed among its ``cp_size`` senders and fails the request; the
   prefill scheduler's poll (a MIN over the CP group) fails it on every rank.

Which request a part belongs to: ``send_kvcache`` is not given the room, so the manager's
``transfer_worker`` runs the stock worker on a queue that remembers, per transfer thread, the
chunk it handed out last (``ChunkTrackingQueue``); the stock worker handles one chunk at a time.

A dead decode instance therefore no longer fails later requests up front: each fails on its own
transfer (its engine calls fail), which is what a request whose decode died mid-transfer sees in
stock too.
"""

from __future__ import annotations

import threading
from typing import Dict, Optional, Tuple


class ChunkTrackingQueue:
    """The transfer queue as the stock worker sees it, remembering the chunk last taken by this thread."""

    def __init__(self, queue, current: threading.local):
        self._queue = queue
        self._current = current

    def get(self):
        self._current.chunk = None
        chunk = self._queue.get()
        self._current.chunk = chunk
        return chunk

    def __getattr__(self, name):  # put, qsize ...: the real queue's
        return getattr(self._queue, name)


class RequestTransferFailures:
    """``(room, mooncake session) -> reason`` of requests whose transfer failed on this rank and whose
    Failed status has not been sent yet; shared by a manager's transfer threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._reasons: Dict[Tuple[int, str], str] = {}
        self._current = threading.local()  # .chunk: the TransferKVChunk this thread works on

    def tracking(self, queue) -> ChunkTrackingQueue:
        return ChunkTrackingQueue(queue, self._current)

    def current_room(self) -> Optional[int]:
        """The room of the chunk this transfer thread is working on (None outside the worker)."""
        chunk = getattr(self._current, "chunk", None)
        return None if chunk is None else int(chunk.room)

    def fail(self, room: int, session_id: str, reason: str) -> None:
        with self._lock:
            self._reasons.setdefault((int(room), session_id), reason)

    def has_failed(self, room: Optional[int], session_id: str) -> bool:
        if room is None:
            return False
        with self._lock:
            return (int(room), session_id) in self._reasons

    def take(self, room: int, session_id: str) -> Optional[str]:
        """The reason ``room``'s transfer to ``session_id`` failed, forgotten once read (None: it did not)."""
        with self._lock:
            return self._reasons.pop((int(room), session_id), None)
