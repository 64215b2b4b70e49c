"""Server arguments the unit tests start from, in one place so every test judges the same baseline.

* ``CP_ON``: the smallest flag-on combination sglang's own ``ServerArgs`` accepts (graphs cannot
  replay the per-forward page gather; sglang turns piecewise graphs off by itself for real NSA
  models, not for ``model_path="dummy"``).
* ``GLM5_LIKE_CONFIG``: a tiny model config with only what ``ServerArgs`` reads of GLM-5
  (architecture, indexer top-k and sizes); ``write_model_dir`` puts it where ``--model-path`` looks.
* ``runtime_server_args``: a namespace with the fields the runtime's startup rules read
  (``startup_rules.runtime_problems``, the decode-graph binding), every one at a supported value; a
  test overrides the one it judges.
* ``decided_now``: the settings and the decode path a server decides for given arguments under this
  process's environment, the inputs the rules take besides the arguments.
"""

from __future__ import annotations

import json
import os
import tempfile
from types import SimpleNamespace

CP_ON = dict(
    enable_nsa_prefill_context_parallel=True,
    enable_nsa_prefill_cp_shared_kv=True,
    disable_cuda_graph=True,
    disable_piecewise_cuda_graph=True,
)

GLM5_LIKE_CONFIG = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 4,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
}


def write_model_dir(root: str, name: str, config: dict) -> str:
    """A model directory holding only ``config.json``; returns its path."""
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def runtime_server_args(**overrides) -> SimpleNamespace:
    args = dict(
        enable_nsa_prefill_cp_shared_kv=True,
        disable_cuda_graph=True,
        disable_piecewise_cuda_graph=True,
        nsa_prefill_cp_mode="round-robin-split",
        speculative_algorithm=None,
        enable_two_batch_overlap=False,
        enable_pdmux=False,
        enable_torch_compile=False,
        kv_cache_dtype="fp8_e4m3",
        nsa_prefill_backend="flashmla_kv",
        nsa_decode_backend="flashmla_kv",
        enable_mixed_chunk=False,
        max_prefill_tokens=16384,
        disaggregation_mode="null",
    )
    args.update(overrides)
    return SimpleNamespace(**args)


def decided_now(server_args):
    """``(settings, decode path)`` as a server decides them for ``server_args`` with this
    process's environment (``startup_rules.decide_decode_path``)."""
    from sglang_cp_shared_kv.settings import current_settings
    from sglang_cp_shared_kv.startup_rules import decide_decode_path

    settings = current_settings()
    return settings, decide_decode_path(server_args, settings)


class Glm5LikeModelDir:
    """Test-case mixin: one directory with ``GLM5_LIKE_CONFIG`` for the whole class
    (``cls.model_path``), removed after its last test."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls._model_root = tempfile.TemporaryDirectory()
        cls.model_path = write_model_dir(cls._model_root.name, "glm5", GLM5_LIKE_CONFIG)

    @classmethod
    def tearDownClass(cls):
        cls._model_root.cleanup()
        super().tearDownClass()


class ServerArgsHooksApplied:
    """Test-case mixin: the plugin's server-args hooks applied for each test, and the environment
    variable the hooks set (``CP_SHARED_KV_ENV``) restored afterwards."""

    def setUp(self):
        from sglang_cp_shared_kv.server_args import register_server_args_hooks
        from sglang_cp_shared_kv.settings import CP_SHARED_KV_ENV
        from sglang_cp_shared_kv_testing.hook_sandbox import applied_hooks

        super().setUp()
        saved = os.environ.pop(CP_SHARED_KV_ENV, None)

        def restore():
            os.environ.pop(CP_SHARED_KV_ENV, None)
            if saved is not None:
                os.environ[CP_SHARED_KV_ENV] = saved

        self.addCleanup(restore)
        hooks = applied_hooks(register_server_args_hooks)
        hooks.__enter__()
        self.addCleanup(hooks.__exit__, None, None, None)
