"""Drive sglang's speculative (EAGLE, top-k 1) writers of ``req_to_token`` as its scheduler does.

``SpecSchedulerWrites`` extends ``SchedulerWrites`` (prefill, decode, caching on a real tree cache
with our allocator) with EAGLE's rounds, each through sglang's own functions on duck-typed batches:

* spec v1 (``round_v1``): ``EAGLEWorker._draft_preprocess_decode`` (the draft steps' locs, handed
  back to the allocator), ``EagleVerifyInput.prepare_for_verify`` (the verify's locs) and
  ``EagleVerifyInput.verify`` (acceptance, the rewrite of the accepted tokens' locs, the frees of
  rejected draft pages; a request can finish inside it);
* spec v2 (``round_v2``): ``EagleDraftInputV2Mixin.prepare_for_decode`` (the over-allocation),
  then what the draft steps and the verify read (``assign_draft_cache_locs_page_size_1``,
  ``assign_extend_cache_locs``), then the scheduler's update of the committed length.

The sglang functions launch Triton kernels, so the process must run with ``TRITON_INTERPRET=1``
(set before Triton is imported; the unit test runs ``main`` in a subprocess). Acceptance is chosen
per request through the target's logits; the greedy check of the draft chain stands in for
sgl_kernel's ``verify_tree_greedy`` (CUDA only). After every step ``mismatches`` compares the
mirror with ``req_to_token`` over every position the next forward reads: the draft steps read up to
``seq_len + num_steps``, the verify up to ``seq_len + num_draft_tokens``, the draft extend up to the
new ``seq_len``.

``main`` runs every scenario (with ``--plants`` also each writer's scenarios with that writer's
hook left out) and prints one JSON line: the problems found per scenario.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
from types import SimpleNamespace
from typing import Dict, List, Optional
from unittest import mock

import torch

from sglang_cp_shared_kv.mem_cache.req_to_page_mirror import mirror_of
from sglang_cp_shared_kv_testing.cp_hicache_simulation_workload import SimRequest
from sglang_cp_shared_kv_testing.scheduler_writes import SchedulerWrites, host_write_path

PAGE = 64
NUM_STEPS = 3  # speculative_num_steps
NUM_DRAFT_TOKENS = NUM_STEPS + 1  # top-k 1
VOCAB = 64


class SpecRequest(SimRequest):
    """The fields of ``Req`` that EAGLE's verify reads and updates; finishes at ``max_new_tokens``."""

    max_new_tokens = 1 << 30

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.grammar = None
        self.require_reasoning = False
        self.spec_verify_ct = self.spec_accepted_drafts = self.decode_batch_idx = 0
        self.is_finished = False

    def check_finished(self):
        self.is_finished = self.is_finished or len(self.output_ids) >= self.max_new_tokens

    def finished(self) -> bool:
        return self.is_finished

    def update_spec_acceptance_histogram(self, accepted_draft_tokens: int) -> None:
        pass


def _greedy_chain_verify(
    predicts, accept_index, accept_token_num, candidates, retrieve_index, retrieve_next_token,
    retrieve_next_sibling, target_predict, topk=-1,
):  # fmt: skip
    """What ``verify_tree_greedy`` computes: walk the draft tree from its root while a child's token
    is the target's prediction at its parent; record the accepted nodes and the predictions."""
    for b in range(candidates.shape[0]):
        node, count = 0, 0
        accept_index[b, 0] = retrieve_index[b, 0]
        while True:
            child = int(retrieve_next_token[b, node])
            while child != -1 and int(candidates[b, child]) != int(target_predict[b, node]):
                child = int(retrieve_next_sibling[b, child])
            predicts[retrieve_index[b, node]] = target_predict[b, node]
            if child == -1:
                break
            count += 1
            accept_index[b, count] = retrieve_index[b, child]
            node = child
        accept_token_num[b] = count
    return predicts, accept_index, accept_token_num


