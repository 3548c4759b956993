"""Command-line flags shared by the `expertcache` commands and the benchmarks: argument types,
the model, kernel and cache flags, and turning them into a `CacheConfig` and a loaded model.

Both `commands/` and `bench/` import this; it imports only the library below them.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from .config import CACHE_MODES, DEFAULT_POLICY, POLICY_NAMES, PREFETCH_MODES, STORES, CacheConfig, check_min_prob
from .errors import ExpertCacheError
from .kernels import ACTIVATIONS_CHOICES, KERNELS


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int_at_least(minimum: int, text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if v < minimum:
        raise argparse.ArgumentTypeError(f"{v} must be at least {minimum}" if minimum else f"{v} must be >= 0")
    return v


def positive_int(text: str) -> int:
    return _int_at_least(1, text)


def nonneg_int(text: str) -> int:
    return _int_at_least(0, text)


def finite_float(text: str) -> float:
    """An argparse type: a float that is neither NaN nor infinite."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return v


# The most CPU threads -t takes. Beyond what the OS lets a process create, libgomp aborts or the
# process dies of SIGSEGV while torch starts them (-t 20000 and -t 100000 on a 2-core machine), long
# after the flags were read; llama.cpp caps its -t at 512.
THREADS_MAX = 1024


def threads(text: str) -> int:
    """An argparse type: a number of CPU threads, 1..THREADS_MAX."""
    v = positive_int(text)
    if v > THREADS_MAX:
        raise argparse.ArgumentTypeError(f"{v} threads: expected 1..{THREADS_MAX} "
                                         f"(this machine has {os.cpu_count()} CPUs)")
    return v


def size_bytes(text: str) -> int:
    """A positive size: '2GiB', '300MB' or a number of bytes."""
    from .config import parse_size

    try:
        v = parse_size(text)
    except ExpertCacheError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1 byte")
    return v


def dtype_name(text: str) -> str:
    """An argparse type: a compute dtype's name (float32, bfloat16, float16, ...), checked now and
    kept as text, for the benchmarks that pass it on to another process."""
    from .config import parse_dtype

    try:
        parse_dtype(text)
    except ExpertCacheError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_prefill_flags(p) -> None:
    """How a long prompt is scheduled (`Model.prefill`), for every command that loads a model."""
    p.add_argument("--prefill-stretch", type=positive_int, default=4096, metavar="N",
                   help="tokens the MoE ops of a long prompt run over per load of each expert (default: 4096)")
    p.add_argument("--prefill-mem", type=size_bytes, default=None, metavar="SIZE",
                   help="memory a stretch's activations may take; a longer stretch is cut (default: 2GiB)")


def prefill_options(args) -> dict:
    """The `load` arguments of `add_prefill_flags`."""
    return {"prefill_stretch": args.prefill_stretch, "prefill_mem": args.prefill_mem}


def add_kernels_flag(p) -> None:
    """`--kernels`, for every command that loads a model (`p` a parser or an argument group)."""
    p.add_argument("--kernels", choices=KERNELS, default="auto",
                   help="auto (default): the native decode kernels for a bf16 or quantized model on the CPU where "
                        "they build (compiled on first use; g++ and ninja), torch's otherwise; torch; native")
    p.add_argument("--activations", choices=ACTIVATIONS_CHOICES, default="auto",
                   help="products with quantized weights: q8 rounds their input to 8 bits per block first, as "
                        "llama.cpp's CPU products do (results move by ~1e-3; with --dtype float32, llama.cpp's "
                        "numerics, its norms and GELU included); exact multiplies it as it is; auto (default): q8 where the native kernels run a "
                        "quantized model, for products of up to 8 rows (decode; integer kernels, 2-4x faster) on a "
                        "CPU with bf16 matrix instructions (AVX512-BF16, AMX), every product on one without, where "
                        "a bf16 GEMM is widened to fp32; exact elsewhere")


