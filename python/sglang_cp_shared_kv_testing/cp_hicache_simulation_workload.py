"""The scheduler side of one rank of a simulated CP HiCache group: a seeded random workload.

Every rank builds a ``CpHiCacheWorkload`` with the same scenario and seed and draws (``next_operation``)
and runs (``run``) the same number of operations, so every rank runs the same sequence of operations,
exactly as every CP rank runs the same scheduler on the same batches. Operations go through the entry
points sglang's scheduler uses, on the real ``CpHiRadixCache`` and CP allocator:

* **admit**: a prefill round of 1-3 requests, each like ``PrefillAdder.add_one_req``: ``match_prefix``,
  the logical budget (``available + evictable`` minus what the round already promised), the adder's
  lock, ``init_load_back`` (no quota, the adder's quota, or a shrunk one; optionally declined right
  after it, as the adder can: ``decline_after_load``); then one
  ``ready_to_load_host_cache``, then sglang's own ``alloc_for_extend`` (request slots,
  ``evict_from_tree_cache``, one batched ``alloc_extend``, ``write_cache_indices``), the KV write of
  the new tokens (``write_owned_kv``: each rank stores what it owns), and ``cache_unfinished_req``
  (chunked or not) or an immediate ``cache_finished_req``.
* **continue_chunk**, **decode** (sglang's ``alloc_for_decode``, several steps; retraction when out
  of room),
  **finish** / **abort** (``cache_finished_req`` with / without insert), **match_waiting** (a match
  without admission, as the scheduler's prefix-aware priority does).
* **check_events** (``check_hicache_events``: write and load acks), **evict_device** (``evict``),
  **evict_host** (``evict_host`` with a different physical need on each rank).
* Failures injected on one rank: the next load-back device allocations (``alloc_with_owners``) fail
  there. Host shortage is not injected: it is real and differs per rank (each rank's host pool holds the
  pages it owns), and a host pool that refuses slots its ledger counts as free is a bug the cache
  raises on (``CpHostSlotLedger``).
* **drain** (every request out, acks drained, every node evicted from device and host: free counts
  must be back at baseline) and **flush** (the scheduler's idle ``flush_cache``: reset of the tree,
  request slots and allocator).

Prompts are a prefix, cut at any token, of a shared document or of a recent prompt, then fresh token
ids; decode appends fresh ids. So inserts and matches split nodes at arbitrary page boundaries, on the
device and on host, and a token id is never reused for another (prefix, position): it names the KV its
row must hold (see ``cp_hicache_simulation_invariants``).
"""

from __future__ import annotations

import collections
import contextlib
import random
from types import SimpleNamespace
from typing import List, Optional, Tuple
from unittest import mock

import torch

from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache import common
from sglang.srt.mem_cache.radix_cache import RadixKey

from sglang_cp_shared_kv_testing.cp_hicache_simulation_invariants import write_owned_kv
from sglang_cp_shared_kv_testing.cp_hicache_stack import HiCacheStack
from sglang_cp_shared_kv_testing.scheduler_writes import host_write_path

# (operation, relative weight). Drain and flush are rare: they empty the cache.
OPERATIONS: Tuple[Tuple[str, float], ...] = (
    ("admit", 25),
    ("match_waiting", 5),
    ("continue_chunk", 12),
    ("decode", 14),
    ("finish", 12),
    ("abort", 2),
    ("check_events", 10),
    ("evict_device", 5),
    ("evict_host", 3),
    ("inject_device_failure", 3),
    ("drain", 0.15),
    ("flush", 0.08),
    ("restart", 0.3),  # with a storage tier only
)

_KEPT_PROMPTS = 24


