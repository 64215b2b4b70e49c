"""Runtime startup: what it refuses (with the flag named), how it attaches, which sglang names it hooks."""

import pkgutil
import os
import unittest
from types import SimpleNamespace
from unittest import mock

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool, ReqToTokenPool
from sglang.srt.plugins.hook_registry import HookType
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.mem_cache.req_to_page_mirror import mirror_of
from sglang_cp_shared_kv.model_executor import cp_shared_kv_capacity as capacity
from sglang_cp_shared_kv.model_executor import cp_shared_kv_runtime, startup_wiring
from sglang_cp_shared_kv.model_executor.cp_shared_kv_spec import build_spec
from sglang_cp_shared_kv.model_executor.cp_shared_kv_state import state_of
from sglang_cp_shared_kv.settings import PREFETCH_SLOT_TOKENS_ENV as _SLOT_ENV
from sglang_cp_shared_kv.model_executor import forward_dispatch, owner_filtered_writes, peer_page_reads
from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import runtime_of
from sglang_cp_shared_kv.startup_rules import runtime_problems
from sglang_cp_shared_kv.settings import MTP_ENV
from sglang_cp_shared_kv_testing.runtime_check import PAGE_SIZE, make_nsa_pool
from sglang_cp_shared_kv_testing.server_args_cases import decided_now, runtime_server_args

register_cpu_ci(est_time=10, suite="stage-a-test-cpu")

_server_args = runtime_server_args


def unsupported_server_args(server_args):
    return runtime_problems(server_args, *decided_now(server_args))


class TestUnsupportedServerArgs(CustomTestCase):
    def test_supported_defaults(self):
        self.assertEqual(unsupported_server_args(_server_args()), [])
        bf16 = _server_args(kv_cache_dtype="bfloat16", nsa_prefill_backend="flashmla_sparse",
                            nsa_decode_backend="fa3")
        self.assertEqual(unsupported_server_args(bf16), [])

    def test_each_unsupported_setting_is_named(self):
        cases = {
            "--disable-cuda-graph": dict(disable_cuda_graph=False),
            "--disable-piecewise-cuda-graph": dict(disable_piecewise_cuda_graph=False),
            "round-robin-split": dict(nsa_prefill_cp_mode="in-seq-split"),
            "speculative": dict(speculative_algorithm="EAGLE"),
            "--enable-two-batch-overlap": dict(enable_two_batch_overlap=True),
            "--enable-pdmux": dict(enable_pdmux=True),
            "--enable-torch-compile": dict(enable_torch_compile=True),
            "flashmla_sparse": dict(nsa_prefill_backend="flashmla_sparse"),
            "flashmla_auto": dict(nsa_prefill_backend="flashmla_auto"),
        }
        for expected, override in cases.items():
            reasons = unsupported_server_args(_server_args(**override))
            self.assertEqual(len(reasons), 1, override)
            self.assertIn(expected, reasons[0])
            self.assertIn("--enable-nsa-prefill-cp-shared-kv", reasons[0])
        # fp8 with a trtllm decode backend stores 576-wide rows: top-k stays PAGED, accepted.
        trtllm = _server_args(nsa_prefill_backend="flashmla_sparse", nsa_decode_backend="trtllm")
        self.assertEqual(unsupported_server_args(trtllm), [])


