"""The collectives every rank of the CP HiCache joins, and the write and load acks they release.

The radix tree is identical on every rank of the CP group although each rank's host pool, copy
streams and clock are its own. Most decisions need no collective: whether a host write fits, and
which host nodes to evict when it does not, every rank reads from its ``CpHostSlotLedger``. What is
left is agreed here, each time by one all-reduce of a scalar over the attention groups (attention CP,
then attention TP: ``HiRadixCache._all_reduce_attn_groups``), reusing a tensor preallocated when the
cache is built (no tensor per collective):

* MIN of ``(slots, -slots)``: every rank's host pool is the same size (``_host_capacity_by_rank``,
  once, at construction);
* MIN of the finished write acks (``writing_check``, while a write is tracked; started without
  waiting, applied at the next call);
* MIN of the finished load-backs (``loading_check``, while a load-back is tracked);
* MIN of "got the device locs" (``_all_ranks_ok``: ``load_back``, once per attempt);
* MAX of the host nodes each rank needed evicted (``_max_over_ranks``: ``evict_host``);
* MIN of the L3 pages found, then of the pages read (``_min_over_ranks``: the storage prefetch).

Ordering rule: every rank enters the same collectives in the same order, because each one is reached
through decisions taken on state identical on every rank (the tree, the host ledger, the tracked writes
and load-backs, request lengths), never on this rank's own pool, copy progress or clock; a rank that owns
none of a node's pages still joins. Only the write-ack count stays in flight past its call: collectives
on a group are matched across ranks by issue order, and the next ``writing_check`` waits for it before
reading its result (``reset`` waits for it and drops it).

Costs and history in ``docs/cp-hicache-performance.md``; the protocol in ``docs/cp-hicache.md``.
"""

from __future__ import annotations

from typing import List

import torch

from sglang.srt.disaggregation.kv_events import StorageMedium

from sglang_cp_shared_kv.settings import CP_SHARED_KV_FLAG as FLAG


class _FinishedCollective:
    """The handle of a collective that already ran (the blocking fallback of an async one)."""

    def wait(self) -> bool:
        return True


FINISHED_COLLECTIVE = _FinishedCollective()


