"""Per-owner decode under CUDA graphs, on CPU: static tables refreshed in place, the backend hooks, the
collectives, and the startup rule that accepts decode graphs only where they can work.

A graph replays the tensors it was captured with, so what matters is that (1) a refresh writes the
new batch's tables into the same storage, stale columns included, (2) the capture hook points the
per-owner forward at that storage and the replay hook refreshes it, and (3) the server refuses
graphs with a clear error wherever decode still gathers.

Plants seen failing (then reverted): the refresh not copying ``owned_seq_lens``
(``test_refresh_rewrites_the_same_storage``); the replay hook not refreshing
(``test_capture_then_replay_reads_refreshed_tables``);
the rule accepting graphs with ``SGLANG_CP_SHARED_KV_DECODE=gather``
(``test_graphs_refused_wherever_decode_gathers``); ``merge_partials`` multiplying an empty
partial's garbage by its zero weight, and ``unpack_gathered`` reading the LSE from the last two
partial values (``test_a_replayed_one_exchange_merge_equals_the_scaled_sum``).
"""

import dataclasses
import unittest
from types import SimpleNamespace
from unittest import mock

import torch

from sglang.srt.layers.attention.nsa_backend import NSAIndexerMetadata
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_shared_kv.model_executor.per_owner_decode import cuda_graphs as graphs
from sglang_cp_shared_kv.settings import DECODE_PATH_ENV, GRAPH_DECODE_ENV
from sglang_cp_shared_kv.model_executor.per_owner_decode.owner_decode_tables import (
    build_owner_decode_tables,
)
from sglang_cp_shared_kv.model_executor.peer_page_reads import refuse_cuda_graph
from sglang_cp_shared_kv.model_executor.per_owner_decode import attention_lse_merge as merge
from sglang_cp_shared_kv.model_executor.per_owner_decode import decode_forward as per_owner
from sglang_cp_shared_kv.settings import MODELED_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES, CpSharedKVSettings
from sglang_cp_shared_kv.model_executor.per_owner_decode.decode_forward import _STATE_ATTR
from sglang_cp_shared_kv_testing import cpu_graph_recorder
from sglang_cp_shared_kv_testing.per_owner_decode_cases import random_batch
from sglang_cp_shared_kv.startup_rules import cuda_graph_problem, runtime_problems
from sglang_cp_shared_kv_testing.server_args_cases import decided_now, runtime_server_args
from sglang_cp_shared_kv_testing.shared_kv_state import per_owner_pool_state

register_cpu_ci(est_time=15, suite="stage-a-test-cpu")

PAGE = 64
CP_SIZE = 4


def _batch(seed, seq_lens, padded=None):
    return random_batch(torch.Generator().manual_seed(seed), CP_SIZE, PAGE, seq_lens, padded)


def _assert_tables_equal(test, got, expected):
    test.assertTrue(torch.equal(got.physical_page_table, expected.physical_page_table))
    test.assertTrue(torch.equal(got.logical_page_column, expected.logical_page_column))
    test.assertTrue(torch.equal(got.owned_seq_lens, expected.owned_seq_lens))