class TestPlannedLengths(CustomTestCase):
    """What the plan reads and writes per request in each forward mode (host data only). Planted,
    each caught: TARGET_VERIFY without the draft tokens; DRAFT_EXTEND_V2 reading one token more
    (its lengths taken as a verify's: ``seq_lens_cpu`` plus the draft tokens) and one token less
    (``seq_lens_cpu - 1``), both failing ``test_spec_v2_draft_extend_from_sglangs_own_batch``."""

    @staticmethod
    def _batch(mode, seq_lens, extend=None):
        return SimpleNamespace(
            forward_mode=mode, seq_lens_cpu=torch.tensor(seq_lens), extend_seq_lens_cpu=extend
        )

    def test_lengths_per_mode(self):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import planned_lengths

        cases = {
            # mode: (seq_lens_cpu, extend_seq_lens_cpu) -> (tokens read, tokens written at the end)
            ForwardMode.DECODE: (([70, 129], None), ([70, 129], [1, 1])),
            ForwardMode.EXTEND: (([70, 129], [6, 129]), ([70, 129], [6, 129])),
            ForwardMode.MIXED: (([70, 129], [6, 1]), ([70, 129], [6, 1])),
            # committed lengths; 4 draft tokens each follow them
            ForwardMode.TARGET_VERIFY: (([70, 129], [4, 4]), ([74, 133], [4, 4])),
            # lengths after verify; the accepted tokens end there
            ForwardMode.DRAFT_EXTEND: (([72, 133], [2, 4]), ([72, 133], [2, 4])),
            # committed lengths plus every draft token; all the draft tokens end there
            ForwardMode.DRAFT_EXTEND_V2: (([74, 133], [4, 4]), ([74, 133], [4, 4])),
        }
        for mode, ((seq_lens, extend), (reads, writes)) in cases.items():
            with self.subTest(mode=mode.name):
                got_reads, got_writes = planned_lengths(self._batch(mode, seq_lens, extend))
                self.assertEqual(got_reads.tolist(), reads)
                self.assertEqual(got_writes.tolist(), writes)
        for mode in (ForwardMode.SPLIT_PREFILL, ForwardMode.DLLM_EXTEND):
            with self.subTest(mode=mode.name):
                with self.assertRaisesRegex(ValueError, f"forward mode {mode.name}"):
                    planned_lengths(self._batch(mode, [70], [4]))
        with self.assertRaisesRegex(ValueError, "without extend_seq_lens_cpu"):
            planned_lengths(self._batch(ForwardMode.TARGET_VERIFY, [70], None))

    def test_spec_v2_draft_extend_from_sglangs_own_batch(self):
        """Spec v2's draft extend as sglang builds it: ``prepare_for_extend_to_fill_draft_kvcache``
        on a batch after verify (committed lengths 70 and 129, 4 draft tokens each, which the
        verify wrote at positions ``70..73`` / ``129..132``). The NSA backend reads ``seq_lens``
        tokens per request for it (``cache_seqlens``: the draft term is added for TARGET_VERIFY
        only) and writes ``extend_seq_lens`` tokens at positions ``extend_prefix_lens ..``; the plan
        must read exactly those and take exactly the draft tokens as written (the pages they open
        are not gathered, every older page is)."""
        from sglang.srt.speculative import eagle_info_v2

        from sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime import planned_lengths

        committed, draft_tokens = [70, 129], 4
        batch = SimpleNamespace(
            forward_mode=ForwardMode.DECODE,
            seq_lens=torch.tensor(committed),
            seq_lens_cpu=torch.tensor(committed),
            seq_lens_sum=sum(committed),
        )
        built = []

        def init_new(model_worker_batch, model_runner):
            # The fields ForwardBatch.init_new copies for an extend-like mode.
            built.append(SimpleNamespace(
                forward_mode=model_worker_batch.forward_mode,
                seq_lens_cpu=model_worker_batch.seq_lens_cpu,
                extend_seq_lens_cpu=model_worker_batch.extend_seq_lens,
                extend_prefix_lens_cpu=model_worker_batch.extend_prefix_lens,
            ))  # fmt: skip
            return built[-1]

        runner = SimpleNamespace(attn_backend=SimpleNamespace(init_forward_metadata=lambda fb: None))
        with mock.patch.object(eagle_info_v2.ForwardBatch, "init_new", side_effect=init_new):
            eagle_info_v2.EagleDraftInputV2Mixin.prepare_for_extend_to_fill_draft_kvcache(
                SimpleNamespace(), batch, torch.zeros(2 * draft_tokens, dtype=torch.int64),
                draft_tokens, runner, None,
            )  # fmt: skip
        forward_batch = built[0]
        self.assertEqual(forward_batch.forward_mode, ForwardMode.DRAFT_EXTEND_V2)
        reads, writes = planned_lengths(forward_batch)
        # NSA: cache_seqlens = seq_lens (+ draft tokens for TARGET_VERIFY only).
        self.assertEqual(reads.tolist(), forward_batch.seq_lens_cpu.tolist())
        self.assertEqual(reads.tolist(), [c + draft_tokens for c in committed])
        self.assertEqual(writes.tolist(), [draft_tokens] * 2)
        # The written tokens start where the verify wrote the draft tokens.
        self.assertEqual((reads - writes).tolist(), forward_batch.extend_prefix_lens_cpu)
        self.assertEqual((reads - writes).tolist(), committed)


