"""The get_kv_class hook: mooncake's manager and sender become the shared-KV subclasses everywhere
sglang looks them up (including prefill.py's imported binding); every other backend and class stays
stock; and the hook target exists in sglang 0.5.11."""

import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing import sgl_kernel_cpu_shim

sgl_kernel_cpu_shim.install()

from sglang.srt.disaggregation import prefill as stock_prefill  # noqa: E402
from sglang.srt.disaggregation import utils as stock_utils  # noqa: E402
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver  # noqa: E402
from sglang.srt.disaggregation.nixl.conn import NixlKVManager  # noqa: E402
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend  # noqa: E402

from sglang_cp_shared_kv.disaggregation import transfer_class_hooks  # noqa: E402
from sglang_cp_shared_kv.disaggregation.mooncake.conn import (  # noqa: E402
    CpSharedKVMooncakeKVManager,
    CpSharedKVMooncakeKVSender,
)
from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks  # noqa: E402

register_cpu_ci(est_time=15, suite="stage-a-test-cpu")


class TestGetKvClassHook(CustomTestCase):
    def test_mooncake_manager_and_sender_are_replaced(self):
        with applied_hooks(transfer_class_hooks.register_hooks):
            for get_kv_class in (stock_utils.get_kv_class, stock_prefill.get_kv_class):
                mooncake = TransferBackend.MOONCAKE
                self.assertIs(get_kv_class(mooncake, KVClassType.MANAGER), CpSharedKVMooncakeKVManager)
                self.assertIs(get_kv_class(mooncake, KVClassType.SENDER), CpSharedKVMooncakeKVSender)
                self.assertIs(get_kv_class(mooncake, KVClassType.RECEIVER), MooncakeKVReceiver)
                self.assertIs(get_kv_class(TransferBackend.NIXL, KVClassType.MANAGER), NixlKVManager)
        # undone after the block
        manager = stock_prefill.get_kv_class(TransferBackend.MOONCAKE, KVClassType.MANAGER)
        self.assertIsNot(manager, CpSharedKVMooncakeKVManager)

    def test_subclasses_override_only_the_transfer_methods(self):
        """The manager changes what is sent, not the protocol: bootstrap and status are inherited (a
        stock change to those reaches shared KV unchanged); the worker is stock's, run on a queue that
        names the chunk's request; ``send_aux`` is stock except that it reports a request whose transfer
        failed on this rank (``request_failures.py``); ``_transfer_data`` is stock's engine call, split
        into calls of bounded size."""
        own = {name for name, value in vars(CpSharedKVMooncakeKVManager).items() if callable(value)}
        self.assertEqual(
            own,
            {"__init__", "send_kvcache", "maybe_send_extra", "send_aux", "send_kvcache_hisparse",
             "send_kvcache_slice", "_transfer_data", "transfer_worker", "_fail_request"},
        )  # fmt: skip
        self.assertIn("send", vars(CpSharedKVMooncakeKVSender))
        self.assertNotIn("poll", vars(CpSharedKVMooncakeKVSender))


if __name__ == "__main__":
    unittest.main()
