#!/usr/bin/env python3
"""How fast is a decode step's one-row product straight from GGUF quantized blocks?

Times the native quantized kernels (src/expertcache/native/quant.cpp) against the torch path
they replace for one row, dequantize (src/expertcache/kernels/dequant.py) then `torch.mv` (and
against the native `dequantize_into` then `torch.mv`, the CPU prefill path's building block), on
Qwen3-30B-A3B's expert shapes: gate/up [768, 2048] and down [2048, 768], for Q4_K, Q6_K and Q8_0,
and the native kernels with 8-bit activations (`act8`, llama.cpp's integer products), plus
`torch.mv` on the same shapes in bf16 (what a resident bf16 expert costs) and one decode
wave of 8 SwiGLU experts in Q4_K_M's layout (Q4_K gate/up, Q6_K down) through `experts` against
the torch path; for Q4_K and Q8_0 also the act8 product from the rows interleaved eight at a
time as the engine holds its dense matrices (`act8 tiles`, `Kernels.tiles`; the same bits as
`native act8`; for the wave, gate and up so held, as a slot filled once holds them). Weights
are random valid blocks on the huge-page memory the engine uses; paths alternate for `--rounds`
rounds and medians are reported. Without `--cold` a path may find its weights in the last-level
cache where the path before it read the same ones (the rows' paths share them, the tiles are a
copy of their own); `--cold` reads through 96 MB before each path, so that every path streams its
weights from memory, as a decode step's experts are.

The native kernels are compiled on first use (a minute or more), which needs a C++ compiler
and ninja. Their sums are taken in another order than torch.mv's, so results differ in the last
bits; the largest difference is printed.

    python tools/quant_gemv_probe.py --threads 2 [--cold]

Prints a table and ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from expertcache.errors import ExpertCacheError  # noqa: E402
from expertcache.kernels.dequant import dequantize_into  # noqa: E402
from expertcache.kernels.quant_native import load_quant_native  # noqa: E402
from expertcache.kernels import TILED_TYPES  # noqa: E402
from expertcache.memory import host_copy, host_zeros  # noqa: E402

SHAPES = {"gate/up": (768, 2048), "down": (2048, 768)}  # (N, K)
TYPES = (Q.Q4_K, Q.Q6_K, Q.Q8_0)
# Byte offsets of the fp16 scale fields in a block (ggml's block structs).
FP16_FIELDS = {Q.Q4_K: (0, 2), Q.Q6_K: (208,), Q.Q8_0: (0,)}


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def random_blocks(qtype: Q, count: int, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """`count` matrices [n, k] of `qtype` as raw rows on huge-page memory: uint8 [count, n, row_bytes]."""
    size, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = count * n * k // size
    raw = rng.integers(0, 256, (blocks, nbytes), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:  # scales of trained weights' size, so sums stay finite
        raw[:, at:at + 2] = (rng.standard_normal(blocks) * 2.0 ** -10).astype(np.float16).view(np.uint8).reshape(-1, 2)
    out = host_zeros((count, n, k // size * nbytes), torch.uint8)
    out.copy_(torch.from_numpy(raw).view(count, n, -1))
    return out


def dequant_mv(buf: torch.Tensor, native=None):
    """dequantize into a preallocated fp32 buffer, then torch.mv: with torch's dequantization
    (kernels/dequant.py), or the native module's `dequantize_into` when `native` is given."""
    def run(raw: torch.Tensor, qtype: Q, x: torch.Tensor) -> torch.Tensor:
        w = buf[: raw.shape[0] * x.shape[0]].view(raw.shape[0], x.shape[0])
        if native is None:
            dequantize_into(raw, qtype, tuple(w.shape), w)
        else:
            native.dequantize_into(raw, qtype, w)
        return torch.mv(w, x)
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--rounds", type=positive_int, default=7, help="alternating rounds; medians are reported")
    ap.add_argument("--matrices", type=positive_int, default=8, help="matrices of each shape and type per round")
    ap.add_argument("--cold", action="store_true", help="evict the caches before each path: weights come from memory")
    args = ap.parse_args(argv)
    try:
        mod = load_quant_native()
    except ExpertCacheError as e:
        print(f"quant_gemv_probe: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    count = args.matrices
    buf = torch.empty(max(n * k for n, k in SHAPES.values()))
    torch_path, native_dq = dequant_mv(buf), dequant_mv(buf, mod)
    xs = {k: torch.randn(k, generator=torch.Generator().manual_seed(k)) for _, k in SHAPES.values()}

    # (label, bytes per matrix, {path: fn() running all `count` matrices})
    cases = []
    diffs = {}
    for qtype in TYPES:
        for label, (n, k) in SHAPES.items():
            raw, x = random_blocks(qtype, count, n, k, rng), xs[k]
            a, b = mod.gemv(raw[0], qtype, x), torch_path(raw[0], qtype, x)
            diffs[f"{qtype.name} {label}"] = ((a - b).abs().max() / b.abs().max()).item()
            paths = {
                f"native ({mod.isa})": lambda raw=raw, qtype=qtype, x=x: [mod.gemv(raw[i], qtype, x) for i in range(count)],
                "native act8": lambda raw=raw, qtype=qtype, x=x: [mod.gemv(raw[i], qtype, x, act8=True)
                                                                  for i in range(count)],
                "dequantize+mv": lambda raw=raw, qtype=qtype, x=x: [torch_path(raw[i], qtype, x) for i in range(count)],
                "native deq+mv": lambda raw=raw, qtype=qtype, x=x: [native_dq(raw[i], qtype, x) for i in range(count)],
            }
            if mod.isa == "avx2" and qtype in TILED_TYPES:  # the rows interleaved as `Kernels.tiles` holds them
                tiles = [host_copy(mod.tile_rows(raw[i], qtype, k)) for i in range(count)]
                assert torch.equal(mod.gemm_tiles(tiles[0], qtype, x[None])[0], mod.gemv(raw[0], qtype, x, act8=True))
                paths["act8 tiles"] = lambda tiles=tiles, qtype=qtype, x=x: [mod.gemm_tiles(t, qtype, x[None])
                                                                             for t in tiles]
            cases.append((f"{qtype.name} {label}", raw[0].numel(), paths))
    for label, (n, k) in SHAPES.items():
        w = host_zeros((count, n, k), torch.bfloat16)
        w.copy_(torch.randn(count, n, k) * 0.02)
        xb = xs[k].to(torch.bfloat16)
        cases.append((f"BF16 {label}", w[0].numel() * 2, {"torch.mv": lambda w=w, xb=xb: [torch.mv(w[i], xb) for i in range(count)]}))

    # One decode wave: 8 experts, Q4_K gate and up, Q6_K down (Q4_K_M's usual layout).
    (I, D), wave = SHAPES["gate/up"], 8
    gates, ups = random_blocks(Q.Q4_K, wave, I, D, rng), random_blocks(Q.Q4_K, wave, I, D, rng)
    downs = random_blocks(Q.Q6_K, wave, D, I, rng)
    xw = xs[D]

    def torch_wave():
        return torch.stack([torch_path(downs[e], Q.Q6_K, F.silu(torch_path(gates[e], Q.Q4_K, xw)) * torch_path(ups[e], Q.Q4_K, xw))
                            for e in range(wave)])

    def native_wave():
        return mod.experts(xw, list(gates), list(ups), list(downs), Q.Q4_K, Q.Q4_K, Q.Q6_K)

    a, b = native_wave(), torch_wave()
    diffs["wave"] = ((a - b).abs().max() / b.abs().max()).item()
    wave_bytes = (gates[0].numel() * 2 + downs[0].numel()) * wave
    def native_wave_act8():
        return mod.experts(xw, list(gates), list(ups), list(downs), Q.Q4_K, Q.Q4_K, Q.Q6_K, "silu", True)

    wave_paths = {f"native ({mod.isa})": native_wave, "native act8": native_wave_act8, "dequantize+mv": torch_wave}
    if mod.isa == "avx2":  # gate and up held as tiles, as a slot filled once holds them (Q6_K has none)
        gate_tiles = [host_copy(mod.tile_rows(g, Q.Q4_K, D)) for g in gates]
        up_tiles = [host_copy(mod.tile_rows(u, Q.Q4_K, D)) for u in ups]

        def tiled_wave():
            return mod.experts(xw, gate_tiles, up_tiles, list(downs), Q.Q4_K, Q.Q4_K, Q.Q6_K, "silu", True,
                               tiled=[True, True, False])

        assert torch.equal(tiled_wave(), native_wave_act8())
        wave_paths["act8 tiles"] = tiled_wave
    cases.append(("wave of 8 experts", wave_bytes, wave_paths))

    times: dict[tuple[str, str], list[float]] = {}
    for _, _, paths in cases:  # warm-up: thread pool, page tables
        for fn in paths.values():
            fn()
    flush = host_zeros(((96 << 20) // 4,), torch.float32) if args.cold else None
    for _ in range(args.rounds):
        for label, _, paths in cases:
            for name, fn in paths.items():
                if flush is not None:
                    flush.add_(1.0)  # read and written: the caches now hold this buffer
                t = time.perf_counter()
                fn()
                per = (time.perf_counter() - t) / (1 if label.startswith("wave") else count)
                times.setdefault((label, name), []).append(per)

    print(f"threads {args.threads}; {args.rounds} rounds alternating; {count} matrices of each shape and type; "
          f"times per matrix (per wave for the wave){'; caches evicted before each path' if args.cold else ''}\n")
    print(f"{'weights':22}{'path':20}{'median us':>11}{'GB/s':>8}{'vs dequantize+mv':>18}")
    print("-" * 79)
    result = {}
    for label, nbytes, paths in cases:
        base = statistics.median(times[(label, "dequantize+mv")]) if "dequantize+mv" in paths else None
        for name in paths:
            med = statistics.median(times[(label, name)])
            speed = f"{base / med:17.2f}x" if base else f"{'':18}"
            print(f"{label:22}{name:20}{med * 1e6:11.0f}{nbytes / med / 1e9:8.2f}{speed}")
            result[f"{label} | {name}"] = round(med * 1e6, 1)
    print("\nGB/s counts the bytes stored (quantized blocks, or bf16); largest difference of native from "
          "dequantize+mv, relative to the output's largest value: " + f"{max(diffs.values()):.1e}")
    print(json.dumps({"threads": args.threads, "rounds": args.rounds, "matrices": count, "isa": mod.isa, "cold": args.cold,
                      "median_us": result, "max_relative_difference": max(diffs.values())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