class CpHiRadixRankAgreement:
    """The agreement part of ``CpHiRadixCache`` (mixed in before sglang's ``HiRadixCache``, whose
    groups, controller and ack queues it uses)."""

    def _init_rank_agreement(self) -> None:
        """The agreement tensors, reused by every call; before the stock constructor (its reset)."""
        self._agreed_ok = torch.zeros((), dtype=torch.int32)
        self._agreed_max = torch.zeros((), dtype=torch.int64)
        self._agreed_write_acks = torch.zeros((), dtype=torch.int32)
        self._agreed_load_acks = torch.zeros((), dtype=torch.int32)
        self._write_acks_in_flight = None  # the write-ack all-reduce started by the last writing_check
        self._ack_reduce_groups = None  # groups the write-ack count reduces over (first writing_check)

    def _host_capacity_by_rank(self, cp_size: int) -> List[int]:
        """Every CP rank's host slots, which the ledger starts from: one startup agreement that they
        are the same (a MIN of ``(slots, -slots)``), and a clear error if they are not."""
        slots = self.cache_controller.mem_pool_host.available_size()
        bounds = torch.tensor([slots, -slots], dtype=torch.int64)
        self._all_reduce_attn_groups(bounds, torch.distributed.ReduceOp.MIN)
        smallest, largest = int(bounds[0]), -int(bounds[1])
        if smallest != largest:
            raise ValueError(
                f"{FLAG}: the CP ranks' host pools differ ({smallest} to {largest} slots); "
                "--hicache-ratio / --hicache-size must give every rank the same host pool"
            )
        return [slots] * cp_size

    def _all_ranks_ok(self, ok: bool) -> bool:
        flag = self._agreed_ok
        flag.fill_(int(ok))
        self._all_reduce_attn_groups(flag, torch.distributed.ReduceOp.MIN)
        return bool(flag.item())

    def _max_over_ranks(self, value: int) -> int:
        tensor = self._agreed_max
        tensor.fill_(value)
        self._all_reduce_attn_groups(tensor, torch.distributed.ReduceOp.MAX)
        return int(tensor.item())

    def _min_over_ranks(self, value: int) -> int:
        tensor = self._agreed_max
        tensor.fill_(value)
        self._all_reduce_attn_groups(tensor, torch.distributed.ReduceOp.MIN)
        return int(tensor.item())

    # ---- write acknowledgement ----

    def writing_check(self, write_back: bool = False):
        """Stock agrees on finished write acks with a blocking all-reduce and applies them at once; here
        the all-reduce starts now and its agreed count is applied at the next ``writing_check``.

        Every rank still pops the same acks at the same call: the count started at one call is the MIN
        over ranks of the acks finished then, and the next call waits for it (long done by then) and
        pops exactly that many before counting again. The blocking ``write_back`` path has no
        collective and stays stock (after the count in flight is applied).
        """
        self._apply_write_acks_in_flight()
        if write_back or len(self.ongoing_write_through) == 0:
            # All ranks have the same ongoing writes, so all skip the collective together.
            # (write_back: stock waits for every write; then they go on to storage, in order.)
            written = list(self.ongoing_write_through.values()) if write_back else []
            result = super().writing_check(write_back=write_back)
            for node in written:
                self._store_write(node)
            return result
        finished = 0
        for _, finish_event, _ in self.cache_controller.ack_write_queue:
            if not finish_event.query():
                break
            finished += 1
        count = self._agreed_write_acks
        count.fill_(finished)
        # Keep cache state transitions identical across CPxTP participants.
        self._write_acks_in_flight = self._start_all_reduce_attn_groups(
            count, torch.distributed.ReduceOp.MIN
        )

    def _apply_write_acks_in_flight(self) -> None:
        work, self._write_acks_in_flight = self._write_acks_in_flight, None
        if work is not None:
            work.wait()
            self._apply_write_acks(int(self._agreed_write_acks.item()))

    def _start_all_reduce_attn_groups(self, tensor: torch.Tensor, op):
        """``_all_reduce_attn_groups`` without waiting: a handle whose ``wait()`` leaves the result in
        ``tensor``. Over two groups (attention CP, then attention TP) the second reduces the first's
        result, so that case stays blocking and returns a finished handle."""
        groups = self._ack_reduce_groups
        if groups is None:
            # The groups are fixed once the cache is built: worked out at the first check only.
            groups = [
                group
                for group in (self.attn_cp_group, self.attn_tp_group)
                if group is not None and torch.distributed.get_world_size(group=group) > 1
            ]
            if not groups and self.tp_world_size > 1:
                groups = [self.tp_group]
            self._ack_reduce_groups = groups
        if len(groups) == 1:
            return torch.distributed.all_reduce(tensor, op=op, group=groups[0], async_op=True)
        self._all_reduce_attn_groups(tensor, op)
        return FINISHED_COLLECTIVE

    def _apply_write_acks(self, count: int) -> None:
        """Pop the first ``count`` write acks (finished on every rank): host copy confirmed, unlock."""
        queue = self.cache_controller.ack_write_queue
        for _, finish_event, ack_list in queue[:count]:
            finish_event.synchronize()
            for ack_id in ack_list:
                node = self.ongoing_write_through.pop(ack_id)
                self._record_store_event(node, medium=StorageMedium.CPU)
                self.dec_lock_ref(node)
                self._store_write(node)
        del queue[:count]

    def _drop_write_acks_in_flight(self) -> None:
        """Wait for a write-ack count in flight (every rank started it) and forget it (``reset``)."""
        work, self._write_acks_in_flight = self._write_acks_in_flight, None
        if work is not None:
            work.wait()

    # ---- load acknowledgement ----

    def loading_check(self):
        """Release the locks of the load-backs finished on EVERY rank, the same ones at the same call.

        Stock releases a load's lock when this rank's copy finished, with no collective. When that lock
        is the node's only one (stock's ``PrefillAdder`` can decline a request right after
        ``init_load_back``, e.g. with a ``--chunked-prefill-size`` that is not a multiple of the page),
        a rank whose copy finished first has a larger ``evictable_size_`` and unlocked leaves, the same
        ``evict()`` then leaves different trees on different ranks, and their next decisions and
        collectives diverge (a hang). Acks being one per load on every rank does not help: the ranks'
        copies finish at different times. So the count of finished loads is agreed like the write
        acks' (a MIN over ranks; blocking, and only while a load-back is tracked, which every rank
        knows alike), and every rank pops exactly that many in queue order.
        """
        if len(self.ongoing_load_back) == 0:
            return  # every rank tracks the same load-backs: all skip the collective together
        queue = self.cache_controller.ack_load_queue
        finished = 0
        for _, finish_event, _ in queue:
            if not finish_event.query():
                break
            finished += 1
        count = self._agreed_load_acks
        count.fill_(finished)
        self._all_reduce_attn_groups(count, torch.distributed.ReduceOp.MIN)
        agreed = int(count.item())
        for _, finish_event, ack_list in queue[:agreed]:
            finish_event.synchronize()  # finished on this rank already (MIN <= this rank's count)
            for ack_id in ack_list:
                self.dec_lock_ref(self.ongoing_load_back.pop(ack_id))
        del queue[:agreed]