class _Attention(torch.nn.Module):
    """The attributes ``indexer_layer_ids_of`` reads from sglang's ``DeepseekV2AttentionMLA``."""

    def __init__(self, layer_id, skip_topk):
        super().__init__()
        self.layer_id, self.skip_topk = layer_id, skip_topk
        self.indexer = torch.nn.Identity()


class _AttachCase(CustomTestCase):
    """Stand-in model runners, the capacity hook's install (the spec built, the allocator, the
    pool's state) and the startup's attach (``startup_wiring``) as a TP worker runs them."""

    CONTEXT_LEN, CHUNK = 100, 28  # slot 1: (100 + 28) * 5 // 4 = 160 -> 192 tokens (3 pages)

    def _model_runner(self, pool, allocator, **overrides):
        """Decode gathers (trtllm is not served per owner, whatever the decode-path setting) unless
        ``overrides`` say otherwise."""
        overrides.setdefault("nsa_decode_backend", "trtllm")
        model = torch.nn.ModuleList([_Attention(0, False), _Attention(1, True)])
        return SimpleNamespace(
            token_to_kv_pool=pool,
            token_to_kv_pool_allocator=allocator,
            req_to_token_pool=ReqToTokenPool(4, 8 * PAGE_SIZE, "cpu", False),
            server_args=_server_args(
                chunked_prefill_size=self.CHUNK,
                page_size=PAGE_SIZE,
                enable_return_routed_experts=False,
                **overrides,
            ),
            model_config=SimpleNamespace(context_len=self.CONTEXT_LEN),
            model=model,
            is_draft_worker=False,
            page_size=PAGE_SIZE,
            kv_cache_dtype=torch.int64,
            device="cpu",
        )

    def _installed(self, pool, cp_rank=1, prefetch_slot="auto", env=None, **overrides):
        """A target runner over ``pool`` once the capacity hook ran: its spec built (with this
        environment; ``prefetch_slot``: the slot-1 setting when ``env`` sets none, the prefetch being
        opt-in, None leaves it unset as a server runs), the allocator by its layout, the pool's
        state."""
        runner = self._model_runner(pool, SimpleNamespace(need_sort=False), **overrides)
        with mock.patch.dict(os.environ, env or {}):
            if prefetch_slot is None:
                os.environ.pop(_SLOT_ENV, None)
            else:
                os.environ.setdefault(_SLOT_ENV, prefetch_slot)
            spec = build_spec(runner.server_args, self.CONTEXT_LEN, 2, cp_rank)
        capacity.install_logical_capacity(runner, spec)
        return runner

    def _attach(self, model_runner):
        """``startup_wiring``'s attach as a TP worker runs it."""
        group = SimpleNamespace(device_group="cp-device-group", ranks=[0, 1])
        world = SimpleNamespace(cpu_group="world-cpu-group")
        self.group_calls = []

        def create_prefetch_group(ranks, coordination_group, backend):
            self.group_calls.append((list(ranks), coordination_group, backend))
            return "prefetch-group"

        with mock.patch("sglang.srt.layers.dp_attention.get_attention_cp_group", return_value=group), \
             mock.patch("sglang.srt.distributed.parallel_state.get_world_group", return_value=world), \
             mock.patch.object(startup_wiring, "create_prefetch_group", create_prefetch_group), \
             mock.patch.object(  # the stand-in CP group has no collectives (per-owner decode's attach)
                 startup_wiring.per_owner_decode, "process_group_collectives", return_value=(None, None)
             ), \
             mock.patch("torch.distributed.get_backend", return_value="nccl"):
            startup_wiring.attach_after_attention_backend(None, model_runner)