class TestOwnerTableBuffers(CustomTestCase):
    def test_refresh_rewrites_the_same_storage(self):
        layout = CpSharedKVLayout(CP_SIZE, 1, PAGE)
        buffers = graphs.OwnerTableBuffers(max_bs=6, width_pages=12, page_size=PAGE, device="cpu")
        wide = _batch(0, [700, 64, 1, 650], [False, False, True, False])
        narrow = _batch(1, [130, 70, 5, 200])  # fewer pages: columns past them must be cleaned
        first = buffers.refresh(layout, wide.page_table, wide.seq_lens)
        pointers = [t.data_ptr() for t in (first.physical_page_table, first.owned_seq_lens)]
        for batch in (narrow, wide, narrow):
            static = buffers.refresh(layout, batch.page_table, batch.seq_lens)
            self.assertEqual([t.data_ptr() for t in (static.physical_page_table, static.owned_seq_lens)], pointers)
            fresh = build_owner_decode_tables(layout, batch.page_table, batch.seq_lens)
            width = batch.page_table.shape[1]
            self.assertTrue(torch.equal(static.physical_page_table[:, :width], fresh.physical_page_table))
            self.assertTrue(torch.equal(static.logical_page_column[:, :width], fresh.logical_page_column))
            self.assertTrue(torch.equal(static.owned_seq_lens, fresh.owned_seq_lens))
            self.assertEqual(int(static.physical_page_table[:, width:].abs().sum()), 0)
            self.assertTrue(bool((static.logical_page_column[:, width:] == -1).all()))
            # The per-owner forward derives its columns from the static tables: same as fresh.
            self.assertTrue(torch.equal(static.local_physical_rows(12 * PAGE)[:, : width * PAGE],
                                        fresh.local_physical_rows(width * PAGE)))

    def test_schedule_is_created_once_then_refreshed_in_place(self):
        layout = CpSharedKVLayout(CP_SIZE, 0, PAGE)
        buffers = graphs.OwnerTableBuffers(4, 12, PAGE, "cpu")
        schedule_fn = lambda lens: torch.cumsum(lens, 0)  # noqa: E731 (stands in for deep_gemm's)
        a, b = _batch(2, [700, 300, 64, 5]), _batch(3, [90, 650, 1, 400])
        buffers.refresh(layout, a.page_table, a.seq_lens, schedule_fn)
        held = buffers.schedules[4]
        buffers.refresh(layout, b.page_table, b.seq_lens, schedule_fn)
        self.assertIs(buffers.schedules[4], held)
        self.assertTrue(torch.equal(held, torch.cumsum(buffers.tables(4).owned_seq_lens, 0)))

    def test_table_wider_than_the_static_one_raises(self):
        buffers = graphs.OwnerTableBuffers(4, 2, PAGE, "cpu")
        batch = _batch(4, [700, 1, 1, 1])
        with self.assertRaisesRegex(ValueError, "exceeds the static"):
            buffers.refresh(CpSharedKVLayout(CP_SIZE, 0, PAGE), batch.page_table, batch.seq_lens)


