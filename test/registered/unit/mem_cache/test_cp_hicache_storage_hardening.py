"""L3 storage hardening over a real gloo group of 2 CP ranks (issue 45): what an adversarial review
found, each story replayed through the real stack (``cp_hicache_stack``, sglang's ``HiCacheFile``).

One launch (ranks forked from a server that imported the stack once); every phase builds fresh
stacks on a directory of its own and reports what each rank saw, an exception included (so one
phase's failure does not hide the others).

* ``selective``: a prompt served once under ``write_through_selective`` leaves a device-only node;
  a longer prompt whose tail is in L3 restores that tail below it; device eviction then runs.
  Seen failing before the fix: ``AssertionError: non-leaf`` from stock ``_evict_regular`` on both
  ranks (``write_through`` and ``write_back`` clean, as the review found). Run under every policy.
* ``split``: a node is split by the next step's match while its host write is in flight; every
  page of it must reach L3 and come back after a restart. Seen failing before the fix: 4 of 6
  pages written (only the lower half, the node recorded at write time), 8 of 12 objects, and the
  restart restored 0 tokens (its first page missing).
* ``truncated/indexer``, ``truncated/kv``: page 2's indexer (KV) object cut to half its size, then a
  restart restores, recomputes the rest (which stores pages 2-5 again) and a second restart
  restores. Seen failing before the fix: indexer: 0 tokens restored at both restarts (the short
  read failed rank 0's whole batch) and rank 0 counted 3 pages written (skipped objects counted);
  KV: 128 tokens at both restarts (the truncated object was never rewritten), 2 pages counted.
* ``read_raises``: rank 1's read of page 3's indexer raises. Seen failing: 64 tokens restored
  (rank 1 read nothing, so the cut fell at its first page, 1) instead of 192.
* ``random_faults``: 24 trials of random truncations (1-2 objects, KV or indexer, to 0, 25% or
  99.9% of their size). Seen failing: 12 of 24 restored less than the intact prefix, and in all 24
  a recompute did not repair the store.
"""

import json
import os
import random
import shutil
import tempfile
import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv.mem_cache.cp_hicache_storage_keys import page_hash_chain
from sglang_cp_shared_kv_testing.multi_rank import run_ranks

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")

PAGE = 64
SEQ = list(range(5000, 5000 + 6 * PAGE))
SEED = 11
HASHES = page_hash_chain(SEQ, PAGE)
POLICIES = ("write_through_selective", "write_through", "write_back")
RANDOM_TRIALS = 24


