"""Logical capacity hook around sglang's real ModelRunnerKVCacheMixin.init_memory_pool (CPU).

The stand-in runner carries the attributes ``init_memory_pool`` / ``_init_pools`` read; only memory
profiling (``_resolve_memory_pool_config``) is replaced by a fixed physical size. Pools, the stock
allocator and the draft-worker path are sglang's own code.

Planted, caught: the capacity hook building a second layout for the allocator (equal, not the
spec's object) and the pool's state missing (``test_the_spec_is_built_once_and_handed_on``).
"""

import pkgutil
import unittest
from types import SimpleNamespace
from unittest import mock

import torch

from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.model_runner_kv_cache_mixin import ModelRunnerKVCacheMixin
from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig
from sglang.srt.plugins.hook_registry import HookType
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.mem_cache.allocator import CPSharedPagedTokenToKVPoolAllocator
from sglang_cp_shared_kv.model_executor import cp_shared_kv_capacity as capacity
from sglang_cp_shared_kv.model_executor.cp_shared_kv_state import state_of
from sglang_cp_shared_kv_testing.server_args_cases import runtime_server_args

register_cpu_ci(est_time=20, suite="stage-a-test-cpu")

PAGE_SIZE = 64
PHYSICAL_TOKENS = 6 * PAGE_SIZE


class StandInRunner(ModelRunnerKVCacheMixin):
    """What init_memory_pool reads on a GLM-5 target (or MTP draft) worker, on CPU, one layer."""

    def __init__(self, flag=True, draft_of=None, routed_experts=False):
        self.server_args = runtime_server_args(  # with what the spec's rules read
            enable_nsa_prefill_cp_shared_kv=flag,
            enable_return_routed_experts=routed_experts,
            speculative_num_draft_tokens=None,
            disaggregation_mode="null",
            enable_memory_saver=False,
            kv_cache_dtype="bfloat16",
            nsa_prefill_backend="flashmla_sparse",
            nsa_decode_backend="fa3",
            attention_backend="nsa",
            page_size=PAGE_SIZE,
            chunked_prefill_size=8192,
        )
        self.model_config = SimpleNamespace(
            hf_config=SimpleNamespace(
                architectures=["GlmMoeDsaForCausalLM"], index_topk=2048, index_head_dim=128
            ),
            context_len=4096,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
        )
        self.is_draft_worker = draft_of is not None
        self.spec_algorithm = SimpleNamespace(is_none=lambda: draft_of is None)
        # A draft worker shares the target's req_to_token pool, allocator and physical pool config.
        self.memory_pool_config = draft_of.memory_pool_config if draft_of else None
        self.req_to_token_pool = draft_of.req_to_token_pool if draft_of else None
        self.token_to_kv_pool_allocator = draft_of.token_to_kv_pool_allocator if draft_of else None
        self.mambaish_config = None
        self.hybrid_gdn_config = None
        self.is_hybrid_swa = False
        self.enable_hisparse = False
        self.use_mla_backend = True
        self.num_effective_layers = 1
        self.start_layer, self.end_layer = 0, 1
        self.device, self.gpu_id = "cpu", 0
        self.kv_cache_dtype = torch.bfloat16
        self.page_size = PAGE_SIZE

    def _resolve_memory_pool_config(self, pre_model_load_memory):
        # Stands in for GPU memory profiling: a fixed physical pool per rank.
        return MemoryPoolConfig(max_total_num_tokens=PHYSICAL_TOKENS, max_running_requests=8)


def init_memory_pool(runner, cp_size=4, cp_rank=1):
    with mock.patch.object(
        capacity, "get_attention_cp_size", return_value=cp_size
    ), mock.patch.object(capacity, "get_attention_cp_rank", return_value=cp_rank):
        capacity.init_memory_pool_with_logical_capacity(
            ModelRunnerKVCacheMixin.init_memory_pool, runner, 0
        )