class TestGraphHooks(CustomTestCase):
    MAX_BS, CONTEXT = 4, 12 * PAGE

    def _backend(self, bound=True):
        state = per_owner_pool_state(CpSharedKVLayout(CP_SIZE, 2, PAGE))
        backend = SimpleNamespace(
            decode_cuda_graph_metadata={"page_table": torch.zeros(self.MAX_BS, self.CONTEXT, dtype=torch.int32)},
            real_page_size=PAGE,
            forward_metadata=None,
        )
        setattr(backend, _STATE_ATTR, state.per_owner)
        if bound:
            setattr(backend, graphs._BOUND_ATTR, state)
        return backend, state

    def _set_batch(self, backend, batch):
        """What sglang's own capture / replay metadata leaves in ``forward_metadata`` (its static
        tensors, rewritten in place on replay)."""
        if backend.forward_metadata is None:
            backend.forward_metadata = SimpleNamespace(
                real_page_table=batch.page_table.clone(),
                cache_seqlens_int32=batch.seq_lens.to(torch.int32),
                paged_mqa_schedule_metadata=None,
            )
            return
        width = batch.page_table.shape[1]
        backend.forward_metadata.real_page_table[:, :width].copy_(batch.page_table)
        backend.forward_metadata.cache_seqlens_int32.copy_(batch.seq_lens)

    def test_capture_then_replay_reads_refreshed_tables(self):
        backend, state = self._backend()
        graphs.init_cuda_graph_state_after(None, backend, self.MAX_BS, self.MAX_BS)
        buffers = graphs.buffers_of(backend)
        self.assertEqual(buffers.width_pages, 12)
        capture = _batch(5, [700, 64, 300, 1], [False, False, False, True])
        capture.page_table = torch.nn.functional.pad(capture.page_table, (0, 12 - capture.page_table.shape[1]))
        self._set_batch(backend, capture)
        graphs.capture_metadata_after(None, backend, 4, 4, None, None, None, ForwardMode.DECODE, None)
        self.assertIsNone(state.runtime.plan)  # the captured stores are owner-filtered only
        self.assertTrue(state.reads_physical_pool())
        captured = state.per_owner.forward.tables
        self.assertEqual(captured.physical_page_table.data_ptr(), buffers.physical_page_table.data_ptr())
        layout = state.spec.layout
        _assert_tables_equal(self, captured, build_owner_decode_tables(layout, backend.forward_metadata.real_page_table, backend.forward_metadata.cache_seqlens_int32))

        replay = _batch(6, [200, 650, 5, 400])
        self._set_batch(backend, replay)
        graphs.replay_metadata_after(None, backend, 4)
        expected = build_owner_decode_tables(
            layout, backend.forward_metadata.real_page_table, backend.forward_metadata.cache_seqlens_int32
        )
        _assert_tables_equal(self, captured, expected)  # the captured views now hold the replay's

    def test_capture_of_anything_but_decode_raises(self):
        backend, _ = self._backend()
        graphs.init_cuda_graph_state_after(None, backend, self.MAX_BS, self.MAX_BS)
        self._set_batch(backend, _batch(7, [64, 64, 64, 64]))
        with self.assertRaisesRegex(ValueError, "decode only"):
            graphs.capture_metadata_after(None, backend, 4, 4, None, None, None, ForwardMode.TARGET_VERIFY, None)

    def test_unbound_backend_is_left_alone_and_its_graphs_refused(self):
        backend, state = self._backend(bound=False)
        graphs.init_cuda_graph_state_after(None, backend, self.MAX_BS, self.MAX_BS)
        self.assertIsNone(graphs.buffers_of(backend))
        with self.assertRaisesRegex(ValueError, "--disable-cuda-graph"):
            refuse_cuda_graph(backend, 4)
        bound, _ = self._backend()
        graphs.init_cuda_graph_state_after(None, bound, self.MAX_BS, self.MAX_BS)
        self.assertIsNone(refuse_cuda_graph(bound, 4))


@dataclasses.dataclass(frozen=True)
class _AttnMetadata:
    """The fields of sglang's ``NSAMetadata`` the per-owner graph and indexer hooks read."""

    real_page_table: torch.Tensor
    cache_seqlens_int32: torch.Tensor
    paged_mqa_schedule_metadata: object = None


