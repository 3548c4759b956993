#!/usr/bin/env python3
"""How fast is a decode step's attention over the cache?

Times the native decode attention (`attend` in src/expertcache/native/decode.cpp: q/k norm,
rotary, the cache append and softmax(q k^T) v for one token) against torch's fused
`scaled_dot_product_attention` on the same keys and values (the path without the native kernels,
which leaves out the norm, rotary and append), for a layer of Qwen3-30B-A3B's shape by default
(32 query heads, 4 key/value heads, head width 128) at several numbers of cached positions. The
two alternate for `--rounds` rounds; medians are reported, with the native time as a ratio of
torch's (a ratio within one run is what this noisy host lets one compare).

`--src DIR` loads the package from another tree's `src/` (a worktree of an earlier commit), so
that two commits' kernels can be timed with the same probe:

    python tools/attend_probe.py --threads 2
    python tools/attend_probe.py --threads 2 --src /tmp/older/src

Prints a table and ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--positions", default="64,300,1000,4000", help="cached positions, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50, help="calls per timing")
    ap.add_argument("--src", type=Path, default=Path(__file__).resolve().parents[1] / "src")
    args = ap.parse_args()
    try:
        positions = [int(p) for p in args.positions.split(",")]
    except ValueError:
        ap.error(f"--positions {args.positions!r}: expected comma-separated integers")
    # Checked here, not with expertcache.flags: the package is imported from --src only below.
    for flag in ("threads", "heads", "kv_heads", "head_dim", "rounds", "calls"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected a number >= 1")
    if args.heads % args.kv_heads or args.head_dim % 2 or min(positions) < 1:
        ap.error("expected heads a multiple of kv-heads, an even head dim and positions >= 1")
    sys.path.insert(0, str(args.src))
    import torch
    import torch.nn.functional as F
    from expertcache import kernels

    torch.set_num_threads(args.threads)
    native = kernels.load_native()
    H, G, Dh = args.heads, args.kv_heads, args.head_dim
    gen = torch.Generator().manual_seed(0)

    def bf16(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    qkv, norm = bf16((H + 2 * G) * Dh), bf16(H + G, Dh)
    cos, sin = bf16(Dh), bf16(Dh)

    def timed(fn) -> float:
        fn()
        t = time.perf_counter()
        for _ in range(args.calls):
            fn()
        return (time.perf_counter() - t) / args.calls * 1e6

    rows = []
    for P in positions:
        kc, vc = bf16(G, P, Dh), bf16(G, P, Dh)
        q = bf16(1, G, H // G, Dh)
        ours = lambda: native.attend(qkv, norm, 1e-6, cos, sin, kc, vc, P - 1, Dh ** -0.5, H, G)  # noqa: E731
        theirs = lambda: F.scaled_dot_product_attention(q, kc[None], vc[None], scale=Dh ** -0.5)  # noqa: E731
        a, b = [], []
        for _ in range(args.rounds):
            a.append(timed(ours))
            b.append(timed(theirs))
        rows.append({"positions": P, "native_us": statistics.median(a), "torch_sdpa_us": statistics.median(b)})

    print(f"decode attention, {H} heads, {G} key/value heads, head dim {Dh}, {args.threads} threads "
          f"(medians of {args.rounds} rounds of {args.calls} calls)")
    print(f"{'positions':>10} {'native us':>10} {'torch sdpa us':>14} {'native/torch':>13}")
    for r in rows:
        print(f"{r['positions']:>10} {r['native_us']:>10.1f} {r['torch_sdpa_us']:>14.1f} "
              f"{r['native_us'] / r['torch_sdpa_us']:>12.2f}x")
    print(json.dumps({"tool": "attend_probe", "src": str(args.src), "threads": args.threads, "heads": H,
                      "kv_heads": G, "head_dim": Dh, "rows": rows}))


if __name__ == "__main__":
    main()
