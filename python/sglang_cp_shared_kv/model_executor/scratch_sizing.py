"""How many gather-scratch pages a prefill batch can need: the bound admission keeps every batch within.

Where decode runs per owner, slot 0 of the gather scratch is sized for prefill batches only (the
decision is ``startup_rules.decide_scratch``; the slots are allocated in ``gather_scratch``). An
extend forward references, per request, its prefix plus this forward's chunk, i.e.
``len(fill_ids)`` tokens, so a plan needs at most ``1 + sum over requests of ceil(len(fill_ids) /
page_size)`` scratch pages whatever the owners (``PeerPagePlan``'s exact layout), and admission
(``managers.prefill_scratch_admission``) keeps every batch within it.
"""

from __future__ import annotations

from typing import Sequence


def request_scratch_pages(context_tokens: int, page_size: int) -> int:
    """Scratch pages one request of ``context_tokens`` (prefix + chunk) can take in a plan."""
    return -(-max(context_tokens, 0) // page_size)


def prefill_batch_scratch_pages(context_tokens: Sequence[int], page_size: int) -> int:
    """Upper bound of the scratch pages (dummy page 0 included) of an extend batch whose requests
    reference ``context_tokens`` tokens each; shared prefix pages only make the real need smaller."""
    return 1 + sum(request_scratch_pages(t, page_size) for t in context_tokens)
