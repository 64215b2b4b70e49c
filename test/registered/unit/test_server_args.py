"""``--enable-nsa-prefill-cp-shared-kv``: parsing, the keyword form, fail-fast validation, env carrier.

The server-args hooks are applied through ``HookRegistry`` only inside ``applied_hooks`` so that
other tests in the same process see stock sglang.
"""

import os
from types import SimpleNamespace
import pickle
import tempfile
import unittest
from argparse import ArgumentParser, HelpFormatter
from unittest import mock

from sglang.srt.server_args import ServerArgs, prepare_server_args
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

from sglang_cp_shared_kv.settings import ALL_CP_RANKS_ENV
from sglang_cp_shared_kv.settings import CP_SHARED_KV_ENV, CP_SHARED_KV_FLAG
from sglang_cp_shared_kv_testing.server_args_cases import (
    CP_ON,
    GLM5_LIKE_CONFIG,
    ServerArgsHooksApplied,
    write_model_dir,
)

register_cpu_ci(est_time=25, suite="stage-a-test-cpu")

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
}


class TestCpSharedKVServerArgs(ServerArgsHooksApplied, CustomTestCase):
    FLAG_OFF_ARGV = ["--model-path", "dummy", "--enable-nsa-prefill-context-parallel", "--page-size", "64"]

    @classmethod
    def setUpClass(cls):
        cls.stock_flag_off_args = prepare_server_args(cls.FLAG_OFF_ARGV)  # before any hook
        cls._tmp = tempfile.TemporaryDirectory()
        cls.glm5_path = write_model_dir(cls._tmp.name, "glm5", GLM5_LIKE_CONFIG)
        cls.llama_path = write_model_dir(cls._tmp.name, "llama", LLAMA_CONFIG)

    @classmethod
    def tearDownClass(cls):
        cls._tmp.cleanup()

    def assertRejected(self, *flags, **kwargs):
        with self.assertRaises(ValueError) as ctx:
            ServerArgs(**kwargs)
        message = str(ctx.exception)
        for flag in (CP_SHARED_KV_FLAG,) + flags:
            self.assertIn(flag, message)
        self.assertNotEqual(os.environ.get(CP_SHARED_KV_ENV), "1")

    # ---- parsing and carriers ----

    def test_sglang_parser_lists_and_parses_the_flag(self):
        parser = ArgumentParser()
        ServerArgs.add_cli_args(parser)
        self.assertIn(CP_SHARED_KV_FLAG, parser.format_help())

        args = prepare_server_args(
            ["--model-path", "dummy", "--enable-nsa-prefill-context-parallel", "--disable-cuda-graph",
             "--disable-piecewise-cuda-graph", CP_SHARED_KV_FLAG]
        )
        self.assertIs(args.enable_nsa_prefill_cp_shared_kv, True)
        self.assertEqual(os.environ.get(CP_SHARED_KV_ENV), "1")
        # Scheduler processes receive ServerArgs pickled.
        self.assertIs(pickle.loads(pickle.dumps(args)).enable_nsa_prefill_cp_shared_kv, True)

    def test_keyword_form_used_by_engine(self):
        args = ServerArgs(model_path="dummy", **CP_ON)
        self.assertIs(args.enable_nsa_prefill_cp_shared_kv, True)
        self.assertEqual(os.environ.get(CP_SHARED_KV_ENV), "1")

    def test_flag_off_leaves_stock_args_and_clears_env(self):
        os.environ[CP_SHARED_KV_ENV] = "1"  # e.g. left over from an earlier launch in this process
        hooked = prepare_server_args(self.FLAG_OFF_ARGV)
        self.assertIs(hooked.enable_nsa_prefill_cp_shared_kv, False)
        self.assertIs(ServerArgs(model_path="dummy").enable_nsa_prefill_cp_shared_kv, False)
        self.assertIsNone(os.environ.get(CP_SHARED_KV_ENV))
        self.assertEqual(hooked, self.stock_flag_off_args)  # dataclass equality: every sglang field

    def test_validation_runs_again_before_launch(self):
        args = ServerArgs(model_path="dummy")
        args.enable_nsa_prefill_cp_shared_kv = True  # set after construction, CP still off
        with self.assertRaises(ValueError) as ctx:
            args.check_server_args()
        self.assertIn("--enable-nsa-prefill-context-parallel", str(ctx.exception))

    # ---- fail fast ----

    def test_requires_nsa_prefill_context_parallel(self):
        self.assertRejected(
            "--enable-nsa-prefill-context-parallel",
            model_path="dummy",
            enable_nsa_prefill_cp_shared_kv=True,
        )
        with self.assertRaises(ValueError):
            prepare_server_args(["--model-path", "dummy", CP_SHARED_KV_FLAG])

    def test_rejects_unsupported_combinations(self):
        cases = [
            (("--hicache-storage-backend file",), dict(hicache_storage_backend="file")),
            (("--enable-hisparse",), dict(enable_hisparse=True)),
            (("--nsa-prefill-cp-mode round-robin-split",), dict(nsa_prefill_cp_mode="in-seq-split")),
            (("SGLANG_CP_SHARED_KV_MTP=1",), dict(speculative_algorithm="EAGLE")),
            (("--disable-cuda-graph",), dict(disable_cuda_graph=False)),
            (("--disable-piecewise-cuda-graph",), dict(disable_piecewise_cuda_graph=False)),
            (("--enable-return-routed-experts",), dict(enable_return_routed_experts=True)),
            (("--pipeline-parallel-size 2",), dict(pp_size=2)),
            (("--enable-lmcache",), dict(enable_lmcache=True)),
            (("--device cpu",), dict(device="cpu")),
            (("--page-size 32",), dict(page_size=32)),
            (("--page-size 0",), dict(page_size=0)),
            (("--page-size '64'",), dict(page_size="64")),
        ]
        for flags, extra in cases:
            with self.subTest(extra=extra):
                self.assertRejected(*flags, model_path="dummy", **{**CP_ON, **extra})

    def test_storage_backends_and_their_layouts(self):
        """file and mooncake are served (with the host tier and the layouts each needs); any other
        backend, storage without the host tier, storage with MTP and a prefetch policy the
        synchronous prefetch would ignore are refused by name. Planted: the policy check removed ->
        the --hicache-storage-prefetch-policy subtests fail."""
        from sglang_cp_shared_kv.startup_rules import storage_problems

        def problems(**fields):
            args = dict(hicache_storage_backend="file", enable_hierarchical_cache=True,
                        hicache_mem_layout="layer_first", speculative_algorithm=None,
                        hicache_storage_prefetch_policy="best_effort")  # fmt: skip
            return storage_problems(SimpleNamespace(**{**args, **fields}))

        self.assertEqual(problems(), [])
        self.assertEqual(problems(hicache_storage_backend="mooncake", hicache_mem_layout="page_first"), [])
        self.assertEqual(problems(hicache_storage_backend=None, enable_hierarchical_cache=False), [])
        cases = [
            ("--hicache-storage-backend nixl", dict(hicache_storage_backend="nixl")),
            ("--hicache-mem-layout layer_first", dict(hicache_storage_backend="mooncake")),
            ("--enable-hierarchical-cache", dict(enable_hierarchical_cache=False)),
            ("--speculative-algorithm EAGLE", dict(speculative_algorithm="EAGLE")),
            ("--hicache-storage-prefetch-policy timeout", dict(hicache_storage_prefetch_policy="timeout")),
            ("--hicache-storage-prefetch-policy wait_complete",
             dict(hicache_storage_prefetch_policy="wait_complete")),  # fmt: skip
        ]
        for name, fields in cases:
            with self.subTest(name=name):
                self.assertTrue(any(name in problem for problem in problems(**fields)), problems(**fields))

    def test_rejects_an_unknown_decode_mode_before_launch(self):
        """SGLANG_CP_SHARED_KV_DECODE is read where per-owner decode attaches, in every scheduler;
        the launcher refuses a bad value first. Planted: the check removed -> no ValueError."""
        with mock.patch.dict(os.environ, {"SGLANG_CP_SHARED_KV_DECODE": "owner"}):
            self.assertRejected("SGLANG_CP_SHARED_KV_DECODE", model_path="dummy", **CP_ON)
        for mode in ("gather", "per_owner"):
            with mock.patch.dict(os.environ, {"SGLANG_CP_SHARED_KV_DECODE": mode}):
                args = ServerArgs(model_path="dummy", **CP_ON)
            self.assertIs(args.enable_nsa_prefill_cp_shared_kv, True)

    # ---- PD disaggregation (docs/pd-disaggregation.md) ----

    def test_rejects_pd_decode_mode(self):
        with mock.patch.dict(os.environ, {ALL_CP_RANKS_ENV: "1"}):
            self.assertRejected(
                "--disaggregation-mode decode",
                "supported on the prefill server only",
                model_path="dummy",
                disaggregation_mode="decode",
                disaggregation_transfer_backend="mooncake",
                **CP_ON,
            )

    def test_accepts_pd_prefill_with_mooncake_and_all_cp_ranks_transfer(self):
        with mock.patch.dict(os.environ, {ALL_CP_RANKS_ENV: "1"}):
            args = self.glm5_args(
                tp_size=2,
                disaggregation_mode="prefill",
                disaggregation_transfer_backend="mooncake",
                **CP_ON,
            )
            self.assertEqual(os.environ.get(CP_SHARED_KV_ENV), "1")  # patch.dict restores it on exit
        self.assertIs(args.enable_nsa_prefill_cp_shared_kv, True)
        self.assertEqual(args.disaggregation_mode, "prefill")
        self.assertEqual((args.tp_size, args.attn_cp_size), (2, 2))

    def test_rejects_pd_prefill_without_all_cp_ranks_transfer(self):
        with mock.patch.dict(os.environ):
            os.environ.pop(ALL_CP_RANKS_ENV, None)
            self.assertRejected(
                f"{ALL_CP_RANKS_ENV} is off or unset",
                model_path="dummy",
                disaggregation_mode="prefill",
                disaggregation_transfer_backend="mooncake",
                **CP_ON,
            )

    def test_rejects_pd_prefill_with_nixl(self):
        with mock.patch.dict(os.environ, {ALL_CP_RANKS_ENV: "1"}):
            self.assertRejected(
                "--disaggregation-transfer-backend nixl",
                model_path="dummy",
                disaggregation_mode="prefill",
                disaggregation_transfer_backend="nixl",
                **CP_ON,
            )

    def test_rejects_non_nsa_model(self):
        self.assertRejected(
            f"--model-path {self.llama_path}",
            "LlamaForCausalLM",
            model_path=self.llama_path,
            tp_size=8,
            device="cuda",
            **CP_ON,
        )

    def test_accepts_nsa_model_with_the_values_sglang_settles(self):
        # sglang's DSA branch reads the GPU generation to pick the KV dtype and NSA backends.
        with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
            args = ServerArgs(model_path=self.glm5_path, tp_size=8, device="cuda", **CP_ON)
        self.assertIs(args.enable_nsa_prefill_cp_shared_kv, True)
        self.assertEqual(args.page_size, 64)
        self.assertEqual(args.attn_cp_size, 8)
        self.assertEqual(os.environ.get(CP_SHARED_KV_ENV), "1")

    def test_refuses_before_the_weights_what_failed_after_them(self):
        """Each launch here was accepted and failed only once the scheduler built its cache or
        admitted a request, after the weights loaded (issue 45). Now each is refused while
        ``ServerArgs`` is built, naming its setting, all in one error. Seen failing before the
        rules: every subtest but the last (accepted); the last, every problem in one error."""
        bad_json = dict(hicache_storage_backend_extra_config="{file_path: /tmp}")
        missing = dict(hicache_storage_backend_extra_config="@/nonexistent/l3.json")
        threshold = dict(hicache_storage_backend_extra_config='{"prefetch_threshold": "256"}')
        storage = dict(enable_hierarchical_cache=True, hicache_storage_backend="file")
        cases = [
            ("not JSON", ["--hicache-storage-backend-extra-config", "Expecting property name"],
             {**storage, **bad_json}, {}),
            ("a missing file", ["--hicache-storage-backend-extra-config", "No such file"],
             {**storage, **missing}, {}),
            ("a non-integer threshold", ["prefetch_threshold must be int"], {**storage, **threshold}, {}),
            ("the host tier's own parse", ["--hicache-storage-backend-extra-config"],
             {"enable_hierarchical_cache": True, **bad_json}, {}),
            ("streaming sessions", ["--enable-streaming-session"], {"enable_streaming_session": True}, {}),
            ("the C++ radix tree", ["SGLANG_EXPERIMENTAL_CPP_RADIX_TREE"], {},
             {"SGLANG_EXPERIMENTAL_CPP_RADIX_TREE": "1"}),
            ("the unified radix tree", ["SGLANG_ENABLE_UNIFIED_RADIX_TREE"], {},
             {"SGLANG_ENABLE_UNIFIED_RADIX_TREE": "true"}),
            ("a scratch below the context", ["SGLANG_CP_SHARED_KV_PREFILL_SCRATCH_TOKENS=1", "4096"], {},
             {"SGLANG_CP_SHARED_KV_PREFILL_SCRATCH_TOKENS": "1"}),
            ("all at once", ["--enable-streaming-session", "SGLANG_EXPERIMENTAL_CPP_RADIX_TREE",
                             "prefetch_threshold must be int"],
             {"enable_streaming_session": True, **storage, **threshold},
             {"SGLANG_EXPERIMENTAL_CPP_RADIX_TREE": "y"}),
        ]  # fmt: skip
        for name, texts, fields, env in cases:
            with self.subTest(name), mock.patch.dict(os.environ, env):
                with self.assertRaises(ValueError) as raised:
                    self.glm5_args(tp_size=8, **{**CP_ON, **fields})
                message = str(raised.exception)
                self.assertTrue(message.startswith(f"{CP_SHARED_KV_FLAG} cannot be used here:"), message)
                for text in texts:
                    self.assertIn(text, message)
        # The unified tree is what sglang builds only without HiCache; the scratch at the context.
        env = {"SGLANG_ENABLE_UNIFIED_RADIX_TREE": "1", "SGLANG_CP_SHARED_KV_PREFILL_SCRATCH_TOKENS": "4096"}
        with mock.patch.dict(os.environ, env):
            args = self.glm5_args(tp_size=8, enable_hierarchical_cache=True, **CP_ON)
        self.assertTrue(args.enable_nsa_prefill_cp_shared_kv)

    def test_the_extra_config_is_read_as_sglangs_hicache_reads_it(self):
        """Startup reads the extra config with a copy of sglang's parse (sglang's own sits in a
        module that loads GPU kernels): both give the same config or raise the same error."""
        from sglang_cp_shared_kv_testing import sgl_kernel_cpu_shim

        sgl_kernel_cpu_shim.install()
        from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

        from sglang_cp_shared_kv.startup_rules import parse_storage_extra_config

        files = {}
        for name, text in (("a.json", '{"file_path": "/x", "prefetch_threshold": 64}'),
                           ("a.toml", 'file_path = "/x"\nprefetch_threshold = 128'),
                           ("a.yaml", "file_path: /x\nprefetch_threshold: 512"),
                           ("a.txt", "{}"), ("list.json", "[1, 2]")):  # fmt: skip
            files[name] = os.path.join(self._tmp.name, name)
            with open(files[name], "w") as f:
                f.write(text)
        cases = [None, "", '{"file_path": "/x"}', '{"prefetch_threshold": 16, "prefetch_timeout_base": 2}',
                 "{file_path: /x}", '{"prefetch_threshold": "256"}', '{"prefetch_timeout_base": "1"}',
                 '{"prefetch_timeout_per_ki_token": []}', '{"hicache_storage_pass_prefix_keys": 1}',
                 "@/nonexistent/l3.json", "[1, 2]", "3"] + [f"@{path}" for path in files.values()]  # fmt: skip
        for raw in cases:
            with self.subTest(raw=raw):
                try:
                    stock = HiRadixCache._parse_storage_backend_extra_config(None, raw)
                    stock = (stock[0], stock[1])
                except Exception as error:
                    stock = type(error)
                try:
                    ours = parse_storage_extra_config(raw)
                except Exception as error:
                    ours = type(error)
                if isinstance(stock, type) and isinstance(ours, type):
                    continue  # both refuse (a non-object: sglang's AttributeError, our ValueError)
                self.assertEqual(ours, stock)

    # ---- CP sizes 2, 4, 8 on one node ----

    def glm5_args(self, **kwargs):
        with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
            return ServerArgs(model_path=self.glm5_path, device="cuda", **kwargs)

    def test_accepts_cp_sizes_2_4_8_on_one_node(self):
        for tp in (2, 4, 8):
            with self.subTest(tp=tp):
                args = self.glm5_args(tp_size=tp, **CP_ON)
                self.assertEqual((args.tp_size, args.attn_cp_size, args.dp_size), (tp, tp, 1))
                self.assertEqual(args.page_size, 64)
                self.assertEqual(args.moe_dense_tp_size, 1)

    def test_cli_form_accepts_tp_2(self):
        argv = ["--model-path", self.glm5_path, "--device", "cuda", "--tp", "2",
                "--enable-nsa-prefill-context-parallel", "--disable-cuda-graph",
                "--disable-piecewise-cuda-graph", CP_SHARED_KV_FLAG]  # fmt: skip
        with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
            args = prepare_server_args(argv)
        self.assertEqual((args.tp_size, args.attn_cp_size), (2, 2))
        self.assertIs(args.enable_nsa_prefill_cp_shared_kv, True)

    def test_settles_the_same_values_as_stock_tp_8_except_cp_size(self):
        shared_tp2 = vars(self.glm5_args(tp_size=2, **CP_ON))
        shared_tp8 = vars(self.glm5_args(tp_size=8, **CP_ON))
        # random_seed is drawn per construction; model_config objects compare by identity.
        ignored = {"random_seed", "model_config"}
        differing = {k for k in shared_tp8 if k not in ignored and shared_tp2.get(k) != shared_tp8[k]}
        self.assertEqual(differing, {"tp_size", "attn_cp_size"})

    def test_flag_off_keeps_sglangs_tp_8_rule(self):
        flag_off = {**CP_ON, "enable_nsa_prefill_cp_shared_kv": False}
        with self.assertRaisesRegex(AssertionError, "tp_size == 8"):
            self.glm5_args(tp_size=2, **flag_off)
        self.assertEqual(self.glm5_args(tp_size=8, **flag_off).attn_cp_size, 8)

    def test_rejects_tp_sizes_the_models_do_not_split_at(self):
        """GLM-5 / DeepSeek-V3.2 experts (moe_intermediate_size 2048) split only at tp 2, 4, 8. Planted
        bug: accepting range(2, 9) again lets 3, 5, 6, 7 through and this fails."""
        for tp in (3, 5, 6, 7):
            with self.subTest(tp=tp), self.assertRaises(ValueError) as ctx:
                self.glm5_args(tp_size=tp, **CP_ON)
            message = str(ctx.exception)
            for part in (CP_SHARED_KV_FLAG, f"--tp {tp}", "--tp 2, 4 or 8"):
                self.assertIn(part, message)

    def test_rejects_cp_sizes_off_one_node(self):
        for tp in (1, 16):
            with self.subTest(tp=tp), self.assertRaises(ValueError) as ctx:
                self.glm5_args(tp_size=tp, **CP_ON)
            self.assertIn(CP_SHARED_KV_FLAG, str(ctx.exception))
            self.assertIn(f"--tp {tp}", str(ctx.exception))

    def test_rejects_more_than_one_node(self):
        for tp in (2, 8):
            with self.subTest(tp=tp), self.assertRaises(ValueError) as ctx:
                self.glm5_args(tp_size=tp, nnodes=2, dist_init_addr="127.0.0.1:5000", **CP_ON)
            self.assertIn(CP_SHARED_KV_FLAG, str(ctx.exception))
            self.assertIn("--nnodes 2", str(ctx.exception))
        self.assertRejected("--nnodes 2", model_path="dummy", nnodes=2, **CP_ON)

    # ---- attention backends: NSA for prefill and decode ----

    def test_default_and_explicit_nsa_backends_are_accepted(self):
        for backends in (
            {},
            dict(attention_backend="nsa"),
            dict(prefill_attention_backend="nsa", decode_attention_backend="nsa"),
        ):
            with self.subTest(backends=backends):
                args = self.glm5_args(tp_size=2, **CP_ON, **backends)
                self.assertEqual(args.get_attention_backends(), ("nsa", "nsa"))

    def test_rejects_attention_backends_other_than_nsa(self):
        """Each choice is accepted by stock sglang for a GLM-5 config and would fail (or read another
        forward's plan) only after the model loaded. Planted bug: judging only ``attention_backend``
        lets the prefill/decode overrides and the mixes through and this fails."""
        cases = [
            (dict(attention_backend="fa3"), "fa3"),
            (dict(attention_backend="flashinfer"), "flashinfer"),
            (dict(prefill_attention_backend="fa3"), "fa3"),
            (dict(decode_attention_backend="triton"), "triton"),
            (dict(prefill_attention_backend="fa3", decode_attention_backend="nsa"), "fa3"),
            (dict(attention_backend="nsa", decode_attention_backend="triton"), "triton"),
            # only one side set: the other falls back to sglang's platform default, not nsa
            (dict(prefill_attention_backend="nsa"), "prefill resolves to nsa and decode to "),
        ]
        for backends, bad in cases:
            with self.subTest(backends=backends), self.assertRaises(ValueError) as ctx:
                self.glm5_args(tp_size=2, **CP_ON, **backends)
            message = str(ctx.exception)
            for part in (CP_SHARED_KV_FLAG, bad, "--attention-backend", "--prefill-attention-backend",
                         "--decode-attention-backend"):  # fmt: skip
                self.assertIn(part, message)
            if backends == dict(prefill_attention_backend="nsa"):
                self.assertNotIn("decode to nsa", message)
        self.assertRejected("--attention-backend", "triton", model_path="dummy",
                            attention_backend="triton", **CP_ON)  # fmt: skip

    def test_flag_off_keeps_other_attention_backends(self):
        flag_off = {**CP_ON, "enable_nsa_prefill_cp_shared_kv": False}
        args = self.glm5_args(tp_size=8, attention_backend="fa3", **flag_off)
        self.assertEqual(args.get_attention_backends(), ("fa3", "fa3"))

    # ---- HiCache sizes and layouts that cannot work ----

    def test_rejects_a_host_pool_not_larger_than_the_device_pool(self):
        """Stock asserts host slots > device slots when the scheduler builds HiCache; the host pool is
        whole pages, one more than ``device * ratio`` rounds down to, so ratio 1 passes and anything below
        fails. Planted bug: ``< 1`` changed to ``<= 1`` rejects the ratio-1 case and this fails."""
        hicache = dict(model_path="dummy", enable_hierarchical_cache=True, **CP_ON)
        for ratio in (0.5, 0.99):
            with self.subTest(ratio=ratio):
                self.assertRejected(f"--hicache-ratio {ratio}", "--hicache-size", hicache_ratio=ratio, **hicache)
        for accepted in (dict(hicache_ratio=1.0), dict(hicache_ratio=2.0),
                         dict(hicache_ratio=0.5, hicache_size=64)):  # fmt: skip
            with self.subTest(accepted=accepted):
                ServerArgs(**hicache, **accepted)
        ServerArgs(model_path="dummy", hicache_ratio=0.5, **CP_ON)  # HiCache off: the ratio is unused

    def test_rejects_host_layouts_the_nsa_host_pools_cannot_allocate(self):
        hicache = dict(enable_hierarchical_cache=True, **CP_ON)
        for layout in ("page_head", "page_first_kv_split"):
            with self.subTest(layout=layout):
                self.assertRejected(f"--hicache-mem-layout {layout}", model_path="dummy",
                                    hicache_mem_layout=layout, **hicache)  # fmt: skip
        for layout in ("layer_first", "page_first", "page_first_direct"):
            with self.subTest(layout=layout):
                args = self.glm5_args(tp_size=2, hicache_mem_layout=layout, **hicache)
                self.assertIn(args.hicache_mem_layout, ("layer_first", "page_first", "page_first_direct"))
        with self.assertRaises(ValueError) as ctx:
            self.glm5_args(tp_size=2, hicache_mem_layout="page_head", **hicache)
        self.assertIn("--hicache-mem-layout page_head", str(ctx.exception))

    def test_the_nsa_host_pools_accept_exactly_the_allowed_layouts(self):
        """The allowed list against sglang itself: each layout through the two NSA host pool
        constructors (KV, then indexer K) on a tiny CPU pool."""
        from sglang_cp_shared_kv.startup_rules import NSA_HICACHE_MEM_LAYOUTS
        from sglang_cp_shared_kv_testing.cp_hicache_stack import build_cp_hicache_stack
        from sglang_cp_shared_kv_testing.multi_rank import single_process_group

        allowed = set()
        for layout in ("layer_first", "page_first", "page_first_direct", "page_first_kv_split", "page_head"):
            io_backend = "direct" if layout in ("page_first_direct", "page_first_kv_split") else "kernel"
            try:
                build_cp_hicache_stack(cp_size=2, cp_rank=0, group=single_process_group(),
                                       physical_pages=4, io_backend=io_backend, host_layout=layout)  # fmt: skip
            except ValueError as e:
                self.assertIn("Unsupported layout", str(e))
            else:
                allowed.add(layout)
        self.assertEqual(allowed, set(NSA_HICACHE_MEM_LAYOUTS))

    # ---- radix cache off, page size ----

    def test_rejects_radix_cache_off(self):
        self.assertRejected("--disable-radix-cache", "not been audited", model_path="dummy",
                            disable_radix_cache=True, **CP_ON)  # fmt: skip

    def test_page_size_is_judged_after_sglangs_rewrite(self):
        """For an NSA model on CUDA sglang runs 64-token pages whatever --page-size says (with a
        warning), so the rule accepts it; the value is refused only where it would survive (dummy)."""
        args = self.glm5_args(tp_size=2, page_size=32, **CP_ON)
        self.assertEqual(args.page_size, 64)
        os.environ.pop(CP_SHARED_KV_ENV)  # exported by the accepted launch above
        self.assertRejected("--page-size 32", model_path="dummy", page_size=32, **CP_ON)

    def test_help_names_what_the_flag_requires(self):
        # One line per option: argparse wraps at hyphens ("--disable- cuda-graph") at a terminal's width.
        parser = ArgumentParser(formatter_class=lambda prog: HelpFormatter(prog, width=100_000))
        ServerArgs.add_cli_args(parser)
        help_text = " ".join(parser.format_help().split())
        start = help_text.rindex(CP_SHARED_KV_FLAG)  # its entry, after the usage line
        flag_help = help_text[start : start + 1200]
        for part in ("--enable-nsa-prefill-context-parallel", "--tp 2, 4 or 8", "NSA attention backend",
                     "--disable-cuda-graph", "page size 64", "file or mooncake", "is opt-in"):  # fmt: skip
            self.assertIn(part, flag_help)


if __name__ == "__main__":
    unittest.main()
