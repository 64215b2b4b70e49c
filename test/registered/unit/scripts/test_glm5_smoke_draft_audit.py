"""The smoke's draft audits on CPU: real shared-KV forwards of the MTP draft pool across gloo ranks,
clean and with the planted ``draft-wrong-owner``.

Each rank applies the runtime's write/read hooks and the draft steps' hooks, plus the smoke's KV
audits as the smoke plugin registers them (``kv_audit.register_hooks``, which brings
``draft_audit``'s), and optionally the plant; then it replays ``runtime_check``'s story with the
draft pool (``draft=True``): the draft layer after the target's on every forward, the speculative
step (target verify, draft extend) and the draft's three decode steps, each on its own plan. The
draft's runtime is found through ``attach_draft_runtime``, as on a server. The counts come from the
files the audits write: ``draft_write_audit.rank<r>.json``, ``read_audit_draft.rank<r>.json`` and
the target's ``read_audit.rank<r>.json``.

Planted in the audit and reverted: the write audit comparing the owner's row with the owner's row
(``truth`` for ``stored``): the plant went unseen (``kv_wrong`` 0), caught by
``test_draft_page_written_by_the_wrong_owner_fails_the_write_audit``; the draft steps' references
not selected per step (``after_begin_draft_step`` not registered): the draft read audit counted no
step forward (5 forwards, not 8), caught by the clean test.
"""

import json
import os
import sys
import tempfile
import unittest
from pathlib import Path

import torch.distributed as dist

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing import runtime_check
from sglang_cp_shared_kv_testing.multi_rank import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "scripts" / "smoke_plugin"))
from cp_shared_kv_smoke_hooks import kv_audit, planted_bugs  # noqa: E402

register_cpu_ci(est_time=60, suite="stage-a-test-cpu")

TIMEOUT_S = 240
DRAFT_STEPS = 4  # --speculative-num-steps 4: three step forwards


def _rank(rank, world_size, audit_dir, plant):
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang_cp_shared_kv.model_executor import (
        draft_decode_steps,
        forward_dispatch,
        owner_filtered_writes,
        peer_page_reads,
    )
    from sglang_cp_shared_kv.settings import CP_SHARED_KV_ENV
    from sglang_cp_shared_kv_testing.nsa_cpu_kernels import act_quant_torch, cpu_kernels

    os.environ[CP_SHARED_KV_ENV] = "1"
    HookRegistry.reset()
    owner_filtered_writes.register_hooks(HookRegistry)
    peer_page_reads.register_hooks(HookRegistry)
    forward_dispatch.register_hooks(HookRegistry)
    draft_decode_steps.register_hooks(HookRegistry)
    kv_audit.register_hooks(HookRegistry, audit_dir)
    if plant:
        planted_bugs.register_hooks(HookRegistry, plant)
    HookRegistry.apply_hooks()
    with cpu_kernels():
        story = runtime_check.run_rank(
            rank, world_size, dist.group.WORLD, device="cpu", dtype_name="fp8", act_quant=act_quant_torch,
            seed=world_size, num_layers=2, draft=True, spec=True, draft_steps=DRAFT_STEPS, physical_pages=8,
        )  # fmt: skip
    files = {}
    for name in ("draft_write_audit", "read_audit_draft", "read_audit"):
        path = Path(audit_dir) / f"{name}.rank{rank}.json"
        files[name] = json.loads(path.read_text()) if path.exists() else None
    return {"mismatches": story.mismatches, "draft_steps": story.draft_steps, **files}


class TestSmokeDraftAudit(CustomTestCase):
    def _run(self, plant=None):
        with tempfile.TemporaryDirectory() as audit_dir:
            ranks = run_ranks(
                _rank, 2, (audit_dir, plant), start_method="forkserver", preload=[runtime_check.__name__],
                timeout_s=TIMEOUT_S, deadline_s=TIMEOUT_S,
            )  # fmt: skip
        # Every rank audited the same rows (the write audit's and read audit's gathers are collectives).
        for key in ("draft_write_audit", "read_audit_draft"):
            self.assertIsNotNone(ranks[0][key], key)
            self.assertEqual(ranks[1][key]["kv_rows"], ranks[0][key]["kv_rows"], key)
        return ranks

    def test_clean_draft_forwards_pass_every_draft_audit(self):
        ranks = self._run()
        self.assertEqual([r["mismatches"] for r in ranks], [0, 0])
        self.assertEqual(ranks[0]["draft_steps"], DRAFT_STEPS - 1)
        write = ranks[0]["draft_write_audit"]
        self.assertGreater(write["kv_rows"], 0)
        self.assertEqual(write["kv_rows"], write["index_rows"])
        self.assertEqual(write["kv_wrong"] + write["index_wrong"], 0)
        # One seed on every rank: the ranks store identical rows, so not a bit differs either.
        self.assertEqual(write["kv_bit_diffs"] + write["index_bit_diffs"], 0)
        read = ranks[0]["read_audit_draft"]
        self.assertGreater(read["kv_rows"], 0)
        self.assertEqual(read["kv_wrong"] + read["index_wrong"] + read["dummy_refs"], 0)
        # The draft's own file: one forward per target forward (the three story forwards, the draft
        # extend where the target ran its verify, the fresh requests' extend), then each decode step
        # on its own references.
        self.assertEqual(ranks[0]["read_audit"]["forwards"], 5)
        self.assertEqual(read["forwards"], 5 + DRAFT_STEPS - 1)

    def test_draft_page_written_by_the_wrong_owner_fails_the_write_audit(self):
        ranks = self._run("draft-wrong-owner")
        # The story's own comparison against replicated pools sees it as well.
        self.assertTrue(all(r["mismatches"] > 0 for r in ranks))
        write = ranks[0]["draft_write_audit"]
        self.assertGreater(write["kv_wrong"], 0)
        self.assertGreater(write["index_wrong"], 0)
        self.assertLessEqual(write["kv_wrong"], write["kv_rows"])
        # The target is untouched: its read audit stays clean.
        target = ranks[0]["read_audit"]
        self.assertEqual(target["kv_wrong"] + target["index_wrong"], 0)


if __name__ == "__main__":
    unittest.main()
