"""Bytes one decode step moves per CP rank: the page gather versus per-owner top-k and LSE merge.

Received bytes per rank (what its links carry in). Ring collectives: an all-gather of ``s`` bytes
per rank delivers ``(cp - 1) * s``; an all-reduce of ``s`` bytes moves ``2 (cp - 1) / cp * s``.

* Page gather (``peer_page_gather``): per layer every rank receives every referenced page it does
  not own, KV row and indexer row per token: ``layers * context * (cp - 1) / cp * (kv_row + 132)``
  for ``context`` tokens of history in the batch. Grows with the context.
* Per owner (``decode_topk_merge`` + ``attention_lse_merge``): per layer that computes top-k, one
  all-gather of ``k`` float32 candidate scores per token; per layer, the merge of the partial attention
  outputs. Independent of the context.
"""

from __future__ import annotations

from dataclasses import dataclass

CANDIDATE_SCORE_BYTES = 4  # float32: only the scores travel (rows and positions stay local)
LSE_BYTES = 4  # float32
INDEX_K_BYTES_PER_TOKEN = 132  # fp8 K (128) + fp32 scale, as NSATokenToKVPool stores it

MERGE_FORMS = ("all_gather", "scaled_sum", "scaled_sum_after_o_proj")


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
SERVED_MERGE_FORM = "scaled_sum"  # what per_owner_decode runs (attention_lse_merge.merge_by_scaled_sum)


def page_gather_bytes(shapes: DecodeShapes, cp_size: int, context_tokens: int) -> float:
    """Received per rank per step by the page gather, ``context_tokens`` summed over the batch."""
    per_token = shapes.kv_row_bytes + INDEX_K_BYTES_PER_TOKEN
    return shapes.layers * context_tokens * (cp_size - 1) / cp_size * per_token


def candidate_bytes_per_token_layer(shapes: DecodeShapes, cp_size: int) -> int:
    return (cp_size - 1) * shapes.index_topk * CANDIDATE_SCORE_BYTES


def merge_bytes_per_token_layer(shapes: DecodeShapes, cp_size: int, form: str) -> float:
    heads, dim = shapes.heads, shapes.kv_lora_rank
    lse_gather = (cp_size - 1) * heads * LSE_BYTES
    ring_reduce = 2 * (cp_size - 1) / cp_size
    if form == "all_gather":
        return (cp_size - 1) * heads * (dim * shapes.out_bytes + LSE_BYTES)
    if form == "scaled_sum":
        return lse_gather + ring_reduce * heads * dim * shapes.out_bytes
    if form == "scaled_sum_after_o_proj":
        return lse_gather + ring_reduce * shapes.hidden * shapes.out_bytes
    raise ValueError(f"unknown merge form {form!r}; one of {MERGE_FORMS}")


def per_owner_bytes(shapes: DecodeShapes, cp_size: int, batch: int, form: str) -> float:
    """Received per rank per step by per-owner decode (candidates + merge), ``batch`` requests."""
    topk_layers = shapes.layers if shapes.topk_layers is None else shapes.topk_layers
    return batch * (
        topk_layers * candidate_bytes_per_token_layer(shapes, cp_size)
        + shapes.layers * merge_bytes_per_token_layer(shapes, cp_size, form)
    )


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
    against per-owner decode (the served merge form; independent of the KV dtype and the context;
    every layer counted as computing top-k, an upper bound where ``skip_topk`` layers exist)."""
    lines = [
        "| cp | batch x context | page gather, fp8 KV | page gather, bf16 KV | per owner |",
        "|---|---|---|---|---|",
    ]
    for cp_size in cp_sizes:
        for batch in batches:
            per_owner = per_owner_bytes(shapes, cp_size, batch, SERVED_MERGE_FORM)
            for context_k in contexts_k:
                tokens = batch * context_k * 1024
                lines.append(
                    f"| {cp_size} | {batch} x {context_k}K "
                    f"| {human_bytes(page_gather_bytes(shapes, cp_size, tokens))} "
                    f"| {human_bytes(page_gather_bytes(bf16, cp_size, tokens))} "
                    f"| {human_bytes(per_owner)} |"
                )
    return "\n".join(lines)


if __name__ == "__main__":
    print(step_bytes_table())