def add_cache_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("expert cache")
    g.add_argument("--cache-mode", choices=CACHE_MODES, default=None,
                   help="cache (the default when a size, a --store other than ram or --cache-verify is given), "
                        "resident (every expert in fast memory; the default otherwise) or staging")
    size = g.add_mutually_exclusive_group()
    size.add_argument("--cache-experts", type=positive_int, help="slots in the cache, in experts")
    size.add_argument("--cache-mem", type=size_bytes, metavar="SIZE", help="cache size in bytes: 300MB, 2GiB, ...")
    size.add_argument("--cache-fraction", type=float, help="cache size as a fraction of all experts")
    g.add_argument("--cache-policy", choices=POLICY_NAMES, default=DEFAULT_POLICY, metavar="POLICY",
                   help=f"eviction policy: {', '.join(POLICY_NAMES)} (default: {DEFAULT_POLICY})")
    g.add_argument("--store", choices=STORES, default="ram", help="slow tier for experts (default: ram; resident mode, which copies every expert once, reads them through mmap instead of keeping a second copy in RAM, and reports mmap)")
    g.add_argument("--cache-verify", action="store_true", help="checksum every slot on fill and read")
    g.add_argument("--prefetch", choices=PREFETCH_MODES, default="auto",
                   help="load the experts predicted for the next MoE op while this one computes (cache mode): "
                        "auto (default: on with a GPU, and on a CPU for direct disk reads with a fitted --predictor), on, off")
    add_prefetch_width_flag(g)
    g.add_argument("--predictor", metavar="FILE",
                   help="predict the next layer's experts with maps fitted for this model "
                        "(`expertcache trace fit-predictor`) instead of its router")


def cache_config(args) -> CacheConfig:
    """The cache flags as one checked config. EXPERTCACHE_CACHE_TRACE=1 prints a counter line
    every EXPERTCACHE_CACHE_TRACE_EVERY (default 100) MoE ops: read here, at the command line,
    and passed down, so the library itself reads no environment."""
    if args.cache_mode == "resident":  # it holds every expert: a size would be ignored without a word
        for flag, value in (("--cache-experts", args.cache_experts), ("--cache-mem", args.cache_mem),
                            ("--cache-fraction", args.cache_fraction)):
            if value is not None:
                raise ExpertCacheError(f"--cache-mode resident holds every expert and takes no {flag}: "
                                       "give a size with --cache-mode cache or staging, or none")
    trace = 0
    if os.environ.get("EXPERTCACHE_CACHE_TRACE") == "1":
        every = os.environ.get("EXPERTCACHE_CACHE_TRACE_EVERY", "100")
        trace = int(every) if every.isdigit() and int(every) > 0 else 100
    cfg = CacheConfig(mode=args.cache_mode, experts=args.cache_experts, mem=args.cache_mem,
                      fraction=args.cache_fraction, policy=args.cache_policy, store=args.store,
                      verify=args.cache_verify, trace_every=trace, prefetch=getattr(args, "prefetch", "auto"),
                      prefetch_width=getattr(args, "prefetch_width", 1.0),
                      prefetch_min_prob=getattr(args, "prefetch_min_prob", 0.0),
                      predictor=getattr(args, "predictor", None))
    # --prefetch on outside the slot cache would be ignored without a word, as a size would be in
    # resident mode (`perplexity --compare` gives each mode its own config: its cache run prefetches).
    if cfg.prefetch == "on" and cfg.mode != "cache" and not getattr(args, "compare", None):
        raise ExpertCacheError(f"--prefetch on applies only to the slot cache (--cache-mode cache, the default with "
                               f"a cache size), and this run is in {cfg.mode} mode: run in cache mode, or drop "
                               "--prefetch on")
    return cfg


def prefetch_width(text: str) -> float:
    """`--prefetch-width W`: how many experts a prediction names per token, as a multiple of top-k
    (1.0 = k, 1.5 = ceil(1.5 k)); 0 predicts nothing."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}: expected a multiple of top-k such as 1.5") from None
    if not 0 <= v <= 64:
        raise argparse.ArgumentTypeError(f"{text} must be in [0, 64] (a multiple of top-k)")
    return v


def prefetch_min_prob(text: str) -> float:
    """`--prefetch-min-prob P`: a predicted expert counts only if the predictor gives it at least P."""
    try:
        return check_min_prob(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}: expected a probability such as 0.5") from None
    except ExpertCacheError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_prefetch_width_flag(p) -> None:
    p.add_argument("--prefetch-width", type=prefetch_width, default=1.0, metavar="W",
                   help="experts predicted per token as a multiple of top-k: 1.0 (default) = k, 1.5 = ceil(1.5 k)")
    p.add_argument("--prefetch-min-prob", type=prefetch_min_prob, default=0.0, metavar="P",
                   help="of those, predict only the experts the predictor gives a probability of at least P "
                        "(default: 0, all; meant for a predictor fitted with --objective used, whose "
                        "probabilities are calibrated)")


def json_line(obj) -> str:
    """`obj` as one line of JSON. A float that is not finite (a perplexity past a double, a NaN
    from a broken checkpoint) is null: Python's json writes Infinity and NaN, which are not JSON
    (RFC 8259) and which jq and JavaScript's JSON.parse refuse, the whole line with them."""
    return json.dumps(_finite(obj), allow_nan=False)


def _finite(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
