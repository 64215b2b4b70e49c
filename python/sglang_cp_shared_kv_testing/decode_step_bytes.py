"""Collectives and bytes one decode step moves per CP rank: the page gather versus per-owner decode, and
per-owner decode's merge in two exchanges per layer (before) or one (after, where the rule picks it).

Received bytes per rank (what its links carry in). Ring collectives: an all-gather of ``s`` bytes
per rank delivers ``(cp - 1) * s``; an all-reduce of ``s`` bytes moves ``2 (cp - 1) / cp * s``.

* Page gather (``peer_page_gather``): per layer every rank receives every referenced page it does
  not own, KV row and indexer row per token: ``layers * context * (cp - 1) / cp * (kv_row + 132)``
  for ``context`` tokens of history in the batch. Grows with the context.
* Per owner (``decode_topk_merge`` + ``attention_lse_merge``): per layer that computes top-k, one
  all-gather of ``k`` float32 candidate scores per token; per layer, the merge of the partial
  attention outputs, by one all-gather (partial + LSE) or by the scaled sum (an LSE all-gather and a
  sum all-reduce), as ``attention_lse_merge.choose_merge_exchange`` picks for the batch.
  Independent of the context and of the KV dtype (the exchanges carry scores, LSEs and the bf16
  attention output, never KV rows).

``test_decode_step_bytes`` holds these counts to the collectives a real ``PerOwnerDecode`` makes
(injected counting collectives). Printed by ``python -m sglang_cp_shared_kv_testing.decode_step_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sglang_cp_shared_kv.model_executor.per_owner_decode.attention_lse_merge import (
    MERGE_COLLECTIVES,
    ONE_EXCHANGE,
    SCALED_SUM,
    choose_merge_exchange,
    merge_received_bytes,
)
from sglang_cp_shared_kv.settings import MODELED_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES

CANDIDATE_SCORE_BYTES = 4  # float32: only the scores travel (rows and positions stay local)
INDEX_K_BYTES_PER_TOKEN = 132  # fp8 K (128) + fp32 scale, as NSATokenToKVPool stores it
SCALED_SUM_AFTER_O_PROJ = "scaled_sum_after_o_proj"  # not served: the scaled sum moved past o_proj

MERGE_FORMS = (ONE_EXCHANGE, SCALED_SUM, SCALED_SUM_AFTER_O_PROJ)


@dataclass(frozen=True)
class DecodeShapes:
    layers: int
    heads: int
    kv_lora_rank: int  # values per head of the absorbed attention output
    hidden: int
    index_topk: int
    kv_row_bytes: int  # 656 fp8, 1152 bf16
    out_bytes: int = 2  # bf16 attention output
    topk_layers: int | None = None  # layers computing top-k (others reuse it); default: all


GLM5_FP8 = DecodeShapes(
    layers=78, heads=64, kv_lora_rank=512, hidden=6144, index_topk=2048, kv_row_bytes=656
)
GLM5_BF16 = DecodeShapes(
    layers=78, heads=64, kv_lora_rank=512, hidden=6144, index_topk=2048, kv_row_bytes=1152
)
GLM5_KV = (("fp8", GLM5_FP8), ("bf16", GLM5_BF16))


def page_gather_bytes(shapes: DecodeShapes, cp_size: int, context_tokens: int) -> float:
    """Received per rank per step by the page gather, ``context_tokens`` summed over the batch."""
    per_token = shapes.kv_row_bytes + INDEX_K_BYTES_PER_TOKEN
    return shapes.layers * context_tokens * (cp_size - 1) / cp_size * per_token


def candidate_bytes_per_token_layer(shapes: DecodeShapes, cp_size: int) -> int:
    return (cp_size - 1) * shapes.index_topk * CANDIDATE_SCORE_BYTES


def merge_bytes_per_token_layer(shapes: DecodeShapes, cp_size: int, form: str) -> float:
    """The product's formula for the served forms (``merge_received_bytes``, which its rule uses)."""
    if form == SCALED_SUM_AFTER_O_PROJ:
        lse_gather = (cp_size - 1) * shapes.heads * 4
        return lse_gather + 2 * (cp_size - 1) / cp_size * shapes.hidden * shapes.out_bytes
    return merge_received_bytes(form, 1, shapes.heads, shapes.kv_lora_rank, shapes.out_bytes, cp_size)


