"""A GLM-5-width model for ``--load-format dummy``: every width of the real GLM-5, fewer layers.

The tiny GLM-5 (``tiny_glm5``) keeps the attention, KV-row and expert geometry but shrinks the
hidden size to 1024, so per-step fixed costs dominate every timing taken on it. This model keeps
*every* width of GLM-5: hidden 6144, MLA (64 heads, ``q_lora_rank`` 2048, ``kv_lora_rank`` 512,
``qk_nope_head_dim`` 192, ``qk_rope_head_dim`` 64, ``v_head_dim`` 256), the DSA indexer (32 heads x
128, top-k 2048), 256 routed experts of ``moe_intermediate_size`` 2048 (8 per token, one shared),
three dense layers first (``intermediate_size`` 12288) and the 154880-token vocabulary. Only
``num_hidden_layers`` is cut, to what the GPUs hold next to a KV pool (``layers_that_fit``).

Source of the values: the defaults of transformers' ``GlmMoeDsaConfig`` (transformers 5.6, whose
docstring names the checkpoint ``zai-org/GLM-5``), which are GLM-5's published config. The fp8
``quantization_config`` (block-wise e4m3, 128 x 128 blocks, dynamic activations) is the format of
the FP8 GLM-5 / DeepSeek-V3 checkpoints; with it sglang creates fp8 weights directly and its dummy
loader fills them.

The memory model follows what sglang 0.5.11 allocates per rank under round-robin NSA prefill CP
(``server_args``: attention runs with attention-TP 1, ``moe_dense_tp_size`` 1): attention, indexer,
dense MLPs and the input embedding are replicated on every rank; routed (and the fused shared)
experts and the LM head are split over ``--tp``. Norms and biases are left out (under 0.01%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List

from sglang_cp_shared_kv_testing.e2e.tiny_glm5 import tiny_glm5_config

GIB = 1 << 30
# GLM-5's widths (transformers 5.6 GlmMoeDsaConfig defaults = zai-org/GLM-5's config.json).
GLM5_WIDTHS: Dict[str, Any] = {
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "max_position_embeddings": 202752,
}
GLM5_NUM_LAYERS = 78
FP8_BLOCK = 128
FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
}
WEIGHT_DTYPES = ("bf16", "fp8")
KV_DTYPES = ("bf16", "fp8")
PAGE_SIZE = 64  # sglang 0.5.11 forces it for DSA models on CUDA
H200_GIB = 139  # what torch reports for one H200 (141 GB of HBM3e)


def glm5_width_config(num_hidden_layers: int, weight_dtype: str = "bf16") -> Dict[str, Any]:
    """config.json content: the tiny config's fields with every width set to GLM-5's."""
    first_k_dense = GLM5_WIDTHS["first_k_dense_replace"]
    if num_hidden_layers <= first_k_dense:
        raise ValueError(f"the GLM-5-width model needs > {first_k_dense} layers ({first_k_dense} dense, then MoE)")
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
    config = {**tiny_glm5_config(num_hidden_layers), **GLM5_WIDTHS}
    config["mlp_layer_types"] = ["dense"] * first_k_dense + ["sparse"] * (num_hidden_layers - first_k_dense)
    if weight_dtype == "fp8":
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    return config


def _weight_bytes(rows: int, cols: int, weight_dtype: str) -> int:
    """One linear weight; fp8 adds one fp32 scale per 128 x 128 block (``weight_scale_inv``)."""
    if weight_dtype == "bf16":
        return rows * cols * 2
    return rows * cols + math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK) * 4


@dataclass(frozen=True)
class WeightBytes:
    """Weight bytes one rank holds (see the module docstring for what is split and what is not)."""

    attention_per_layer: int  # MLA projections + absorbed bf16 copies of kv_b (w_kc, w_vc) + indexer
    dense_mlp_per_layer: int
    moe_per_layer: int  # routed + shared experts (split over tp) + router (replicated)
    embedding_and_head: int
    largest_param: int  # elements of the largest single parameter (the fused expert w13)

    def dense_layer(self) -> int:
        return self.attention_per_layer + self.dense_mlp_per_layer

    def moe_layer(self) -> int:
        return self.attention_per_layer + self.moe_per_layer

    def total(self, num_layers: int, first_k_dense: int) -> int:
        dense = min(num_layers, first_k_dense)
        return self.embedding_and_head + dense * self.dense_layer() + (num_layers - dense) * self.moe_layer()


def weight_bytes_per_rank(config: Dict[str, Any], tp: int, weight_dtype: str) -> WeightBytes:
    c = config
    heads, hidden = c["num_attention_heads"], c["hidden_size"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q_lora, kv_lora = c["q_lora_rank"], c["kv_lora_rank"]
    w = lambda rows, cols: _weight_bytes(rows, cols, weight_dtype)  # noqa: E731
    attention = (
        w(q_lora + kv_lora + rope, hidden)  # fused q_a / kv_a projection
        + w(heads * (nope + rope), q_lora)  # q_b
        + w(heads * (nope + v), kv_lora)  # kv_b
        + w(hidden, heads * v)  # o_proj
        + heads * (nope + v) * kv_lora * 2  # w_kc / w_vc, bf16 copies of kv_b for absorbed MLA
    )
    indexer = (
        w(c["index_n_heads"] * c["index_head_dim"], q_lora)  # wq_b
        + w(c["index_head_dim"], hidden)  # wk
        + c["index_n_heads"] * hidden * 2  # weights_proj, always bf16
    )
    dense_mlp = w(2 * c["intermediate_size"], hidden) + w(hidden, c["intermediate_size"])
    moe_inter = c["moe_intermediate_size"]
    if moe_inter % tp:
        raise ValueError(f"--tp {tp} does not divide moe_intermediate_size {moe_inter}")
    experts = c["n_routed_experts"] + c["n_shared_experts"]  # sglang fuses the shared expert in
    shard = moe_inter // tp
    moe = experts * (w(2 * shard, hidden) + w(hidden, shard)) + c["n_routed_experts"] * hidden * 4
    embedding = c["vocab_size"] * hidden * 2
    head = math.ceil(c["vocab_size"] / tp) * hidden * 2
    return WeightBytes(
        attention_per_layer=attention + indexer,
        dense_mlp_per_layer=dense_mlp,
        moe_per_layer=moe,
        embedding_and_head=embedding + head,
        largest_param=experts * 2 * shard * hidden,
    )


def kv_bytes_per_token_per_layer(kv_dtype: str, kv_lora_rank: int = 512, qk_rope_head_dim: int = 64) -> int:
    """One token of one layer in sglang's NSA device pool: the KV row plus the 132-byte indexer row."""
    from sglang_cp_shared_kv.model_executor.gather_scratch import index_k_bytes_per_token

    if kv_dtype == "bf16":
        kv_row = (kv_lora_rank + qk_rope_head_dim) * 2
    elif kv_dtype == "fp8":
        kv_row = 656  # sglang's fp8 NSA row: 512 fp8 values + 4 fp32 scales + 64 bf16 rope values
    else:
        raise ValueError(f"kv dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    return kv_row + index_k_bytes_per_token()


def kv_row_bytes(kv_dtype: str) -> int:
    from sglang_cp_shared_kv.model_executor.gather_scratch import index_k_bytes_per_token

    return kv_bytes_per_token_per_layer(kv_dtype) - index_k_bytes_per_token()


def kv_pool_bytes_per_rank(physical_tokens: int, num_layers: int, kv_dtype: str, cp_size: int) -> int:
    """Device KV bytes one rank allocates for ``physical_tokens`` rows; ``cp_size`` > 1 (shared KV)
    adds the one-layer gather scratch of the logical capacity (``gather_scratch.scratch_bytes``)."""
    from sglang_cp_shared_kv.model_executor.gather_scratch import scratch_bytes

    pool = physical_tokens * num_layers * kv_bytes_per_token_per_layer(kv_dtype)
    if cp_size > 1:
        pool += scratch_bytes(cp_size * physical_tokens, kv_row_bytes(kv_dtype), PAGE_SIZE)
    return pool


@dataclass(frozen=True)
class MemoryPlan:
    tp: int
    weight_dtype: str
    kv_dtype: str
    num_layers: int
    physical_tokens_per_rank: int
    weight_bytes: int
    kv_bytes_shared: int  # pool + scratch of the shared-KV server (the larger of the two)
    budget_bytes: int

    def lines(self) -> List[str]:
        return [
            f"tp {self.tp}, weights {self.weight_dtype}, KV {self.kv_dtype}: {self.num_layers} layers; per rank "
            f"weights {self.weight_bytes / GIB:.1f} GiB + KV pool of {self.physical_tokens_per_rank} tokens "
            f"with the shared-KV scratch {self.kv_bytes_shared / GIB:.1f} GiB <= budget {self.budget_bytes / GIB:.1f} GiB"
        ]


def layers_that_fit(
    tp: int,
    weight_dtype: str,
    kv_dtype: str,
    physical_tokens_per_rank: int,
    gpu_gib: float = H200_GIB,
    mem_fraction_static: float = 0.85,
    overhead_gib: float = 3.0,
) -> MemoryPlan:
    """Most layers whose weights plus a KV pool of ``physical_tokens_per_rank`` rows (and, for the
    shared-KV server, its scratch) fit sglang's static budget ``mem_fraction_static x gpu`` less
    ``overhead_gib`` (CUDA context, NCCL and allocator slack; an estimate). While it fills a
    parameter, the dummy loader holds a temporary copy of it (float16 in sglang's init for fp8
    parameters, float32 in the smoke plugin's unit-gain init), so the largest parameter's float32
    copy must fit beside all the weights too."""
    gpu = int(gpu_gib * GIB)
    budget = int(mem_fraction_static * gpu - overhead_gib * GIB)
    first_k_dense = GLM5_WIDTHS["first_k_dense_replace"]
    best = None
    for num_layers in range(first_k_dense + 1, GLM5_NUM_LAYERS + 1):
        config = glm5_width_config(num_layers, weight_dtype)
        weights = weight_bytes_per_rank(config, tp, weight_dtype)
        total_weights = weights.total(num_layers, first_k_dense)
        kv = kv_pool_bytes_per_rank(physical_tokens_per_rank, num_layers, kv_dtype, cp_size=tp)
        dummy_fill = weights.largest_param * 4
        if total_weights + kv > budget or total_weights + dummy_fill > gpu - overhead_gib * GIB:
            break
        best = MemoryPlan(tp, weight_dtype, kv_dtype, num_layers, physical_tokens_per_rank, total_weights, kv, budget)
    if best is None:
        raise ValueError(
            f"not even {first_k_dense + 1} GLM-5-width layers fit tp {tp} with {weight_dtype} weights and "
            f"{physical_tokens_per_rank} KV tokens per rank"
        )
    return best


def memory_report(physical_tokens_per_rank: int, kv_dtype: str, mem_fraction_static: float, gpu_gib: float) -> List[str]:
    """What ``make_tiny_glm5_config.py --print-memory`` prints: per-layer bytes and layers that fit."""
    lines = [f"GLM-5 widths, per rank, H200 of {gpu_gib} GiB, --mem-fraction-static {mem_fraction_static}:"]
    for weight_dtype in WEIGHT_DTYPES:
        for tp in (2, 4, 8):
            w = weight_bytes_per_rank(glm5_width_config(GLM5_WIDTHS["first_k_dense_replace"] + 1, weight_dtype), tp, weight_dtype)
            plan = layers_that_fit(tp, weight_dtype, kv_dtype, physical_tokens_per_rank, gpu_gib, mem_fraction_static)
            lines.append(
                f"  weights {weight_dtype} tp {tp}: dense layer {w.dense_layer() / GIB:.2f} GiB, MoE layer "
                f"{w.moe_layer() / GIB:.2f} GiB, embedding + head {w.embedding_and_head / GIB:.2f} GiB -> "
                f"{plan.num_layers} layers (KV {kv_dtype}, {physical_tokens_per_rank} tokens per rank: "
                f"{plan.kv_bytes_shared / GIB:.1f} GiB with the scratch; weights {plan.weight_bytes / GIB:.1f} GiB)"
            )
    return lines