class TestCapturedRuns(CustomTestCase):
    """sglang captures a decode graph after two eager warm-up runs of the same forward, all three
    after ONE ``init_forward_metadata_capture_cuda_graph`` (so one ``OwnerForward``); a replay then
    runs only the kernels the capture run issued (``cpu_graph_recorder`` replays them on CPU).
    Served, per-owner graphs crashed with an illegal memory access (2026-12-02): the local columns
    (each score column's position and pool row) were derived in the first warm-up and cached on the
    ``OwnerForward``, so the captured run recorded no kernel computing them and every replay read the
    warm-up's tensors (capture-time values, freed once the ``OwnerForward`` was replaced). Seen
    failing before the fix: the replay attended the capture batch's columns (all -1), not the
    replayed batch's."""

    BS, WIDTH_PAGES, TOPK = 4, 12, 96

    def _state(self, layout):
        def all_gather(scores):  # this rank's candidates; the other rank owns none of these
            return torch.stack([scores, torch.full_like(scores, float("-inf"))])

        pool_state = per_owner_pool_state(layout, collectives=(all_gather, None))
        return pool_state, pool_state.pool

    def test_a_replay_reads_the_replayed_batch_columns_not_the_warm_up_ones(self):
        layout = CpSharedKVLayout(2, 0, PAGE)
        state, pool = self._state(layout)
        backend = SimpleNamespace(
            decode_cuda_graph_metadata={"page_table": torch.zeros(self.BS, self.WIDTH_PAGES * PAGE, dtype=torch.int32)},
            real_page_table=None, real_page_size=PAGE, forward_metadata=None,
        )  # fmt: skip
        setattr(backend, _STATE_ATTR, state.per_owner)
        setattr(backend, graphs._BOUND_ATTR, state)
        graphs.init_cuda_graph_state_after(None, backend, self.BS, self.BS)
        # sglang's capture batch: every request padded (seq len 1 on the dummy page 0).
        backend.forward_metadata = _AttnMetadata(
            real_page_table=torch.zeros(self.BS, self.WIDTH_PAGES, dtype=torch.int32),
            cache_seqlens_int32=torch.ones(self.BS, dtype=torch.int32),
        )
        graphs.capture_metadata_after(None, backend, self.BS, self.BS, None, None, None, ForwardMode.DECODE, None)
        logits = torch.zeros(self.BS, self.WIDTH_PAGES * PAGE)  # the indexer's output: a graph tensor
        forward_batch = SimpleNamespace(token_to_kv_pool=pool)
        result = NSAIndexerMetadata(attn_metadata=backend.forward_metadata, topk_transform_method=None)

        def forward():
            return [per_owner.indexer_metadata_per_owner(result, backend, layer, forward_batch)
                    .topk_transform(logits, self.TOPK) for layer in (0, 1)]  # fmt: skip

        forward(), forward()  # sglang's two eager warm-ups
        with cpu_graph_recorder.RecordedRun() as capture:
            captured = forward()

        batch = _batch(11, [700, 64, 300, 1], [False, False, False, True])
        width = batch.page_table.shape[1]
        backend.forward_metadata.real_page_table[:, :width].copy_(batch.page_table)
        backend.forward_metadata.cache_seqlens_int32.copy_(batch.seq_lens)
        logits.copy_(torch.randn(logits.shape, generator=torch.Generator().manual_seed(3)))
        graphs.replay_metadata_after(None, backend, self.BS)
        capture.replay()

        state.per_owner.forward = per_owner.OwnerForward(
            build_owner_decode_tables(layout, backend.forward_metadata.real_page_table,
                                      backend.forward_metadata.cache_seqlens_int32), None)  # fmt: skip
        expected = state.per_owner.select(logits, self.TOPK)
        self.assertGreater(int((expected >= 0).sum()), 0)
        for layer_indices in captured:
            self.assertTrue(torch.equal(layer_indices, expected))

    def test_columns_are_derived_once_per_run(self):
        tables = build_owner_decode_tables(CpSharedKVLayout(2, 0, PAGE), *(_batch(4, [300, 64]).page_table,
                                                                         _batch(4, [300, 64]).seq_lens))
        forward = per_owner.OwnerForward(tables, None)
        runs = []
        for layers in ((0, 1, 3), (0, 1, 3)):
            for layer in layers:
                forward.begin_layer(layer)
                runs.append(forward.columns(5 * PAGE)[0])
        self.assertIs(runs[0], runs[2])  # one run: derived once, shared by its layers
        self.assertIsNot(runs[2], runs[3])  # the next run derives its own


