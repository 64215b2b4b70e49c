"""HiCache L3 storage with shared KV through sglang's real ``MooncakeStore`` and a real Mooncake master.

The test starts ``mooncake_master`` itself, inside a network namespace of its own (``unshare -n`` as
root, else ``unshare -rn``), with only loopback up: the master and its clients bind all interfaces,
so nothing is exposed and no port of the machine is taken. In that namespace a child process (this
file run as a script) writes a 4-page prefix from a CP 2 placement (each rank stores the pages it
owns: KV zero-copy from its ``page_first_direct`` host pool, the indexer as ``PoolTransfer(INDEXER)``)
and restores it into fresh CP 3 stacks, whose owners differ for pages 2 and 3, through
``prefetch_from_storage_cp`` (every rank queries every page, reads its own); every restored KV row
and indexer page must equal what was written. The child is bounded in time and stops the master
(which also dies with the child: parent-death signal; ``sglang_cp_shared_kv_testing/mooncake_master.py``).

Skipped, with the reason, where it cannot run: no ``mooncake`` package (``pip install
mooncake-transfer-engine-non-cuda`` on a CPU machine; the CUDA wheel needs libcuda), its system
libraries missing (it loads libibverbs, libnl-route-3, libnuma and libcurl: ``apt-get install
libibverbs1 libnl-route-3-200 libnuma1 libcurl4``), or no network namespace. ``.ci/run`` installs
both before the suite (README, "Mooncake Store tests"); elsewhere run it as in docs/hicache-storage.md.
Device <-> host copies are not exercised (the CPU kernel shim has none for page-first layouts): the
writer fills its host pool directly; the GPU leg of scripts/gpu/check_cp_hicache_gpu.py does both.

Planted and seen to fail (then reverted): the CP size in the key namespace -> restored 0 tokens.
"""

import json
import os
import signal
import subprocess
import sys
import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv_testing.mooncake_master import (
    client_extra_config,
    loopback_up,
    mooncake_unavailable,
    start_master,
    stop_store_process,
    unshare_prefix,
)

register_cpu_ci(est_time=25, suite="stage-a-test-cpu")  # skips where Mooncake cannot run

PAGE = 64
PAGES = 4
MASTER_PORT = 50051
CHILD_TIMEOUT_S = 150


# ---- the child, inside the namespace ----


def child_round_trip() -> dict:
    """Write at CP 2, restore at CP 3 (see the module docstring); counts for the parent to check."""
    import torch

    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang_cp_shared_kv.mem_cache.cp_hicache_storage_keys import page_hash_chain, storage_keys
    from sglang_cp_shared_kv_testing.cp_hicache_stack import (
        build_cp_hicache_stack,
        host_page_bytes,
        host_page_pattern,
    )
    from sglang_cp_shared_kv_testing.multi_rank import single_process_group

    seq = list(range(3000, 3000 + PAGES * PAGE))
    extra = client_extra_config(MASTER_PORT, prefetch_threshold=PAGE)
    group = single_process_group()

    def views(cp_size):
        return [
            build_cp_hicache_stack(cp_size=cp_size, cp_rank=rank, group=group, physical_pages=4,
                                   host_layout="page_first_direct", storage_backend="mooncake",
                                   storage_extra_config=extra)  # fmt: skip
            for rank in range(cp_size)
        ]

    report = {"written": [], "restored": [], "kv_bad": 0, "indexer_bad": 0, "pages_checked": 0}
    writers = views(2)
    keys = storage_keys(writers[0].cache.cp_storage.namespace, page_hash_chain(seq, PAGE))
    for rank, view in enumerate(writers):
        io = view.cache.cp_storage
        owned = [page for page in range(PAGES) if page % 2 == rank]
        slots = view.controller.mem_pool_host.alloc(len(owned) * PAGE).cpu()
        for i, page in enumerate(owned):
            io.kv_host.set_from_flat_data_page(int(slots[i * PAGE]), host_page_pattern(io.kv_host, page, 1))
            io.indexer_host.set_from_flat_data_page(
                int(slots[i * PAGE]), host_page_pattern(io.indexer_host, page, 2)
            )
        report["written"].append(io.write_pages([keys[page] for page in owned], slots))

    readers = views(3)  # a restart with other owners: page q on rank q % 3
    for rank, view in enumerate(readers):
        restored = view.cache.prefetch_from_storage_cp("req", seq)
        report["restored"].append(restored)
        if not restored:
            continue
        match = view.cache.match_prefix(MatchPrefixParams(key=RadixKey(seq)))
        metadata = match.last_host_node.cp_hicache
        pages = (metadata.owned_positions[::PAGE] // PAGE).tolist()
        io = view.cache.cp_storage
        for i, page in enumerate(pages):
            slot = int(metadata.host_indices[i * PAGE])
            for pool, salt, name in ((io.kv_host, 1, "kv_bad"), (io.indexer_host, 2, "indexer_bad")):
                expected = host_page_pattern(pool, page, salt).view(torch.uint8).reshape(-1)
                report[name] += int(not torch.equal(host_page_bytes(pool, slot), expected))
            report["pages_checked"] += 1
    return report


def child_main():
    loopback_up()
    master = start_master(MASTER_PORT, MASTER_PORT + 1)
    try:
        print("REPORT " + json.dumps(child_round_trip()), flush=True)
    finally:
        stop_store_process(master)
    os._exit(0)  # Mooncake clients' threads can hold up interpreter exit


class TestMooncakeStoreRoundTrip(CustomTestCase):
    def test_write_at_cp2_restore_at_cp3_through_a_real_master(self):
        reason = mooncake_unavailable()
        if reason:
            self.skipTest(reason)
        child = subprocess.Popen(
            unshare_prefix() + [sys.executable, os.path.abspath(__file__), "--mooncake-child"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            out, err = child.communicate(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            out, err = child.communicate()
            self.fail(f"Mooncake round trip exceeded {CHILD_TIMEOUT_S} s:\n{err[-3000:]}")
        lines = [line for line in out.splitlines() if line.startswith("REPORT ")]
        self.assertTrue(lines, f"child exited {child.returncode} without a report:\n{err[-3000:]}")
        report = json.loads(lines[-1][len("REPORT ") :])
        # CP 2 writers: rank 0 owns pages 0 and 2, rank 1 pages 1 and 3; each stored its own.
        self.assertEqual(report["written"], [2, 2])
        self.assertEqual(report["restored"], [PAGES * PAGE] * 3)
        self.assertEqual(report["pages_checked"], PAGES)  # every page restored on exactly one rank
        self.assertEqual([report["kv_bad"], report["indexer_bad"]], [0, 0])


if __name__ == "__main__":
    if sys.argv[1:] == ["--mooncake-child"]:
        child_main()
    else:
        unittest.main()