def _rank(rank, world_size, root):
    import torch
    import torch.distributed as dist

    from sglang_cp_shared_kv_testing.cp_hicache_stack import (
        SequenceBytes,
        build_cp_hicache_stack,
        settle_write_acks,
        tree_signature,
    )
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang_cp_shared_kv.mem_cache.cp_hicache_storage_keys import storage_keys

    def stack(directory, policy="write_through"):
        extra = json.dumps({"file_path": directory, "prefetch_threshold": PAGE})
        return build_cp_hicache_stack(cp_size=world_size, cp_rank=rank, group=dist.group.WORLD,
                                      physical_pages=8, storage_backend="file",
                                      storage_extra_config=extra, write_policy=policy)  # fmt: skip

    def pattern(view):
        return SequenceBytes(view, len(SEQ), SEED)  # the same bytes on every rank and server

    def serve(view, tokens, locs=None):
        """Insert ``tokens`` computed at fresh locs (this rank's part of the pattern written)."""
        if locs is None:
            locs = view.allocator.alloc(len(tokens))
        pattern(view).write_owned(view, locs)
        view.cache.insert(InsertParams(key=RadixKey(tokens), value=locs))
        return locs

    def write_store(directory):
        writer = stack(directory)
        serve(writer, SEQ)
        settle_write_acks(writer.cache)
        dist.barrier()

    def load_back_all(view):
        """Load back what the tree holds of SEQ; (tokens on device, wrong owned KV rows + pages)."""
        match = view.cache.match_prefix(MatchPrefixParams(key=RadixKey(SEQ)))
        if match.host_hit_length:
            view.cache.load_back(match.last_host_node)
            view.cache.ready_to_load_host_cache()
            view.cache.loading_check()
            match = view.cache.match_prefix(MatchPrefixParams(key=RadixKey(SEQ)))
        locs = match.device_indices
        return len(locs), sum(pattern(view).owned_mismatches(view, locs))

    def recompute(view):
        """The request's own prefill: what the tree holds of SEQ loaded back, the rest computed at
        fresh locs and inserted (write-through backs it up and stores it when acknowledged)."""
        match = view.cache.match_prefix(MatchPrefixParams(key=RadixKey(SEQ)))
        if match.host_hit_length:
            view.cache.load_back(match.last_host_node)
            view.cache.ready_to_load_host_cache()
            view.cache.loading_check()
            match = view.cache.match_prefix(MatchPrefixParams(key=RadixKey(SEQ)))
        prefix = match.device_indices
        locs = torch.cat([prefix, view.allocator.alloc(len(SEQ) - len(prefix))])
        serve(view, SEQ, locs)
        settle_write_acks(view.cache)

    def object_path(view, page, component):
        """The file of page ``page``'s KV or indexer object (HiCacheFile's naming)."""
        [key] = storage_keys(view.cache.cp_storage.namespace, [HASHES[page]])
        pool = PoolName.INDEXER if component == "indexer" else PoolName.KV
        return view.cache.cp_storage.backend._get_component_path(key, pool)

    def damage(directory, damaged):
        """Rank 0 truncates each ``(page, component, keep fraction)`` object; both ranks wait."""
        view = stack(directory)  # on both ranks: building one enters collectives
        if rank == 0:
            for page, component, keep in damaged:
                path = object_path(view, page, component)
                os.truncate(path, int(os.path.getsize(path) * keep))
        dist.barrier()

    def state(view):
        return {
            "tree": tree_signature(view.cache),
            "ledger": view.cache.host_ledger.free.tolist(),
        }

    def phase_selective(policy):
        directory = os.path.join(root, f"selective-{policy}")
        write_store(directory)
        server = stack(directory, policy)
        serve(server, SEQ[: 2 * PAGE])  # served once
        if server.cache.ongoing_write_through:
            settle_write_acks(server.cache)
        first = next(iter(server.cache.root_node.children.values()))
        report = {"head_backed_up": first.host_len > 0}
        report["restored"] = server.cache.prefetch_from_storage_cp("longer", SEQ)
        if server.cache.ongoing_write_through:
            settle_write_acks(server.cache)
        evicted = server.cache.evict(EvictParams(num_tokens=len(SEQ)))
        report["evicted"] = evicted.num_tokens_evicted
        report["on_device"], report["bad"] = load_back_all(server)
        report.update(state(server))
        return report

    def phase_split():
        directory = os.path.join(root, "split")
        server = stack(directory)
        serve(server, SEQ)
        report = {"in_flight": len(server.cache.ongoing_write_through)}
        # The next step's match splits the node while its host write is in flight (a shared
        # system prompt is split exactly so).
        shared = SEQ[: 2 * PAGE] + list(range(90_000, 90_000 + 2 * PAGE))
        server.cache.match_prefix(MatchPrefixParams(key=RadixKey(shared)))
        settle_write_acks(server.cache)
        report["pages_written"] = server.cache.cp_storage.pages_written
        dist.barrier()
        report["objects"] = len(os.listdir(directory))
        restarted = stack(directory)
        report["restored"] = restarted.cache.prefetch_from_storage_cp("again", SEQ)
        report["on_device"], report["bad"] = load_back_all(restarted)
        report.update(state(restarted))
        return report

    def phase_truncated(component):
        directory = os.path.join(root, f"truncated-{component}")
        write_store(directory)
        damage(directory, [(2, component, 0.5)])  # page 2 lives on rank 0 (2 % 2)
        first = stack(directory)
        report = {"restored_damaged": first.cache.prefetch_from_storage_cp("a", SEQ)}
        recompute(first)
        storage = first.cache.cp_storage
        report["pages_written"], report["pages_found_stored"] = (
            storage.pages_written, storage.pages_found_stored
        )
        dist.barrier()
        second = stack(directory)
        report["restored"] = second.cache.prefetch_from_storage_cp("b", SEQ)
        report["on_device"], report["bad"] = load_back_all(second)
        report.update(state(second))
        return report

    def phase_read_raises():
        """Rank 1's read of page 3's indexer object raises (a backend error, not a miss)."""
        directory = os.path.join(root, "read-raises")
        write_store(directory)
        view = stack(directory)
        backend = view.cache.cp_storage.backend
        [page_3] = storage_keys(view.cache.cp_storage.namespace, [HASHES[3]])
        real_read_page = backend._read_page

        def read_page(pool_name, key, host_pool, page_offset):
            if rank == 1 and pool_name == PoolName.INDEXER and key == page_3:
                raise RuntimeError("backend error reading page 3")
            return real_read_page(pool_name, key, host_pool, page_offset)

        backend._read_page = read_page
        report = {"restored": view.cache.prefetch_from_storage_cp("c", SEQ)}
        report["on_device"], report["bad"] = load_back_all(view)
        report.update(state(view))
        return report

    def phase_random_faults():
        """Random truncations of a pristine store: the restore is the intact prefix exactly (the
        pages before the first damaged one), and after one recompute the whole prefix."""
        pristine = os.path.join(root, "pristine")
        write_store(pristine)
        rng = random.Random(45)  # the same draws on both ranks
        trials = []
        for trial in range(RANDOM_TRIALS):
            directory = os.path.join(root, f"random-{trial}")
            if rank == 0:
                shutil.copytree(pristine, directory)
            dist.barrier()
            damaged = [
                (rng.randrange(len(HASHES)), rng.choice(("kv", "indexer")), rng.choice((0.0, 0.25, 0.999)))
                for _ in range(rng.choice((1, 2)))
            ]
            damage(directory, damaged)
            view = stack(directory)
            restored = view.cache.prefetch_from_storage_cp("r", SEQ)
            recompute(view)
            dist.barrier()
            again = stack(directory).cache.prefetch_from_storage_cp("s", SEQ)
            intact = min(page for page, _, _ in damaged) * PAGE
            trials.append((damaged, restored, intact, again))
        return {"trials": trials, **state(view)}

    phases = {f"selective/{policy}": (phase_selective, policy) for policy in POLICIES}
    phases["split"] = (phase_split,)
    phases["truncated/indexer"] = (phase_truncated, "indexer")
    phases["truncated/kv"] = (phase_truncated, "kv")
    phases["read_raises"] = (phase_read_raises,)
    phases["random_faults"] = (phase_random_faults,)
    reports = {}
    for name, (phase, *args) in phases.items():
        try:
            reports[name] = phase(*args)
        except Exception as error:  # reported per phase; the test names it
            reports[name] = {"error": repr(error)}
        dist.barrier()
    return reports


