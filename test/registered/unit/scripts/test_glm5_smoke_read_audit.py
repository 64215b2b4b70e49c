"""The smoke's read audit on CPU: real shared-KV forwards across gloo ranks, clean and with a page read
from the wrong owner.

Each rank applies the runtime's write/read hooks plus the smoke's read-audit hooks (and, for the
planted run, ``planted_bugs.read_from_wrong_owner``), replays ``runtime_check``'s story (fresh
prefill, prefill on a cached prefix with a chunk starting mid-page, decode with sglang's padding row),
then one more decode in which a real request references never-allocated logical pages. The counts
come from the ``read_audit.rank<r>.json`` the audit writes; every collective a rank enters is
recorded so the ranks' sequences can be compared. Two ranks only: four pass as well but cost about
as much again as the whole file on two cores.
"""

import json
import os
import sys
import tempfile
import unittest
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing import runtime_check
from sglang_cp_shared_kv_testing.multi_rank import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "scripts" / "smoke_plugin"))
from cp_shared_kv_smoke_hooks import kv_audit, planted_bugs  # noqa: E402

register_cpu_ci(est_time=30, suite="stage-a-test-cpu")

TIMEOUT_S = 120
NUM_LAYERS = 2
PAGE = runtime_check.PAGE_SIZE
_RUNTIME = "sglang_cp_shared_kv.model_executor.cp_shared_kv_runtime.CpSharedKVRuntime"
_COLLECTIVES = ("all_gather_into_tensor", "all_gather", "all_reduce", "broadcast", "barrier")


def _record_collectives() -> list:
    """Wrap ``torch.distributed``'s collectives (this rank's process only); returns the call log."""
    log = []

    def recording(name, original):
        def call(*args, **kwargs):
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            log.append((name, shapes))
            return original(*args, **kwargs)

        return call

    for name in _COLLECTIVES:
        setattr(dist, name, recording(name, getattr(dist, name)))
    return log


def _apply_hooks(audit_dir: str, plant: bool, runtimes: list) -> None:
    """The runtime's hooks, the smoke's read audit and optionally the planted bug, as the smoke
    plugin registers them (audit before plant)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang_cp_shared_kv.model_executor import forward_dispatch, owner_filtered_writes, peer_page_reads
    from sglang_cp_shared_kv.settings import CP_SHARED_KV_ENV

    os.environ[CP_SHARED_KV_ENV] = "1"  # the audit registers its read hooks on shared-KV servers only
    HookRegistry.reset()
    owner_filtered_writes.register_hooks(HookRegistry)
    peer_page_reads.register_hooks(HookRegistry)
    forward_dispatch.register_hooks(HookRegistry)
    kv_audit.register_hooks(HookRegistry, audit_dir)
    if plant:
        planted_bugs.register_hooks(HookRegistry, "read-wrong-owner")
    HookRegistry.register(
        f"{_RUNTIME}.begin_forward", lambda plan, runtime, batch: runtimes.append(runtime), HookType.AFTER
    )
    HookRegistry.apply_hooks()


def _decode_with_dummy_refs(runtime, act_quant) -> None:
    """DECODE of request 1 (129 tokens: logical pages 0 and cp_size-1, never allocated, then a new
    token on page cp_size) and sglang's padding row (req_pool_idx 0, seq_len 1, loc 0)."""
    from sglang.srt.layers.attention.nsa.nsa_indexer import Indexer
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang_cp_shared_kv.model_executor import forward_dispatch
    from sglang_cp_shared_kv_testing.nsa_cpu_kernels import IndexerStub
    from sglang_cp_shared_kv_testing.page_mirror import mirrored

    cp_size = runtime.layout.cp_size
    req_to_token = torch.zeros((2, 4 * PAGE), dtype=torch.int32)
    slots = torch.arange(PAGE, dtype=torch.int32)
    req_to_token[1, :PAGE] = slots  # logical page 0
    req_to_token[1, PAGE : 2 * PAGE] = (cp_size - 1) * PAGE + slots  # last rank's dummy page
    req_to_token[1, 2 * PAGE] = cp_size * PAGE  # the new token, on an allocatable page
    out_cache_loc = torch.tensor([cp_size * PAGE, 0], dtype=torch.int64)
    batch = mirrored(SimpleNamespace(
        forward_mode=ForwardMode.DECODE,
        seq_lens_cpu=torch.tensor([2 * PAGE + 1, 1]),
        extend_seq_lens_cpu=[1, 1],
        req_pool_indices=torch.tensor([1, 0], dtype=torch.int64),
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        out_cache_loc=out_cache_loc,
        token_to_kv_pool=runtime.pool,
    ))
    table = req_to_token[batch.req_pool_indices, : 2 * PAGE + 1]
    backend = SimpleNamespace(forward_metadata=runtime_check.nsa_metadata_for(table))
    forward_dispatch.dispatch_forward_metadata(None, backend, batch)
    data = torch.Generator().manual_seed(7)  # same on every rank: the batch is replicated
    for layer_id in range(NUM_LAYERS):
        nope = torch.randn(2, 1, 512, generator=data).to(torch.bfloat16)
        rope = torch.randn(2, 1, 64, generator=data).to(torch.bfloat16)
        key = torch.randn(2, 128, generator=data).to(torch.bfloat16)
        runtime.pool.set_mla_kv_buffer(SimpleNamespace(layer_id=layer_id), out_cache_loc, nope, rope)
        Indexer._store_index_k_cache(IndexerStub(), batch, layer_id, key, act_quant=act_quant)


