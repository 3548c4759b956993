#!/usr/bin/env python3
"""Is the decode step's matrix-vector product limited by memory or by torch's kernel?

A decode step is ~41 one-row bf16 products over ~244 MB of weights (`torch.mv`, the BLAS path
`expertcache` takes for one row). torch's bf16 kernel widens every weight to fp32 before its
multiply-add; a CPU with AVX512-BF16 can instead multiply bf16 pairs directly (`vdpbf16ps`), as
llama.cpp's bf16 path does. This builds a small kernel of that kind (one row at a time, one or
two accumulators, rows split across threads) and times it against `torch.mv` on the decode
step's shapes, on the same huge-page memory the engine uses, alternating the two for `--rounds`
rounds and reporting medians. If the kernel streams faster, the product is kernel-bound.

The kernel is a probe, not part of expertcache: it needs a C++ compiler and ninja
(`pip install ninja`) and compiles for about a minute on first use. Its results differ from
`torch.mv` in the last bits (bf16 pairs summed inside the instruction).

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
from expertcache.commands.common import positive_int  # noqa: E402
from expertcache.memory import host_zeros  # noqa: E402
from expertcache.models.layers import linear  # noqa: E402
from matmul_probe import cpu_flags  # noqa: E402  (this script's own folder)

# The decode step's products on Qwen3-30B-A3B's shapes: expert gate/up and down, fused q/k/v, and o.
SHAPES = [(1536, 2048, 16), (2048, 768, 16), (5120, 2048, 2), (2048, 4096, 2)]  # (N, K, matrices)

KERNEL = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// y[n] = sum_k w[n, k] x[k], one row at a time, U accumulators per row; K % 32 == 0.
template <int U>
torch::Tensor gemv(torch::Tensor w, torch::Tensor x) {
  TORCH_CHECK(w.dtype() == torch::kBFloat16 && x.dtype() == torch::kBFloat16 && w.is_contiguous());
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % 32 == 0 && x.numel() == K);
  auto y = torch::empty({N}, w.options());
  auto W = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto X = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto Y = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = W + r * K;
      __m512 acc[U];
      for (int i = 0; i < U; ++i) acc[i] = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + 32 * U <= K; k += 32 * U)
        for (int i = 0; i < U; ++i)
          acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(row + k + 32 * i),
                                    (__m512bh)_mm512_loadu_si512(X + k + 32 * i));
      for (; k < K; k += 32)
        acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)_mm512_loadu_si512(row + k),
                                  (__m512bh)_mm512_loadu_si512(X + k));
      for (int i = 1; i < U; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);
      Y[r] = at::BFloat16(_mm512_reduce_add_ps(acc[0]));
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("one_acc", &gemv<1>);
  m.def("two_acc", &gemv<2>);
}
"""


def fail(msg: str) -> None:
    print(f"gemv_probe: {msg}", file=sys.stderr)
    raise SystemExit(2)


def build():
    if "avx512_bf16" not in cpu_flags():
        fail("this CPU has no AVX512-BF16 (or this is not Linux); expected a CPU whose flags list avx512_bf16")
    try:
        from torch.utils.cpp_extension import load_inline
        return load_inline("expertcache_gemv_probe", cpp_sources=KERNEL,
                           extra_cflags=["-O3", "-mavx512f", "-mavx512bf16", "-fopenmp"])
    except (RuntimeError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        fail(f"could not build the kernel ({first}); expected a C++ compiler and ninja (pip install ninja)")


def engine_mv(w, x):
    """The engine's own one-row product: `torch.mv` with oneDNN off."""
    return linear(x[None], w)[0]


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
    paths = {"torch.mv": engine_mv, "bf16-dot, 1 acc": mod.one_acc, "bf16-dot, 2 acc": mod.two_acc}
    diff = max((mod.two_acc(w[0], x).float() - engine_mv(w[0], x).float()).abs().max().item() /
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
    print(f"{'path':18}{'median GB/s':>12}{'min':>8}{'max':>8}{'vs torch.mv':>13}")
    print("-" * 59)
    for name, r in rates.items():
        med = statistics.median(r)
        print(f"{name:18}{med:12.1f}{min(r):8.1f}{max(r):8.1f}{med / base:12.2f}x")
    print(f"\nlargest difference from torch.mv, relative to the output's largest value: {diff:.1e}")
    print(json.dumps({"threads": args.threads, "rounds": args.rounds, "mib": round(nbytes / 2**20),
                      "median_gb_s": {p: round(statistics.median(r), 1) for p, r in rates.items()},
                      "max_relative_difference": diff}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
