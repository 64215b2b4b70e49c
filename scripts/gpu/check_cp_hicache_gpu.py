"""Bit-exact check of the CP HiCache data path: write -> device evict -> load-back, per CP rank.

Simulates a CP group with one process per rank (all on the same GPU, or all on the CPU) joined by a
gloo group (``multi_rank.run_ranks``). Each rank builds its real stack
(``cp_hicache_stack.build_cp_hicache_stack``: CUDA ``NSATokenToKVPool`` shard, our allocator, real
``CpHiRadixCache`` with sglang's KV + indexer host pools and our ``CpHybridCacheController``), then every
rank runs the same calls:

1. insert sequence A (2 * cp_size + 1 pages) and B (A's first cp_size + 1 pages and one page of its own,
   which splits A's node and gives a one-page node in which cp_size - 1 ranks own nothing), after
   writing random bytes into the KV rows and indexer pages each rank owns; write-through backs them up;
2. wait for the copies, ``writing_check`` until every write is acknowledged; evict both from the device, poison every device row;
3. take two pages so that the load-back lands elsewhere, ``match_prefix`` + ``load_back`` A then B,
   ``ready_to_load_host_cache``, wait, ``loading_check``;
4. count owned KV rows and indexer pages whose bytes differ at their new physical rows.

With ``--draft`` every rank also has an MTP draft pool (one layer, KV and indexer K, the target's
shard size) registered with HiCache as the scheduler does it (``register_draft_pool``: sglang's
``Scheduler._maybe_register_hicache_draft`` with the plugin's hook), its own random bytes written
at the same locs; its owned rows are counted at the new locs too. ``--draft-plants`` then runs every
configuration again with each planted draft bug (``stale``: the draft restore skipped, as sglang's
NSA controller does; ``next-page``: the draft's first restored page one page off) and passes only
if every plant is caught (draft mismatches > 0).

Per configuration it also checks what the group must agree on: identical new logical locs and trees on
every rank, each position restored by exactly one rank, and the locs actually moved. Configurations:
cp_size in --cp-sizes, KV format bf16 / fp8, io backend ``kernel`` (host layouts layer_first, page_first)
and ``direct`` (layer_first, page_first_direct); ``--device cpu`` runs the direct backend with the
layer_first layout only (the CPU shim has no other kernel).

``--storage file|mooncake`` runs the L3 storage leg instead (docs/hicache-storage.md): per
configuration, the writers (cp_size ranks) insert sequence A with their owned bytes and back it up;
write-through stores each rank's own pages (KV and indexer) under owner-free keys. Then a fresh stack
of cp_size + 1 ranks (a restart where pages cp_size.. have other owners) prefetches A from storage
(every rank queries every page, reads the pages it owns now), loads it back to device and counts
owned KV rows and indexer pages whose bytes differ. Checked too: every writer page stored exactly
once, the full prefix restored on every reader, identical trees, each position restored by exactly
one rank. Host layouts: ``file`` every one of the io backend, ``mooncake`` the page-first ones
(its zero-copy path). ``file`` writes under a fresh temporary directory; ``mooncake`` starts its own
``mooncake_master`` on loopback (``--mooncake-port``; ``sglang_cp_shared_kv_testing/mooncake_master.py``) and stops it.
``--device cpu --storage file`` runs the direct/layer_first configuration (a CPU test does).

Prints one line per configuration (and per plant) and ``mismatches = N`` (unplanted runs only);
exits 1 if anything failed or a plant went uncaught.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist

PAGE = 64


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--kv-formats", nargs="+", default=["bf16", "fp8"])
    parser.add_argument("--backends", nargs="+", default=None, help="default: kernel direct on cuda")
    parser.add_argument("--layers", type=int, default=None, help="default: 4 on cuda, 2 on cpu")
    parser.add_argument("--physical-pages", type=int, default=12, help="device pages per rank")
    parser.add_argument("--timeout-s", type=int, default=180, help="gloo collective timeout")
    parser.add_argument("--draft", action="store_true", help="also check an MTP draft pool")
    parser.add_argument(
        "--draft-plants", action="store_true", help="with --draft: each planted draft bug must be caught"
    )
    parser.add_argument(
        "--widen-host-rows",
        action="store_true",
        help="build KV host rows as wide as the device rows (works around sglang 0.5.11's 576-byte "
        "fp8 host rows, docs/cp-hicache.md) to check the rest of the fp8 path",
    )
    parser.add_argument(
        "--storage", choices=("file", "mooncake"), default=None,
        help="run the L3 storage leg (write at cp, restore at cp + 1) with this backend",
    )  # fmt: skip
    parser.add_argument("--mooncake-port", type=int, default=50051, help="our mooncake_master's RPC port")
    args = parser.parse_args(argv)
    if args.storage and (args.draft or args.widen_host_rows):
        parser.error("--storage runs without --draft / --widen-host-rows")
    if args.storage == "mooncake" and args.device == "cpu":
        parser.error("--storage mooncake needs page-first host layouts, which the CPU shim cannot copy")
    args.storage_dir = None  # set by main for --storage file
    if args.backends is None:
        args.backends = ["kernel", "direct"] if args.device == "cuda" else ["direct"]
    if args.layers is None:
        args.layers = 4 if args.device == "cuda" else 2
    if args.draft_plants and not args.draft:
        parser.error("--draft-plants needs --draft")
    return args


DRAFT_PLANTS = ("stale", "next-page")


@contextlib.contextmanager
def planted_draft_bug(stack, plant):
    """One planted bug of the draft's restore (None: none) while the block runs."""
    if plant is None:
        yield
        return
    from unittest import mock

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang_cp_shared_kv_testing.cp_hicache_stack import draft_load_one_page_off

    controller = stack.controller
    if plant == "stale":
        # sglang's NSA controller: the target restored, the draft left as it was.
        with mock.patch.object(
            controller, "start_loading", lambda: HybridCacheController.start_loading(controller)
        ):
            yield
        return
    group = controller.mem_pool_host_draft
    next_page = draft_load_one_page_off(group.load_to_device_per_layer, PAGE)
    with mock.patch.object(group, "load_to_device_per_layer", next_page):
        yield


