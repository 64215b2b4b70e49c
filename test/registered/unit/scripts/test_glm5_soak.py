"""The served soak's plan, verdict and driver, on the CPU (``sglang_cp_shared_kv_testing/e2e/soak.py``, ``scripts/glm5_cp_hicache_soak.py``).

Plan: deterministic from its seed, sized from the logical pool so every request fits beside the
others' while the conversations overfill the host. Verdict on canned evidence: clean passes; a
lost request, a server error, a dead rank, read-audit rows of another token, or tree dumps that
differ across ranks each fail. The driver end to end against ``fake_sglang_server`` (no audits, no
tree dumps there: those checks are reported as skipped) and its dry run: by default the server's own
decode (no decode setting, CUDA graphs kept), ``--decode`` / ``--cuda-graphs`` for another, the verdict
naming the decode the server logged, and a server that does not start failing with its own error.

Planted checks: ``soak_failures`` without ``lost_request_failures`` fails
``test_a_lost_request_fails``; ``run_generate`` counting a disconnected stream as FINISHED fails the
fake end-to-end test's ``aborted`` count; ``compare_tree_dumps`` comparing ``rank_local`` instead of
``shared`` fails ``test_tree_dumps_that_differ_across_ranks_fail``. The pool self-consistency check
(the soak's pool audit without a reference) on canned dumps: ``TestPoolSelfConsistency``. A fake
server answering every 5th request with HTTP 500 (``FAKE_SGLANG_FAIL_EVERY``) fails the soak end to end.
"""

import contextlib
import io
import json
import tempfile
import unittest
from pathlib import Path

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from sglang_cp_shared_kv_testing.e2e import soak
from sglang_cp_shared_kv_testing.repo_scripts import REPO_ROOT, load_script

register_cpu_ci(est_time=60, suite="stage-a-test-cpu")

PAGE = 64


