"""One-GPU test mode (``SGLANG_CP_SHARED_KV_SMOKE_ONE_GPU=1``): every rank of this server on device 0.

sglang 0.5.11 puts rank r on device ``base_gpu_id + r * gpu_id_step`` (``entrypoints/engine.py``)
and refuses ``--gpu-id-step 0``. The rank's device then reaches everything else only through the
``gpu_id`` argument of two functions of the scheduler process, both wrapped here:

* ``configure_scheduler_process`` (CPU affinity and NUMA binding of "its" GPU), called first;
* ``Scheduler.__init__``, which keeps ``self.gpu_id`` and hands it to everything that picks a
  device: ``TpModelWorker`` -> ``ModelRunner`` (``torch.cuda.set_device``, the distributed init's
  ``local_rank``, memory profiling), the MTP draft worker (``EAGLEWorker`` / ``EAGLEWorkerV2``, which
  build their own ``ModelRunner``), and the PD queues (``PrefillBootstrapQueue`` /
  ``DecodePreallocQueue``: the mooncake transfer engine's ``kv_args.gpu_id``).

Both get ``gpu_id=0``. NCCL refuses two ranks of one communicator on one device ("Duplicate GPU
detected") unless each looks like its own host: before any communicator exists, each scheduler
process sets its own ``NCCL_HOSTID`` (unique per server and rank: it carries the process id, and
two servers may share the GPU), and NCCL then connects the ranks through its socket transport over
loopback (``NCCL_SOCKET_IFNAME=lo``). NVLink multicast stays off. The server arguments and the
environment the launcher adds are in ``sglang_cp_shared_kv_testing.e2e.one_gpu``.
"""

from __future__ import annotations

import inspect
import logging
import os

from sglang.srt.plugins.hook_registry import HookType

logger = logging.getLogger(__name__)

ONE_GPU_DEVICE = 0
_SCHEDULER = "sglang.srt.managers.scheduler"
# Set in every rank process (again, in case the launcher's environment lacked them).
_PROCESS_ENV = {
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "0",
}


def rank_host_id(tp_rank: int, pp_rank: int, pid: int) -> str:
    """NCCL_HOSTID of one rank process: distinct for every rank of every server on the machine."""
    return f"cp-smoke-one-gpu-pid{pid}-tp{tp_rank}-pp{pp_rank}"


def enter_rank_process(tp_rank: int, pp_rank: int) -> str:
    """Set this process's NCCL host id and socket settings (before NCCL starts); returns the id."""
    host_id = rank_host_id(tp_rank, pp_rank, os.getpid())
    os.environ["NCCL_HOSTID"] = host_id
    os.environ.update(_PROCESS_ENV)
    return host_id


def _on_device_0(original, args, kwargs):
    """Call ``original`` with ``gpu_id=0`` (bound through its own signature) after entering the rank."""
    bound = inspect.signature(original).bind(*args, **kwargs)
    requested = bound.arguments["gpu_id"]
    bound.arguments["gpu_id"] = ONE_GPU_DEVICE
    tp_rank, pp_rank = bound.arguments["tp_rank"], bound.arguments["pp_rank"]
    host_id = enter_rank_process(tp_rank, pp_rank)
    logger.info(
        "cp-shared-kv smoke one-GPU mode: tp rank %d (pp %d) on device %d instead of %d, NCCL_HOSTID=%s",
        tp_rank, pp_rank, ONE_GPU_DEVICE, requested, host_id,
    )  # fmt: skip
    return original(*bound.args, **bound.kwargs)


def configure_scheduler_process_on_device_0(original, *args, **kwargs):
    """AROUND ``configure_scheduler_process``: affinity and NUMA of device 0."""
    return _on_device_0(original, args, kwargs)


def scheduler_init_on_device_0(original, *args, **kwargs):
    """AROUND ``Scheduler.__init__``: the scheduler, its workers and PD queues on device 0."""
    return _on_device_0(original, args, kwargs)


def register_hooks(registry) -> None:
    registry.register(f"{_SCHEDULER}.configure_scheduler_process", configure_scheduler_process_on_device_0, HookType.AROUND)
    registry.register(f"{_SCHEDULER}.Scheduler.__init__", scheduler_init_on_device_0, HookType.AROUND)