class TestAttachRuntime(_AttachCase):
    def test_per_owner_decode_gets_a_prefill_sized_scratch_and_gathering_decode_raises(self):
        pool = make_nsa_pool(3 * PAGE_SIZE, "fp8", 2, "cpu")
        runner = self._installed(
            pool, prefetch_slot=None, env={"SGLANG_CP_SHARED_KV_DECODE": "per_owner"},
            nsa_decode_backend="flashmla_kv",
        )  # fmt: skip
        self._attach(runner)
        runtime = runtime_of(pool)
        # Context 100 + chunk 28 = 128 tokens (2 pages), below the logical 384.
        self.assertEqual(runtime.scratch.size, 2 * PAGE_SIZE)
        self.assertFalse(runtime.scratch_serves_decode)
        # The same spec attached per-owner decode, after the runtime, in the same hook
        # (planted, caught: startup_wiring skipping per-owner decode's attach).
        from sglang_cp_shared_kv.model_executor.per_owner_decode.decode_forward import per_owner_of

        self.assertEqual(per_owner_of(pool).decode_impl, "flashmla_kv")
        batch = SimpleNamespace(forward_mode=ForwardMode.DECODE)
        with self.assertRaisesRegex(ValueError, "SGLANG_CP_SHARED_KV_DECODE=gather"):
            runtime.begin_forward(batch)

    def test_attaches_once_with_a_logical_size_scratch(self):
        pool = make_nsa_pool(3 * PAGE_SIZE, "fp8", 2, "cpu")
        runner = self._installed(pool)
        self._attach(runner)
        runtime = runtime_of(pool)
        self.assertEqual((runtime.layout.cp_size, runtime.layout.cp_rank), (2, 1))
        # One birth of the layout: the runtime holds the spec's object, which the allocator holds
        # (planted: rebuilding it from get_attention_cp_size() in the attach failed this and
        # test_the_layout_is_built_once).
        self.assertIs(runtime.layout, runner.token_to_kv_pool_allocator.layout)
        self.assertIs(runtime.state, state_of(pool))
        self.assertEqual(runtime.scratch.size, 2 * pool.size)
        self.assertEqual(runtime.cp_group, "cp-device-group")
        self.assertIsNone(runtime_of(runtime.scratch))
        # The second slot, sized from context length + chunk, and the prefetch's own group over
        # the CP ranks, created with the CP group's backend after an exchange on the world group.
        slot1 = runtime.pipeline.slots[1]
        self.assertEqual(slot1.size, 3 * PAGE_SIZE)
        self.assertIsNone(runtime_of(slot1))
        self.assertEqual(runtime.pipeline.prefetch_group, "prefetch-group")
        self.assertEqual(self.group_calls, [([0, 1], "world-cpu-group", "nccl")])
        self.assertEqual(runtime.pipeline.indexer_layer_ids, frozenset({0}))  # layer 1 skips
        # The plan's host mirror of req_to_token: one page id per page of every row, in the state.
        mirror = mirror_of(runner.req_to_token_pool)
        self.assertEqual(mirror.pages.shape, (5, 8))
        self.assertIs(runtime.state.mirror, mirror)
        self._attach(runner)
        self.assertIs(runtime_of(pool), runtime)
        self.assertIs(mirror_of(runner.req_to_token_pool), mirror)

    def test_prefetch_off_unless_asked_for(self):
        pool = make_nsa_pool(3 * PAGE_SIZE, "fp8", 2, "cpu")
        self._attach(self._installed(pool, prefetch_slot=None))
        runtime = runtime_of(pool)
        self.assertEqual(len(runtime.pipeline.slots), 1)
        self.assertFalse(runtime.pipeline.can_prefetch)
        self.assertEqual(self.group_calls, [])  # no second group on any rank

    def test_prefetch_off_with_a_zero_token_second_slot(self):
        pool = make_nsa_pool(3 * PAGE_SIZE, "fp8", 2, "cpu")
        self._attach(self._installed(pool, env={"SGLANG_CP_SHARED_KV_PREFETCH_SLOT_TOKENS": "0"}))
        runtime = runtime_of(pool)
        self.assertEqual(len(runtime.pipeline.slots), 1)
        self.assertFalse(runtime.pipeline.can_prefetch)
        self.assertEqual(self.group_calls, [])  # no group: nothing else to create on any rank

    def test_flag_off_attaches_nothing(self):
        pool = make_nsa_pool(3 * PAGE_SIZE, "bf16", 1, "cpu")
        runner = self._model_runner(pool, object(), enable_nsa_prefill_cp_shared_kv=False)
        self._attach(runner)  # a stock allocator is fine: nothing of ours runs
        self.assertIsNone(state_of(pool))
        self.assertIsNone(mirror_of(runner.req_to_token_pool))

    def test_refusals_name_the_flag(self):
        """Where the spec is built (the capacity hook) or where the runtime attaches, each naming
        the flag and what to change."""

        def graphs_on():
            self._installed(make_nsa_pool(3 * PAGE_SIZE, "bf16", 1, "cpu"), disable_cuda_graph=False)

        def no_capacity_hook():
            self._attach(self._model_runner(make_nsa_pool(3 * PAGE_SIZE, "bf16", 1, "cpu"), object()))

        def another_allocator():
            runner = self._installed(make_nsa_pool(3 * PAGE_SIZE, "bf16", 1, "cpu"))
            runner.token_to_kv_pool_allocator = object()
            self._attach(runner)

        def draft_without_speculative_decoding():
            runner = self._installed(make_nsa_pool(3 * PAGE_SIZE, "bf16", 1, "cpu"))
            runner.is_draft_worker = True
            self._attach(runner)

        def hisparse_like():
            pool = make_nsa_pool(3 * PAGE_SIZE, "bf16", 1, "cpu")
            pool.__class__ = type("HiSparseNSATokenToKVPool", (NSATokenToKVPool,), {})
            self._attach(self._installed(pool))

        cases = [
            ("--disable-cuda-graph", graphs_on),
            ("capacity hook", no_capacity_hook),
            ("CPSharedPagedTokenToKVPoolAllocator", another_allocator),
            ("draft worker", draft_without_speculative_decoding),
            ("HiSparseNSATokenToKVPool", hisparse_like),
        ]
        for expected, refused in cases:
            with self.subTest(expected):
                with self.assertRaisesRegex(ValueError, "enable-nsa-prefill-cp-shared-kv") as raised:
                    refused()
                self.assertIn(expected, str(raised.exception))