def _rank(rank, world_size, dtype_name, audit_dir, plant, prefetch=False, audit_layers=None):
    from cp_shared_kv_smoke_hooks import SMOKE_AUDIT_LAYERS_ENV
    from sglang_cp_shared_kv_testing.nsa_cpu_kernels import act_quant_torch, cpu_kernels

    if audit_layers is not None:
        os.environ[SMOKE_AUDIT_LAYERS_ENV] = str(audit_layers)
    # With ``prefetch``: a second group and slot, the layer-ahead path on the chunked forward.
    prefetch_group = dist.new_group(list(range(world_size))) if prefetch else None
    runtimes = []
    _apply_hooks(audit_dir, plant, runtimes)
    collectives = _record_collectives()
    counts_file = Path(audit_dir) / f"read_audit.rank{rank}.json"
    with cpu_kernels():
        story = runtime_check.run_rank(
            rank, world_size, dist.group.WORLD, device="cpu", dtype_name=dtype_name,
            act_quant=act_quant_torch, seed=world_size, num_layers=NUM_LAYERS,
            prefetch_group=prefetch_group, hicache=prefetch,
        )  # fmt: skip
        after_story = counts_file.read_text()
        _decode_with_dummy_refs(runtimes[-1], act_quant_torch)
        after_dummy = counts_file.read_text()
    return {
        "story_mismatches": story.mismatches,
        "after_story": after_story,
        "after_dummy": after_dummy,
        "runtimes": len({id(r) for r in runtimes}),
        "collectives": collectives,
        "prefetch_forwards": story.prefetch_forwards,
    }


