"""Peer pages of layer l+1 gathered during layer l: two scratch slots, a side stream, its own group.

Ordering rule: slot ``l % 2`` belongs to layer ``l``; the side stream writes it for layer ``l``
only after the compute stream passed layer ``l-1``'s first store (everything of layer ``l-2``,
its reads of that slot included, is queued before that point), and the compute stream writes or
reads it for layer ``l`` only after waiting for that prefetch.

How the code follows it (``LayerPipeline``):

* ``begin`` (metadata init, before the first layer) records an event on the compute stream, makes
  the side stream wait for it and prefetches the forward's first layer.
* The first store hook of layer ``l`` (``enter_layer``: the indexer store, or the KV store on a
  layer that skips the indexer) records an event on the compute stream; the side stream waits for
  it, then prefetches layer ``l+1`` into slot ``(l+1) % 2``, which layer ``l-1`` read.
* Before storing layer ``l``'s rows into slot ``l % 2``, the compute stream waits for layer
  ``l``'s prefetch event (``slot_for_store``); the layer's reads come after its stores.

What a prefetch moves: every gathered page of the plan (cached prefix, earlier chunks, and a page
mixing old and new tokens), packed from the owner's pool before anything of this forward's layer
was stored there. That is complete for every token of earlier forwards, which is all a gathered
page needs from its owner: the store of layer ``l`` then writes this forward's rows into the slot
itself (at ``PeerPagePlan.remap_token_locs``, mixed pages included, after the prefetch landed), so
no page has to be gathered after the store. HiCache's layer-wise load-back writes the owner's
pages on its own stream; ``LayerDoneCounter.wait_until`` makes the *current* stream wait for the
layer's load event, so it is called on the side stream before packing.

The collective runs on a process group of its own (``create_prefetch_group``): torch runs each
group's NCCL work on that group's internal stream, so a prefetch never queues behind the
forward's own collectives (sglang's communicators) nor those behind it. Every rank takes the same
decisions from the shared plan and the static per-layer indexer table (``skip_topk`` comes from
the model config), so every rank enters the same prefetch collectives in the same order, a rank
owning none of the pages too (it sends its dummy page).

Forwards that do not use the prefetch (decode, a forward with nothing to gather, a plan larger
than the second slot) run the serial path: one slot, each layer gathered on the compute stream
right after its store, over the attention CP group.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from sglang_cp_shared_kv.model_executor.gather_scratch import SCRATCH_LAYER_ID
from sglang_cp_shared_kv.model_executor.peer_page_gather import as_pages, gather_peer_pages
from sglang_cp_shared_kv.model_executor.peer_page_plan import PeerPagePlan
from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG

logger = logging.getLogger(__name__)

KV, INDEX = "kv", "index"


def create_prefetch_group(
    cp_ranks: Sequence[int], coordination_group=None, backend: Optional[str] = None
) -> dist.ProcessGroup:
    """A new process group over this rank's CP ranks, created identically on every rank.

    ``dist.new_group`` must be entered by every process of the default group, for every group, in
    the same order, ranks outside the group included. Each rank only knows its own CP group, so
    the ranks of all of them are exchanged first over ``coordination_group`` (a CPU group spanning
    the default group); then every rank creates every CP group's twin in sorted order and keeps its
    own. Called once at startup.
    """
    world_size = dist.get_world_size()
    every = [None] * world_size
    dist.all_gather_object(every, sorted(int(r) for r in cp_ranks), group=coordination_group)
    groups = sorted({tuple(ranks) for ranks in every})
    members = [rank for ranks in groups for rank in ranks]
    if sorted(members) != list(range(world_size)):
        raise ValueError(f"{FLAG}: the attention CP groups {groups} do not partition the world")
    own = None
    for ranks in groups:
        group = dist.new_group(list(ranks), backend=backend)
        if dist.get_rank() in ranks:
            own = group
    return own


class LayerPipeline:
    """Which scratch slot each layer uses, the side-stream prefetch, and what each slot holds."""

    def __init__(
        self,
        pool,
        slots: Sequence,
        prefetch_group: Optional[dist.ProcessGroup],
        indexer_layer_ids: Optional[frozenset] = None,
    ):
        """``slots``: one scratch pool (serial only) or two (slot 1 may be smaller);
        ``indexer_layer_ids``: layers that store indexer K (None: every layer)."""
        self.pool = pool
        self.slots = list(slots)
        self.prefetch_group = prefetch_group
        self.indexer_layer_ids = indexer_layer_ids
        self.side_stream = None
        self._slot_events = [None] * len(self.slots)  # re-recorded by each prefetch into the slot
        if len(self.slots) > 1 and torch.device(pool.device).type == "cuda":
            self.side_stream = torch.cuda.Stream(device=pool.device)
            self._slot_events = [torch.cuda.Event() for _ in self.slots]
        self.plan: Optional[PeerPagePlan] = None
        self.prefetching = False
        self._logged_serial = False
        self._reset()

    @property
    def can_prefetch(self) -> bool:
        return len(self.slots) > 1 and self.prefetch_group is not None

    def _reset(self) -> None:
        self._current_layer: Optional[int] = None
        # Per slot: (layer id, parts) of the prefetch issued into it, and its event.
        self._prefetched: list = [None] * len(self.slots)
        self._prefetch_events: list = [None] * len(self.slots)
        # Per slot and part: the layer whose store assembled it (reads check it).
        self._assembled = [{KV: None, INDEX: None} for _ in self.slots]

    # ---- per forward ----

    def begin(self, plan: PeerPagePlan, is_decode: bool) -> None:
        """Choose this forward's path from the shared plan and start the first layer's prefetch."""
        self.plan = plan
        self._reset()
        self.prefetching = self.can_prefetch and not is_decode and plan.gather_pages_per_rank > 0
        if self.prefetching and plan.scratch_pages_used > self.slot_num_pages(1):
            self.prefetching = False
            if not self._logged_serial:
                self._logged_serial = True
                logger.info(
                    "CP shared KV: a prefill forward needs %d scratch pages, the second slot has "
                    "%d; such forwards gather each layer after its store (logged once)",
                    plan.scratch_pages_used,
                    self.slot_num_pages(1),
                )
        if self.prefetching:
            self._prefetch_after_compute(self.pool.start_layer)

    def clear(self) -> None:
        """No forward planned: nothing is assembled, so every read raises until the next ``begin``."""
        self.plan = None
        self.prefetching = False
        self._reset()

    def slot_num_pages(self, slot_index: int) -> int:
        slot = self.slots[slot_index]
        return slot.size // slot.page_size + 1

    def slot_index(self, layer_id: int) -> int:
        return (layer_id - self.pool.start_layer) % 2 if self.prefetching else 0

    def enter_layer(self, layer_id: int) -> None:
        """The first store of ``layer_id``: layer ``layer_id - 1``'s reads are all queued."""
        if layer_id == self._current_layer:
            return
        self._current_layer = layer_id
        if self.prefetching and layer_id + 1 < self.pool.start_layer + self.pool.layer_num:
            self._prefetch_after_compute(layer_id + 1)

    def slot_for_store(self, layer_id: int, part: str):
        """The slot ``layer_id``'s store writes, and whether ``part`` of it was prefetched.

        In prefetch mode the compute stream first waits for the layer's prefetch.
        """
        self.enter_layer(layer_id)
        index = self.slot_index(layer_id)
        if not self.prefetching:
            return self.slots[index], False
        prefetched = self._prefetched[index]
        if prefetched is None or prefetched[0] != layer_id:
            raise RuntimeError(
                f"{FLAG}: layer {layer_id} stored before its prefetch was issued "
                f"(slot {index} holds {prefetched})"
            )
        event = self._prefetch_events[index]
        if event is not None:
            torch.cuda.current_stream(self.pool.device).wait_event(event)
        return self.slots[index], part in prefetched[1]

    def mark_assembled(self, layer_id: int, part: str) -> None:
        self._assembled[self.slot_index(layer_id)][part] = layer_id

    def slot_for_read(self, layer_id: int, part: str):
        index = self.slot_index(layer_id)
        holder = self._assembled[index][part]
        if holder != layer_id:
            what = "KV" if part == KV else "indexer K"
            raise RuntimeError(
                f"{FLAG}: {what} of layer {layer_id} read before its store assembled the "
                f"scratch (scratch holds layer {holder})"
            )
        return self.slots[index]

    # ---- the side stream ----

    def _side(self):
        return torch.cuda.stream(self.side_stream) if self.side_stream is not None else contextlib.nullcontext()

    def side_waits_for_compute(self) -> None:
        """Everything queued on the compute stream so far happens before the next prefetch."""
        if self.side_stream is not None:
            self.side_stream.wait_stream(torch.cuda.current_stream(self.pool.device))

    def wait_for_load_back(self, layer_index: int) -> None:
        """HiCache's load-back of the layer, waited for on the current (side) stream."""
        counter = self.pool.layer_transfer_counter
        if counter is not None:
            counter.wait_until(layer_index)

    def _prefetch_after_compute(self, layer_id: int) -> None:
        # This wait also orders the side stream after everything the compute stream has queued for
        # this forward, the plan's non-blocking upload included: the first prefetch (``begin``) reads
        # ``send_physical_pages`` right after it was queued.
        self.side_waits_for_compute()
        index = self.slot_index(layer_id)
        parts = (KV,) + ((INDEX,) if self._stores_index_k(layer_id) else ())
        with self._side():
            self.wait_for_load_back(layer_id - self.pool.start_layer)
            self.gather_into(self.slots[index], layer_id, parts)
            event = self._slot_events[index]
            if event is not None:
                event.record(self.side_stream)
        self._prefetched[index] = (layer_id, parts)
        self._prefetch_events[index] = event

    def gather_into(self, slot, layer_id: int, parts) -> None:
        """Gather the plan's pages of ``layer_id`` into ``slot`` over the prefetch group."""
        layer_index = layer_id - self.pool.start_layer
        if KV in parts:
            gather_peer_pages(
                self.plan,
                as_pages(self.pool.kv_buffer[layer_index], self.pool.page_size),
                as_pages(slot.kv_buffer[SCRATCH_LAYER_ID], slot.page_size),
                self.prefetch_group,
            )
        if INDEX in parts:
            gather_peer_pages(
                self.plan,
                self.pool.index_k_with_scale_buffer[layer_index],
                slot.index_k_with_scale_buffer[SCRATCH_LAYER_ID],
                self.prefetch_group,
            )

    def _stores_index_k(self, layer_id: int) -> bool:
        return self.indexer_layer_ids is None or layer_id in self.indexer_layer_ids


def indexer_layer_ids_of(model) -> Optional[frozenset]:
    """Layers whose attention stores indexer K, from the model's static ``skip_topk`` flags.

    ``skip_topk`` is set from the model config at construction (``index_topk_freq`` /
    ``index_topk_pattern``), so it is identical on every rank and known before any layer runs. A
    layer that skips computes no indexer and stores no indexer K. None when the model exposes no
    such flags (every layer is then assumed to store indexer K).
    """
    ids = set()
    found = False
    for module in model.modules():
        if getattr(module, "indexer", None) is None or not hasattr(module, "skip_topk"):
            continue
        found = True
        if not module.skip_topk:
            ids.add(int(module.layer_id))
    return frozenset(ids) if found else None