class EmulatedPeers:
    """The other ranks of a CP group as static buffers (graph inputs, refreshed before a replay):
    this rank is rank 0; the collectives put the peers' contributions, computed from the buffers
    inside the recorded run, beside this rank's."""

    def __init__(self, outs: torch.Tensor, lses: torch.Tensor):
        self.outs, self.lses = outs, lses  # [cp - 1, T, H, D] bf16, [cp - 1, T, H] natural
        self.gathered_lses = None
        self.calls = []

    def all_gather(self, tensor):
        self.calls.append("all_gather")
        if tensor.dim() == 3:  # the one exchange's packed partial
            peers = [merge.pack_partial(out, lse) for out, lse in zip(self.outs, self.lses)]
            return torch.stack([tensor, *peers])
        self.gathered_lses = torch.cat([tensor[None], self.lses])  # the scaled sum's LSEs
        return self.gathered_lses

    def all_reduce_sum(self, tensor):
        self.calls.append("all_reduce")
        total = tensor.float()
        for out, lse in zip(self.outs, self.lses):
            total = total + merge.scaled_partial_of_gathered(out, lse, self.gathered_lses).float()
        return total.to(tensor.dtype)


def _partials(seed, cp_size=4, tokens=4, heads=8, dim=64):
    """Every rank's partial and natural LSE; rank 0 owns none of token 1 (+inf LSE, NaN output),
    rank 2 none of token 0 (-inf), token 3 is padded (no rank owns any of it)."""
    g = torch.Generator().manual_seed(seed)
    outs = (torch.randn(cp_size, tokens, heads, dim, generator=g) * 3).to(torch.bfloat16)
    lses = torch.randn(cp_size, tokens, heads, generator=g) * 2
    lses[0, 1], lses[2, 0], lses[:, 3] = float("inf"), float("-inf"), float("inf")
    outs = torch.where(torch.isfinite(lses)[..., None], outs, float("nan")).to(torch.bfloat16)
    return outs, lses


class TestCapturedMerge(CustomTestCase):
    """``PerOwnerDecode.merge`` recorded as a graph captures it (``cpu_graph_recorder``) at a batch
    whose form the rule makes one exchange, then replayed over new partials (this rank's and the
    peers'): equal to today's merge (the scaled sum) run eagerly on them, within the checks' bf16
    tolerance, with empty partials' garbage never read and a padded token exactly 0."""

    def _merge_state(self, peers, max_extra_bytes):
        settings = CpSharedKVSettings(merge_one_exchange_max_extra_bytes=max_extra_bytes)
        return per_owner_pool_state(CpSharedKVLayout(4, 0, PAGE), (peers.all_gather, peers.all_reduce_sum),
                                    settings=settings).per_owner  # fmt: skip

    def test_a_replayed_one_exchange_merge_equals_the_scaled_sum(self):
        outs, lses = _partials(0)
        out, lse = outs[0].clone(), lses[0].clone()  # this rank's static partial
        peers = EmulatedPeers(outs[1:].clone(), lses[1:].clone())
        decode = self._merge_state(peers, MODELED_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES)
        decode.merge(out, lse)  # warm-up
        peers.calls.clear()
        with cpu_graph_recorder.RecordedRun() as capture:
            captured = decode.merge(out, lse)
        self.assertEqual(peers.calls, ["all_gather"])  # one exchange, fixed for this batch size
        at_capture = captured.clone()

        new_outs, new_lses = _partials(1)
        out.copy_(new_outs[0]), lse.copy_(new_lses[0])
        peers.outs.copy_(new_outs[1:]), peers.lses.copy_(new_lses[1:])
        capture.replay()

        today_peers = EmulatedPeers(new_outs[1:], new_lses[1:])
        today = self._merge_state(today_peers, None).merge(new_outs[0], new_lses[0])
        self.assertEqual(today_peers.calls, ["all_gather", "all_reduce"])
        self.assertFalse(captured.isnan().any())
        torch.testing.assert_close(captured.float(), today.float(), rtol=2e-2, atol=2e-2)
        self.assertTrue(torch.equal(captured[3], torch.zeros_like(captured[3])))
        self.assertGreater(float((captured.float() - at_capture.float()).abs().max()), 1.0)


