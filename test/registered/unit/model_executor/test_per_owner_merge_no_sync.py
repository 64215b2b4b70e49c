"""Per-owner decode's merge never waits for the GPU, in either form, the one exchange's included.

Every layer of a per-owner decode step merges the ranks' partial outputs; a read-back there would
stall every layer. The partials, LSEs and every gathered buffer live on ``meta`` (the stand-in GPU)
and the merge runs under ``DeviceSyncRecorder``, which records every read-back, value-sized op,
boolean mask index and blocking upload on that device:

* both exchanges as per-owner decode calls them (``merge_by_all_gather``: pack, one all-gather, the
  merge of the gathered buffers; ``merge_by_scaled_sum``: the LSE all-gather, the scaled partial,
  the sum), the collectives standing in as shape-right meta ops, the merge in its torch form;
* the CUDA wrappers of the fused kernels that replace the torch forms on a GPU (``merge_gathered``,
  ``scaled_partial``), with the Triton launch itself stubbed: what our Python does around it.

Batches of 1 and 48 at GLM-5's widths (64 heads x 512), CP 2 and 8, empty partials included.
Planted: ``int(lses.isfinite().all())`` in ``merge_partials``, and the token count read back through
the device (``torch.tensor(tokens, device=...).item()``) in the ``merge_gathered`` wrapper: each
recorded (the test failed), then reverted.
"""

import unittest
from unittest import mock

import torch

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.model_executor.per_owner_decode import attention_lse_merge as merge
from sglang_cp_shared_kv.model_executor.per_owner_decode import fused_kernels
from sglang_cp_shared_kv_testing.device_sync_recorder import DeviceSyncRecorder

register_cpu_ci(est_time=5, suite="stage-a-test-cpu")

HEADS, DIM = 64, 512
DEVICE = "meta"


def _all_gather(cp_size):
    return lambda tensor: tensor.unsqueeze(0).expand(cp_size, *tensor.shape).contiguous()


def _sum(tensor):
    return tensor.clone()


class _NoLaunch:
    """A Triton kernel's ``kernel[grid](...)`` that launches nothing (the grid is host integers)."""

    def __init__(self):
        self.launches = 0

    def __getitem__(self, grid):
        assert all(isinstance(g, int) for g in grid), grid

        def launch(*args, **kwargs):
            self.launches += 1

        return launch


class TestMergeHasNoDeviceSync(CustomTestCase):
    def _partial(self, tokens):
        out = torch.empty(tokens, HEADS, DIM, dtype=torch.bfloat16, device=DEVICE)
        lse = torch.empty(tokens, HEADS, dtype=torch.float32, device=DEVICE)
        return out, lse

    def test_both_exchanges_record_nothing(self):
        for cp_size in (2, 8):
            for tokens in (1, 48):
                with self.subTest(cp_size=cp_size, tokens=tokens):
                    out, lse = self._partial(tokens)
                    with DeviceSyncRecorder(DEVICE, raise_at_first=True) as recorder:
                        one = merge.merge_by_all_gather(out, lse, _all_gather(cp_size))
                        two = merge.merge_by_scaled_sum(out, lse, _all_gather(cp_size), _sum)
                    self.assertEqual(recorder.recorded, [])
                    self.assertEqual((one.shape, one.dtype), (out.shape, out.dtype))
                    self.assertEqual((two.shape, two.dtype), (out.shape, out.dtype))

    def test_the_fused_kernels_wrappers_record_nothing(self):
        merge_kernel, scale_kernel = _NoLaunch(), _NoLaunch()
        with mock.patch.object(fused_kernels, "_merge_gathered_kernel", merge_kernel), \
                mock.patch.object(fused_kernels, "_scaled_partial_kernel", scale_kernel):  # fmt: skip
            for cp_size in (2, 8):
                out, lse = self._partial(48)
                with DeviceSyncRecorder(DEVICE, raise_at_first=True) as recorder:
                    gathered = _all_gather(cp_size)(merge.pack_partial(out, lse))
                    merged = fused_kernels.merge_gathered(gathered, DIM)
                    lses = _all_gather(cp_size)(lse)
                    scaled = fused_kernels.scaled_partial(out, lse, lses)
                self.assertEqual(recorder.recorded, [])
                self.assertEqual(merged.shape, out.shape)
                self.assertEqual(scaled.shape, out.shape)
        self.assertEqual((merge_kernel.launches, scale_kernel.launches), (2, 2))


if __name__ == "__main__":
    unittest.main()