class TestCpSharedKVCapacity(CustomTestCase):
    def test_target_worker_gets_logical_capacity_and_cp_allocator(self):
        runner = StandInRunner()
        init_memory_pool(runner, cp_size=4, cp_rank=1)
        pool = runner.token_to_kv_pool
        # the pool is sglang's, sized physically as profiled
        self.assertIs(type(pool), NSATokenToKVPool)
        self.assertEqual(pool.size, PHYSICAL_TOKENS)
        self.assertEqual(pool.kv_buffer[0].shape[0], PHYSICAL_TOKENS + PAGE_SIZE)
        self.assertEqual(runner.memory_pool_config.max_total_num_tokens, PHYSICAL_TOKENS)
        # logical capacity and the allocator over the same pool
        self.assertEqual(runner.max_total_num_tokens, 4 * PHYSICAL_TOKENS)
        allocator = runner.token_to_kv_pool_allocator
        self.assertIs(type(allocator), CPSharedPagedTokenToKVPoolAllocator)
        self.assertIs(allocator.get_kvcache(), pool)
        self.assertEqual((allocator.cp_size, allocator.cp_rank), (4, 1))
        self.assertEqual(allocator.physical_size, PHYSICAL_TOKENS)
        self.assertEqual(allocator.available_size(), runner.max_total_num_tokens)
        # TpModelWorker derives max_req_len from this property
        self.assertEqual(ModelRunner.max_token_pool_size.fget(runner), 4 * PHYSICAL_TOKENS)

    def test_the_spec_is_built_once_and_handed_on(self):
        """One ``CpSharedKVSpec`` per target runner, built where the capacity is installed: the
        allocator allocates by its layout, the pool's state carries it to the attach, and nothing
        of it is set on the model runner."""
        runner = StandInRunner()
        with mock.patch.object(capacity, "build_spec", wraps=capacity.build_spec) as build:
            init_memory_pool(runner, cp_size=4, cp_rank=1)
        self.assertEqual(build.call_count, 1)
        spec = state_of(runner.token_to_kv_pool).spec
        self.assertIs(runner.token_to_kv_pool_allocator.layout, spec.layout)
        self.assertEqual((spec.layout.cp_size, spec.layout.cp_rank), (4, 1))
        self.assertTrue(spec.decode.per_owner)  # fa3 under auto
        self.assertEqual(spec.scratch.slot0.prefill_tokens, 4096 + 8192)
        self.assertIsNone(state_of(runner.token_to_kv_pool).runtime)  # attached later
        self.assertEqual([name for name in vars(runner) if name.startswith("_cp")], [])

    def test_flag_off_leaves_stock_sizing(self):
        runner = StandInRunner(flag=False)
        init_memory_pool(runner)
        self.assertEqual(runner.max_total_num_tokens, PHYSICAL_TOKENS)
        self.assertIs(type(runner.token_to_kv_pool_allocator), PagedTokenToKVPoolAllocator)

    def test_draft_worker_keeps_physical_pool_and_shares_target_allocator(self):
        target = StandInRunner()
        init_memory_pool(target, cp_size=2, cp_rank=0)
        draft = StandInRunner(draft_of=target)
        init_memory_pool(draft, cp_size=2, cp_rank=0)
        self.assertEqual(draft.max_total_num_tokens, PHYSICAL_TOKENS)
        self.assertEqual(draft.token_to_kv_pool.size, PHYSICAL_TOKENS)
        self.assertIsNot(draft.token_to_kv_pool, target.token_to_kv_pool)
        self.assertIs(draft.token_to_kv_pool_allocator, target.token_to_kv_pool_allocator)

    def test_the_draft_pool_sglang_builds_is_exactly_one_shard_of_the_logical_capacity(self):
        """The MTP draft's pool (sized by stock from the target's physical config) holds a physical
        row for every logical loc the shared allocator can hand out, on its owner, each exactly once:
        sharded by the target's layout it needs no byte more or less than stock allocates."""
        from sglang_cp_shared_kv.model_executor.cp_shared_kv_draft_pool import draft_pool_problems

        for cp_size in (2, 8):
            for cp_rank in (0, cp_size - 1):
                target = StandInRunner()
                target.num_effective_layers, target.end_layer = 3, 3  # several target layers
                init_memory_pool(target, cp_size=cp_size, cp_rank=cp_rank)
                draft = StandInRunner(draft_of=target)  # one NextN layer
                init_memory_pool(draft, cp_size=cp_size, cp_rank=cp_rank)
                msg = f"cp {cp_size} rank {cp_rank}"
                self.assertEqual(draft_pool_problems(target.token_to_kv_pool, draft.token_to_kv_pool), [], msg)
                self.assertEqual(draft.token_to_kv_pool.layer_num, 1, msg)
                allocator = target.token_to_kv_pool_allocator
                locs = allocator.alloc(allocator.available_size())  # every logical loc there is
                self.assertEqual(len(locs), cp_size * PHYSICAL_TOKENS, msg)
                layout = allocator.layout
                owned = locs[layout.owned_by_this_rank(locs)]
                rows = layout.physical_locs_or_dummy(owned)
                self.assertEqual(len(owned), PHYSICAL_TOKENS, msg)  # 1 / cp_size of them is ours
                # ... at distinct real rows (page 0 is the dummy page) inside the draft's buffers
                self.assertEqual(len(torch.unique(rows)), PHYSICAL_TOKENS, msg)
                self.assertGreaterEqual(int(rows.min()), PAGE_SIZE, msg)
                self.assertLess(int(rows.max()), draft.token_to_kv_pool.kv_buffer[0].shape[0], msg)
                pages = torch.unique(rows // PAGE_SIZE)
                self.assertLess(int(pages.max()), draft.token_to_kv_pool.index_k_with_scale_buffer[0].shape[0], msg)

    def test_non_nsa_pool_and_routed_experts_are_refused(self):
        runner = StandInRunner()
        runner.model_config.hf_config.architectures = ["DeepseekV2ForCausalLM"]  # plain MLA pool
        with self.assertRaisesRegex(ValueError, "enable-nsa-prefill-cp-shared-kv"):
            init_memory_pool(runner)
        with self.assertRaisesRegex(ValueError, "routed-experts"):
            init_memory_pool(StandInRunner(routed_experts=True))

    def test_register_hooks_wraps_init_memory_pool(self):
        registered = []
        capacity.register_hooks(SimpleNamespace(register=lambda *args: registered.append(args)))
        self.assertEqual(
            registered,
            [
                (
                    capacity.INIT_MEMORY_POOL,
                    capacity.init_memory_pool_with_logical_capacity,
                    HookType.AROUND,
                ),
                (
                    capacity.PROFILE_AVAILABLE_BYTES,
                    capacity.reserve_scratch_before_pool_sizing,
                    HookType.AFTER,
                ),
            ],
        )
        self.assertIs(
            pkgutil.resolve_name(capacity.INIT_MEMORY_POOL),
            ModelRunnerKVCacheMixin.init_memory_pool,
        )
        self.assertIs(
            pkgutil.resolve_name(capacity.PROFILE_AVAILABLE_BYTES),
            ModelRunnerKVCacheMixin._profile_available_bytes,
        )


if __name__ == "__main__":
    unittest.main()