class TestCollectivesAndBinding(CustomTestCase):
    def test_coordinator_collectives_shapes(self):
        calls = []

        class Coordinator:
            def all_gather_into_tensor(self, out, source):
                calls.append("all_gather_into_tensor")
                out.copy_(torch.cat([source, source + 1]))

            def all_reduce(self, tensor):
                calls.append("all_reduce")
                return tensor * 2

        all_gather, all_reduce_sum = graphs.coordinator_collectives(Coordinator(), 2)
        keys = torch.arange(6).view(3, 2)
        gathered = all_gather(keys)
        self.assertEqual(tuple(gathered.shape), (2, 3, 2))
        self.assertTrue(torch.equal(gathered[1], keys + 1))
        x = torch.ones(3)
        self.assertTrue(torch.equal(all_reduce_sum(x), 2 * x))
        self.assertTrue(torch.equal(x, torch.ones(3)))  # the input is not reduced in place
        self.assertEqual(calls, ["all_gather_into_tensor", "all_reduce"])

    def _runner(self, disable_cuda_graph=False, cp_size=2):
        state = per_owner_pool_state(CpSharedKVLayout(cp_size, 0, PAGE))
        runner = SimpleNamespace(
            server_args=SimpleNamespace(disable_cuda_graph=disable_cuda_graph),
            token_to_kv_pool=state.pool,
            attn_backend=SimpleNamespace(),
        )
        return runner, state

    def test_binding_needs_the_cp_group_to_be_the_tp_group(self):
        runner, state = self._runner()
        tp, other = object(), object()
        with mock.patch("sglang.srt.distributed.parallel_state.get_tp_group", return_value=tp):
            with mock.patch("sglang.srt.layers.dp_attention.get_attention_cp_group", return_value=other):
                with self.assertRaisesRegex(ValueError, "TP group"):
                    graphs.bind_graph_decode(runner)
            with mock.patch("sglang.srt.layers.dp_attention.get_attention_cp_group", return_value=tp):
                self.assertTrue(graphs.bind_graph_decode(runner))
        self.assertIs(getattr(runner.attn_backend, _STATE_ATTR), state.per_owner)
        self.assertIs(graphs.bound_state(runner.attn_backend), state)
        self.assertIsNotNone(state.per_owner.all_gather)

    def test_binding_at_every_cp_size_the_flag_accepts(self):
        """Per-owner graphs have served clean at CP 2, 4 and 8 with padded replays: a padded capture
        list (sglang's default keeps 2 4 8 12 16 at CP 2) binds at each. Seen failing with the
        former check before capture (graphs refused above CP 4) put back."""
        tp = object()
        for cp_size, binds in ((2, True), (4, True), (8, True)):
            with self.subTest(cp_size=cp_size):
                runner, state = self._runner(cp_size=cp_size)
                runner.server_args.cuda_graph_bs = [2, 4, 8, 12, 16]
                with mock.patch("sglang.srt.distributed.parallel_state.get_tp_group", return_value=tp), \
                     mock.patch("sglang.srt.layers.dp_attention.get_attention_cp_group", return_value=tp):
                    self.assertTrue(graphs.bind_graph_decode(runner))
                self.assertEqual(hasattr(runner.attn_backend, _STATE_ATTR), binds)

    def test_nothing_bound_without_graphs(self):
        runner, state = self._runner(disable_cuda_graph=True)
        self.assertFalse(graphs.bind_graph_decode(runner))
        self.assertFalse(hasattr(runner.attn_backend, _STATE_ATTR))


def _server_args(**overrides):
    return runtime_server_args(**{"disable_cuda_graph": False, **overrides})


