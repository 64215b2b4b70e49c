"""A tiny GLM-5 (``GlmMoeDsaForCausalLM``) model directory for ``--load-format dummy`` launches.

The end-to-end smoke needs sglang to take exactly the GLM-5 code paths (DSA / NSA attention, NSA
prefill CP, ``NSATokenToKVPool``, the NSA HiCache host pools) without a 1.5 TB checkpoint. So the
attention, KV-row and MoE geometry stays that of the real model (64 heads, ``kv_lora_rank`` 512,
``qk_rope_head_dim`` 64, indexer 32 x 128 with top-k 2048: one KV row is 576 values and one
indexer row 132 bytes, as in production; 256 experts, 8 per token, one shared), so the kernels see
production shapes; only depth, hidden size and vocabulary shrink.

The tokenizer is a byte-level BPE built here with ``tokenizers`` (id ``b`` is byte ``b``), so the
directory loads with no hub access; its length equals the config's ``vocab_size``.

``nextn=True`` adds GLM-5's ``num_nextn_predict_layers: 1``: with ``--speculative-algorithm EAGLE``
sglang then builds the MTP draft from the same directory (``DeepseekV3ForCausalLMNextN``, one NextN
decoder layer with its own NSA indexer, a one-layer draft KV pool). Off by default, so the directory
of the smokes without MTP stays what they have run with.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List

ARCHITECTURE = "GlmMoeDsaForCausalLM"
NUM_BYTE_TOKENS = 256
# GLM-style special tokens first, then reserved fillers up to a vocab that is a multiple of 64.
SPECIAL_TOKENS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>"]
VOCAB_SIZE = 320
EOS_TOKEN = "<|endoftext|>"
EOS_TOKEN_ID = NUM_BYTE_TOKENS  # first id after the bytes
# Prompts built from these ids are plain text for every GLM-5 tokenizer and for ours.
ORDINARY_TOKEN_IDS = range(0, NUM_BYTE_TOKENS)
MAX_POSITION_EMBEDDINGS = 131072  # room for the 64K-token TPOT request


DRAFT_ARCHITECTURE = "DeepseekV3ForCausalLMNextN"  # what sglang makes of it for a draft worker


def tiny_glm5_config(num_hidden_layers: int = 4, nextn: bool = False) -> Dict[str, Any]:
    """config.json content. Fields follow zai-org/GLM-5's config; sizes marked 'real' are unchanged.
    ``nextn``: one NextN (MTP) layer, as GLM-5 ships."""
    if num_hidden_layers < 2:
        raise ValueError("the tiny GLM-5 needs >= 2 layers (one dense, the rest MoE)")
    first_k_dense = 1
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "glm_moe_dsa",
        "dtype": "bfloat16",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 1024,
        "intermediate_size": 12288,  # real
        "moe_intermediate_size": 2048,  # real
        "num_hidden_layers": num_hidden_layers,
        "first_k_dense_replace": first_k_dense,
        "moe_layer_freq": 1,
        "mlp_layer_types": ["dense"] * first_k_dense + ["sparse"] * (num_hidden_layers - first_k_dense),
        # Attention: real GLM-5 geometry (MLA, 64 heads).
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "q_lora_rank": 2048,  # real
        "kv_lora_rank": 512,  # real
        "qk_nope_head_dim": 192,  # real
        "qk_rope_head_dim": 64,  # real
        "v_head_dim": 256,  # real
        "attention_bias": False,
        "attention_dropout": 0.0,
        # DSA indexer: real GLM-5 values (sglang asserts index_head_dim == 128).
        "index_topk": 2048,
        "index_head_dim": 128,
        "index_n_heads": 32,
        "indexer_rope_interleave": True,
        # MoE: real GLM-5 routing (256 experts, sigmoid router with correction bias, top 8 + 1 shared),
        # which also keeps sglang's fused-shared-expert path (it requires 256 routed experts).
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": None,
    }
    if nextn:
        config["num_nextn_predict_layers"] = 1  # real
    return config


def _byte_to_unicode() -> Dict[int, str]:
    """The byte-level BPE alphabet: printable Latin-1 bytes map to themselves, the rest above 255."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    mapping: Dict[int, str] = {}
    shifted = 0
    for byte in range(NUM_BYTE_TOKENS):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(NUM_BYTE_TOKENS + shifted)
            shifted += 1
    return mapping


def special_tokens(vocab_size: int = VOCAB_SIZE) -> List[str]:
    reserved = vocab_size - NUM_BYTE_TOKENS - len(SPECIAL_TOKENS)
    return SPECIAL_TOKENS + [f"<|reserved_{i}|>" for i in range(reserved)]


