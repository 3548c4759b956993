#!/usr/bin/env python3
"""Is the decode step's matrix-vector product limited by memory or by the kernel?

A decode step is ~41 one-row bf16 products over ~244 MB of weights. torch's bf16 kernel
(`torch.mv`, the BLAS path `expertcache` takes for one row by default) widens every weight to
fp32 before its multiply-add; a CPU with AVX512-BF16 can instead multiply bf16 pairs directly
(`vdpbf16ps`), as llama.cpp's bf16 path does, and so does expertcache's native kernel
(`--kernels native`, src/expertcache/native/decode.cpp). This times the two on the decode step's
shapes, on the same huge-page memory the engine uses, alternating them for `--rounds` rounds and
reporting medians. If the native kernel streams faster, torch's product is kernel-bound.

The native kernels are compiled on first use (about a minute), which needs a C++ compiler and
ninja (`pip install ninja`). Their results differ from `torch.mv` in the last bits (bf16 pairs
summed inside the instruction).

    python tools/gemv_probe.py --threads 2

Prints a table and ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from expertcache.flags import positive_int  # noqa: E402
from expertcache.errors import ExpertCacheError  # noqa: E402
from expertcache.kernels import TorchKernels, load_native  # noqa: E402
from expertcache.memory import host_zeros  # noqa: E402

# The decode step's products on Qwen3-30B-A3B's shapes: expert gate/up and down, fused q/k/v, and o.
SHAPES = [(1536, 2048, 16), (2048, 768, 16), (5120, 2048, 2), (2048, 4096, 2)]  # (N, K, matrices)

def fail(msg: str) -> None:
    print(f"gemv_probe: {msg}", file=sys.stderr)
    raise SystemExit(2)


def build():
    try:
        return load_native()
    except ExpertCacheError as e:
        fail(str(e))


def engine_mv(w, x):
    """The engine's own one-row product (the torch kernels' `linear`): `torch.mv` with oneDNN off."""
    return TorchKernels().linear(x[None], w)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--rounds", type=positive_int, default=7, help="alternating rounds; medians are reported")
    args = ap.parse_args(argv)
    mod = build()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    sets = []
    for n, k, count in SHAPES:
        w = host_zeros((count, n, k), torch.bfloat16)
        w.copy_(torch.randn(count, n, k) * 0.02)
        sets.append((w, torch.randn(k).to(torch.bfloat16)))
    nbytes = sum(w.numel() * 2 for w, _ in sets)
    paths = {"torch.mv": engine_mv, f"native ({mod.isa})": mod.gemv}
    diff = max((mod.gemv(w[0], x).float() - engine_mv(w[0], x).float()).abs().max().item() /
               engine_mv(w[0], x).float().abs().max().item() for w, x in sets)
    rates: dict[str, list[float]] = {p: [] for p in paths}
    for fn in paths.values():  # warm-up: thread pool, page tables
        for w, x in sets:
            fn(w[0], x)
    for _ in range(args.rounds):
        for name, fn in paths.items():
            t = time.perf_counter()
            for w, x in sets:
                for i in range(w.shape[0]):
                    fn(w[i], x)
            rates[name].append(nbytes / (time.perf_counter() - t) / 1e9)
    base = statistics.median(rates["torch.mv"])
    print(f"{nbytes / 2**20:.0f} MiB of bf16 weights per round on huge-page memory; threads {args.threads}; "
          f"{args.rounds} rounds alternating\n")
    print(f"{'path':22}{'median GB/s':>12}{'min':>8}{'max':>8}{'vs torch.mv':>13}")
    print("-" * 63)
    for name, r in rates.items():
        med = statistics.median(r)
        print(f"{name:22}{med:12.1f}{min(r):8.1f}{max(r):8.1f}{med / base:12.2f}x")
    print(f"\nlargest difference from torch.mv, relative to the output's largest value: {diff:.1e}")
    print(json.dumps({"threads": args.threads, "rounds": args.rounds, "mib": round(nbytes / 2**20),
                      "median_gb_s": {p: round(statistics.median(r), 1) for p, r in rates.items()},
                      "max_relative_difference": diff}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