class TestAttachDraftRuntime(_AttachCase):
    """The MTP draft worker's attach (after the target's), with the target's spec. Planted, caught:
    the draft worker attached like a target (a runtime with a scratch of its own); the draft's state
    built with a spec of its own."""

    SPEC = dict(speculative_algorithm="EAGLE", speculative_eagle_topk=1)

    def _draft_runner(self, target_runner, **server_args):
        draft_pool = make_nsa_pool(target_runner.token_to_kv_pool.size, "fp8", 1, "cpu")
        runner = self._model_runner(draft_pool, target_runner.token_to_kv_pool_allocator, **server_args)
        runner.is_draft_worker = True
        runner.req_to_token_pool = target_runner.req_to_token_pool  # shared, as EAGLEWorker does
        return runner

    def test_mtp_is_judged_once_where_the_spec_is_built(self):
        """The rules MTP must pass are judged with the target's spec (the same server args as the
        draft's); the draft reuses it."""
        pool = make_nsa_pool(3 * PAGE_SIZE, "fp8", 2, "cpu")
        with self.assertRaisesRegex(ValueError, f"--speculative-algorithm EAGLE.*{MTP_ENV}=1"):
            self._installed(pool, env={MTP_ENV: "0"}, **self.SPEC)  # MTP is not served yet
        with self.assertRaisesRegex(ValueError, "--speculative-eagle-topk 2"):  # whatever is opted in
            self._installed(pool, env={MTP_ENV: "1"}, **{**self.SPEC, "speculative_eagle_topk": 2})
        self.assertIsNone(state_of(pool))

    def test_draft_pool_gets_a_runtime_sharing_the_targets_spec_and_scratch(self):
        pool = make_nsa_pool(3 * PAGE_SIZE, "fp8", 2, "cpu")
        target_runner = self._installed(pool, env={MTP_ENV: "1"}, **self.SPEC)
        self._attach(target_runner)
        target = runtime_of(pool)
        mirror = mirror_of(target_runner.req_to_token_pool)
        draft_runner = self._draft_runner(target_runner, **self.SPEC)
        self._attach(draft_runner)  # the draft worker's step of the one attach hook
        draft = runtime_of(draft_runner.token_to_kv_pool)
        self.assertIsNotNone(draft)
        self.assertIsNot(draft, target)
        self.assertIs(draft.scratch, target.scratch)
        self.assertIs(draft.state.spec, target.state.spec)
        self.assertIs(draft.state.mirror, mirror)
        self.assertIs(mirror_of(target_runner.req_to_token_pool), mirror)  # not re-attached

    def test_a_pd_prefill_server_attaches_the_draft_to_its_prefill_sized_scratch(self):
        """A PD prefill server runs no decode (its scratch holds prefill batches only) and its
        draft only extends, so the draft pool attaches there; a draft step would raise.
        Planted, each caught: the PD prefill server judged as one that runs draft steps; the draft
        runtime built as if the scratch held the logical capacity (which first failed here)."""
        pool = make_nsa_pool(3 * PAGE_SIZE, "fp8", 2, "cpu")
        server_args = dict(disaggregation_mode="prefill", **self.SPEC)
        target_runner = self._installed(pool, prefetch_slot=None, env={MTP_ENV: "1"}, **server_args)
        self._attach(target_runner)
        self.assertFalse(runtime_of(pool).scratch_serves_decode)
        draft_runner = self._draft_runner(target_runner, **server_args)
        self._attach(draft_runner)
        draft = runtime_of(draft_runner.token_to_kv_pool)
        self.assertIs(draft.scratch, runtime_of(pool).scratch)
        step = SimpleNamespace(forward_mode=ForwardMode.DECODE)
        with self.assertRaisesRegex(ValueError, "sized for prefill batches only"):
            draft.plan_draft_step(SimpleNamespace(speculative_step_id=0), step)