def build_tiny_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A ``tokenizers.Tokenizer``: byte-level BPE without merges, id b == byte b, then specials up to
    ``vocab_size`` ids (the GLM-5-width model keeps the real vocabulary size, so its embedding and
    LM head weigh what they weigh in production)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {symbol: byte for byte, symbol in _byte_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in special_tokens(vocab_size)]
    )
    assert tokenizer.get_vocab_size() == vocab_size
    assert tokenizer.token_to_id(EOS_TOKEN) == EOS_TOKEN_ID
    return tokenizer


def write_tiny_glm5_model(out_dir: str | os.PathLike, num_hidden_layers: int = 4, nextn: bool = False) -> Path:
    """Write config.json, generation_config.json and the tokenizer files into ``out_dir``."""
    return write_model_dir(out_dir, tiny_glm5_config(num_hidden_layers, nextn=nextn))


def write_model_dir(out_dir: str | os.PathLike, config: Dict[str, Any]) -> Path:
    """A loadable model directory (no weights) for ``config``, with a byte-level tokenizer of its vocab."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation_config = {"eos_token_id": EOS_TOKEN_ID, "bos_token_id": None, "pad_token_id": None}
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    build_tiny_tokenizer(config["vocab_size"]).save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return out


def check_model_has_nextn(model_path: str) -> None:
    """``--mtp`` builds the draft from the model's NextN layer: a config without one cannot serve it."""
    config = Path(model_path) / "config.json"
    if config.is_file() and not json.loads(config.read_text()).get("num_nextn_predict_layers"):
        raise ValueError(
            f"--mtp: {config} has no num_nextn_predict_layers (no NextN layer to draft with); "
            "make_tiny_glm5_config.py --nextn writes a tiny GLM-5 with one"
        )


def kv_row_bytes_per_layer(kv_lora_rank: int, qk_rope_head_dim: int, index_head_dim: int) -> Dict[str, int]:
    """Bytes one token occupies per layer in sglang's bf16 NSA device pool (KV row, indexer row)."""
    bf16_bytes = 2
    # Indexer K: index_head_dim fp8 values + one fp32 scale per 128-value block.
    indexer_bytes = index_head_dim + index_head_dim // 128 * 4
    return {"kv": (kv_lora_rank + qk_rope_head_dim) * bf16_bytes, "indexer": indexer_bytes}


def check_model_dir(model_dir: str | os.PathLike) -> Dict[str, Any]:
    """Load the directory offline the way sglang does and check it is classified as NSA/MLA.

    Raises ``ValueError`` on the first mismatch; returns a summary of what was checked.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoConfig, AutoTokenizer

    from sglang.srt.configs.model_config import AttentionArch, ModelConfig, is_deepseek_nsa

    model_dir = str(model_dir)
    hf_config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model_config = ModelConfig(model_path=model_dir)

    problems = []
    if not is_deepseek_nsa(model_config.hf_config):
        problems.append("sglang's is_deepseek_nsa() is False")
    if model_config.attention_arch != AttentionArch.MLA:
        problems.append(f"attention_arch is {model_config.attention_arch}, not MLA")
    index_head_dim = getattr(model_config, "index_head_dim", None)  # set for MLA archs only
    if index_head_dim != 128:
        problems.append(f"index_head_dim is {index_head_dim}, sglang needs 128")
    if len(tokenizer) != hf_config.vocab_size:
        problems.append(f"tokenizer has {len(tokenizer)} tokens, config vocab_size {hf_config.vocab_size}")
    nextn_layers = getattr(hf_config, "num_nextn_predict_layers", None)
    draft_architecture = None
    if nextn_layers is not None and not problems:
        # Last: sglang caches the loaded config by path, and the draft's load renames its architecture.
        draft_config = ModelConfig(model_path=model_dir, is_draft_model=True)
        draft_architecture = draft_config.hf_config.architectures[0]
        if draft_architecture != DRAFT_ARCHITECTURE:
            problems.append(f"sglang's draft model is {draft_architecture}, not {DRAFT_ARCHITECTURE}")
        if draft_config.num_nextn_predict_layers != 1:
            problems.append(f"num_nextn_predict_layers is {draft_config.num_nextn_predict_layers}, sglang needs 1")
    if problems:
        raise ValueError(f"{model_dir}: " + "; ".join(problems))
    return {
        "architecture": model_config.hf_config.architectures[0],
        "hf_config_class": type(hf_config).__name__,
        "num_hidden_layers": model_config.num_hidden_layers,
        "num_nextn_predict_layers": nextn_layers,
        "draft_architecture": draft_architecture,
        "kv_lora_rank": model_config.kv_lora_rank,
        "qk_rope_head_dim": model_config.qk_rope_head_dim,
        "index_head_dim": model_config.index_head_dim,
        "index_topk": hf_config.index_topk,
        "context_len": model_config.context_len,
        "vocab_size": hf_config.vocab_size,
        "tokenizer_len": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "row_bytes_per_layer": kv_row_bytes_per_layer(
            model_config.kv_lora_rank, model_config.qk_rope_head_dim, model_config.index_head_dim
        ),
    }
