"""HiCache L3 storage with shared KV on the CPU: owner-free keys, disjoint writers, restores into other
placements (another CP size, a rank owning nothing), host eviction for restored pages, fp8 rows.

Every rank's view is a real CpHiRadixCache with sglang's real HiCacheFile backend, in one process and
fed the same calls; a "restart" is a fresh set of stacks over the same directory. All-reduces over
one process are the identity, so the agreement of ranks that see different things (a failed read, a
missing object) is tested over a real gloo group in test_cp_hicache_storage_ranks.py.

Planted and seen to fail (then reverted):
* owner-blind writes (each rank stores its host pages as the node's leading pages, whoever owns
  them) -> test_each_rank_writes_only_its_own_pages (pages 3 and 4 never stored) and every
  bit-exact restore;
* the CP size in the key namespace -> every restore at another CP size (test_restore_at_another_cp_size_is_bit_exact,
  test_a_rank_owning_nothing_joins_and_the_others_restore, test_fp8_rows_round_trip: no hit); the CP
  rank in it -> every restore test (each rank's hit stops at the first page another rank wrote).
"""

import json
import os
import shutil
import tempfile
import unittest
from unittest import mock

import torch

from sglang_cp_shared_kv_testing.cp_hicache_stack import (
    KV_FORMATS,
    SequenceBytes,
    build_cp_hicache_stack,
    glm5_nsa,
    owned_host_slots_in_tree,
    settle_write_acks,
    tree_signature,
    write_owned_pattern,
)
from sglang_cp_shared_kv_testing.multi_rank import single_process_group
from sglang_cp_shared_kv.mem_cache.cp_hicache_storage_keys import (
    StorageNamespace,
    chain_seed,
    page_hash_chain,
    storage_keys,
)
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_hash_str
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

PAGE = 64
SEQ = list(range(1000, 1000 + 5 * PAGE))  # 5 pages


def prefix_mismatches(view, locs, seq, seed):
    """Owned KV rows + indexer pages at ``locs`` (a prefix of ``seq``) that differ from the bytes
    ``write_owned_pattern`` wrote for all of ``seq``."""
    return sum(SequenceBytes(view, len(seq), seed).owned_mismatches(view, locs))


def namespace(**overrides):
    fields = dict(model="m", kv_dtype="torch.bfloat16", kv_row_bytes=1152, indexer_page_bytes=8448,
                  page_size=64, layer_num=2, host_layout="layer_first")  # fmt: skip
    fields.update(overrides)
    return StorageNamespace(**fields)


class TestStorageKeys(CustomTestCase):
    def test_chain_is_stocks_sha256_chain(self):
        tokens = list(range(3 * PAGE + 5))  # a trailing partial page is not a page
        hashes = page_hash_chain(tokens, PAGE)
        self.assertEqual(len(hashes), 3)
        self.assertEqual(hashes[0], get_hash_str(tokens[:PAGE]))
        self.assertEqual(hashes[2], get_hash_str(tokens[2 * PAGE : 3 * PAGE], hashes[1]))

    def test_namespace_names_what_changes_bytes_and_no_owner(self):
        base = namespace()
        for change in (dict(model="other"), dict(kv_dtype="torch.float8_e4m3fn"),
                       dict(kv_row_bytes=656), dict(indexer_page_bytes=1), dict(page_size=32),
                       dict(layer_num=78), dict(host_layout="page_first")):  # fmt: skip
            with self.subTest(change=change):
                self.assertNotEqual(namespace(**change).tag(), base.tag())
        self.assertEqual(namespace().tag(), base.tag())
        self.assertNotIn("rank", base.describe())
        keys = storage_keys(base, ["ab", "cd"])
        self.assertEqual(keys, [f"{base.tag()}_ab", f"{base.tag()}_cd"])

    def test_extra_key_seeds_the_chain(self):
        self.assertIsNone(chain_seed(None))
        self.assertNotEqual(page_hash_chain(SEQ, PAGE, chain_seed("lora-1")), page_hash_chain(SEQ, PAGE))

    def test_bad_namespace_is_refused(self):
        with self.assertRaisesRegex(ValueError, "page_size"):
            namespace(page_size=0)