class SpecSchedulerWrites(SchedulerWrites):
    request_class = SpecRequest

    def __init__(self, *args, spec_v2: bool = False, seed: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.spec_v2 = spec_v2
        self.rng = random.Random(seed)
        self.pages_freed_by_verify = 0  # rejected draft pages spec v1's verify gave back

    @contextlib.contextmanager
    def server_args(self):
        """The global server args the speculative functions read (EAGLE, top-k 1, 3 steps)."""
        from sglang.srt import server_args as sglang_server_args
        from sglang.srt.mem_cache import common

        args = SimpleNamespace(
            attention_backend="torch_native",
            page_size=self.page_size,
            speculative_algorithm="EAGLE",
            speculative_num_steps=NUM_STEPS,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=NUM_DRAFT_TOKENS,
            speculative_accept_threshold_single=1.0,
            speculative_accept_threshold_acc=1.0,
            strip_thinking_cache=False,
            enable_mamba_extra_buffer=lambda: False,
        )
        with mock.patch.object(sglang_server_args, "_global_server_args", args), mock.patch.object(
            common, "get_global_server_args", return_value=args
        ):
            yield

    def _batch(self, reqs, seq_lens: List[int]):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        seq = torch.tensor(seq_lens, dtype=torch.int64)
        return SimpleNamespace(
            reqs=reqs,
            forward_mode=ForwardMode.DECODE,
            seq_lens=seq,
            seq_lens_cpu=seq.clone(),
            seq_lens_sum=int(seq.sum()),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64),
            req_to_token_pool=self.pool,
            tree_cache=self.tree,
            token_to_kv_pool_allocator=self.allocator,
            device="cpu",
            is_spec_v2=self.spec_v2,
            model_config=SimpleNamespace(think_end_id=None, is_encoder_decoder=False),
            sampling_info=_GreedySampling(len(reqs)),
            maybe_evict_swa=lambda: None,
            maybe_wait_verify_done=lambda: None,
            batch_size=lambda: len(reqs),
        )

    # ---- spec v1 ----

    def round_v1(self, reqs, accepted: List[int]) -> List[str]:
        """One EAGLE v1 round; ``accepted[i]`` draft tokens of request i accepted (0..NUM_STEPS)."""
        from sglang.srt.speculative import eagle_info
        from sglang.srt.speculative.eagle_worker import EAGLEWorker

        problems = []
        seq_lens = [r.kv_committed_len for r in reqs]
        batch = self._batch(reqs, seq_lens)
        worker = SimpleNamespace(
            page_size=self.page_size, topk=1, speculative_num_steps=NUM_STEPS, device="cpu",
            token_to_kv_pool_allocator=self.allocator,
            extend_lens=torch.empty((), dtype=torch.int64),
            num_new_pages_per_topk=torch.empty((), dtype=torch.int64),
        )  # fmt: skip
        batch.spec_info = SimpleNamespace(verified_id=None)
        with self.server_args():
            EAGLEWorker._draft_preprocess_decode(worker, batch)
            problems += self._check(reqs, [s + NUM_STEPS for s in seq_lens], "draft steps")
            verify_input = self._verify_input(len(reqs))
            verify_input.prepare_for_verify(batch, self.page_size)
            problems += self._check(reqs, [s + NUM_DRAFT_TOKENS for s in seq_lens], "verify")
            logits = self._logits(verify_input, accepted)
            verify_input.hidden_states = torch.zeros(len(reqs) * NUM_DRAFT_TOKENS, 1)
            batch.spec_info = verify_input
            free_before = self.allocator.available_size()
            with mock.patch.object(eagle_info, "verify_tree_greedy_func", _greedy_chain_verify):
                verify_input.verify(
                    batch, SimpleNamespace(next_token_logits=logits, hidden_states=None),
                    self.allocator, self.page_size,
                )  # fmt: skip
            self.pages_freed_by_verify += (self.allocator.available_size() - free_before) // PAGE
        for req, start, count in zip(reqs, seq_lens, accepted):
            expected = start + (
                count + 1 if not req.finished() else req.kv_committed_len - start
            )
            if req.kv_committed_len != expected or req.kv_allocated_len != req.kv_committed_len:
                problems.append(f"request {req.rid}: lengths after verify {req.kv_committed_len}")
        problems += self._check(reqs, [r.kv_committed_len for r in reqs], "draft extend")
        return problems

    def _verify_input(self, bs: int):
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        from sglang.srt.speculative.eagle_info import EagleVerifyInput

        n = NUM_DRAFT_TOKENS
        chain = torch.arange(n).repeat(bs, 1)
        next_token = torch.where(chain + 1 < n, chain + 1, torch.full_like(chain, -1))
        draft = torch.tensor([self.rng.randrange(1, VOCAB) for _ in range(bs * n)])
        return EagleVerifyInput(
            draft_token=draft,
            custom_mask=torch.ones(bs * n * n, dtype=torch.bool),
            positions=torch.zeros(bs * n, dtype=torch.int64),
            retrieve_index=torch.arange(bs * n).view(bs, n),
            retrieve_next_token=next_token,
            retrieve_next_sibling=torch.full((bs, n), -1),
            retrieve_cum_len=None,
            spec_steps=NUM_STEPS,
            topk=1,
            draft_token_num=n,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            seq_lens_sum=0,
            seq_lens_cpu=None,
        )

    def _logits(self, verify_input, accepted: List[int]) -> torch.Tensor:
        """Target logits whose argmax accepts exactly ``accepted[i]`` draft tokens of request i."""
        n = NUM_DRAFT_TOKENS
        draft = verify_input.draft_token.view(-1, n)
        logits = torch.zeros(draft.shape[0] * n, VOCAB)
        for b, count in enumerate(accepted):
            for j in range(n):
                token = int(draft[b, j + 1]) if j < count else 0  # token 0 is never drafted
                logits[b * n + j, token] = 1.0
        return logits

    # ---- spec v2 ----

    def round_v2(self, reqs, accepted: List[int]) -> List[str]:
        """One EAGLE v2 round: the decode over-allocation, the draft steps' and the verify's reads
        of ``req_to_token`` (compared with the mirror's pages), then the committed lengths."""
        from sglang.srt.speculative.eagle_info import EagleDraftInput
        from sglang.srt.speculative.eagle_info_v2 import (
            assign_draft_cache_locs_page_size_1,
            assign_extend_cache_locs,
        )
        from sglang.srt.utils.common import next_power_of_2

        problems = []
        seq_lens = [r.kv_committed_len for r in reqs]
        batch = self._batch(reqs, seq_lens)
        draft_input = EagleDraftInput()
        with self.server_args():
            draft_input.prepare_for_decode(batch)
        problems += self._check(reqs, [r.kv_allocated_len for r in reqs], "v2 over-allocation")
        bs, table = len(reqs), self.pool.req_to_token
        draft_locs = torch.empty(bs * NUM_STEPS, dtype=torch.int64)
        assign_draft_cache_locs_page_size_1[(bs,)](
            batch.req_pool_indices, table, batch.seq_lens, draft_locs, table.shape[1], 1, NUM_STEPS
        )
        verify_locs = torch.empty(bs * NUM_DRAFT_TOKENS, dtype=torch.int64)
        assign_extend_cache_locs[(bs,)](
            batch.req_pool_indices, table, batch.seq_lens, batch.seq_lens + NUM_DRAFT_TOKENS,
            verify_locs, table.shape[1], next_power_of_2(bs),
        )  # fmt: skip
        for what, locs, count in (("draft steps", draft_locs, NUM_STEPS), ("verify", verify_locs, NUM_DRAFT_TOKENS)):
            problems += self._pages_read(reqs, seq_lens, locs.view(bs, count), what)
        # The scheduler's resolve: prepare_for_decode pre-claimed the bonus token.
        for req, count in zip(reqs, accepted):
            req.output_ids += [7] * (count + 1)
            req.kv_committed_len += count
        problems += self._check(reqs, [r.kv_committed_len for r in reqs], "v2 draft extend")
        return problems

    def _pages_read(self, reqs, starts, locs, what) -> List[str]:
        mirror, problems = mirror_of(self.pool), []
        for req, start, row_locs in zip(reqs, starts, locs):
            positions = torch.arange(start, start + row_locs.shape[0])
            mirrored = torch.from_numpy(mirror.pages[req.req_pool_idx][positions // PAGE])
            if not torch.equal(row_locs // PAGE, mirrored.to(torch.int64)):
                problems.append(f"{what}: request {req.rid} reads pages the mirror does not hold")
        return problems

    def finish_spec(self, req) -> None:
        """Finish as ``release_kv_cache`` does: the tree takes the committed tokens, the
        over-allocated tail (whole pages past them) is freed, then the row."""
        self.tree.cache_finished_req(req)
        start = -(-req.kv_committed_len // PAGE) * PAGE
        if start < req.kv_allocated_len:
            self.allocator.free(self.pool.req_to_token[req.req_pool_idx, start : req.kv_allocated_len])
        self.pool.free(req)
        self.running.remove(req)

    def _check(self, reqs, lens, what) -> List[str]:
        problems = mirror_of(self.pool).mismatches(
            self.pool.req_to_token, [r.req_pool_idx for r in reqs], lens
        )
        return [f"{what}: {p}" for p in problems]


class _GreedySampling:
    """The ``SamplingBatchInfo`` fields EAGLE's verify reads, all greedy, no penalties."""

    def __init__(self, bs: int):
        self.bs = bs
        self.is_all_greedy = True
        self.has_custom_logit_processor = False
        self.logit_bias = None
        self.penalizer_orchestrator = SimpleNamespace(is_required=False)

    def __len__(self):
        return self.bs


# ---- scenarios ----


def _stack(cache: str, physical_pages: int = 40):
    from sglang.srt.mem_cache.chunk_cache import ChunkCache
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sglang_cp_shared_kv_testing.scheduler_writes import mirrored_cp_stack

    # The scheduler builds an EAGLE server's radix tree with bigram keys (is_eagle); ChunkCache has none.
    cache_class = {"radix": RadixCache, "chunk": ChunkCache}[cache]
    writes = mirrored_cp_stack(cache_class, physical_pages, 2, PAGE, is_eagle=True)
    return writes.tree, writes.pool, writes.allocator


def run_scenario(cache: str, spec_v2: bool, seed: int = 0, rounds: int = 40) -> Dict[str, object]:
    """Prompts that end at, just before and just after page boundaries; EAGLE rounds with random
    acceptance (draft tokens that open pages, rejected pages freed and reused), one request
    finishing inside a round (v1) and one new request admitted midway, which matches the finished
    request's prompt in the tree (bigram keys on the radix cache); every step checked."""
    tree, pool, allocator = _stack(cache)
    writes = SpecSchedulerWrites(tree, pool, allocator, spec_v2=spec_v2, seed=seed)
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(1, 30_000) for _ in range(n)]  # noqa: E731
    problems: List[str] = []
    stats = {"rounds": 0, "pages_opened_by_drafts": 0, "finished_in_verify": 0, "prefix_matched": 0}

    def admit(length, max_new=1 << 30, prefix=()):
        req = writes.admit(list(prefix) + tokens(length - len(prefix)))
        req.matched_len = len(req.prefix_indices)
        req.max_new_tokens = max_new
        with host_write_path():
            writes.extend([req], [length])
            writes.after_extend(req)
        problems.extend(writes.mismatches())
        return req

    admit(PAGE - 2)
    admit(PAGE)
    finishing = admit(2 * PAGE + 1, max_new=9)
    for round_index in range(rounds):
        if round_index == rounds // 2:
            late = admit(3 * PAGE - 3, prefix=finishing.origin_input_ids)
            stats["prefix_matched"] = late.matched_len
        reqs = [r for r in writes.running if not r.finished()]
        accepted = [rng.randrange(0, NUM_STEPS + 1) for _ in reqs]
        stats["pages_opened_by_drafts"] += sum(
            (r.kv_committed_len + NUM_DRAFT_TOKENS - 1) // PAGE > (r.kv_committed_len - 1) // PAGE
            for r in reqs
        )
        round_fn = writes.round_v2 if spec_v2 else writes.round_v1
        problems += [f"round {round_index}: {p}" for p in round_fn(reqs, accepted)]
        stats["rounds"] += 1
        with host_write_path() if not spec_v2 else writes.server_args():
            for req in [r for r in reqs if r.finished() or len(r.output_ids) >= r.max_new_tokens]:
                stats["finished_in_verify"] += req.finished()
                (writes.finish_spec if spec_v2 else writes.finish)(req)
    with host_write_path() if not spec_v2 else writes.server_args():
        for req in list(writes.running):
            (writes.finish_spec if spec_v2 else writes.finish)(req)
    return {"problems": problems, "pages_freed_by_verify": writes.pages_freed_by_verify, **stats}


def _register(skip_hook: Optional[str]):
    from sglang_cp_shared_kv.mem_cache import req_to_page_mirror_spec_writers, req_to_page_mirror_writers

    def register(registry):
        real = registry.register

        def register_unless_skipped(target, hook, kind):
            if skip_hook is None or not target.endswith("." + skip_hook):
                real(target, hook, kind)

        registry.register = register_unless_skipped
        try:
            req_to_page_mirror_writers.register_hooks(registry)
            req_to_page_mirror_spec_writers.register_hooks(registry)
        finally:
            registry.register = real

    return register


# The scenarios each writer's hook serves (a plant is run on those only).
SCENARIOS_OF_HOOK = {
    "_draft_preprocess_decode": ("radix-v1",),
    "prepare_for_verify": ("radix-v1",),
    "prepare_for_decode": ("radix-v2",),
}
SCENARIOS = ("radix-v1", "radix-v2", "chunk-v1", "chunk-v2")


def run(skip_hook: Optional[str], scenarios) -> Dict[str, dict]:
    from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks

    report = {}
    with applied_hooks(_register(skip_hook)):
        for name in scenarios:
            cache, version = name.split("-")
            try:
                report[name] = run_scenario(cache, spec_v2=version == "v2")
            except Exception as error:  # a hook's own consistency check, or a crash
                report[name] = {"problems": [f"raised {type(error).__name__}: {error}"]}
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--plants", action="store_true",
        help="also run each writer's scenarios with that writer's hook left out",
    )  # fmt: skip
    args = parser.parse_args(argv)

    from sglang_cp_shared_kv_testing import sgl_kernel_cpu_shim

    sgl_kernel_cpu_shim.install()
    report = {"clean": run(None, SCENARIOS)}
    if args.plants:
        for hook, scenarios in SCENARIOS_OF_HOOK.items():
            report[f"without {hook}"] = run(hook, scenarios)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