def configurations(args):
    from sglang_cp_shared_kv.startup_rules import STORAGE_BACKEND_LAYOUTS
    from sglang_cp_shared_kv_testing.cp_hicache_stack import HOST_LAYOUTS

    for kv_format in args.kv_formats:
        for cp_size in args.cp_sizes:
            for backend in args.backends:
                for host_layout in HOST_LAYOUTS[backend]:
                    if args.device == "cpu" and host_layout != "layer_first":
                        continue
                    if args.storage and host_layout not in STORAGE_BACKEND_LAYOUTS[args.storage]:
                        continue
                    yield cp_size, kv_format, backend, host_layout


def world_size(args) -> int:
    """Processes the run needs: the largest CP group (the storage leg restores at cp_size + 1)."""
    return max(args.cp_sizes) + (1 if args.storage else 0)


def group_sizes(args) -> list:
    sizes = set(args.cp_sizes)
    if args.storage:
        sizes |= {cp + 1 for cp in args.cp_sizes}
    return sorted(sizes)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_configuration(args, rank, group, cp_size, kv_format, backend, host_layout, seed, plant=None):
    """One configuration on this rank (with a planted draft bug, or none); returns the rank's numbers
    (rank 0 aggregates)."""
    from sglang_cp_shared_kv_testing.cp_hicache_stack import (
        build_cp_hicache_stack,
        glm5_nsa,
        host_rows_as_wide_as_device_rows,
    )

    widen = host_rows_as_wide_as_device_rows() if args.widen_host_rows else contextlib.nullcontext()
    with widen:
        stack = build_cp_hicache_stack(
            device=args.device,
            shape=glm5_nsa(kv_format, args.layers),
            io_backend=backend,
            host_layout=host_layout,
            cp_size=cp_size,
            cp_rank=rank,
            group=group,
            physical_pages=args.physical_pages,
            draft_layers=1 if args.draft else 0,
        )
    with planted_draft_bug(stack, plant):
        return _round_trip(args, stack, cp_size, seed)