class TestSoakPlan(CustomTestCase):
    def plan(self, device=32768, **kwargs):
        return soak.build_soak_plan(device, 2.0, page_size=PAGE, **kwargs)

    def test_same_seed_same_plan_other_seed_other_order(self):
        a, b, c = self.plan(seed=3), self.plan(seed=3), self.plan(seed=4)
        self.assertEqual(a.items, b.items)
        self.assertEqual(a.input_ids(a.items[5]), b.input_ids(b.items[5]))
        self.assertNotEqual([i.conversation for i in a.items[:50]], [i.conversation for i in c.items[:50]])

    def test_sizes_follow_the_logical_pool(self):
        for device, clients in ((32768, 8), (65536, 8), (131072, 16), (16384, 4)):
            plan = self.plan(device, clients=clients)
            requests = [i for i in plan.items if i.kind == soak.GENERATE]
            # Every request (prompt and output) fits D / (2 x clients): all clients' requests fit at once.
            self.assertLessEqual(max(i.prompt_tokens + i.max_new_tokens for i in requests), device // (2 * clients))
            self.assertEqual(plan.prefix_tokens % PAGE, 0)
            self.assertEqual(plan.turn_tokens % PAGE, 0)
            # The conversations together overfill the host (host eviction), so also the device.
            self.assertGreaterEqual(plan.conversations * plan.conversation_tokens, 1.5 * plan.logical_host_tokens)
            self.assertEqual(plan.logical_host_tokens, 2 * device)

    def test_turns_extend_their_conversation_and_conversations_differ(self):
        plan = self.plan(max_items=600)
        by_key = {(i.conversation, i.turn): i for i in plan.items if i.kind == soak.GENERATE}
        first, second = by_key[(0, 0)], by_key[(0, 1)]
        ids0, ids1 = plan.input_ids(first), plan.input_ids(second)
        self.assertEqual(len(ids0), first.prompt_tokens)
        self.assertEqual(ids1[: len(ids0)], ids0)
        other = plan.input_ids(by_key[(1, 0)])
        self.assertNotEqual(other[: plan.prefix_tokens], ids0[: plan.prefix_tokens])
        # A conversation comes back only after every other one had its turn (so it left the device).
        order = [i.conversation for i in plan.items if i.kind == soak.GENERATE]
        self.assertEqual(sorted(order[: plan.conversations]), list(range(plan.conversations)))

    def test_faults_and_flushes(self):
        plan = self.plan(max_items=1000, fault_fraction=0.3, flush_every=25)
        requests = [i for i in plan.items if i.kind == soak.GENERATE]
        for fault in soak.FAULTS:
            self.assertGreater(sum(1 for i in requests if i.fault == fault), 30, fault)
        self.assertEqual([i.index for i in plan.items if i.kind == soak.FLUSH], list(range(24, 1000, 25)))
        for i in requests:
            decoding = i.fault in (soak.DISCONNECT_DECODE, soak.ABORT_REQUEST)
            self.assertEqual(i.max_new_tokens, 96 if decoding else 16)

    def test_bad_settings_fail_early_naming_them(self):
        with self.assertRaisesRegex(ValueError, "too small for --clients 8"):
            self.plan(2048)
        with self.assertRaisesRegex(ValueError, "hicache-ratio"):
            soak.build_soak_plan(32768, 1.0)
        with self.assertRaisesRegex(ValueError, "--fault-fraction"):
            self.plan(fault_fraction=1.5)


def outcome(index, status=soak.FINISHED, fault=soak.NO_FAULT, http_status=200):
    return soak.RequestOutcome(index, fault, status, 1024, output_tokens=16, http_status=http_status)


def evidence(**overrides):
    outcomes = overrides.pop("outcomes", [outcome(0), outcome(1, soak.ABORTED, soak.DISCONNECT_DECODE)])
    fields = dict(
        summary=soak.load_summary(outcomes, {"ok": 1, "refused": 2, "error": 0}, 2, 10.0),
        outcomes=outcomes, log_failures=[], health_ok=True, schedulers_alive=2, schedulers_expected=2,
        audit_failures=[], tree_checkpoints=3, tree_failures=[],
    )  # fmt: skip
    fields.update(overrides)
    return soak.SoakEvidence(**fields)


class TestSoakVerdict(CustomTestCase):
    def test_clean_passes(self):
        self.assertEqual(soak.soak_failures(evidence()), [])

    def test_a_lost_request_fails(self):
        lost = soak.RequestOutcome(2, soak.NO_FAULT, soak.ERROR, 1024, output_tokens=3, detail="3 of 16 tokens")
        failures = soak.soak_failures(evidence(outcomes=[outcome(0), lost]))
        self.assertEqual(len(failures), 1)
        self.assertIn("1 of 2 requests lost", failures[0])
        self.assertIn("3 of 16 tokens", failures[0])

    def test_server_errors_and_dead_ranks_fail(self):
        failures = soak.soak_failures(evidence(outcomes=[outcome(0, soak.ERROR, http_status=500)]))
        self.assertIn("1 server errors (HTTP 5xx)", failures)
        failures = soak.soak_failures(evidence(health_ok=False, schedulers_alive=1))
        self.assertEqual(len(failures), 2, failures)
        self.assertIn("1 of 2 scheduler processes alive at the end", failures)

    def test_audit_rows_of_another_token_fail(self):
        """The smoke's own read-audit judgement, on canned per-rank count files."""
        import sys

        sys.path.insert(0, str(REPO_ROOT / "scripts" / "smoke_plugin"))
        from cp_shared_kv_smoke_hooks import kv_audit_compare

        with tempfile.TemporaryDirectory() as tmp:
            for rank, wrong in ((0, 0), (1, 3)):
                counts = {"forwards": 5, "kv_rows": 100, "kv_wrong": wrong, "index_rows": 100, "index_wrong": 0}
                (Path(tmp) / f"read_audit.rank{rank}.json").write_text(json.dumps(counts))
            audit = kv_audit_compare.read_audit_failures(kv_audit_compare.read_audit_totals(Path(tmp)))
        self.assertEqual(len(audit), 1)
        failures = soak.soak_failures(evidence(audit_failures=audit))
        self.assertEqual(failures, audit)
        self.assertIn("3 of 200 kv rows", failures[0])

    def test_tree_dumps_that_differ_across_ranks_fail(self):
        def dump(lock_ref, free_slots):
            node = {"path": [1, 0], "key_len": 128, "key": "k", "device_locs": "d", "host_len": 128,
                    "lock_ref": lock_ref, "host_ref": 0}  # fmt: skip
            return {"shared": {"nodes": [node], "evictable_size": 128, "ledger_free_slots": [64, 64]},
                    "rank_local": {"host_pool_free_slots": free_slots}}  # fmt: skip

        with tempfile.TemporaryDirectory() as tmp:
            tree_dir = Path(tmp)
            # Checkpoint 0 equal (rank-local parts differ by design), checkpoint 1 not.
            for seq, locks in ((0, (0, 0)), (1, (0, 1))):
                for rank in (0, 1):
                    soak.tree_dump_path(tree_dir, rank, seq).write_text(json.dumps(dump(locks[rank], 100 + rank)))
            checkpoints, failures = soak.compare_tree_dumps(tree_dir, 2)
        self.assertEqual(checkpoints, 2)
        self.assertEqual(failures, ["tree dump 1: rank 1 differs from rank 0 at .nodes[0].lock_ref: 0 vs 1"])
        self.assertTrue(soak.soak_failures(evidence(tree_failures=failures)))

    def test_no_tree_checkpoint_fails_unless_skipped(self):
        self.assertEqual(soak.soak_failures(evidence(tree_checkpoints=0)), ["tree dumps: no checkpoint compared"])
        self.assertEqual(soak.soak_failures(evidence(tree_checkpoints=0, skipped=["tree dumps"])), [])


def row_values(token: int, position: int, width: int):
    """A layer-0 row standing in for the model's: a function of (token id, position) alone."""
    import torch

    g = torch.Generator().manual_seed(token * 100_003 + position)
    return torch.randn(width, generator=g)


def write_request_dump(run_dir: Path, rid: str, token_ids, swap_pages=None, cp=2, layers=2):
    """Pool dumps of one request as ``kv_audit`` writes them (bf16 KV, fp8 indexer K with a scale),
    positions split over ``cp`` ranks by page; ``swap_pages`` (a, b): their rows exchanged, as a
    load-back one page off would leave them."""
    import numpy as np
    import torch

    n = len(token_ids)
    kv = torch.stack([row_values(t, i, 64) for i, t in enumerate(token_ids)]).to(torch.bfloat16)
    head = torch.stack([row_values(t, i + 7, 32) for i, t in enumerate(token_ids)]).to(torch.float8_e4m3fn)
    index = torch.cat([head.view(torch.uint8), torch.ones(n, 1).view(torch.uint8)], dim=1)
    kv_bytes = kv.view(torch.uint8).numpy()
    index_bytes = index.numpy()
    order = np.arange(n)
    if swap_pages:
        a, b = swap_pages
        order[a * PAGE:(a + 1) * PAGE], order[b * PAGE:(b + 1) * PAGE] = (
            np.arange(b * PAGE, (b + 1) * PAGE), np.arange(a * PAGE, (a + 1) * PAGE))  # fmt: skip
    (run_dir / "pool").mkdir(parents=True, exist_ok=True)
    for rank in range(cp):
        mine = np.nonzero((np.arange(n) // PAGE) % cp == rank)[0]
        np.savez(
            run_dir / "pool" / f"{rid}.rank{rank}.npz", positions=mine, token_ids=np.asarray(token_ids),
            kv=np.repeat(kv_bytes[order][mine][:, None], layers, 1), index=np.repeat(index_bytes[order][mine][:, None], layers, 1),
            kv_dtype=np.array("torch.bfloat16"), cached_tokens=np.array(0),
        )  # fmt: skip


class TestPoolSelfConsistency(CustomTestCase):
    """The soak's pool audit without a reference server (``kv_audit_compare.layer0_self_consistency``).
    Planted check: comparing each row with itself instead of its (token, position)'s first row fails
    ``test_a_page_loaded_back_one_page_off_fails``."""

    @classmethod
    def setUpClass(cls):
        import sys

        sys.path.insert(0, str(REPO_ROOT / "scripts" / "smoke_plugin"))
        from cp_shared_kv_smoke_hooks import kv_audit_compare

        cls.compare = staticmethod(kv_audit_compare.layer0_self_consistency)
        prefix = [(5 * i + 1) % 256 for i in range(3 * PAGE)]
        cls.turns = [prefix + [(11 * i + t) % 256 for i in range(PAGE)] for t in range(2)]

    def test_turns_sharing_a_prefix_agree(self):
        with tempfile.TemporaryDirectory() as tmp:
            for t, ids in enumerate(self.turns):
                write_request_dump(Path(tmp), f"soak-{t}-c0t{t}-audit", ids)
            result = self.compare(Path(tmp))
        self.assertEqual(result.failures, [])
        self.assertEqual((result.requests, result.positions), (2, 8 * PAGE))
        self.assertEqual(result.repeated_positions, 3 * PAGE)  # the shared prefix

    def test_a_page_loaded_back_one_page_off_fails(self):
        with tempfile.TemporaryDirectory() as tmp:
            write_request_dump(Path(tmp), "soak-0-c0t0-audit", self.turns[0])
            write_request_dump(Path(tmp), "soak-1-c0t1-audit", self.turns[1], swap_pages=(0, 2))
            result = self.compare(Path(tmp))
        self.assertEqual(result.layer0_wrong_kv_rows, 2 * PAGE)
        self.assertEqual(result.wrong_by_request, {"soak-1-c0t1-audit": 2 * PAGE})
        self.assertEqual(len(result.failures), 1)
        self.assertIn("pool self-consistency", result.failures[0])

    def test_nothing_repeated_or_nothing_dumped_fails(self):
        with tempfile.TemporaryDirectory() as tmp:
            self.assertIn("no pool audit dumps", self.compare(Path(tmp)).failures[0])
            write_request_dump(Path(tmp), "soak-0-c0t0-audit", self.turns[0])
            self.assertIn("no (token, position) dumped twice", self.compare(Path(tmp)).failures[0])


class TestSoakDriver(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.driver = load_script("scripts/glm5_cp_hicache_soak.py", "glm5_cp_hicache_soak_under_test")

    def run_main(self, argv):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = self.driver.main(argv)
        return rc, out.getvalue()

    def test_dry_run_prints_the_server_command_and_the_plan(self):
        with tempfile.TemporaryDirectory() as tmp:
            rc, text = self.run_main(["--model-path", tmp, "--tp", "4", "--one-gpu", "--write-policy", "write_back",
                                      "--plant", "skip-load-ack", "--dry-run", "--out-dir", tmp])  # fmt: skip
            self.assertFalse(any(Path(tmp).iterdir()), "a dry run wrote files")
        self.assertEqual(rc, 0)
        command = text.splitlines()[0]
        for part in ("sglang serve", "--tp 4", "--enable-nsa-prefill-cp-shared-kv", "--enable-hierarchical-cache",
                     "--hicache-write-policy write_back", "--disable-custom-all-reduce",
                     "SGLANG_CP_SHARED_KV_SMOKE_ONE_GPU=1", "SGLANG_CP_SHARED_KV_SMOKE_PLANT=skip-load-ack",
                     "SGLANG_CP_SHARED_KV_SMOKE_AUDIT_POOL=-audit$", "SGLANG_CP_SHARED_KV_SMOKE_AUDIT_LAYERS=1", "SGLANG_CP_SHARED_KV_SMOKE_AUDIT_DIR="):  # fmt: skip
            self.assertIn(part, command)
        self.assertIn("logical device D=65536 host H=131072", text)

    def dry_run_line(self, *options):
        """The ``[name] ENV... sglang serve ...`` line of a dry run: (environment part, command part)."""
        with tempfile.TemporaryDirectory() as tmp:
            rc, text = self.run_main(["--model-path", tmp, "--tp", "2", "--dry-run", "--out-dir", tmp, *options])
        self.assertEqual(rc, 0, text[-2000:])
        env, _, command = text.splitlines()[0].partition(" sglang serve ")
        return env, command

    def test_the_default_serves_the_servers_own_decode(self):
        """What a user launches: no decode setting, no ``--disable-cuda-graph``, sglang's own capture
        list. Seen failing before the drivers defaulted to it (the gather, named, and eager)."""
        env, command = self.dry_run_line()
        self.assertNotIn("SGLANG_CP_SHARED_KV_DECODE", env)  # neither the path nor its graph switch
        self.assertNotIn("--disable-cuda-graph ", command + " ")
        self.assertNotIn("--cuda-graph-bs", command)
        self.assertIn("--enable-nsa-prefill-cp-shared-kv", command)

    def test_decode_options_name_the_path_and_keep_the_startup_rules(self):
        """Seen failing before ``--decode`` existed (argparse refused it)."""
        env, command = self.dry_run_line("--decode", "gather")
        self.assertIn("SGLANG_CP_SHARED_KV_DECODE=gather", env)
        self.assertIn("--disable-cuda-graph ", command)
        env, command = self.dry_run_line("--decode", "per_owner", "--cuda-graphs", "off")
        self.assertIn("SGLANG_CP_SHARED_KV_DECODE=per_owner", env)
        self.assertIn("SGLANG_CP_SHARED_KV_DECODE_CUDA_GRAPH=0", env)
        self.assertIn("--disable-cuda-graph ", command)
        env, command = self.dry_run_line("--decode", "per_owner")
        self.assertIn("SGLANG_CP_SHARED_KV_DECODE_CUDA_GRAPH=1", env)
        self.assertNotIn("--disable-cuda-graph ", command)
        # The server's default gathers with fp8 KV: eager unless asked otherwise, refused with graphs.
        _, command = self.dry_run_line("--extra-server-args", "--kv-cache-dtype fp8_e4m3")
        self.assertIn("--disable-cuda-graph ", command)
        for refused, rule in ((["--decode", "gather", "--cuda-graphs", "on"], "--disable-cuda-graph"),
                              (["--cuda-graphs", "on", "--extra-server-args", "--kv-cache-dtype fp8_e4m3"],
                               "--disable-cuda-graph"),
                              (["--decode", "per_owner", "--extra-server-args", "--speculative-algorithm EAGLE"],
                               "refuses MTP")):  # fmt: skip
            with self.subTest(refused=refused), tempfile.TemporaryDirectory() as tmp:
                err = io.StringIO()
                with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as exit_:
                    self.run_main(["--model-path", tmp, "--dry-run", *refused])
                self.assertEqual(exit_.exception.code, 2)
                self.assertIn(rule, err.getvalue())

    def test_settings_too_big_for_the_pool_fail_before_a_server_starts(self):
        with tempfile.TemporaryDirectory() as tmp:
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                rc, _ = self.run_main(["--model-path", tmp, "--physical-tokens-per-rank", "1024", "--clients", "16",
                                       "--out-dir", f"{tmp}/out"])  # fmt: skip
            self.assertFalse(Path(tmp, "out").exists())
        self.assertEqual(rc, 2)
        self.assertIn("--physical-tokens-per-rank", err.getvalue())

    def test_against_the_fake_server_every_request_is_accounted_for(self):
        with tempfile.TemporaryDirectory() as tmp:
            rc, text = self.run_main([
                "--model-path", tmp, "--tp", "2", "--fake-server", "--duration-s", "20", "--max-requests", "120",
                "--flush-every", "15", "--fault-fraction", "0.3", "--out-dir", tmp,
            ])  # fmt: skip
            report = json.loads((Path(tmp) / "report.json").read_text())
        self.assertEqual(rc, 0, text[-2000:])
        s = report["summary"]
        self.assertEqual(s["requests_sent"], 120 - 8)  # 8 of the 120 items are flushes
        self.assertEqual(s["requests_sent"], s["finished"] + s["aborted"])
        self.assertEqual(s["error"], 0)
        # The fake runs /abort_request'ed requests to their end; disconnects are aborted.
        disconnects = s["faults"][soak.DISCONNECT_PREFILL] + s["faults"][soak.DISCONNECT_DECODE]
        self.assertGreater(disconnects, 0)
        self.assertEqual(s["aborted"], disconnects)
        self.assertEqual(s["flushes"]["ok"], 8)
        self.assertEqual(s["flushes_quiesced"], 4)  # every other flush waits for the requests to end
        self.assertGreater(s["max_concurrency"], 1)
        self.assertIn("VERDICT: PASS soak cp2_write_through, decode per owner (fa3), graphs on (asked: server-default)",
                      text)  # fmt: skip
        self.assertIn("skipped: kv audits, tree dumps", text)
        # The decode the fake logged (the verdict reads the log): seen failing before the verdict named it.
        self.assertIn("| per owner (fa3), graphs on | PASS |", report["table_row"])
        self.assertEqual(report["decode"]["asked"], "server-default")

    def test_the_verdict_names_the_gather_when_it_served(self):
        """Seen failing before the verdict named the decode path."""
        with tempfile.TemporaryDirectory() as tmp:
            rc, text = self.run_main(["--model-path", tmp, "--tp", "2", "--fake-server", "--decode", "gather",
                                      "--duration-s", "20", "--max-requests", "20", "--out-dir", tmp])  # fmt: skip
        self.assertEqual(rc, 0, text[-2000:])
        self.assertIn("VERDICT: PASS soak cp2_write_through, decode gather, graphs off (asked: gather)", text)

    def test_server_errors_fail_the_soak_end_to_end(self):
        import os

        from sglang_cp_shared_kv_testing.e2e.fake_sglang_server import FAIL_EVERY_ENV

        os.environ[FAIL_EVERY_ENV] = "5"
        try:
            with tempfile.TemporaryDirectory() as tmp:
                rc, text = self.run_main(["--model-path", tmp, "--tp", "2", "--fake-server", "--duration-s", "20",
                                          "--max-requests", "40", "--fault-fraction", "0", "--out-dir", tmp])  # fmt: skip
                report = json.loads((Path(tmp) / "report.json").read_text())
        finally:
            os.environ.pop(FAIL_EVERY_ENV)
        self.assertEqual(rc, 1)
        self.assertEqual(report["summary"]["error"], 40 // 5)  # 40 requests (no flush before item 50)
        self.assertIn("8 server errors (HTTP 5xx)", report["failures"])
        self.assertIn("VERDICT: FAIL soak cp2_write_through", text)

    def test_a_server_that_does_not_start_fails_quoting_its_error(self):
        """The fake server cannot bind its port (held here), so it exits with a traceback before
        ``/health`` answers. The verdict must be FAIL with the server's own error, not a driver
        traceback. Seen failing before the fix: ``KeyError: 'ok'`` in ``soak.table_row`` (no load,
        so no flush counts)."""
        import socket

        from sglang_cp_shared_kv_testing.e2e.server_process import LOOPBACK, free_port

        with tempfile.TemporaryDirectory() as tmp, socket.socket() as held:
            held.bind((LOOPBACK, free_port()))  # sglang's port range: --port refuses the ephemeral top
            rc, text = self.run_main(["--model-path", tmp, "--tp", "2", "--fake-server", "--port",
                                      str(held.getsockname()[1]), "--out-dir", tmp])  # fmt: skip
            report = json.loads((Path(tmp) / "report.json").read_text())
        self.assertEqual(rc, 1, text[-2000:])
        verdict = [line for line in text.splitlines() if line.startswith("VERDICT:")]
        self.assertEqual(len(verdict), 1, text[-2000:])
        self.assertTrue(verdict[0].startswith("VERDICT: FAIL soak cp2_write_through"), verdict[0])
        self.assertIn("OSError: [Errno 98] Address already in use", verdict[0])
        self.assertEqual(len(report["failures"]), 1, report["failures"])  # the cause alone, no fallout
        self.assertIn("did not start", report["failures"][0])


class TestSoakRunner(CustomTestCase):
    def dry_run(self, **settings):
        """The one server line and the output of ``scripts/gpu/soak_runs.sh`` with ``SOAK_DRY_RUN=1``
        for the soak ``cp4_write_through``; nothing started."""
        import os
        import subprocess

        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "python"), "OUT": f"{tmp}/out",
                   "SOAK_RUNS_DIR": f"{tmp}/runs", "SMOKE_MODEL_DIR": f"{tmp}/tiny", "SOAK_DRY_RUN": "1",
                   "SOAK_ONLY": "cp4_write_through", **settings}  # fmt: skip
            proc = subprocess.run(["bash", "scripts/gpu/soak_runs.sh"], cwd=REPO_ROOT, env=env, capture_output=True,
                                  text=True, timeout=300)  # fmt: skip
            self.assertFalse(list(Path(tmp, "runs").glob("*/server.log")), "a dry run started a server")
        self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
        lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
        self.assertEqual(len(lines), 1, proc.stdout[-2000:])
        return lines[0], proc.stdout

    def test_dry_run_of_one_soak(self):
        """The selected soak's server command (one GPU, CP 4, write_through, audits on, no plant, the
        server's default decode: seen failing while the runner served the gather) and its plan."""
        line, out = self.dry_run()
        for part in ("[cp4_write_through]", "SGLANG_CP_SHARED_KV_SMOKE_ONE_GPU=1", "--tp 4",
                     "--hicache-write-policy write_through", "--grammar-backend none", "--load-format dummy"):  # fmt: skip
            self.assertIn(part, line)
        self.assertNotIn("SMOKE_PLANT", line)
        self.assertNotIn("SGLANG_CP_SHARED_KV_DECODE", line)
        self.assertNotIn("--disable-cuda-graph ", line)
        self.assertIn("logical device D=65536", out)

    def test_soak_decode_serves_another_path(self):
        """``SOAK_DECODE=gather``: named, eager (seen failing before the runner passed it on)."""
        line, _ = self.dry_run(SOAK_DECODE="gather")
        self.assertIn("SGLANG_CP_SHARED_KV_DECODE=gather", line)
        self.assertIn("--disable-cuda-graph ", line)


if __name__ == "__main__":
    unittest.main()