class TestSmokeReadAudit(CustomTestCase):
    def _run(self, world_size, dtype_name="fp8", plant=False, prefetch=False, audit_layers=None):
        with tempfile.TemporaryDirectory() as audit_dir:
            ranks = run_ranks(
                _rank, world_size, (dtype_name, audit_dir, plant, prefetch, audit_layers), start_method="forkserver",
                preload=[runtime_check.__name__], timeout_s=TIMEOUT_S, deadline_s=TIMEOUT_S,
            )  # fmt: skip
        for r in ranks:
            r["after_story"] = json.loads(r["after_story"])
            r["after_dummy"] = json.loads(r["after_dummy"])
            self.assertEqual(r["runtimes"], 1)
        # Every rank entered the same collectives (the runtime's gathers and the audit's) in the
        # same order with the same shapes, and audited the same references.
        self.assertGreater(len(ranks[0]["collectives"]), 0)
        for r in ranks[1:]:
            self.assertEqual(r["collectives"], ranks[0]["collectives"])
            self.assertEqual(r["after_story"], ranks[0]["after_story"])
            self.assertEqual(r["after_dummy"], ranks[0]["after_dummy"])
        return ranks[0], ranks

    def _assert_clean(self, world_size, dtype_name, prefetch=False):
        rank0, ranks = self._run(world_size, dtype_name, prefetch=prefetch)
        self.assertEqual([r["prefetch_forwards"] for r in ranks], [int(prefetch)] * world_size)
        self.assertEqual([r["story_mismatches"] for r in ranks], [0] * world_size)
        story = rank0["after_story"]
        self.assertEqual(story["forwards"], 3)
        self.assertGreater(story["kv_rows"], 0)
        self.assertGreater(story["index_rows"], 0)
        self.assertEqual(story["kv_rows"], story["index_rows"])  # KV and indexer K per reference
        for key in ("kv_wrong", "index_wrong", "dummy_refs"):
            self.assertEqual(story[key], 0, key)
        # Every rank stores the same bytes here (one seed), so even rounding differences are absent.
        self.assertEqual(story["kv_bit_diffs"] + story["index_bit_diffs"], 0)
        # The story's decode carries sglang's padding row: counted as padding, not as a dummy ref.
        self.assertEqual(story["padding_requests"], 1)
        # A real request reading two never-allocated pages (2 x 64 refs per layer) is caught; the
        # padding row of the same forward is not counted with them.
        dummy = rank0["after_dummy"]
        self.assertEqual(dummy["forwards"], 4)
        self.assertEqual(dummy["padding_requests"], 2)
        self.assertEqual(dummy["dummy_refs"], 2 * PAGE * NUM_LAYERS)
        # Only the new token is audited (dummy refs are left out of the row comparison).
        self.assertEqual(dummy["kv_rows"] - story["kv_rows"], NUM_LAYERS)
        self.assertEqual(dummy["index_rows"] - story["index_rows"], NUM_LAYERS)
        self.assertEqual(dummy["kv_wrong"] + dummy["index_wrong"], 0)

    def _assert_catches_wrong_owner(self, world_size, dtype_name):
        rank0, ranks = self._run(world_size, dtype_name, plant=True)
        # The runtime check's own comparison against a replicated pool sees the bug as well.
        self.assertTrue(all(r["story_mismatches"] > 0 for r in ranks))
        story = rank0["after_story"]
        self.assertGreater(story["kv_wrong"], 0)
        self.assertGreater(story["index_wrong"], 0)
        self.assertLessEqual(story["kv_wrong"], story["kv_rows"])
        self.assertEqual(story["dummy_refs"], 0)

    def test_two_ranks_clean(self):
        self._assert_clean(2, "fp8")

    def test_two_ranks_clean_with_the_layer_ahead_prefetch(self):
        # The audit checks each layer's slot against the owners' pages on the prefetch path too
        # (the chunked forward, with its prefix page loaded back layer by layer).
        self._assert_clean(2, "fp8", prefetch=True)

    def test_two_ranks_read_from_wrong_owner(self):
        self._assert_catches_wrong_owner(2, "fp8")

    def test_layer_limit_audits_the_leading_layers_on_every_rank_alike(self):
        """With SMOKE_AUDIT_LAYERS_ENV=1 only layer 0 is audited (a wide, deep model's per-layer
        gathers of every layer would not fit a run); every rank skips the same collectives and a
        wrong owner is still caught."""
        rank0, _ = self._run(2, "fp8", audit_layers=1)
        dummy = rank0["after_dummy"]
        self.assertEqual(dummy["dummy_refs"], 2 * PAGE)  # one layer's references, not NUM_LAYERS'
        self.assertEqual(dummy["kv_rows"] - rank0["after_story"]["kv_rows"], 1)
        self.assertEqual(dummy["kv_wrong"] + dummy["index_wrong"], 0)
        planted, _ = self._run(2, "fp8", plant=True, audit_layers=1)
        self.assertGreater(planted["after_story"]["kv_wrong"], 0)


if __name__ == "__main__":
    unittest.main()
