"""`expertcache pack`: write an expert-major checkpoint (see `expertcache.models.pack`)."""

from __future__ import annotations

from ..models.pack import pack


def cmd_pack(args) -> int:
    out = pack(args.model, args.output, args.dtype, args.force)
    print(f"wrote {out}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("pack", help="write an expert-major checkpoint (each expert one contiguous range)")
    p.add_argument("-m", "--model", required=True, help="model directory to read")
    p.add_argument("-o", "--output", required=True, help="directory to write (must not exist)")
    p.add_argument("--dtype", help="dtype of the written weights (default: the checkpoint's)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.set_defaults(func=cmd_pack)
