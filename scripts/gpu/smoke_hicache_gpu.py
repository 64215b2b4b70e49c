"""GPU smoke of the staged environment and of sglang 0.5.11's NSA HiCache data path (stock, no CP).

Proves, on the GPU machine after remote_install.sh / remote_env.sh, that:
1. our plugin and sglang's pools, host pools and HiCache controllers import, with the real
   ``sgl_kernel`` (not our CPU shim);
2. for bf16 (576 x 2 B rows) and fp8 (656 B rows) CUDA ``NSATokenToKVPool``s (page 64), the real
   ``HybridCacheController`` over ``MLATokenToKVPoolHost`` + ``NSAIndexerPoolHost`` restores every KV
   row and indexer page bit-exactly through write -> device poison -> load into new device pages,
   for io backend ``kernel`` (host layouts layer_first, page_first) and ``direct`` (layer_first,
   page_first_direct);
3. ``sgl_kernel_cpu_shim.transfer_kv_direct_reference`` gives the same bytes as the real
   ``sgl_kernel.kvcacheio.transfer_kv_direct`` on the same inputs, both directions.

It also reports (without failing) the fp8 round trip with the host pool built the way sglang's NSA
assembler builds it (no ``override_kv_cache_dim``: 576-byte host rows for 656-byte device rows).

Prints one line per check and ``smoke: N passed, M failed``; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import traceback

import torch

PAGE_SIZE = 64
KV_FORMATS = ("bf16", "fp8")  # GLM-5 NSA rows (cp_hicache_stack.KV_FORMATS): 576 x 2 B, 656 B
BACKEND_LAYOUTS = (
    ("kernel", "layer_first"),
    ("kernel", "page_first"),
    ("direct", "layer_first"),
    ("direct", "page_first_direct"),
)


class Checks:
    def __init__(self):
        self.passed = 0
        self.failed = 0

    def record(self, name: str, ok: bool, detail: str = "", informational: bool = False) -> None:
        tag = "INFO" if informational else ("PASS" if ok else "FAIL")
        print(f"[{tag}] {name}{': ' + detail if detail else ''}", flush=True)
        if informational:
            return
        if ok:
            self.passed += 1
        else:
            self.failed += 1

    def run(self, name: str, fn, informational: bool = False) -> None:
        try:
            ok, detail = fn()
        except Exception as exc:  # report and go on: one broken config must not hide the others
            traceback.print_exc()
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        self.record(name, ok, detail, informational)


def check_imports():
    from sglang_cp_shared_kv_testing import sgl_kernel_cpu_shim

    shim_active = sgl_kernel_cpu_shim.install()
    import sgl_kernel.kvcacheio  # noqa: F401
    from sglang.srt.mem_cache import memory_pool, memory_pool_host  # noqa: F401
    from sglang.srt.mem_cache.hybrid_cache import hybrid_cache_controller  # noqa: F401

    from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout  # noqa: F401

    import sglang
    import transformers

    detail = (
        f"sglang {sglang.__version__}, transformers {transformers.__version__}, torch "
        f"{torch.__version__}, {torch.cuda.get_device_name()}, shim active: {shim_active}"
    )
    return not shim_active, detail


def check_plugin_import():
    import sglang_cp_shared_kv.plugin  # noqa: F401

    return True, "sglang_cp_shared_kv.plugin"


class RoundTrip:
    """One stock NSA HiCache stack on the GPU, built as the server builds it
    (``cp_hicache_stack.build_stock_hicache_stack``: sglang's NSA assembler makes the KV and indexer
    host pools and the ``HybridCacheController``); this smoke drives the controller directly."""

    def __init__(self, kv_format, io_backend, host_layout, layers, pages, override_host_row=True):
        from sglang_cp_shared_kv_testing.cp_hicache_stack import (
            build_stock_hicache_stack,
            glm5_nsa,
            host_rows_as_wide_as_device_rows,
        )
        from sglang_cp_shared_kv_testing.multi_rank import single_process_group

        widen = host_rows_as_wide_as_device_rows() if override_host_row else contextlib.nullcontext()
        with widen:
            stack = build_stock_hicache_stack(
                pages=pages,
                group=single_process_group(),
                device="cuda",
                shape=glm5_nsa(kv_format, layers),
                io_backend=io_backend,
                host_layout=host_layout,
            )
        self.pool, self.allocator = stack.kv_pool, stack.allocator
        self.controller, self.kv_host = stack.controller, stack.kv_host

    def _indexer_extra_pools(self):
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        return [PoolTransfer(name=PoolName.INDEXER, hit_policy=PoolHitPolicy.ALL_PAGES)]

    def _kv_rows(self, layer):
        buffer = self.pool.kv_buffer[layer]
        return buffer.view(torch.uint8).view(buffer.shape[0], -1)

    def _scattered_pages(self, num_pages, generator):
        """``num_pages`` device pages in random order, from a random half of the free pages."""
        locs = self.allocator.alloc(2 * num_pages * PAGE_SIZE)
        pages = locs.view(-1, PAGE_SIZE)[:, 0] // PAGE_SIZE
        order = torch.randperm(len(pages), generator=generator).to(pages.device)
        keep, drop = pages[order[:num_pages]], pages[order[num_pages:]]
        self.allocator.free(_page_locs(drop))
        return _page_locs(keep)

    def run(self, num_pages, seed):
        """write -> poison device pages -> load into other pages; returns mismatching rows/pages."""
        generator = torch.Generator().manual_seed(seed)
        device_locs = self._scattered_pages(num_pages, generator)
        device_pages = device_locs[::PAGE_SIZE] // PAGE_SIZE
        expected_kv, expected_index = [], []
        for layer in range(self.pool.layer_num):
            rows = self._kv_rows(layer)
            data = torch.randint(0, 256, (len(device_locs), rows.shape[1]), generator=generator)
            rows[device_locs] = data.to(torch.uint8).cuda()
            expected_kv.append(rows[device_locs].clone())
            index_pages = self.pool.index_k_with_scale_buffer[layer]
            data = torch.randint(0, 256, (num_pages, index_pages.shape[1]), generator=generator)
            index_pages[device_pages] = data.to(torch.uint8).cuda()
            expected_index.append(index_pages[device_pages].clone())

        host_locs = self.controller.write(
            device_locs, node_id=1, extra_pools=self._indexer_extra_pools()
        )
        if host_locs is None:
            raise RuntimeError("host pool allocation failed")
        self.controller.ack_write_queue[-1].finish_event.synchronize()

        for layer in range(self.pool.layer_num):  # device eviction: the old pages hold garbage now
            self._kv_rows(layer)[device_locs] = 0xA5
            self.pool.index_k_with_scale_buffer[layer][device_pages] = 0x5A
        new_locs = self.controller.load(
            host_locs, node_id=2, extra_pools=self._indexer_extra_pools()
        )
        if new_locs is None:
            raise RuntimeError("device allocation for load failed")
        self.controller.start_loading()
        self.controller.ack_load_queue[-1].finish_event.synchronize()
        torch.cuda.synchronize()
        self.allocator.free(device_locs)

        new_pages = new_locs[::PAGE_SIZE] // PAGE_SIZE
        moved = int((new_pages != device_pages).sum())
        kv_bad = index_bad = 0
        for layer in range(self.pool.layer_num):
            got = self._kv_rows(layer)[new_locs]
            kv_bad += int((got != expected_kv[layer]).any(dim=1).sum())
            got = self.pool.index_k_with_scale_buffer[layer][new_pages]
            index_bad += int((got != expected_index[layer]).any(dim=1).sum())
        self.allocator.free(new_locs)
        self.kv_host_row_bytes = self.kv_host.token_stride_size
        return kv_bad, index_bad, moved


def _page_locs(pages):
    return (pages[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE, device=pages.device)).flatten()


def check_round_trip(kv_format, io_backend, host_layout, layers, pages, seed, override_host_row=True):
    def run():
        stack = RoundTrip(kv_format, io_backend, host_layout, layers, pages, override_host_row)
        num_pages = pages // 4
        kv_bad, index_bad, moved = stack.run(num_pages, seed)
        detail = (
            f"mismatches = {kv_bad + index_bad} (kv rows {kv_bad}/{num_pages * PAGE_SIZE * layers}, "
            f"indexer pages {index_bad}/{num_pages * layers}); {moved}/{num_pages} pages moved; "
            f"host row {stack.kv_host_row_bytes} B, jit {stack.kv_host.can_use_jit}"
        )
        return kv_bad + index_bad == 0 and moved > 0, detail

    return run


def check_transfer_kv_direct(kind):
    """Same inputs to the real kernel and to our reference; outputs must be bit-identical."""

    def run():
        from sgl_kernel.kvcacheio import transfer_kv_direct

        from sglang_cp_shared_kv_testing.sgl_kernel_cpu_shim import transfer_kv_direct_reference

        generator = torch.Generator().manual_seed(7)
        layers, pages = 3, 24
        if kind == "kv_rows":  # fp8 NSA rows, 64-token pages
            row_shape, dtype, page_size = (1, 656), torch.uint8, PAGE_SIZE
        else:  # indexer pages, moved one page per index (page_size=1), as NSAIndexerPoolHost does
            row_shape, dtype, page_size = (PAGE_SIZE * 132,), torch.uint8, 1
        rows = pages * page_size
        num_pages = pages // 3
        src_pages = torch.randperm(pages, generator=generator)[:num_pages]
        dst_pages = torch.sort(torch.randperm(pages, generator=generator)[:num_pages]).values
        span = torch.arange(page_size)
        src_idx = (src_pages[:, None] * page_size + span).flatten()
        dst_idx = (dst_pages[:, None] * page_size + span).flatten()
        mismatched = 0
        for direction in ("d2h", "h2d"):
            src_device, dst_device = ("cuda", "cpu") if direction == "d2h" else ("cpu", "cuda")

            def make(device):
                data = torch.randint(0, 256, (layers, rows, *row_shape), generator=generator)
                tensor = data.to(dtype)
                return tensor.pin_memory() if device == "cpu" else tensor.to(device)

            src = make(src_device)
            dst_real = make(dst_device)
            dst_ref = dst_real.clone()
            if dst_device == "cpu":
                dst_ref = dst_ref.pin_memory()
            transfer_kv_direct(list(src), list(dst_real), src_idx, dst_idx, page_size)
            transfer_kv_direct_reference(list(src), list(dst_ref), src_idx, dst_idx, page_size)
            torch.cuda.synchronize()
            mismatched += int((dst_real.cpu() != dst_ref.cpu()).sum())
        return mismatched == 0, f"{mismatched} differing bytes over d2h + h2d"

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pages", type=int, default=64, help="device pages per pool")
    args = parser.parse_args()
    start = time.time()
    checks = Checks()
    checks.run("imports (real sgl_kernel, sglang pools, our layout)", check_imports)
    checks.run("import sglang_cp_shared_kv.plugin", check_plugin_import)
    for kind in ("kv_rows", "indexer_pages"):
        checks.run(f"transfer_kv_direct reference == real ({kind})", check_transfer_kv_direct(kind))
    configs = [(f, b, l) for f in KV_FORMATS for b, l in BACKEND_LAYOUTS]
    for seed, (kv_format, io_backend, host_layout) in enumerate(configs):
        checks.run(
            f"round trip {kv_format} {io_backend} {host_layout}",
            check_round_trip(kv_format, io_backend, host_layout, args.layers, args.pages, seed),
        )
    checks.run(
        "round trip fp8 kernel layer_first, host pool as sglang's NSA assembler builds it",
        check_round_trip("fp8", "kernel", "layer_first", args.layers, args.pages, 99, False),
        informational=True,
    )
    print(f"smoke: {checks.passed} passed, {checks.failed} failed ({time.time() - start:.0f} s)")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
