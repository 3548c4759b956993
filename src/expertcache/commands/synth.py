"""`expertcache synth`: a random-weight checkpoint with a real model's layer shapes."""

from __future__ import annotations

from ..errors import ExpertCacheError
from ..models.synth import PRESETS, QUANTS, synth
from ..flags import positive_int
from .args import seed
from .common import writing


def cmd_synth(args) -> int:
    if args.quant is not None and args.dtype is not None:
        # A GGUF file's weights are the --quant recipe's blocks: --dtype was ignored without a word.
        raise ExpertCacheError(f"--dtype does not apply to --quant {args.quant}: the GGUF file's weights are "
                               "its blocks; give one of them")
    with writing(args.output):
        if args.quant is not None:
            from ..models.synth_gguf import synth_gguf

            out = synth_gguf(args.output, args.like, args.layers, args.experts, args.top_k, args.vocab, args.quant,
                             args.seed, args.force)
        else:
            out = synth(args.output, args.like, args.layers, args.experts, args.top_k, args.vocab,
                        args.dtype or "bfloat16", args.seed, args.force)
    print(f"wrote {out}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("synth", help="write a random-weight checkpoint with a real model's layer shapes")
    p.add_argument("--like", default="qwen3-30b-a3b", help=f"shapes to copy: {', '.join(PRESETS)} (default: qwen3-30b-a3b: "
                   "2 layers of its 128 experts write about 2.4 GB)")
    p.add_argument("--layers", type=positive_int, default=2, help="decoder layers (default: 2)")
    p.add_argument("--experts", type=positive_int, help="experts per layer (default: the model's)")
    p.add_argument("--top-k", type=positive_int, help="experts per token (default: the model's)")
    p.add_argument("--vocab", type=positive_int, default=4096, help="vocabulary size (default: 4096)")
    p.add_argument("--dtype", help="weight dtype (default: bfloat16; not with --quant)")
    p.add_argument("--quant", choices=QUANTS, help="write a GGUF file instead of a safetensors directory: "
                   "q4_k_m (llama.cpp's recipe, random valid blocks) or bf16")
    p.add_argument("--seed", type=seed, default=0, help="seed of the random weights, 64 bits (default: 0)")
    p.add_argument("--force", action="store_true", help="replace an earlier output of synth or pack")
    p.add_argument("-o", "--output", required=True,
                   help="directory to write (with --quant: a .gguf file); must not exist, unless --force")
    p.set_defaults(func=cmd_synth)
