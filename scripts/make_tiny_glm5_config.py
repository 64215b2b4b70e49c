#!/usr/bin/env python3
"""Write a GLM-5 (GlmMoeDsaForCausalLM) model directory for ``sglang serve --load-format dummy``.

  python scripts/make_tiny_glm5_config.py /tmp/tiny-glm5
  python scripts/make_tiny_glm5_config.py /tmp/tiny-glm5-nextn --nextn
  python scripts/make_tiny_glm5_config.py /tmp/glm5-width-tp2 --glm5-width --tp 2 --weights fp8
  python scripts/make_tiny_glm5_config.py --print-memory

Writes config.json, generation_config.json, tokenizer.json and tokenizer_config.json (no weights),
then loads the directory offline with transformers and sglang's ModelConfig and checks sglang
classifies it as an NSA (DSA) MLA model. Default: the tiny GLM-5 (hidden 1024, see
sglang_cp_shared_kv_testing.e2e.tiny_glm5). ``--glm5-width``: every width of GLM-5 (hidden 6144,
real attention, indexer, experts and vocabulary, see ...e2e.glm5_width) with as many layers as fit
``--tp`` H200s next to a KV pool of ``--physical-tokens-per-rank`` (or ``--num-layers``).
``--nextn``: the tiny GLM-5 with GLM-5's NextN (MTP) layer, ``num_nextn_predict_layers: 1``, so
that ``--speculative-algorithm EAGLE`` builds the draft from it (the check then loads sglang's draft
config too). ``--print-memory``: weight bytes per layer and the layers that fit at tp 2 / 4 / 8. Exit 1 if the
check fails.
"""

from __future__ import annotations

import argparse
import json
import sys

from sglang_cp_shared_kv_testing.e2e import glm5_width
from sglang_cp_shared_kv_testing.e2e.tiny_glm5 import check_model_dir, write_model_dir, write_tiny_glm5_model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", nargs="?", help="directory to create (existing files are overwritten)")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="decoder layers (tiny: default 4, 1 dense + MoE; --glm5-width: default as many as fit)")
    parser.add_argument("--no-check", action="store_true", help="skip loading it back with transformers/sglang")
    parser.add_argument("--glm5-width", action="store_true", help="GLM-5's real widths, layer count cut")
    parser.add_argument("--tp", type=int, default=2, help="--glm5-width: the --tp the layer count is sized for")
    parser.add_argument("--weights", choices=glm5_width.WEIGHT_DTYPES, default="bf16",
                        help="--glm5-width: bf16, or fp8 (block-quantized config; the dummy loader fills fp8)")
    parser.add_argument("--kv-dtype", choices=glm5_width.KV_DTYPES, default="bf16", help="sizing: KV cache dtype")
    parser.add_argument("--physical-tokens-per-rank", type=int, default=262144,
                        help="sizing: the KV pool rows per rank that must fit beside the weights")
    parser.add_argument("--mem-fraction-static", type=float, default=0.85, help="sizing: sglang's static budget")
    parser.add_argument("--gpu-gib", type=float, default=glm5_width.H200_GIB, help="sizing: memory of one GPU")
    parser.add_argument("--nextn", action="store_true",
                        help="tiny model: add GLM-5's NextN (MTP) layer (num_nextn_predict_layers 1)")
    parser.add_argument("--print-memory", action="store_true", help="print the memory table (tp 2/4/8) and exit")
    args = parser.parse_args(argv)
    if args.print_memory:
        print("\n".join(glm5_width.memory_report(
            args.physical_tokens_per_rank, args.kv_dtype, args.mem_fraction_static, args.gpu_gib)))
        return 0
    if args.out_dir is None:
        parser.error("out_dir is required unless --print-memory")
    if args.nextn and args.glm5_width:
        parser.error("--nextn is for the tiny model")
    if args.glm5_width:
        num_layers = args.num_layers
        if num_layers is None:
            plan = glm5_width.layers_that_fit(args.tp, args.weights, args.kv_dtype, args.physical_tokens_per_rank,
                                              args.gpu_gib, args.mem_fraction_static)  # fmt: skip
            print("\n".join(plan.lines()))
            num_layers = plan.num_layers
        out = write_model_dir(args.out_dir, glm5_width.glm5_width_config(num_layers, args.weights))
    else:
        out = write_tiny_glm5_model(args.out_dir, num_hidden_layers=args.num_layers or 4, nextn=args.nextn)
    print(f"wrote {out}")
    if args.no_check:
        return 0
    try:
        summary = check_model_dir(out)
    except ValueError as e:
        print(f"check failed: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
