"""The one-GPU test mode of the smokes and the serving benchmark: every rank of every server on device 0.

Test-only (never set by the product). No multi-GPU machine was lent for weeks, yet a served run at
CP 2, 4 or 8 exercises everything the unit tests cannot: the real scheduler, tree, allocator,
HiCache, PD transfer, NCCL collectives and CUDA graphs. One H200 holds every rank of a small server
if three things change, and nothing else does:

* the smoke plugin's ``one_gpu`` hook gives each scheduler process device 0 and an NCCL host id of
  its own (NCCL refuses two ranks of one communicator on one device unless they look like two
  hosts; it then connects them through its socket transport over loopback);
* every server gets ``ONE_GPU_SERVER_ARGS`` (no custom all-reduce, no flashinfer all-reduce
  fusion: both assume one rank per device);
* every server gets ``one_gpu_env()`` (the hook's switch, sglang's TP memory-imbalance check off,
  since every rank sees the others' memory, and NVLink multicast off).

What it cannot give: timings across ranks (the GPU is time-sliced between the ranks and the
collectives go through sockets). Pool sizes: capped by ``--max-total-tokens`` for the audits; where
memory sizes them, ``per_rank_mem_fraction`` gives each rank its share (docs/gpu.md).
"""

from __future__ import annotations

from typing import Dict, List, Sequence

# The smoke plugin's switch (``scripts/smoke_plugin/cp_shared_kv_smoke_hooks``) for a server's ranks.
ONE_GPU_PLUGIN_ENV = "SGLANG_CP_SHARED_KV_SMOKE_ONE_GPU"
ONE_GPU_SERVER_ARGS = ("--disable-custom-all-reduce", "--enforce-disable-flashinfer-allreduce-fusion")
# Every rank process of a server inherits these; the hook sets the per-rank NCCL_HOSTID itself.
ONE_GPU_ENV = {
    ONE_GPU_PLUGIN_ENV: "1",
    "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "0",
    "SGLANG_JIT_DEEPGEMM_PRECOMPILE": "0",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    # Up to 14 rank processes share the machine's cores: torch's default of one intra-op thread per
    # core in each of them oversubscribes the CPU the schedulers and NCCL's socket proxies need.
    "OMP_NUM_THREADS": "1",
}


def one_gpu_env() -> Dict[str, str]:
    return dict(ONE_GPU_ENV)


def with_one_gpu_args(args: Sequence[str]) -> List[str]:
    """``args`` plus whichever of ``ONE_GPU_SERVER_ARGS`` they lack."""
    return list(args) + [a for a in ONE_GPU_SERVER_ARGS if a not in args]


# The smallest --mem-fraction-static a rank gets when memory sizes the pools on one GPU. A rank's
# budget is its fraction of the free memory less what every rank of the server loaded (each sees the
# whole GPU): the tiny GLM-5 at CP 8 loads about 10 GB of weights plus a context and buffers per
# rank, more than 0.85 / 8 of an H200 (served 2026-12-03: "Not enough memory" on stock and shared KV
# alike). 0.18 leaves each of 8 ranks a pool for loads up to 22 GB and keeps the 8 pools and the
# loads within 0.85 of the GPU for loads from 14 GB (test_one_gpu_mode.py).
ONE_GPU_MIN_RANK_MEM_FRACTION = 0.18
# How far two servers' pool budgets may differ on one GPU, as a share of stock's pool. Each budget
# is the minimum over ranks of free memory measured while the other ranks of the server may still
# be allocating: served 2026-12-03 at CP 2, the shared-KV pool came out 6,464 tokens (0.065%) above
# stock's less the scratch, where on two GPUs it matched to the page. Below the scratch's own share
# (about 0.35% of that pool), so a missing reservation still fails.
ONE_GPU_BUDGET_TOLERANCE = 0.002


def per_rank_mem_fraction(mem_fraction_static: float, ranks_on_the_gpu: int) -> float:
    """``--mem-fraction-static`` of one rank when ``ranks_on_the_gpu`` ranks share the GPU and
    memory sizes the pools: its share, at least ``ONE_GPU_MIN_RANK_MEM_FRACTION``.

    sglang 0.5.11 gives a rank's pool ``free_after_load - free_before_load x (1 - fraction)``, both
    measured as the minimum over the server's ranks at a barrier (before any rank allocates its
    pool, so the ranks of one server agree on the size). With every rank on one GPU each rank sees
    the whole GPU, and ``free_after_load`` already lacks every rank's weights and buffers: a rank
    then gets ``fraction x free`` less all of them. The stock and the shared-KV server get the same
    fraction, so their capacities compare."""
    if not 0 < mem_fraction_static < 1 or ranks_on_the_gpu < 1:
        raise ValueError(
            f"--mem-fraction-static {mem_fraction_static} over {ranks_on_the_gpu} ranks: need a "
            "fraction in (0, 1) and at least one rank"
        )
    share = mem_fraction_static / ranks_on_the_gpu
    return round(max(share, min(ONE_GPU_MIN_RANK_MEM_FRACTION, mem_fraction_static)), 4)