class TestStorageHardeningAcrossRanks(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.root = tempfile.mkdtemp(prefix="cp-hicache-l3-hardening-")
        cls.reports = run_ranks(
            _rank, 2, args=(cls.root,), timeout_s=120, start_method="forkserver",
            preload=["sglang_cp_shared_kv_testing.cp_hicache_stack"],
        )  # fmt: skip

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.root, True)

    def phase(self, name):
        """Both ranks' reports of ``name``, neither with an error, trees and ledgers equal."""
        reports = [rank_reports[name] for rank_reports in self.reports]
        for rank, report in enumerate(reports):
            self.assertNotIn("error", report, f"rank {rank}: {report.get('error')}")
        self.assertEqual(reports[0]["tree"], reports[1]["tree"])
        self.assertEqual(reports[0]["ledger"], reports[1]["ledger"])
        return reports

    def test_a_restored_tail_below_a_device_only_node_survives_eviction(self):
        for policy in POLICIES:
            with self.subTest(policy=policy):
                reports = self.phase(f"selective/{policy}")
                for report in reports:
                    if policy == "write_through_selective":
                        self.assertFalse(report["head_backed_up"])  # the story's premise
                    self.assertEqual(report["restored"], 4 * PAGE)
                    self.assertGreater(report["evicted"], 0)
                    self.assertEqual(report["on_device"], len(SEQ))
                    self.assertEqual(report["bad"], 0)

    def test_pages_of_a_node_split_while_its_write_is_in_flight_all_reach_storage(self):
        reports = self.phase("split")
        self.assertEqual([report["in_flight"] for report in reports], [1, 1])
        self.assertEqual(sum(report["pages_written"] for report in reports), len(SEQ) // PAGE)
        self.assertEqual(reports[0]["objects"], 2 * len(SEQ) // PAGE)  # KV + indexer per page
        for report in reports:
            self.assertEqual(report["restored"], len(SEQ))
            self.assertEqual(report["on_device"], len(SEQ))
            self.assertEqual(report["bad"], 0)

    def test_a_truncated_object_cuts_the_restore_there_and_is_rewritten(self):
        for component in ("indexer", "kv"):
            with self.subTest(component=component):
                reports = self.phase(f"truncated/{component}")
                for report in reports:
                    self.assertEqual(report["restored_damaged"], 2 * PAGE)  # pages 0 and 1
                    self.assertEqual(report["restored"], len(SEQ))  # rewritten by the recompute
                    self.assertEqual(report["on_device"], len(SEQ))
                    self.assertEqual(report["bad"], 0)
                # The recompute stored pages 2-5: rank 0 rewrote page 2 (KV and indexer) and
                # found page 4 whole; rank 1 found pages 3 and 5 whole.
                self.assertEqual([r["pages_written"] for r in reports], [1, 0])
                self.assertEqual([r["pages_found_stored"] for r in reports], [1, 2])

    def test_a_read_error_of_one_page_is_a_miss_from_that_page_on(self):
        for report in self.phase("read_raises"):
            self.assertEqual(report["restored"], 3 * PAGE)
            self.assertEqual(report["on_device"], 3 * PAGE)
            self.assertEqual(report["bad"], 0)

    def test_random_truncations_restore_the_intact_prefix_then_everything(self):
        reports = self.phase("random_faults")
        self.assertEqual(reports[0]["trials"], reports[1]["trials"])
        short = [t for t in reports[0]["trials"] if t[1] != t[2]]
        self.assertEqual(short, [], "(damaged, restored, intact prefix, after a recompute)")
        self.assertEqual({t[3] for t in reports[0]["trials"]}, {len(SEQ)})


if __name__ == "__main__":
    unittest.main()