class TestIndexerLayerTable(CustomTestCase):
    def test_sglang_attention_still_carries_the_flags_the_table_reads(self):
        # indexer_layer_ids_of reads layer_id, indexer and skip_topk from sglang's NSA attention.
        import inspect

        from sglang.srt.models.deepseek_v2 import DeepseekV2AttentionMLA

        source = inspect.getsource(DeepseekV2AttentionMLA.__init__)
        for assignment in ("self.layer_id = ", "self.indexer = ", "self.skip_topk = "):
            self.assertIn(assignment, source)

    def test_model_without_nsa_attention_means_every_layer(self):
        from sglang_cp_shared_kv.model_executor.peer_page_prefetch import indexer_layer_ids_of

        self.assertIsNone(indexer_layer_ids_of(torch.nn.Linear(2, 2)))
        model = torch.nn.ModuleList([_Attention(i, i % 2 == 1) for i in range(4)])
        self.assertEqual(indexer_layer_ids_of(model), frozenset({0, 2}))


class TestHookTargets(CustomTestCase):
    def test_every_target_resolves_in_sglang(self):
        registered = []
        registry = SimpleNamespace(register=lambda target, hook, kind: registered.append(target))
        for module in (capacity, cp_shared_kv_runtime, owner_filtered_writes, peer_page_reads, forward_dispatch,
                       startup_wiring):
            module.register_hooks(registry)
        self.assertEqual(len(registered), len(set(registered)))
        for target in registered:
            owner, name = target.rsplit(".", 1)
            self.assertTrue(callable(getattr(pkgutil.resolve_name(owner), name)), target)
        for expected in (
            "NSATokenToKVPool.set_mla_kv_buffer",
            "Indexer._store_index_k_cache",
            "NSATokenToKVPool.get_key_buffer",
            "NSATokenToKVPool.get_index_k_scale_buffer",
            "NativeSparseAttnBackend.init_forward_metadata",
            "ModelRunnerKVCacheMixin.init_memory_pool",
            "ModelRunnerKVCacheMixin._profile_available_bytes",
            "ModelRunner.init_attention_backend",
        ):
            self.assertTrue(any(t.endswith(expected) for t in registered), expected)

    def test_one_ordered_attach_hook(self):
        """The plugin hooks ``ModelRunner.init_attention_backend`` once, with ``startup_wiring``'s
        attach, which runs the runtime, the draft's and per-owner decode's steps in its own order
        (planted, caught: per-owner decode's attach registered as a second AFTER hook again)."""
        from sglang_cp_shared_kv import plugin
        from sglang_cp_shared_kv_testing import sgl_kernel_cpu_shim

        sgl_kernel_cpu_shim.install()  # the plugin's hook modules import sglang's host pools
        registered = []
        registry = SimpleNamespace(register=lambda *entry: registered.append(entry))
        plugin.register_runtime_hooks(registry)
        target = "sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backend"
        hooks = [(hook, kind) for t, hook, kind in registered if t == target]
        self.assertEqual(hooks, [(startup_wiring.attach_after_attention_backend, HookType.AFTER)])
        owner, name = target.rsplit(".", 1)
        self.assertTrue(callable(getattr(pkgutil.resolve_name(owner), name)))

if __name__ == "__main__":
    unittest.main()
