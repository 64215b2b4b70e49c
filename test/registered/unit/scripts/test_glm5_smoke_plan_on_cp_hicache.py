"""CPU dry run of the smoke's request plan on the real CP HiCache: backup, eviction and load-back happen.

One CP rank's view (rank 0 of 8) of the real ``CpHiRadixCache`` with its allocator, NSA device pool
and NSA host pools (``sglang_cp_shared_kv_testing/cp_hicache_stack.py``) receives the plan's requests through the calls
sglang's scheduler makes for one request at a time: match (all but the last prompt token), lock, host
load-back, allocate (evicting if short), insert the finished sequence, unlock, and the write / load
acknowledgement checks. Model compute is left out; the cache's decisions are what the plan is for.
"""

import unittest

import torch

from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing.cp_hicache_stack import settle_write_acks
from sglang_cp_shared_kv_testing.cp_hicache_stack import build_cp_hicache_stack
from sglang_cp_shared_kv_testing.multi_rank import single_process_group
from sglang_cp_shared_kv_testing.e2e.request_plan import REPLAY, ROUND1, ROUND2, build_plan

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

CP_SIZE = 8
PAGE = 64
PHYSICAL_PAGES = 24  # per rank: the CP group's device holds 8 x 24 x 64 = 12288 logical tokens
MAX_NEW_TOKENS = 8


def serve_one(stack, input_ids, max_new_tokens):
    """What the scheduler does to the tree cache for one request served alone.

    Returns (tokens matched on device, tokens matched on host, tokens actually loaded back).
    """
    cache, allocator = stack.cache, stack.allocator
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(input_ids[:-1])))
    prefix, last_node = match.device_indices, match.last_device_node
    device_hit = len(prefix)
    cache.inc_lock_ref(last_node)  # PrefillAdder._lock_node around the load-back
    if match.host_hit_length > 0:
        loaded, new_last = cache.init_load_back(
            InitLoadBackParams(last_host_node=match.last_host_node, host_hit_length=match.host_hit_length)
        )
        prefix = torch.cat([prefix, loaded])
        cache.dec_lock_ref(last_node)
        last_node = new_last
        cache.inc_lock_ref(last_node)
    loaded_back = len(prefix) - device_hit
    cache.ready_to_load_host_cache()

    # KV rows of the sequence: the prompt plus every output token but the last.
    sequence = list(input_ids) + [(sum(input_ids) + 7 * i) % 256 for i in range(max_new_tokens - 1)]
    need = len(sequence) - len(prefix)
    pages = -(-need // PAGE) * PAGE
    if allocator.available_size() < pages:
        cache.evict(EvictParams(num_tokens=pages - allocator.available_size()))
    new_locs = allocator.alloc(pages)
    assert new_locs is not None, "device full although the tree was evicted"
    cache.loading_check()

    locs = torch.cat([prefix, new_locs[:need]])
    aligned = len(sequence) // PAGE * PAGE  # cache_finished_req keeps whole pages
    inserted = cache.insert(InsertParams(key=RadixKey(sequence[:aligned]), value=locs[:aligned]))
    allocator.free(locs[len(prefix) : inserted.prefix_len])  # already in the tree
    allocator.free(torch.cat([locs[aligned:], new_locs[need:]]))
    cache.dec_lock_ref(last_node)
    settle_write_acks(cache)
    return device_hit, match.host_hit_length, loaded_back


class TestPlanOnCpHiCache(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.stack = build_cp_hicache_stack(
            cp_size=CP_SIZE, cp_rank=0, group=single_process_group(), physical_pages=PHYSICAL_PAGES
        )
        cls.device_tokens = cls.stack.allocator.available_size()
        # One group per capacity, as the smoke plans shared KV off (1 rank's pool) and on (8 ranks').
        cls.plan = build_plan(
            [cls.device_tokens // CP_SIZE, cls.device_tokens], 2.0, PAGE, 8192, MAX_NEW_TOKENS, (0, 256)
        )
        cls.hits = {r.index: serve_one(cls.stack, cls.plan.input_ids(r), MAX_NEW_TOKENS) for r in cls.plan.requests}

    def requests(self, group, phase):
        return [r for r in self.plan.requests if r.group == group and r.phase == phase]

    def test_the_group_sized_for_this_device_keeps_every_prefix_and_loads_back(self):
        group = 1  # sized for 8 x the physical pool, i.e. this shared-KV device
        self.assertEqual(self.plan.groups[group].logical_device_tokens, self.device_tokens)
        for r in self.requests(group, ROUND1):
            self.assertEqual(self.hits[r.index], (0, 0, 0), r.name)  # cold
        round2 = self.requests(group, ROUND2)
        for r in round2:
            device, host, _ = self.hits[r.index]
            # Every prefix is still matched, on device or on host: the plan never overflows the host.
            self.assertEqual(device + host, r.prefix_tokens, r.name)
        loaded = [r.name for r in round2 if self.hits[r.index][2] == r.prefix_tokens]
        self.assertGreater(len(loaded), len(round2) // 2, "prefixes evicted from device were not loaded back")
        replay = self.requests(group, REPLAY)[0]
        self.assertEqual(sum(self.hits[replay.index][:2]), replay.prompt_tokens - PAGE)

    def test_every_prefix_matched_on_host_is_loaded_back(self):
        """With a full device, the load-back retry must free pages on the ranks that hold the prefix
        on host (CpHiRadixCache._evict_for_load), not just as many logical tokens: otherwise some
        load-backs fail and those prefixes are recomputed."""
        for r in self.requests(1, ROUND2):
            _, host, loaded = self.hits[r.index]
            self.assertEqual(loaded, host, r.name)

    def test_the_group_sized_for_a_smaller_device_stays_on_this_one(self):
        for r in self.requests(0, ROUND2):
            self.assertEqual(self.hits[r.index], (r.prefix_tokens, 0, 0), r.name)

    def test_no_token_leaked(self):
        cache, allocator = self.stack.cache, self.stack.allocator
        settle_write_acks(cache)
        self.assertEqual(cache.protected_size(), 0)
        self.assertEqual(allocator.available_size() + cache.evictable_size(), self.device_tokens)


if __name__ == "__main__":
    unittest.main()