def served_merge_form(
    shapes: DecodeShapes, cp_size: int, batch: int,
    max_extra_bytes: Optional[int] = MODELED_MERGE_ONE_EXCHANGE_MAX_EXTRA_BYTES,
) -> str:
    """The form per-owner decode runs for ``batch`` decode tokens (its rule, the setting given;
    None: the scaled sum, as before the one-exchange form)."""
    return choose_merge_exchange(
        batch, shapes.heads, shapes.kv_lora_rank, shapes.out_bytes, cp_size, max_extra_bytes
    )


def topk_layers(shapes: DecodeShapes) -> int:
    return shapes.layers if shapes.topk_layers is None else shapes.topk_layers


def per_owner_bytes(shapes: DecodeShapes, cp_size: int, batch: int, form: str) -> float:
    """Received per rank per step by per-owner decode (candidates + merge), ``batch`` requests."""
    return batch * (
        topk_layers(shapes) * candidate_bytes_per_token_layer(shapes, cp_size)
        + shapes.layers * merge_bytes_per_token_layer(shapes, cp_size, form)
    )


def per_owner_collectives(shapes: DecodeShapes, form: str) -> int:
    """Collectives per rank per step: one candidate all-gather per top-k layer, the merge's per layer."""
    return topk_layers(shapes) + shapes.layers * MERGE_COLLECTIVES[form]


def human_bytes(n: float) -> str:
    """Decimal units, three significant digits (``7.05 GB``, ``18.0 MB``, ``881 MB``)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            value = n / scale
            digits = 2 if value < 10 else 1 if value < 100 else 0
            return f"{value:.{digits}f} {unit}"
    return f"{n:.0f} B"


def step_bytes_table(
    cp_sizes=(2, 8), batches=(1, 32), contexts_k=(4, 16, 64, 128), shapes=GLM5_FP8, bf16=GLM5_BF16
) -> str:
    """Markdown table of the bytes one decode step receives per rank: page gather (fp8 and bf16 KV)
    against per-owner decode (the merge form its rule picks with the default setting; independent of
    the KV dtype and the context; every layer counted as computing top-k, an upper bound where
    ``skip_topk`` layers exist)."""
    lines = [
        "| cp | batch x context | page gather, fp8 KV | page gather, bf16 KV | per owner |",
        "|---|---|---|---|---|",
    ]
    for cp_size in cp_sizes:
        for batch in batches:
            per_owner = per_owner_bytes(shapes, cp_size, batch, served_merge_form(shapes, cp_size, batch))
            for context_k in contexts_k:
                tokens = batch * context_k * 1024
                lines.append(
                    f"| {cp_size} | {batch} x {context_k}K "
                    f"| {human_bytes(page_gather_bytes(shapes, cp_size, tokens))} "
                    f"| {human_bytes(page_gather_bytes(bf16, cp_size, tokens))} "
                    f"| {human_bytes(per_owner)} |"
                )
    return "\n".join(lines)


def exchange_table(cp_sizes=(2, 4, 8), batches=(1, 8, 32, 128), kv_shapes=GLM5_KV) -> str:
    """Markdown table of per-owner decode's collectives and received bytes (exact) per rank and
    decode step, before (every merge by the scaled sum: three collectives per top-k layer) and after (the form the
    rule picks with the default setting)."""
    lines = [
        "| cp | batch | KV | before: collectives / step | before: bytes / rank / step "
        "| after: merge | after: collectives / step | after: bytes / rank / step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cp_size in cp_sizes:
        for batch in batches:
            for kv, shapes in kv_shapes:
                after = served_merge_form(shapes, cp_size, batch)
                merge = "one all-gather" if after == ONE_EXCHANGE else "scaled sum"
                lines.append(
                    f"| {cp_size} | {batch} | {kv} "
                    f"| {per_owner_collectives(shapes, SCALED_SUM)} "
                    f"| {per_owner_bytes(shapes, cp_size, batch, SCALED_SUM):,.0f} "
                    f"| {merge} | {per_owner_collectives(shapes, after)} "
                    f"| {per_owner_bytes(shapes, cp_size, batch, after):,.0f} |"
                )
    return "\n".join(lines)


if __name__ == "__main__":
    print(step_bytes_table())
    print()
    print(exchange_table())
