#!/usr/bin/env python3
"""How fast this CPU multiplies bf16 matrices of an expert's shape, by row count and kernel path.

Prefill's expert products have few rows (512 tokens x 8 of 128 experts: 32 rows on average), decode's
have one. This prints the rate of a [M x 2048] x [2048 x 1536] product (Qwen3-30B-A3B's gate/up)
for M from 1 to 512 through the paths torch offers on a CPU: `F.linear` (oneDNN), the same with
oneDNN switched off (the BLAS path the decode step uses for one row), that path again on weights
in memory advised for huge pages (as the engine allocates them), fp32, both operands widened to
fp32 per call (the engine's path for many rows on a CPU without bf16 instructions), oneDNN with
the weight packed once ahead of time (which tells whether per-call repacking is what small
products cost), and the engine's own product under `--kernels native` (on AVX2, `linear_rows`
below `kernels.NATIVE_ROWS` rows). The weights cycle through 16 matrices (96 MB) so that they
come from memory, not the cache.
It also says whether the CPU has AMX tiles, which decide what bf16 products can reach.

    python tools/matmul_probe.py --threads 2

Prints a table and ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from expertcache.flags import positive_int  # noqa: E402
from expertcache.errors import ExpertCacheError  # noqa: E402
from expertcache.kernels import NativeKernels, _linear_in_fp32, load_native  # noqa: E402
from expertcache.memory import host_copy  # noqa: E402

K, N, MATRICES = 2048, 1536, 16


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def no_onednn(x, w):
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        return F.linear(x, w)
    finally:
        torch._C._set_mkldnn_enabled(was)


def fp32(x, w):
    return F.linear(x.float(), w.float())


def prepacked_path():
    packed: dict[int, torch.Tensor] = {}

    def run(x, w):
        key = id(w)
        if key not in packed:
            packed[key] = torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0])
        return torch.ops.mkldnn._linear_pointwise(x, packed[key], None, "none", [], "")
    return run, packed


def row_counts(text: str) -> list[int]:
    try:
        rows = [int(r) for r in text.split(",")]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated row counts >= 1, got {text!r}")
    return rows


def rate(fn, weights, m: int, seconds: float) -> float:
    """Seconds per product, over whole passes through the weights."""
    x = torch.randn(m, K, dtype=torch.bfloat16)
    for w in weights[:2]:
        fn(x, w)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for w in weights:
            fn(x, w)
        n += len(weights)
    return (time.perf_counter() - t0) / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--rows", type=row_counts, default="1,8,32,128,512", help="comma-separated row counts M")
    ap.add_argument("--seconds", type=float, default=0.5, help="time per measurement")
    args = ap.parse_args(argv)
    if not args.seconds > 0:
        ap.error(f"argument --seconds: expected a number > 0, got {args.seconds}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = args.rows
    weights = [torch.randn(N, K, dtype=torch.bfloat16) * 0.02 for _ in range(MATRICES)]
    # The same weights on memory advised for huge pages, as the engine keeps them.
    huge = [host_copy(w) for w in weights]
    flags = cpu_flags()
    amx = sorted(f for f in flags if f.startswith("amx"))
    print(f"cpu: {platform.processor() or platform.machine()}; avx512_bf16: {'avx512_bf16' in flags}; "
          f"amx: {', '.join(amx) if amx else 'none'}; threads {args.threads}")
    packed_fn, packed = prepacked_path()
    paths = {"linear": (F.linear, weights), "onednn-off": (no_onednn, weights),
             "off+hugepage": (no_onednn, huge), "fp32": (fp32, weights),
             "widened": (lambda x, w: _linear_in_fp32(x, w, None), weights), "prepacked": (packed_fn, weights)}
    try:
        native = NativeKernels(load_native())
        paths[f"native-{native.native.isa}"] = (native.linear, huge)
    except ExpertCacheError as e:
        print(f"native kernels: {e}; their row left out")
    results: dict[str, dict[int, float]] = {p: {} for p in paths}
    print(f"\n{'path':12}" + "".join(f"{f'M={m}':>10}" for m in rows) + "   (GFLOP/s)")
    print("-" * (12 + 10 * len(rows) + 14))
    for name, (fn, ws) in paths.items():
        cells = []
        for m in rows:
            packed.clear()  # a packing is specific to the row count it was made for
            try:
                dt = rate(fn, ws, m, args.seconds)
            except RuntimeError as e:  # oneDNN's prepacking needs AVX-512 or AVX-NE-CONVERT for bf16
                cells = [f"  not on this CPU: {str(e).splitlines()[0]}"]
                del results[name]
                break
            results[name][m] = 2 * m * K * N / dt / 1e9
            cells.append(f"{results[name][m]:10.1f}")
        print(f"{name:12}" + "".join(cells))
    if 1 in rows:
        # one row: 2 flops per 2-byte weight, so GFLOP/s is also the weight read rate in GB/s
        print("\nM=1 reads the weights at the GFLOP/s figure in GB/s (bf16 paths)")
    print(json.dumps({"threads": args.threads, "amx": amx, "avx512_bf16": "avx512_bf16" in flags,
                      "shape": [K, N], "gflops": {p: {str(m): round(v, 1) for m, v in r.items()}
                                                  for p, r in results.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
