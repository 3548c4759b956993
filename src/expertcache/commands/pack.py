"""`expertcache pack`: write an expert-major checkpoint (see `expertcache.models.pack`, and
`expertcache.models.pack_gguf` for GGUF files)."""

from __future__ import annotations

from pathlib import Path

from ..errors import ExpertCacheError
from .common import writing


def cmd_pack(args) -> int:
    from ..models.gguf_loader import is_gguf

    if is_gguf(Path(args.model)):
        if args.dtype:
            raise ExpertCacheError("--dtype does not apply to a GGUF file: its experts are packed as its blocks")
        from ..models.pack_gguf import pack_gguf

        with writing(args.output):
            out = pack_gguf(args.model, args.output, args.force)
    else:
        from ..models.pack import pack

        with writing(args.output):
            out = pack(args.model, args.output, args.dtype, args.force)
    print(f"wrote {out}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("pack", help="write an expert-major checkpoint (each expert one contiguous range)")
    p.add_argument("-m", "--model", required=True, help="model to read: a checkpoint directory or a GGUF file")
    p.add_argument("-o", "--output", required=True,
                   help="directory to write (a GGUF model: a .gguf file to write); must not exist")
    p.add_argument("--dtype", help="dtype of the written weights (default: each tensor keeps its own, and the copy "
                   "computes in the dtype the source computes in; not for GGUF). With it, the copy "
                   "then computes in it by default, so its logits equal the source's loaded with the same --dtype "
                   "where the conversion is exact (to float32); to bfloat16 or float16 weights are rounded, and "
                   "a weight beyond float16's range is an error")
    p.add_argument("--force", action="store_true", help="replace an earlier output of pack or synth")
    p.set_defaults(func=cmd_pack)