class TestGraphDecodeStartupRule(CustomTestCase):
    def _problem(self, env=None, opt_in=True, **overrides):
        """``opt_in``: decode per owner (``SGLANG_CP_SHARED_KV_DECODE=per_owner``) unless ``env`` sets it."""
        with mock.patch.dict("os.environ") as environ:
            for name in (DECODE_PATH_ENV, GRAPH_DECODE_ENV):
                environ.pop(name, None)
            if opt_in:
                environ[DECODE_PATH_ENV] = "per_owner"
            environ.update(env or {})
            args = _server_args(**overrides)
            return cuda_graph_problem(args, *decided_now(args)), runtime_problems(args, *decided_now(args))

    def test_defaults_run_graphs_where_decode_runs_per_owner(self):
        """Nothing set: with fa3 (bf16 KV) decode runs per owner under graphs, no
        --disable-cuda-graph needed, at every CP size; with flashmla_kv (fp8 KV) decode gathers, so
        graphs are refused naming the impl and the setting. Seen failing with the former defaults
        (gather, graphs off)."""
        for tp_size in (2, 4, 8):
            with self.subTest(tp_size=tp_size):
                self.assertEqual(self._problem(opt_in=False, nsa_decode_backend="fa3", tp_size=tp_size), (None, []))
        problem, problems = self._problem(opt_in=False, nsa_decode_backend="flashmla_kv")
        for named in ("--disable-cuda-graph", "flashmla_kv", f"{DECODE_PATH_ENV}=auto"):
            self.assertIn(named, problem)
        self.assertEqual(problems, [problem])
        self.assertEqual(self._problem(opt_in=False, disable_cuda_graph=True), (None, []))

    def test_graphs_turned_off_require_disable_cuda_graph(self):
        problem, problems = self._problem({GRAPH_DECODE_ENV: "0"})
        self.assertIn("--disable-cuda-graph", problem)
        self.assertIn(f"{GRAPH_DECODE_ENV}=0", problem)
        self.assertEqual(problems, [problem])
        self.assertEqual(self._problem({GRAPH_DECODE_ENV: "0"}, disable_cuda_graph=True), (None, []))

    def test_per_owner_decode_accepts_graphs(self):
        self.assertEqual(self._problem(), (None, []))
        self.assertEqual(self._problem({GRAPH_DECODE_ENV: "1"}), (None, []))

    def test_graphs_refused_wherever_decode_gathers(self):
        cases = {
            f"{DECODE_PATH_ENV}=gather": dict(env={GRAPH_DECODE_ENV: "1", DECODE_PATH_ENV: "gather"}),
            "--nsa-decode-backend trtllm": dict(env={GRAPH_DECODE_ENV: "1"}, nsa_decode_backend="trtllm"),
            f"{DECODE_PATH_ENV}=auto (the default) with flashmla_kv": dict(env={GRAPH_DECODE_ENV: "1"}, opt_in=False),
        }
        for named, case in cases.items():
            with self.subTest(named):
                problem, problems = self._problem(**case)
                self.assertIn("--disable-cuda-graph", problem)
                self.assertIn(named.split(" (")[0], problem)
                self.assertEqual(problems, [problem])

    def test_any_capture_list_is_accepted_at_every_cp_size(self):
        """Served clean at CP 2 with batches replayed padded (captured at 2 and 16 only, batches of
        3-15 in the graph of 16) and with every size captured, at CP 4 (captured at 4 8 12 16) and
        at CP 8 (8 and 16): no capture list is refused, sglang's default (1 2 4 8 12 16) included.
        Planted: the former list rule (every multiple of the CP size) refused the default list; the
        former CP cap (4) refused CP 8."""
        env = {GRAPH_DECODE_ENV: "1"}
        for tp_size in (2, 4, 8):
            for listed in ([1, 2, 4, 8, 12, 16], [tp_size, 16], list(range(1, 17)), None):
                with self.subTest(tp_size=tp_size, listed=listed):
                    self.assertEqual(self._problem(env, tp_size=tp_size, cuda_graph_bs=listed), (None, []))

    def test_piecewise_graphs_stay_refused(self):
        _, problems = self._problem({GRAPH_DECODE_ENV: "1"}, disable_piecewise_cuda_graph=False)
        self.assertEqual(len(problems), 1)
        self.assertIn("--disable-piecewise-cuda-graph", problems[0])


if __name__ == "__main__":
    unittest.main()
