#!/usr/bin/env python3
"""Write a tiny GLM-5 (GlmMoeDsaForCausalLM) model directory for ``sglang serve --load-format dummy``.

  python scripts/make_tiny_glm5_config.py /tmp/tiny-glm5

Writes config.json, generation_config.json, tokenizer.json and tokenizer_config.json (no weights),
then loads the directory offline with transformers and sglang's ModelConfig and checks sglang
classifies it as an NSA (DSA) MLA model. See sglang_cp_shared_kv.testing.e2e.tiny_glm5 for the
geometry. Exit 1 if the check fails.
"""

from __future__ import annotations

import argparse
import json
import sys

from sglang_cp_shared_kv.testing.e2e.tiny_glm5 import check_model_dir, write_tiny_glm5_model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="directory to create (existing files are overwritten)")
    parser.add_argument("--num-layers", type=int, default=4, help="decoder layers: 1 dense, the rest MoE")
    parser.add_argument("--no-check", action="store_true", help="skip loading it back with transformers/sglang")
    args = parser.parse_args(argv)
    out = write_tiny_glm5_model(args.out_dir, num_hidden_layers=args.num_layers)
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
