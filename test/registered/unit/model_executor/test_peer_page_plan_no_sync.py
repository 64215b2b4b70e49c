"""The per-forward plan never waits for the GPU: no op that syncs on CUDA touches a device tensor.

The runtime's pool, scratch, ``req_to_token`` and the backend's tables live on ``meta`` (the stand-in
GPU); the whole metadata hook (``begin_forward``, ``build_peer_page_plan``, the table remap) runs under
``DeviceSyncRecorder``, which records every read-back, value-sized op, boolean mask index and blocking
upload on that device. The plan must record none and upload exactly once (non-blocking).

Planted: ``send.tolist()`` on the device send list inside ``build_peer_page_plan``, and the old
``torch.unique`` over the device table: both recorded (the test failed), then reverted.
"""

import unittest
from types import SimpleNamespace

import numpy as np
import torch

from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror import ReqToPageMirror
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror_writers import ROWS_ATTR
from sglang_cp_shared_kv.model_executor import forward_dispatch
from sglang_cp_shared_kv.model_executor.gather_scratch import create_gather_scratch
from sglang_cp_shared_kv_testing.device_sync_recorder import DeviceSyncRecorder
from sglang_cp_shared_kv_testing.runtime_check import PAGE_SIZE, make_nsa_pool, nsa_metadata_for
from sglang_cp_shared_kv_testing.shared_kv_state import attach_runtime

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

CP_SIZE, RANK, PHYSICAL_PAGES = 4, 1, 64
DEVICE = "meta"


class TestPlanHasNoDeviceSync(CustomTestCase):
    def setUp(self):
        shard = make_nsa_pool(PHYSICAL_PAGES * PAGE_SIZE, "bf16", 2, DEVICE)
        layout = CpSharedKVLayout(CP_SIZE, RANK, PAGE_SIZE)
        self.req_to_token_pool = ReqToTokenPool(4, 32 * PAGE_SIZE, DEVICE, False)
        mirror = ReqToPageMirror.attach(self.req_to_token_pool, PAGE_SIZE)
        self.runtime = attach_runtime(
            shard, layout, create_gather_scratch(shard, CP_SIZE), None,
            req_to_token_pool=self.req_to_token_pool,
        )  # fmt: skip
        # Request 1: a 10-page cached prefix shared with request 2; each has its own pages after it.
        rng = np.random.default_rng(0)
        pages = rng.permutation(np.arange(CP_SIZE, CP_SIZE * (PHYSICAL_PAGES + 1)))
        mirror.write(1, 0, pages[:16])
        mirror.write(2, 0, pages[:10])
        mirror.write(2, 10, pages[16:22])

    def _batch(self, mode, rows, seq_lens, new):
        out_locs = torch.zeros(sum(new), dtype=torch.int64, device=DEVICE)
        return SimpleNamespace(
            forward_mode=mode,
            seq_lens_cpu=torch.tensor(seq_lens),
            extend_seq_lens_cpu=list(new),
            req_pool_indices=torch.zeros(len(seq_lens), dtype=torch.int64, device=DEVICE),
            req_to_token_pool=self.req_to_token_pool,
            out_cache_loc=out_locs,
            token_to_kv_pool=self.runtime.pool,
            **{ROWS_ATTR: np.array(rows, dtype=np.int64)},
        )

    def _plan_under_recorder(self, batch):
        table = torch.zeros((len(batch.seq_lens_cpu), 16 * PAGE_SIZE), dtype=torch.int32, device=DEVICE)
        backend = SimpleNamespace(forward_metadata=nsa_metadata_for(table))
        recorder = DeviceSyncRecorder(DEVICE, raise_at_first=True)
        with recorder:
            forward_dispatch.dispatch_forward_metadata(None, backend, batch)
        return recorder

    def test_chunked_prefill_over_a_cached_prefix(self):
        # Request 1's third chunk (pages 10.. new, one mixed page), request 2 on the shared prefix.
        batch = self._batch(ForwardMode.EXTEND, [1, 2], [16 * PAGE_SIZE - 5, 16 * PAGE_SIZE], [300, 400])
        recorder = self._plan_under_recorder(batch)
        self.assertEqual(recorder.recorded, [])
        self.assertEqual(recorder.host_to_device_copies, 1)
        plan = self.runtime.plan
        self.assertGreater(plan.gather_pages_per_rank, 0)
        self.assertGreater(plan.num_fill_pages, 0)
        self.assertEqual(plan.lookup.device.type, DEVICE)
        self.assertEqual(plan.send_physical_pages.device.type, DEVICE)

    def test_padded_decode(self):
        # Two decoding requests and a padding request sglang points at row 0 (no host row).
        batch = self._batch(ForwardMode.DECODE, [1, 2], [16 * PAGE_SIZE + 1, 16 * PAGE_SIZE, 1], [1, 1, 1])
        recorder = self._plan_under_recorder(batch)
        self.assertEqual(recorder.recorded, [])
        self.assertEqual(recorder.host_to_device_copies, 1)

    def test_the_recorder_sees_what_the_old_plan_did(self):
        # The calls the previous device-side plan made, on a device table: each one is recorded.
        table = self.req_to_token_pool.req_to_token
        cases = {
            "tolist": lambda: torch.bincount(table[0]).tolist(),
            "unique": lambda: torch.unique(table[0]),
            "mask": lambda: table[0][table[0] > 0],
            "isin": lambda: table[0][~torch.isin(table[0], table[1])],
            "tensor": lambda: torch.tensor([1, 2], device=DEVICE),
            "item": lambda: table[0, 0].item(),
        }
        for name, call in cases.items():
            recorder = DeviceSyncRecorder(DEVICE)
            with recorder:
                try:
                    call()
                except (NotImplementedError, RuntimeError):
                    pass  # meta tensors have no values; the op was recorded before it ran
            self.assertNotEqual(recorder.recorded, [], name)


if __name__ == "__main__":
    unittest.main()