class StorageCase(CustomTestCase):
    def setUp(self):
        self.directory = tempfile.mkdtemp(prefix="cp-hicache-l3-")
        self.addCleanup(shutil.rmtree, self.directory, True)

    def views(self, cp_size, threshold=PAGE, **options):
        extra = json.dumps({"file_path": self.directory, "prefetch_threshold": threshold})
        group = single_process_group()
        return [
            build_cp_hicache_stack(cp_size=cp_size, cp_rank=rank, group=group, physical_pages=12,
                                   storage_backend="file", storage_extra_config=extra, **options)
            for rank in range(cp_size)
        ]  # fmt: skip

    def serve_and_store(self, cp_size, seq=SEQ, seed=3, **options):
        """First instance: each view computes its part of ``seq``, backs it up and stores it."""
        views = self.views(cp_size, **options)
        for view in views:
            locs = view.allocator.alloc(len(seq))
            write_owned_pattern(view, locs, seed=seed)
            view.cache.insert(InsertParams(key=RadixKey(seq), value=locs))
        for view in views:
            settle_write_acks(view.cache)
        return views

    def restore(self, views, seq=SEQ, skip_pages=0):
        """Restarted instance: prefetch ``seq`` from storage and load it back to device on every view.
        Returns, per view, (tokens restored, new locs or None)."""
        results = []
        for view in views:
            view.allocator.alloc(skip_pages * PAGE)  # other device placement than the writer's
            restored = view.cache.prefetch_from_storage_cp("req", seq)
            locs = None
            if restored:
                match = view.cache.match_prefix(MatchPrefixParams(key=RadixKey(seq)))
                self.assertEqual(match.host_hit_length, restored)
                locs = view.cache.load_back(match.last_host_node)
                view.cache.ready_to_load_host_cache()
                view.cache.loading_check()
            results.append((restored, locs))
        return results

    def assert_same_everywhere(self, views):
        for view in views[1:]:
            self.assertEqual(tree_signature(view.cache), tree_signature(views[0].cache))
            self.assertTrue((view.cache.host_ledger.free == views[0].cache.host_ledger.free).all())
        for view in views:
            self.assertEqual(owned_host_slots_in_tree(view.cache), view.controller.physical_host_slots_used())

    def stored_files(self):
        return sorted(os.listdir(self.directory))


