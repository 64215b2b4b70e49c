"""The real ``CpSharedKVMooncakeKVManager.__init__`` on a prefill rank: it takes its layout from the
allocator of the pool it sends from (through sglang's ``PrefillBootstrapQueue._init_kv_manager`` and
our hook on it), runs the stock mooncake/common init (buffers registered with the engine), and
refuses a setup it cannot serve. Only what needs a cluster is stubbed: the parallel-state getters,
the bootstrap registration, the mooncake engine and the bootstrap listener thread."""

import contextlib
import os
import unittest
from types import SimpleNamespace
from unittest import mock

import torch

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing import fake_pd_transfer as pd

from sglang.srt.disaggregation.base.conn import KVArgs  # noqa: E402  (after the CPU shim)
from sglang.srt.disaggregation.common.conn import CommonKVManager  # noqa: E402
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang_cp_shared_kv.disaggregation.mooncake.conn import CpSharedKVMooncakeKVManager  # noqa: E402
from sglang_cp_shared_kv.disaggregation.transfer_class_hooks import init_kv_manager_around  # noqa: E402
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout  # noqa: E402
from sglang_cp_shared_kv.model_executor.cp_shared_kv_state import CpSharedKVState, state_of  # noqa: E402
from sglang_cp_shared_kv_testing.shared_kv_state import spec_for  # noqa: E402

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

ALL_CP_RANKS_ENV = "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"
COMMON = "sglang.srt.disaggregation.common.conn."
DP_ATTENTION = "sglang.srt.layers.dp_attention."


def prefill_kv_args(pool, metadata):
    kv_args = KVArgs()
    kv_args.engine_rank, kv_args.pp_rank, kv_args.system_dp_rank = 1, 0, 0
    kv_args.prefill_start_layer, kv_args.page_size = 0, pool.page_size
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = pool.get_contiguous_buf_infos()
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = metadata.get_buf_infos()
    kv_args.state_data_ptrs, kv_args.state_data_lens, kv_args.state_item_lens = pool.get_state_buf_infos()
    kv_args.state_type, kv_args.ib_device, kv_args.gpu_id = "nsa", None, 0
    return kv_args


@contextlib.contextmanager
def prefill_rank_of_cp2(engine, env_value):
    """CP rank 1 of 2 (attention TP 1), without network, engine or listener thread."""
    env = {k: v for k, v in os.environ.items() if k != ALL_CP_RANKS_ENV}
    if env_value is not None:
        env[ALL_CP_RANKS_ENV] = env_value
    getters = {"tp_size": 1, "tp_rank": 0, "cp_size": 2, "cp_rank": 1, "dp_size": 1, "dp_rank": 0}
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, env, clear=True))
        for name, value in getters.items():
            stack.enter_context(mock.patch(f"{COMMON}get_attention_{name}", return_value=value))
        for name in ("cp_size", "cp_rank"):
            stack.enter_context(mock.patch(f"{DP_ATTENTION}get_attention_{name}", return_value=getters[name]))
        stack.enter_context(mock.patch(f"{COMMON}get_pp_group", return_value=None))
        stack.enter_context(mock.patch(f"{COMMON}get_local_ip_auto", return_value="127.0.0.1"))
        stack.enter_context(mock.patch.object(CommonKVManager, "register_to_bootstrap"))
        stack.enter_context(mock.patch.object(MooncakeKVManager, "start_prefill_thread"))
        stack.enter_context(
            mock.patch("sglang.srt.disaggregation.mooncake.conn.get_mooncake_transfer_engine", return_value=engine)
        )
        yield


class TestManagerInit(CustomTestCase):
    def setUp(self):
        self.pool = pd.build_nsa_pool(2)
        self.metadata = pd.MetadataBuffers(2, 8, torch.float32)

    def build(self, shared_kv=True, env_value="1", mode=DisaggregationMode.PREFILL):
        engine = pd.CopyingTransferEngine({})
        server_args = SimpleNamespace(
            host="127.0.0.1",
            disaggregation_bootstrap_port=0,
            dist_init_addr=None,
            enable_dp_attention=True,
            dp_size=1,
            pp_size=1,
            enable_nsa_prefill_cp_shared_kv=shared_kv,
            kv_cache_dtype="auto",
            load_balance_method="follow_bootstrap_room",
        )
        # What the capacity hook does: the pool's state carries the server's spec and its layout.
        state = state_of(self.pool) or CpSharedKVState(self.pool, spec_for(CpSharedKVLayout(2, 1, 64)))
        self.allocator_layout = state.spec.layout
        queue = SimpleNamespace(token_to_kv_pool=self.pool)

        def stock_init_kv_manager(queue):
            return CpSharedKVMooncakeKVManager(
                prefill_kv_args(queue.token_to_kv_pool, self.metadata), mode, server_args, True
            )

        with prefill_rank_of_cp2(engine, env_value):
            manager = init_kv_manager_around(stock_init_kv_manager, queue)
        return manager, engine

    def test_layout_from_the_spec_and_stock_registration(self):
        manager, engine = self.build()
        self.assertIs(manager.cp_shared_kv_layout, self.allocator_layout)
        self.assertTrue(manager.enable_all_cp_ranks_for_transfer)
        self.assertFalse(manager.is_dummy_cp_rank)  # rank 1 takes part in every transfer
        kv_args = manager.kv_args
        registered = len(kv_args.kv_data_ptrs) + len(kv_args.aux_data_ptrs) + len(kv_args.state_data_ptrs)
        self.assertEqual(len(engine.local), registered)  # physical KV, aux and indexer buffers

    def test_refused_without_all_cp_ranks_transfer(self):
        for value in (None, "0"):
            with self.assertRaisesRegex(ValueError, ALL_CP_RANKS_ENV):
                self.build(env_value=value)

    def test_flag_off_is_the_stock_manager(self):
        manager, _ = self.build(shared_kv=False, env_value=None)
        self.assertIsNone(manager.cp_shared_kv_layout)
        self.assertTrue(manager.is_dummy_cp_rank)  # stock: only CP rank 0 sends

    def test_decode_mode_refused(self):
        with self.assertRaisesRegex(ValueError, "prefill server"):
            self.build(mode=DisaggregationMode.DECODE)


if __name__ == "__main__":
    unittest.main()