def _round_trip(args, stack, cp_size, seed):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sglang_cp_shared_kv_testing.cp_hicache_stack import (
        SequenceBytes,
        clear_device_pool,
        settle_write_acks,
        tree_signature,
    )

    cache, allocator, layout = stack.cache, stack.allocator, stack.layout
    draft = stack.draft_view() if args.draft else None
    len_a, split = (2 * cp_size + 1) * PAGE, (cp_size + 1) * PAGE
    seq_a = list(range(len_a))
    seq_b = seq_a[:split] + list(range(10**6, 10**6 + PAGE))
    bytes_a = SequenceBytes(stack, len_a, seed)
    bytes_b = SequenceBytes(stack, PAGE, seed + 1)
    if draft is not None:
        draft_a, draft_b = SequenceBytes(draft, len_a, seed + 7), SequenceBytes(draft, PAGE, seed + 8)

    full = allocator.available_size()
    locs_a = allocator.alloc(len_a)
    bytes_a.write_owned(stack, locs_a)
    if draft is not None:
        draft_a.write_owned(draft, locs_a)
    cache.insert(InsertParams(key=RadixKey(seq_a), value=locs_a))
    suffix_b = allocator.alloc(PAGE)
    bytes_b.write_owned(stack, suffix_b)
    if draft is not None:
        draft_b.write_owned(draft, suffix_b)
    cache.insert(InsertParams(key=RadixKey(seq_b), value=torch.cat([locs_a[:split], suffix_b])))
    _sync(args.device)
    problems = []
    try:
        # Acks agreed at one writing_check are applied at the next (non-blocking acks).
        settle_write_acks(cache)
    except AssertionError as error:
        problems.append(f"writes not acknowledged: {error}")

    cache.evict(EvictParams(num_tokens=len_a + PAGE))
    if allocator.available_size() != full:
        problems.append("device eviction did not free every page")
    clear_device_pool(stack, kv_byte=0xA5, index_byte=0x5A)  # poison: freed pages get reused
    if draft is not None:
        clear_device_pool(draft, kv_byte=0x3C, index_byte=0xC3)
    allocator.alloc(2 * PAGE)  # the load-back must land on other logical pages

    match_a = cache.match_prefix(MatchPrefixParams(key=RadixKey(seq_a)))
    new_a = cache.load_back(match_a.last_host_node)
    cache.ready_to_load_host_cache()
    match_b = cache.match_prefix(MatchPrefixParams(key=RadixKey(seq_b)))
    new_suffix_b = cache.load_back(match_b.last_host_node)
    cache.ready_to_load_host_cache()
    _sync(args.device)
    cache.loading_check()
    if new_a is None or new_suffix_b is None:
        problems.append("load_back returned None")
        return {"problems": problems, "kv_bad": 0, "index_bad": 0, "owned": 0, "kv_rows": 0,
                "index_pages": 0, "draft_kv_bad": 0, "draft_index_bad": 0}
    if cache.ongoing_load_back:
        problems.append("load-back not acknowledged")
    if match_a.host_hit_length != len_a or match_b.host_hit_length != PAGE:
        problems.append(f"host hit lengths {match_a.host_hit_length}, {match_b.host_hit_length}")
    if torch.equal(new_a, locs_a):
        problems.append("load-back reused the old locs: nothing moved")
    if not torch.equal(layout.owner_of_page(new_a // PAGE), layout.owner_of_page(locs_a // PAGE)):
        problems.append("a page came back on another rank than the one holding it on host")

    kv_a, index_a = bytes_a.owned_mismatches(stack, new_a)
    kv_b, index_b = bytes_b.owned_mismatches(stack, new_suffix_b)
    owned = int(layout.owned_by_this_rank(new_a).sum()) + int(
        layout.owned_by_this_rank(new_suffix_b).sum()
    )
    draft_kv_bad = draft_index_bad = 0
    if draft is not None:
        for sequence_bytes, locs in ((draft_a, new_a), (draft_b, new_suffix_b)):
            kv_bad, index_bad = sequence_bytes.owned_mismatches(draft, locs)
            draft_kv_bad, draft_index_bad = draft_kv_bad + kv_bad, draft_index_bad + index_bad
    return {
        "draft_kv_bad": draft_kv_bad,
        "draft_index_bad": draft_index_bad,
        "problems": problems,
        "kv_bad": kv_a + kv_b,
        "index_bad": index_a + index_b,
        "owned": owned,
        "owned_b_suffix": int(layout.owned_by_this_rank(new_suffix_b).sum()),
        "kv_rows": owned * args.layers,
        "index_pages": owned // PAGE * args.layers,
        "decisions": (new_a.tolist(), new_suffix_b.tolist(), tree_signature(cache)),
        "host_row_bytes": stack.kv_host.token_stride_size,
        "device_row_bytes": stack.kv_row_bytes(),
        "jit": bool(getattr(stack.kv_host, "can_use_jit", False)),
        "total_tokens": len_a + PAGE,
    }


def storage_extra_config(args, index: int) -> str:
    """The backend's extra config for configuration ``index`` (a fresh directory per configuration
    for ``file``; one master for every configuration, distinct tokens keep them apart)."""
    import json

    if args.storage == "file":
        return json.dumps({"file_path": os.path.join(args.storage_dir, f"cfg{index}"),
                           "prefetch_threshold": PAGE})  # fmt: skip
    from sglang_cp_shared_kv_testing.mooncake_master import client_extra_config

    return client_extra_config(args.mooncake_port, prefetch_threshold=PAGE)


def storage_round_trip(args, rank, groups, index, cp_size, kv_format, backend, host_layout):
    """One storage configuration on this rank; returns (writer numbers or None, reader numbers or
    None). Every process joins both barriers, whether it writes, reads or neither."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sglang_cp_shared_kv_testing.cp_hicache_stack import (
        SequenceBytes,
        build_cp_hicache_stack,
        glm5_nsa,
        settle_write_acks,
        tree_signature,
    )

    extra = storage_extra_config(args, index)
    seed = 1000 + 10 * index
    len_a = (2 * cp_size + 1) * PAGE
    seq_a = list(range(10**6 * (index + 1), 10**6 * (index + 1) + len_a))  # distinct per configuration

    def stack(size):
        return build_cp_hicache_stack(
            device=args.device, shape=glm5_nsa(kv_format, args.layers), io_backend=backend,
            host_layout=host_layout, cp_size=size, cp_rank=rank, group=groups[size],
            physical_pages=args.physical_pages, storage_backend=args.storage,
            storage_extra_config=extra,
        )  # fmt: skip

    written = None
    if rank < cp_size:
        writer = stack(cp_size)
        locs = writer.allocator.alloc(len_a)
        SequenceBytes(writer, len_a, seed).write_owned(writer, locs)
        writer.cache.insert(InsertParams(key=RadixKey(seq_a), value=locs))
        _sync(args.device)
        settle_write_acks(writer.cache)  # write-through acks store this rank's pages
        written = {"pages_written": writer.cache.cp_storage.pages_written,
                   "owned_pages": int(writer.layout.owned_by_this_rank(locs).sum()) // PAGE}  # fmt: skip
    dist.barrier()

    read = None
    if rank < cp_size + 1:
        reader = stack(cp_size + 1)  # a restart with other owners for pages cp_size..
        reader.allocator.alloc(PAGE)  # and other device pages
        problems = []
        restored = reader.cache.prefetch_from_storage_cp("req", seq_a)
        match = reader.cache.match_prefix(MatchPrefixParams(key=RadixKey(seq_a)))
        if match.host_hit_length != restored:
            problems.append(f"host hit {match.host_hit_length} after restoring {restored}")
        new_locs = reader.cache.load_back(match.last_host_node) if restored else None
        reader.cache.ready_to_load_host_cache()
        _sync(args.device)
        reader.cache.loading_check()
        kv_bad = index_bad = owned = 0
        if new_locs is not None:
            kv_bad, index_bad = SequenceBytes(reader, len_a, seed).owned_mismatches(reader, new_locs)
            owned = int(reader.layout.owned_by_this_rank(new_locs).sum())
        read = {"restored": restored, "problems": problems, "kv_bad": kv_bad, "index_bad": index_bad,
                "owned": owned, "pages_read": reader.cache.cp_storage.pages_read,
                "tree": tree_signature(reader.cache), "total_tokens": len_a}  # fmt: skip
    dist.barrier()
    return written, read


def summarize_storage(written, read, layers):
    """Rank 0's verdict over the writers' and readers' numbers."""
    written = [w for w in written if w is not None]
    read = [r for r in read if r is not None]
    total = read[0]["total_tokens"]
    problems = [f"reader {r}: {p}" for r, res in enumerate(read) for p in res["problems"]]
    stored = [w["pages_written"] for w in written]
    if stored != [w["owned_pages"] for w in written] or sum(stored) != total // PAGE:
        problems.append(f"writers stored {stored} pages; they own {[w['owned_pages'] for w in written]}")
    if any(res["restored"] != total for res in read):
        problems.append(f"restored {[res['restored'] for res in read]} tokens, expected {total} each")
    if any(res["tree"] != read[0]["tree"] for res in read[1:]):
        problems.append("readers' trees differ")
    if sum(res["owned"] for res in read) != total:
        problems.append(f"{sum(res['owned'] for res in read)} positions restored, expected {total}")
    mismatches = sum(res["kv_bad"] + res["index_bad"] for res in read)
    detail = (
        f"mismatches = {mismatches} (kv rows {sum(r['kv_bad'] for r in read)}/{total * layers}, "
        f"indexer pages {sum(r['index_bad'] for r in read)}/{total // PAGE * layers}); pages "
        f"written per writer {stored}, read per reader {[r['pages_read'] for r in read]}"
    )
    return mismatches, problems, detail


def summarize(results, cp_size, draft=False, layers=1):
    """Rank 0's verdict over every rank's numbers."""
    problems = [f"rank {r}: {p}" for r, res in enumerate(results) for p in res["problems"]]
    mismatches = sum(
        res["kv_bad"] + res["index_bad"] + res["draft_kv_bad"] + res["draft_index_bad"]
        for res in results
    )
    if all("decisions" in res for res in results):
        if any(res["decisions"] != results[0]["decisions"] for res in results[1:]):
            problems.append("ranks took different decisions (new locs or tree differ)")
        restored = sum(res["owned"] for res in results)
        if restored != results[0]["total_tokens"]:
            problems.append(f"{restored} positions restored, expected {results[0]['total_tokens']}")
        if sum(1 for res in results if res["owned_b_suffix"] == 0) != cp_size - 1:
            problems.append("B's one-page node is not owned by exactly one rank")
        first = results[0]
        if first["host_row_bytes"] != first["device_row_bytes"]:
            problems.append(
                f"host rows {first['host_row_bytes']} B for device rows {first['device_row_bytes']} B"
            )
    kv_rows = sum(res["kv_rows"] for res in results)
    detail = (
        f"mismatches = {mismatches} (kv rows {sum(r['kv_bad'] for r in results)}/{kv_rows}, "
        f"indexer pages {sum(r['index_bad'] for r in results)}/"
        f"{sum(r['index_pages'] for r in results)}); owned tokens per rank "
        f"{[r['owned'] for r in results]}; jit {results[0].get('jit')}"
    )
    if draft:
        detail += (
            f"; draft kv rows {sum(r['draft_kv_bad'] for r in results)}/{kv_rows // layers}, draft "
            f"indexer pages {sum(r['draft_index_bad'] for r in results)}/"
            f"{sum(r['index_pages'] for r in results) // layers}"
        )
    return mismatches, problems, detail


def rank_main(rank, world, args):
    """Every configuration this rank takes part in; rank 0 returns (mismatches, passed, failed)."""
    if args.device == "cuda":
        torch.cuda.set_device(0)
    groups = {
        cp: dist.group.WORLD if cp == world else dist.new_group(ranks=list(range(cp)))
        for cp in group_sizes(args)
    }
    if args.device == "cuda":
        # Build the bf16 JIT HiCache kernel once before every rank asks for it.
        from sglang.jit_kernel.hicache import can_use_hicache_jit_kernel

        if rank == 0:
            can_use_hicache_jit_kernel(element_size=576 * 2)
        dist.barrier()
        can_use_hicache_jit_kernel(element_size=576 * 2)

    if args.storage:
        return storage_leg(args, rank, groups)
    total_mismatches, failed, passed = 0, 0, 0
    plants = (None,) + (DRAFT_PLANTS if args.draft_plants else ())
    for index, (cp_size, kv_format, backend, host_layout) in enumerate(configurations(args)):
        if rank >= cp_size:
            continue
        group = groups[cp_size]
        for plant in plants:
            start = time.time()
            name = f"cp={cp_size} {kv_format} {backend}/{host_layout}" + (
                f" +draft" if args.draft else ""
            ) + (f" PLANT {plant}" if plant else "")
            try:
                result = run_configuration(
                    args, rank, group, cp_size, kv_format, backend, host_layout,
                    seed=1000 + 10 * index, plant=plant,
                )  # fmt: skip
            except Exception:
                print(f"[FAIL] {name}: rank {rank} raised", flush=True)
                raise
            gathered = [None] * cp_size
            dist.all_gather_object(gathered, result, group=group)
            if rank != 0:
                continue
            mismatches, problems, detail = summarize(gathered, cp_size, args.draft, args.layers)
            if plant is None:
                ok = mismatches == 0 and not problems
                total_mismatches += mismatches
                verdict = "PASS" if ok else "FAIL"
            else:
                # Caught: the draft's bytes differ somewhere, and the target's stay exact.
                draft_bad = sum(r["draft_kv_bad"] + r["draft_index_bad"] for r in gathered)
                ok = draft_bad > 0 and mismatches == draft_bad
                verdict = "CAUGHT" if ok else "MISSED"
            passed, failed = passed + ok, failed + (not ok)
            print(
                f"[{verdict}] {name}: {detail} ({time.time() - start:.1f} s)"
                + "".join(f"\n    {p}" for p in problems),
                flush=True,
            )
    dist.barrier()
    return (total_mismatches, passed, failed) if rank == 0 else None


def storage_leg(args, rank, groups):
    """Every storage configuration; every process takes part in each (see storage_round_trip)."""
    total_mismatches, failed, passed = 0, 0, 0
    for index, (cp_size, kv_format, backend, host_layout) in enumerate(configurations(args)):
        start = time.time()
        name = f"L3 {args.storage}: write cp={cp_size} -> restore cp={cp_size + 1} {kv_format} {backend}/{host_layout}"
        try:
            written, read = storage_round_trip(
                args, rank, groups, index, cp_size, kv_format, backend, host_layout
            )
        except Exception:
            print(f"[FAIL] {name}: rank {rank} raised", flush=True)
            raise
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (written, read))
        if rank != 0:
            continue
        mismatches, problems, detail = summarize_storage(
            [w for w, _ in gathered], [r for _, r in gathered], args.layers
        )
        ok = mismatches == 0 and not problems
        total_mismatches += mismatches
        passed, failed = passed + ok, failed + (not ok)
        print(
            f"[{'PASS' if ok else 'FAIL'}] {name}: {detail} ({time.time() - start:.1f} s)"
            + "".join(f"\n    {p}" for p in problems),
            flush=True,
        )
    dist.barrier()
    return (total_mismatches, passed, failed) if rank == 0 else None


@contextlib.contextmanager
def storage_service(args):
    """The storage the leg writes to, for the whole run: a temporary directory, or our own master."""
    if args.storage == "file":
        args.storage_dir = tempfile.mkdtemp(prefix="cp_hicache_gpu_l3_")
        try:
            yield
        finally:
            shutil.rmtree(args.storage_dir, ignore_errors=True)
    elif args.storage == "mooncake":
        from sglang_cp_shared_kv_testing.mooncake_master import start_master, stop_store_process

        master = start_master(args.mooncake_port, args.mooncake_port + 1)
        try:
            yield
        finally:
            stop_store_process(master)
    else:
        yield


def main(argv=None) -> int:
    from sglang_cp_shared_kv_testing.multi_rank import RanksFailed, run_ranks

    args = parse_args(argv)
    start = time.time()
    try:
        with storage_service(args):
            results = run_ranks(rank_main, world_size(args), (args,), timeout_s=args.timeout_s)
    except RanksFailed as exc:
        print(f"check: a rank failed: {exc}")
        print("mismatches = unknown")
        return 1
    total_mismatches, passed, failed = results[0]
    print(f"mismatches = {total_mismatches}")
    print(f"check: {passed} passed, {failed} failed ({time.time() - start:.0f} s)")
    return 1 if failed or total_mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