class TestStorageWritesAndRestores(StorageCase):
    def test_each_rank_writes_only_its_own_pages(self):
        views = self.serve_and_store(cp_size=2)
        written = [view.cache.cp_storage.pages_written for view in views]
        owned = [len(view.cache.root_node.children) and
                 int(next(iter(view.cache.root_node.children.values())).cp_hicache.num_owned) // PAGE
                 for view in views]  # fmt: skip
        self.assertEqual(written, owned)  # disjoint: together every page exactly once
        self.assertEqual(sum(written), len(SEQ) // PAGE)
        # KV + indexer object of every page, under the page's own key.
        # (HiCacheFile names them <key>_<model>.bin and <key>.indexer_<model>.bin.)
        tag = views[0].cache.cp_storage.namespace.tag()
        expected = set(page_hash_chain(SEQ, PAGE))
        names = self.stored_files()
        self.assertTrue(all(name.startswith(f"{tag}_") for name in names))
        self.assertEqual({name[len(tag) + 1 :][:64] for name in names}, expected)
        self.assertEqual(len(self.stored_files()), 2 * len(SEQ) // PAGE)
        # Every rank counted the node, whether or not it owned pages of it.
        self.assertEqual([view.cache.storage_node_writes for view in views], [1, 1])

    def test_restore_at_another_cp_size_is_bit_exact(self):
        """Written at CP 2, restored at CP 3 on other device pages: every page has another owner
        than its writer for pages 1-4 (cp 1 and cp 4 add no owner pattern this does not cover; cp 4
        is in the next test)."""
        self.serve_and_store(cp_size=2)
        views = self.views(3)
        results = self.restore(views, skip_pages=1)
        for view, (restored, locs) in zip(views, results):
            self.assertEqual(restored, len(SEQ))
            self.assertEqual(prefix_mismatches(view, locs, SEQ, seed=3), 0)
        self.assert_same_everywhere(views)
        # Together the views restored every position exactly once.
        self.assertEqual(sum(view.controller.physical_host_slots_used() for view in views), len(SEQ))

    def test_a_rank_owning_nothing_joins_and_the_others_restore(self):
        seq = SEQ[: 3 * PAGE]
        self.serve_and_store(cp_size=2, seq=seq, seed=5)
        views = self.views(4)
        results = self.restore(views, seq=seq)
        self.assertEqual(views[3].cache.storage_prefetches, 1)
        self.assertEqual(views[3].controller.physical_host_slots_used(), 0)  # owns none of 3 pages
        for view, (restored, locs) in zip(views, results):
            self.assertEqual(restored, len(seq))
            self.assertEqual(prefix_mismatches(view, locs, seq, seed=5), 0)
        self.assert_same_everywhere(views)

    def test_nothing_stored_is_a_miss_with_no_slot_taken(self):
        views = self.views(2)
        self.assertEqual([restored for restored, _ in self.restore(views)], [0, 0])
        for view in views:
            self.assertEqual(view.controller.physical_host_slots_used(), 0)
            self.assertEqual(view.cache.root_node.children, {})

    def test_restore_evicts_host_nodes_when_host_is_full(self):
        """Host pools hold 1600 slots per view here; fill them with other backed-up prefixes, then
        restore: host eviction makes room on every rank alike, never a per-rank shrink."""
        self.serve_and_store(cp_size=2)
        views = self.views(2, hicache_ratio=1.0)
        capacity = int(views[0].cache.host_ledger.capacity[0])
        filler = list(range(90_000, 90_000 + 2 * (capacity // PAGE) * PAGE // 2))
        for view in views:
            locs = view.allocator.alloc(11 * PAGE)
            view.cache.insert(InsertParams(key=RadixKey(filler[: 11 * PAGE]), value=locs))
        for view in views:
            settle_write_acks(view.cache)
            view.cache.evict(EvictParams(num_tokens=11 * PAGE))
        results = self.restore(views)
        self.assertEqual([restored for restored, _ in results], [len(SEQ)] * 2)
        for view, (_, locs) in zip(views, results):
            self.assertEqual(prefix_mismatches(view, locs, SEQ, seed=3), 0)
        self.assert_same_everywhere(views)

    def test_fp8_rows_round_trip(self):
        shape = glm5_nsa("fp8", 1)
        self.serve_and_store(cp_size=2, shape=shape)
        views = self.views(3, shape=shape)
        self.assertEqual(views[0].cache.cp_storage.namespace.kv_row_bytes, KV_FORMATS["fp8"][1])
        for view, (restored, locs) in zip(views, self.restore(views)):
            self.assertEqual(restored, len(SEQ))
            self.assertEqual(prefix_mismatches(view, locs, SEQ, seed=3), 0)


class TestExistenceQueryCost(StorageCase):
    """The prefetch's existence query asks the file backend about the pages asked only, in order,
    stopping at the first one missing: no directory scan (stock's ``HiCacheFile.batch_exists_v2``
    lists the whole store, per request and rank).

    Seen failing before the fix: both tests, on the scan (``os.scandir`` of the whole store,
    refused here: the query failed and nothing was restored; no object was asked about)."""

    def query_stats(self, views, seq):
        """Per view: (tokens restored, objects of the store it asked os.stat about)."""
        asked = []
        real_stat = os.stat

        def counting_stat(path, *args, **kwargs):
            if str(path).startswith(self.directory):
                asked.append(os.path.basename(path))
            return real_stat(path, *args, **kwargs)

        def no_scan(path=None):
            raise AssertionError(f"the store was scanned: {path}")

        results = []
        for view in views:
            asked.clear()
            with mock.patch("os.stat", counting_stat), mock.patch("os.scandir", no_scan):
                restored = view.cache.prefetch_from_storage_cp("req", seq)
            results.append((restored, list(asked)))
        return results

    def test_a_hit_asks_about_each_page_asked_once(self):
        self.serve_and_store(cp_size=2)
        for i in range(200):  # other prefixes' objects: never looked at
            open(os.path.join(self.directory, f"other_{i}.bin"), "wb").close()
        seq = SEQ + list(range(50_000, 50_000 + 3 * PAGE))  # 3 pages beyond what is stored
        hashes = page_hash_chain(seq, PAGE)
        for restored, asked in self.query_stats(self.views(2), seq):
            self.assertEqual(restored, len(SEQ))
            self.assertEqual(len(asked), 2 * 5 + 1)  # KV + indexer of 5 pages, KV of the 6th
            self.assertEqual({name.split("_", 1)[1][:64] for name in asked}, set(hashes[:6]))

    def test_a_miss_asks_about_one_object(self):
        seq = list(range(40_000, 40_000 + 8 * PAGE))
        for restored, asked in self.query_stats(self.views(2), seq):
            self.assertEqual(restored, 0)
            self.assertEqual(len(asked), 1)  # the first page's KV object is missing: stop

if __name__ == "__main__":
    unittest.main()
