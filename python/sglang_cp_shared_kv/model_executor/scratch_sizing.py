"""How many gather-scratch pages a prefill batch can need: the bound admission keeps every batch within.

Where decode runs per owner, slot 0 of the gather scratch is sized for prefill batches only (the
decision is ``startup_rules.decide_scratch``; the slots are allocated in ``gather_scratch``). An
extend forward references, per request, its prefix plus this forward's chunk, i.e.
``len(fill_ids)`` tokens, so a plan needs at most ``1 + sum over requests of ceil(len(fill_ids) /
page_size)`` scratch pages (the dummy page and each request's ``request_scratch_pages``) whatever
the owners (``PeerPagePlan``'s exact layout), and admission (``managers.prefill_scratch_admission``)
keeps every batch within it.
"""

from __future__ import annotations


def request_scratch_pages(context_tokens: int, page_size: int) -> int:
    """Scratch pages one request of ``context_tokens`` (prefix + chunk) can take in a plan."""
    return -(-max(context_tokens, 0) // page_size)
