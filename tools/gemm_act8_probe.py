#!/usr/bin/env python3
"""Many-row products over quantized blocks: the integer kernels with 8-bit activations
(`gemm_act8`) against decoding the matrix to bf16 and a bf16 GEMM, by row count. A third column
multiplies tiles formed ahead of time (`gemm_tiles`, as the dense matrices are held): its lead
over `gemm_act8`, which forms each expert's tiles per product, is what forming costs.

Where the first is faster decides `--activations auto`'s row limit on CPUs with bf16 matrix
instructions (kernels.AUTO_ACT8_ROWS); on CPUs without them the bf16 product is widened to fp32 as
prefill widens it (see kernels.select for why every product is q8 there).
Random valid blocks at Qwen3-30B-A3B's expert shapes; the two paths alternate and medians are
reported.

    python tools/gemm_act8_probe.py --threads 2 --rows 4,8,12,16,24,32,128

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
from gguf.constants import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gguf_blocks import random_rows  # noqa: E402

from expertcache.flags import positive_int  # noqa: E402
from expertcache.kernels import TorchKernels  # noqa: E402
from expertcache.kernels.quant_native import load_quant_native  # noqa: E402
from matmul_probe import row_counts  # noqa: E402  (beside this file)

SHAPES = [("Q4_K", 1536, 2048), ("Q6_K", 2048, 768), ("Q8_0", 1536, 2048)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--rows", type=row_counts, default="4,8,12,16,24,32,128", help="comma-separated row counts")
    ap.add_argument("--rounds", type=positive_int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    m = load_quant_native()
    exact = TorchKernels()
    out = {}
    print(f"threads {args.threads}; GFLOP/s, median of {args.rounds} alternating rounds\n")
    print(f"{'weights':<20}{'rows':>6}{'deq+bf16':>11}{'gemm_act8':>11}{'held tiles':>12}{'act8 / deq':>12}")
    for name, n, k in SHAPES:
        qt = Q[name]
        raw = torch.from_numpy(random_rows(qt, n, k, 0, lo=-14, hi=-4))
        tiles = m.tile_rows(raw, qt, k) if m.isa == "avx2" else None  # no tiles on the plain build
        for T in args.rows:
            x = torch.randn(T, k)

            def deq():
                w = torch.empty(n, k, dtype=torch.bfloat16)
                m.dequantize_into(raw, qt, w)
                return exact.linear(x.bfloat16(), w)  # as prefill multiplies (widened to fp32 where that is faster)

            paths = [("deq+bf16", deq), ("gemm_act8", lambda: m.gemm_act8(raw, qt, x))]
            if tiles is not None:
                paths.append(("held tiles", lambda: m.gemm_tiles(tiles, qt, x)))
            times = {label: [] for label, _ in paths}
            for _ in range(args.rounds):
                for label, fn in paths:
                    t = time.perf_counter()
                    fn()
                    times[label].append(time.perf_counter() - t)
            flop = 2 * T * n * k
            rate = {label: flop / statistics.median(ts) / 1e9 for label, ts in times.items()}
            out[f"{name} {T}"] = {f"{label.replace(' ', '_').replace('+', '_')}_gflops": v for label, v in rate.items()}
            held = f"{rate['held tiles']:>12.1f}" if tiles is not None else f"{'-':>12}"
            print(f"{name + f' [{n}x{k}]':<20}{T:>6}{rate['deq+bf16']:>11.1f}{rate['gemm_act8']:>11.1f}{held}"
                  f"{rate['gemm_act8'] / rate['deq+bf16']:>11.2f}x")
    print(json.dumps({"tool": "gemm_act8_probe", "threads": args.threads, "results": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