class SimRequest:
    """The fields of sglang's ``Req`` that the radix cache and the scheduler's allocation read."""

    def __init__(self, rid: int, origin_input_ids: List[int], priority: int, req_to_token_pool):
        self.rid = rid
        self.origin_input_ids = origin_input_ids
        self.output_ids: List[int] = []
        self.fill_ids: List[int] = []
        self.extra_key = None
        self.priority = priority
        self.req_pool_idx: Optional[int] = None
        self.prefix_indices = torch.empty((0,), dtype=torch.int64)
        self.last_node = None
        self.last_host_node = None
        self.host_hit_length = 0
        # Logical tokens [0, cache_protected_len) belong to the tree; the rest to the request.
        self.cache_protected_len = 0
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.kv_committed_freed = False
        self.is_chunked = 0
        self._req_to_token_pool = req_to_token_pool

    def pop_committed_kv_cache(self) -> int:
        assert not self.kv_committed_freed, f"request {self.rid} released twice"
        self.kv_committed_freed = True
        return self.kv_committed_len

    def all_token_ids(self) -> List[int]:
        return self.origin_input_ids + self.output_ids

    def kv_locs_and_tokens(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Logical locs and token ids of every token whose KV the request has."""
        row = self._req_to_token_pool.req_to_token[self.req_pool_idx]
        locs = row[: self.kv_allocated_len].to(torch.int64)
        tokens = torch.tensor(self.all_token_ids()[: self.kv_allocated_len], dtype=torch.int64)
        return locs, tokens

    def private_locs(self) -> torch.Tensor:
        """Logical locs the request holds outside the tree."""
        row = self._req_to_token_pool.req_to_token[self.req_pool_idx]
        return row[self.cache_protected_len : self.kv_allocated_len].to(torch.int64)


@contextlib.contextmanager
def _quiet_out_of_memory(tree):
    """sglang logs an error and prints the whole tree before it raises out of memory; the workload
    expects that outcome (and handles it), so neither is shown."""
    with mock.patch.object(common.logger, "error"), mock.patch.object(tree, "pretty_print"):
        yield


class _FailNextCalls:
    """Makes the next ``remaining`` calls of one bound method return ``None`` (an injected failure)."""

    def __init__(self, owner, method_name: str):
        self.original = getattr(owner, method_name)
        self.remaining = 0
        self.fired = 0
        setattr(owner, method_name, self)

    def __call__(self, *args, **kwargs):
        if self.remaining > 0:
            self.remaining -= 1
            self.fired += 1
            return None
        return self.original(*args, **kwargs)


class CpHiCacheWorkload:
    """One rank's scheduler stand-in: ``next_operation()`` draws a seeded operation, ``run()`` runs it.

    ``stats`` counts decisions, identical on every rank; ``local_stats`` counts what this rank alone
    did (injected failures that fired, physical host slots freed).
    """

    def __init__(
        self,
        stack: HiCacheStack,
        *,
        seed: int,
        max_running_requests: int,
        max_request_tokens: int,
        decline_after_load: float = 0.0,
    ):
        self.stack = stack
        self.decline_after_load = decline_after_load  # see SimulationScenario
        self.cache = stack.cache
        self.allocator = stack.allocator
        self.host = stack.controller.mem_pool_host
        self.page_size = stack.layout.page_size
        self.cp_size = stack.layout.cp_size
        self.cp_rank = stack.layout.cp_rank
        self.rng = random.Random(seed)
        self.max_running_requests = max_running_requests
        self.max_request_tokens = max_request_tokens
        self.max_prompt_tokens = max_request_tokens - 2 * self.page_size
        self.next_token_id = 1
        # Long shared prefixes (system prompts, documents), together about 1.5x the logical device
        # pool: they are evicted under pressure and come back from host. Plus the recent prompts.
        self.documents: List[List[int]] = []
        while sum(map(len, self.documents)) < 3 * self.allocator.size // 2:
            length = self.rng.randint(self.page_size, self.max_prompt_tokens - self.page_size)
            self.documents.append(self._fresh_tokens(length))
        self.prompts: List[List[int]] = []
        self.next_rid = 0
        self.running: List[SimRequest] = []
        self.device_failures = _FailNextCalls(self.allocator, "alloc_with_owners")
        self.stats = collections.Counter()
        self.local_stats = collections.Counter()
        # Set by drain / flush: the checker then expects an empty cache.
        self.at_baseline = False
        self._count_cache_decisions()

    # ---- driver ----

    def next_operation(self) -> str:
        """Draw the next operation among those possible now (the same on every rank)."""
        enabled = [(name, weight) for name, weight in OPERATIONS if self._enabled(name)]
        names, weights = zip(*enabled)
        return self.rng.choices(names, weights)[0]

    def run(self, operation: str) -> str:
        """Run one operation; returns what it did."""
        self.at_baseline = False
        self.stats[f"op {operation}"] += 1
        return getattr(self, f"_op_{operation}")()

    def request_summary(self) -> list:
        return [
            (r.rid, r.req_pool_idx, r.last_node.id, r.cache_protected_len, r.kv_allocated_len,
             r.is_chunked)
            for r in self.running
        ]  # fmt: skip

    def _enabled(self, name: str) -> bool:
        if name == "admit":
            return len(self.running) < self.max_running_requests
        if name == "continue_chunk":
            return any(r.is_chunked for r in self.running)
        if name in ("decode", "finish"):
            return any(not r.is_chunked for r in self.running)
        if name == "abort":
            return bool(self.running)
        if name == "restart":
            return self.cache.cp_storage is not None
        return True

    # ---- requests ----

    def _op_admit(self) -> str:
        """One prefill round: admit 1-3 new requests like ``PrefillAdder``, start their load-backs
        with one ``ready_to_load_host_cache``, then prefill them in one batch."""
        free_slots = self.max_running_requests - len(self.running)
        wanted = min(free_slots, self.rng.choice((1, 1, 2, 3)))
        batch, notes, promised = [], [], 0
        for _ in range(wanted):
            req, note, extend_len = self._admit_one(promised)
            notes.append(note)
            if req is not None:
                batch.append(req)
                promised += extend_len + self.page_size
        self.cache.ready_to_load_host_cache()
        about = "admit [" + "; ".join(notes) + "]"
        if not batch:
            return about
        # Request slots come with the extend (sglang's alloc_for_extend takes them).
        # Chunked prefill: at most one request per round is cut, the last one admitted.
        fill_lens = [len(r.origin_input_ids) for r in batch[:-1]]
        fill_lens.append(self._chunk_end(batch[-1], len(batch[-1].prefix_indices)))
        if not self._prefill(batch, fill_lens):
            for req in batch:
                self.cache.dec_lock_ref(req.last_node)
                if req.req_pool_idx is not None:
                    self.stack.req_to_token_pool.free(req)
            self.stats["extend out of memory after admission"] += 1
            return about + ", extend allocation failed"
        self.running += batch
        return about + "".join(self._after_prefill(req) for req in batch)

    def _admit_one(self, promised: int):
        """Match, budget check, load-back and lock for one new request; ``(None, note, 0)`` if declined.

        ``promised`` is what earlier requests of this round will allocate (logical tokens).
        """
        tokens = self._new_prompt()
        req = SimRequest(
            self.next_rid, tokens, self.rng.choice((0, 0, 1, 2)), self.stack.req_to_token_pool
        )
        self.next_rid += 1
        self._prefetch_from_storage(req)
        # The scheduler matches at most input_len - 1 tokens.
        match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens[: len(tokens) - 1])))
        req.prefix_indices = match.device_indices
        req.last_node, req.last_host_node = match.last_device_node, match.last_host_node
        req.host_hit_length = match.host_hit_length
        extend_len = len(tokens) - len(req.prefix_indices)
        note = (
            f"request {req.rid}: {len(tokens)} tokens, {len(req.prefix_indices)} on device, "
            f"{req.host_hit_length} on host"
        )
        # PrefillAdder: lock the device prefix (which shrinks the evictable room), check the budget
        # again, load back, lock the request's last node, release the adder's lock.
        adder_lock = req.last_node
        self.cache.inc_lock_ref(adder_lock)
        room = self._logical_room() - promised
        if extend_len + self.page_size >= room:
            self.cache.dec_lock_ref(adder_lock)
            self.stats["admission declined (no room)"] += 1
            return None, note + ", declined (no room)", 0
        if req.host_hit_length > 0:
            quota = self._load_back_quota(req, extend_len, room)
            loaded, req.last_node = self.cache.init_load_back(
                InitLoadBackParams(
                    last_host_node=req.last_host_node,
                    host_hit_length=req.host_hit_length,
                    mem_quota=quota,
                )
            )
            req.prefix_indices = torch.cat([req.prefix_indices, loaded])
            note += f", loaded back {len(loaded)} (quota {quota})"
            if len(loaded) and self.decline_after_load and self.rng.random() < self.decline_after_load:
                # PrefillAdder declining after init_load_back: only the load's lock holds the nodes.
                self.cache.dec_lock_ref(adder_lock)
                self.stats["admission declined after its load-back"] += 1
                return None, note + ", declined after its load-back", 0
        self.cache.inc_lock_ref(req.last_node)
        self.cache.dec_lock_ref(adder_lock)
        req.cache_protected_len = len(req.prefix_indices)
        return req, note, len(tokens) - len(req.prefix_indices)

    def _op_match_waiting(self) -> str:
        """The scheduler matches waiting requests every round (prefix-aware priority) without admitting
        them: the match may split nodes, on the device or on host."""
        tokens = self._new_prompt()
        match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens[: len(tokens) - 1])))
        return (
            f"match a waiting request: {len(tokens)} tokens, {len(match.device_indices)} on device, "
            f"{match.host_hit_length} on host"
        )

    def _op_continue_chunk(self) -> str:
        req = self.rng.choice([r for r in self.running if r.is_chunked])
        prefix_len = len(req.prefix_indices)
        about = f"continue chunked request {req.rid} from {prefix_len} of {len(req.origin_input_ids)}"
        fill_len = self._chunk_end(req, prefix_len)
        if fill_len - prefix_len + self.page_size >= self._logical_room():
            self.stats["chunk declined (no room)"] += 1
            return about + ", declined (no room)"
        if not self._prefill([req], [fill_len]):
            self.stats["extend out of memory after admission"] += 1
            return about + ", extend allocation failed"
        return about + self._after_prefill(req)

    def _op_decode(self) -> str:
        steps = self.rng.randint(1, 8)
        for step in range(steps):
            batch = [r for r in self.running if not r.is_chunked]
            if not batch:
                return f"decode: batch empty after {step} steps"
            num_tokens = len(batch) * self.page_size  # the scheduler's over-estimate
            if num_tokens >= self._logical_room():
                return f"decode step {step}: " + self._retract(batch)
            # sglang's alloc_for_decode: evict_from_tree_cache (the same over-estimate),
            # alloc_decode, the write of each request's next position.
            seq_lens = torch.tensor([r.kv_allocated_len for r in batch], dtype=torch.int64)
            schedule_batch = SimpleNamespace(
                reqs=batch, seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(),
                req_pool_indices=torch.tensor([r.req_pool_idx for r in batch], dtype=torch.int64),
                req_to_token_pool=self.stack.req_to_token_pool, tree_cache=self.cache,
                token_to_kv_pool_allocator=self.allocator, maybe_evict_swa=lambda: None,
                model_config=SimpleNamespace(is_encoder_decoder=False),
            )  # fmt: skip
            try:
                with host_write_path(), _quiet_out_of_memory(self.cache):
                    locs = common.alloc_for_decode(schedule_batch, token_per_req=1)
            except RuntimeError as error:
                if "out of memory" not in str(error):
                    raise
                self.stats["decode out of memory after eviction"] += 1
                return f"decode step {step}: " + self._retract(batch)
            new_tokens = self._fresh_tokens(len(batch))
            for req, token in zip(batch, new_tokens):
                req.output_ids.append(token)
                req.kv_allocated_len += 1
                req.kv_committed_len += 1
            write_owned_kv(self.stack, locs, torch.tensor(new_tokens, dtype=torch.int64))
            for req in batch:
                if req.kv_allocated_len >= self.max_request_tokens:
                    self._release(req, insert=True)
        return f"decode {steps} steps"

    def _op_finish(self) -> str:
        req = self.rng.choice([r for r in self.running if not r.is_chunked])
        self._release(req, insert=True)
        return f"finish request {req.rid} ({req.kv_allocated_len} tokens)"

    def _op_abort(self) -> str:
        req = self.rng.choice(self.running)
        self._release(req, insert=False)
        return f"abort request {req.rid} ({req.kv_allocated_len} tokens)"

    def _retract(self, batch: List[SimRequest]) -> str:
        # The scheduler retracts a decoding request when the pool is out of room.
        req = max(batch, key=lambda r: (r.kv_allocated_len, r.rid))
        self._release(req, insert=False)
        self.stats["decode retractions"] += 1
        return f"retract request {req.rid}"

    def _prefill(self, batch: List[SimRequest], fill_lens: List[int]) -> bool:
        """One prefill forward: allocate and write tokens ``[len(prefix_indices), fill_len)`` of each
        request through sglang's own ``alloc_for_extend`` (request slots, ``evict_from_tree_cache``,
        one ``alloc_extend`` for the batch, ``write_cache_indices``)."""
        prefix_lens = [len(r.prefix_indices) for r in batch]
        extend_lens = [f - p for f, p in zip(fill_lens, prefix_lens)]
        seq_lens = torch.tensor(fill_lens, dtype=torch.int64)
        schedule_batch = SimpleNamespace(
            reqs=batch, prefix_lens=prefix_lens, extend_lens=extend_lens,
            extend_num_tokens=sum(extend_lens), seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(),
            device=self.stack.req_to_token_pool.device, req_to_token_pool=self.stack.req_to_token_pool,
            tree_cache=self.cache, token_to_kv_pool_allocator=self.allocator,
            maybe_evict_swa=lambda: None,
        )  # fmt: skip
        try:
            with host_write_path(), _quiet_out_of_memory(self.cache):
                locs, _, _ = common.alloc_for_extend(schedule_batch)
        except RuntimeError as error:
            if "out of memory" not in str(error):
                raise
            return False
        tokens = []
        for req, prefix_len, fill_len in zip(batch, prefix_lens, fill_lens):
            tokens += req.all_token_ids()[prefix_len:fill_len]
            req.fill_ids = req.origin_input_ids[:fill_len]
            req.kv_allocated_len = req.kv_committed_len = fill_len
            req.is_chunked = int(fill_len < len(req.origin_input_ids))
        write_owned_kv(self.stack, locs, torch.tensor(tokens, dtype=torch.int64))
        return True

    def _after_prefill(self, req: SimRequest) -> str:
        """After the forward: cache the chunk, finish the request, or cache it and keep decoding."""
        about = f", request {req.rid} prefilled to {req.kv_allocated_len}"
        if req.is_chunked:
            self.cache.cache_unfinished_req(req, chunked=True)
            return about + ", chunk cached"
        if self.rng.random() < 0.35:
            self._release(req, insert=True)
            return about + ", finished"
        self.cache.cache_unfinished_req(req)
        return about + ", cached, decoding"

    def _release(self, req: SimRequest, insert: bool) -> None:
        self.cache.cache_finished_req(req, is_insert=insert)
        self.stack.req_to_token_pool.free(req)
        self.running.remove(req)

    def _new_prompt(self) -> List[int]:
        """A prefix of a shared document or of a recent prompt (cut anywhere), then fresh tokens."""
        rng, page = self.rng, self.page_size
        tokens: List[int] = []
        source = rng.random()
        if source < 0.8:
            base = rng.choice(self.documents if source < 0.45 or not self.prompts else self.prompts)
            cut = rng.choice(
                (len(base), rng.randint(0, len(base)), rng.randint(0, len(base) // page) * page)
            )
            tokens = base[:cut]
        fresh = rng.choice((rng.randint(1, page - 1), rng.randint(1, 4 * page), 0 if tokens else 1))
        tokens = (tokens + self._fresh_tokens(fresh))[: self.max_prompt_tokens]
        self.prompts = (self.prompts + [tokens])[-_KEPT_PROMPTS:]
        return tokens

    def _chunk_end(self, req: SimRequest, prefix_len: int) -> int:
        """Where this prefill forward ends: the prompt's end, or a page-aligned chunk before it."""
        remaining = len(req.origin_input_ids) - prefix_len
        if remaining > self.page_size and self.rng.random() < 0.3:
            return prefix_len + self.rng.randint(1, (remaining - 1) // self.page_size) * self.page_size
        return len(req.origin_input_ids)

    def _load_back_quota(self, req: SimRequest, extend_len: int, room: int) -> Optional[int]:
        """The adder's quota (``prefill_load_back_quota``) from the round's remaining ``room``,
        sometimes shrunk as if the tree had changed since matching, or none (stock sglang)."""
        choice = self.rng.random()
        if choice < 0.3:
            return None
        shrink = self.rng.randint(0, req.host_hit_length) if choice < 0.5 else 0
        needed_besides = extend_len - req.host_hit_length + self.page_size
        return room - needed_besides - shrink

    def _logical_room(self) -> int:
        return self.allocator.available_size() + self.cache.evictable_size()

    def _fresh_tokens(self, count: int) -> List[int]:
        tokens = list(range(self.next_token_id, self.next_token_id + count))
        self.next_token_id += count
        return tokens

    # ---- cache maintenance ----

    def _op_check_events(self) -> str:
        self.cache.check_hicache_events()
        return "check_hicache_events"

    def _op_evict_device(self) -> str:
        num_tokens = self.rng.randint(1, self.allocator.size // 2)
        evicted = self.cache.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted
        return f"evict {num_tokens} logical tokens from the device (evicted {evicted})"

    def _op_evict_host(self) -> str:
        needs = [self.rng.randint(0, 3) * self.page_size for _ in range(self.cp_size)]
        freed = self.cache.evict_host(needs[self.cp_rank])
        self.local_stats["physical host slots freed by evict_host"] += freed
        return f"evict_host, physical slots needed by rank: {needs}"

    # ---- injected failures ----

    def _op_inject_device_failure(self) -> str:
        rank, count = self.rng.randrange(self.cp_size), self.rng.choice((1, 1, 2))
        if rank == self.cp_rank:
            self.device_failures.remaining = count
        return f"the next {count} load-back device allocations fail on rank {rank}"

    def _release_injections(self) -> None:
        self.device_failures.remaining = 0

    def _drain_acks(self) -> None:
        for _ in range(8):
            if not (self.cache.ongoing_write_through or self.cache.ongoing_load_back):
                return
            self.cache.check_hicache_events()

    def _op_drain(self) -> str:
        return self.drain()

    def drain(self) -> str:
        """Everything out of the cache the regular way; the checker then expects baseline counts."""
        for req in list(self.running):
            self._release(req, insert=self.rng.random() < 0.5)
        self._release_injections()
        self._drain_acks()
        for _ in range(8):
            if not self.cache.root_node.children:
                break
            self.cache.evict(EvictParams(num_tokens=self.allocator.size))
            self._drain_acks()
            self.cache.evict_host(self.host.size)
        self.at_baseline = True
        return "drain: release every request, evict every node from device and host"

    def _op_flush(self) -> str:
        """The scheduler's ``flush_cache`` once idle (requests out, acks done)."""
        for req in list(self.running):
            self._release(req, insert=True)
        self._release_injections()
        self._drain_acks()
        self.cache.reset()
        self.stack.req_to_token_pool.clear()
        self.allocator.clear()
        self.at_baseline = True
        return "flush: reset tree, request slots and allocator"

    # ---- storage tier ----

    def _prefetch_from_storage(self, req: SimRequest) -> None:
        """As the scheduler's ``_prefetch_kvcache`` hook does when a request arrives: restore what
        storage holds beyond the tree's match, as a host node, before the adder matches."""
        if self.cache.cp_storage is None:
            return
        restored = self.cache.prefetch_from_storage_cp(req.rid, req.origin_input_ids)
        self.cache.prefetch_loaded_tokens_by_reqid.pop(req.rid, None)  # the scheduler pops it too
        if restored:
            self.stats["storage prefetches restored"] += 1
            self.stats["storage tokens restored"] += restored

    def _op_restart(self) -> str:
        """A server restart over the same storage: everything on device and host is gone (the
        scheduler's flush), what the ranks stored stays; later prompts come back from storage."""
        self._op_flush()
        self.stats["restarts"] += 1
        return "restart: device and host emptied, storage kept"

    # ---- coverage ----

    def _count_cache_decisions(self) -> None:
        """Count the decisions the workload is meant to reach (writes refused, splits, ...)."""
        cache, stats = self.cache, self.stats
        write_backup, load_back = cache.write_backup, cache.load_back
        split_node, evict_host = cache._split_node, cache.evict_host
        evict_host_until = cache._evict_host_until

        def counted_write_backup(node, write_back=False):
            eligible = write_back or cache._node_backuped(node.parent)
            written = write_backup(node, write_back=write_back)
            if eligible:
                stats["host writes committed" if written else "host writes refused"] += 1
            return written

        def counted_load_back(node, mem_quota=None):
            loaded = load_back(node, mem_quota)
            stats["load-backs done" if loaded is not None else "load-backs declined"] += 1
            return loaded

        def counted_split_node(key, child, split_len):
            stats["node splits" + (" on host" if child.evicted else "")] += 1
            return split_node(key, child, split_len)

        def counted_evict_host(physical_slots_needed):
            stats["host evictions"] += 1
            return evict_host(physical_slots_needed)

        cache.write_backup = counted_write_backup
        cache.load_back = counted_load_back
        cache._split_node = counted_split_node
        def counted_evict_host_until(shortfall_by_rank):
            stats["host evictions for a write"] += 1
            return evict_host_until(shortfall_by_rank)

        cache.evict_host = counted_evict_host
        cache._evict_host_until = counted_evict_host_until

    def finish_local_stats(self) -> collections.Counter:
        self.local_stats["injected device allocation failures fired"] = self.device_failures.fired
        return self.local_stats
