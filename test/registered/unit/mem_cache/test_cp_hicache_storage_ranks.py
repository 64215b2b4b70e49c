"""L3 storage agreement over a real gloo group of 2 CP ranks: what one rank cannot read cuts every
rank's restore at the same page, and the trees, ledgers and host pools stay in step.

One launch (ranks forked from a server that imported the stack once), three phases on one directory:
(1) rank-sharded write of a 6-page prefix; (2) a fresh stack (a restart) restores it while rank 1's
read of the *indexer* object of its second page (page 3) fails and its KV read succeeds; (3) another
fresh stack restores after page 4's indexer object was removed from storage.

Planted and seen to fail (then reverted):
* restored length per rank instead of the MIN over ranks (``_read_owned_pages``) ->
  test_failed_indexer_read_on_one_rank_cuts_every_rank (rank 0 restores 6 pages, rank 1 3);
* a page counted as read when its KV came back without its indexer page (``read_pages`` over KV
  only) -> test_failed_indexer_read_on_one_rank_cuts_every_rank (6 pages restored, rank 1's
  indexer page 3 wrong);
* the hit counted over KV objects only (``hit_pages`` without the indexer transfer) ->
  test_missing_indexer_object_cuts_every_rank.
"""

import json
import os
import shutil
import tempfile
import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv_testing.multi_rank import run_ranks

register_cpu_ci(est_time=25, suite="stage-a-test-cpu")

PAGE = 64
SEQ = list(range(7000, 7000 + 6 * PAGE))


def _rank(rank, world_size, directory):
    import torch.distributed as dist

    from sglang_cp_shared_kv.mem_cache.cp_hicache_storage_keys import page_hash_chain, storage_keys
    from sglang_cp_shared_kv_testing.cp_hicache_stack import (
        build_cp_hicache_stack,
        SequenceBytes,
        settle_write_acks,
        tree_signature,
        write_owned_pattern,
    )
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.radix_cache import RadixKey

    extra = json.dumps({"file_path": directory, "prefetch_threshold": PAGE})
    hashes = page_hash_chain(SEQ, PAGE)

    def stack():
        return build_cp_hicache_stack(cp_size=world_size, cp_rank=rank, group=dist.group.WORLD,
                                      physical_pages=8, storage_backend="file",
                                      storage_extra_config=extra)  # fmt: skip

    def restore(view):
        restored = view.cache.prefetch_from_storage_cp("req", SEQ)
        match = view.cache.match_prefix(MatchPrefixParams(key=RadixKey(SEQ)))
        locs = view.cache.load_back(match.last_host_node)
        view.cache.ready_to_load_host_cache()
        view.cache.loading_check()
        return {
            "restored": restored,
            "bad": sum(SequenceBytes(view, len(SEQ), 9).owned_mismatches(view, locs)),
            "tree": tree_signature(view.cache),
            "ledger": view.cache.host_ledger.free.tolist(),
            "host_used": view.controller.physical_host_slots_used(),
        }

    writer = stack()
    locs = writer.allocator.alloc(len(SEQ))
    write_owned_pattern(writer, locs, seed=9)
    writer.cache.insert(InsertParams(key=RadixKey(SEQ), value=locs))
    settle_write_acks(writer.cache)
    dist.barrier()

    failing = stack()
    if rank == 1:  # the indexer object of page 3 (its second page) fails to read; its KV reads fine
        backend = failing.cache.cp_storage.backend
        [page_3] = storage_keys(failing.cache.cp_storage.namespace, [hashes[3]])
        real_read_page = backend._read_page

        def read_page(pool_name, key, host_pool, page_offset):
            if pool_name == PoolName.INDEXER and key == page_3:
                return False
            return real_read_page(pool_name, key, host_pool, page_offset)

        backend._read_page = read_page
    report = {"failed_read": restore(failing)}

    dist.barrier()
    if rank == 0:
        tag = failing.cache.cp_storage.namespace.tag()
        for name in os.listdir(directory):
            if name.startswith(f"{tag}_{hashes[4]}.indexer"):
                os.remove(os.path.join(directory, name))
    dist.barrier()
    last = stack()
    kv_keys_read = []
    real_kv_get = last.cache.cp_storage._kv_get

    def kv_get(keys, host_indices):
        kv_keys_read.extend(keys)
        return real_kv_get(keys, host_indices)

    last.cache.cp_storage._kv_get = kv_get
    report["missing_indexer"] = restore(last)
    # Pages past the hit are not read at all (their host slots never reserved).
    beyond = set(storage_keys(last.cache.cp_storage.namespace, hashes[4:]))
    report["missing_indexer"]["read_beyond_hit"] = len(beyond.intersection(kv_keys_read))
    return report


class TestStorageAgreementAcrossRanks(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.directory = tempfile.mkdtemp(prefix="cp-hicache-l3-ranks-")
        cls.reports = run_ranks(
            _rank, 2, args=(cls.directory,), timeout_s=120, start_method="forkserver",
            preload=["sglang_cp_shared_kv_testing.cp_hicache_stack"],
        )  # fmt: skip

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.directory, True)

    def _check(self, phase, pages):
        first, second = (report[phase] for report in self.reports)
        self.assertEqual([first["restored"], second["restored"]], [pages * PAGE] * 2)
        self.assertEqual(first["tree"], second["tree"])
        self.assertEqual(first["ledger"], second["ledger"])
        self.assertEqual([first["bad"], second["bad"]], [0, 0])
        # Owners q % 2: every page on exactly one rank.
        self.assertEqual(first["host_used"] + second["host_used"], pages * PAGE)

    def test_failed_indexer_read_on_one_rank_cuts_every_rank(self):
        self._check("failed_read", 3)

    def test_missing_indexer_object_cuts_every_rank(self):
        self._check("missing_indexer", 4)
        self.assertEqual([report["missing_indexer"]["read_beyond_hit"] for report in self.reports], [0, 0])


if __name__ == "__main__":
    unittest.main()
