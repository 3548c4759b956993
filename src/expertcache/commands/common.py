"""Flags and helpers every subcommand shares: model and cache flags, loading, reading files."""

from __future__ import annotations

import argparse
import resource
from pathlib import Path

from ..config import CACHE_MODES, STORES, CacheConfig
from ..errors import ExpertCacheError
from ..kernels import KERNELS
from ..tiers.policy import DEFAULT_POLICY, POLICIES


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


def add_model_flags(p: argparse.ArgumentParser, ctx: bool = True) -> None:
    p.add_argument("-m", "--model", help="model directory (default: the bundled tiny Qwen3-MoE)")
    p.add_argument("--dtype", help="compute dtype: float32, bfloat16 or float16 (default: the checkpoint's)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("-t", "--threads", type=positive_int, help="CPU threads for torch")
    if ctx:
        p.add_argument("-c", "--ctx-size", type=positive_int, help="context size (default: the model's)")
    p.add_argument("--ubatch", type=positive_int, default=512, help="prefill micro-batch size (default: 512)")
    add_kernels_flag(p)


def add_kernels_flag(p) -> None:
    """`--kernels`, for every command that loads a model (`p` a parser or an argument group)."""
    p.add_argument("--kernels", choices=KERNELS, default="torch",
                   help="decode step on the CPU in bf16: torch's kernels, or native ones compiled on first use "
                        "(faster decode; needs g++ and ninja; results differ from torch's in the last bits)")


def add_cache_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("expert cache")
    g.add_argument("--cache-mode", choices=CACHE_MODES, default=None,
                   help="cache (default when a size is given), resident (every expert in fast memory) or staging")
    size = g.add_mutually_exclusive_group()
    size.add_argument("--cache-experts", type=positive_int, help="slots in the cache, in experts")
    size.add_argument("--cache-mem", help="cache size in bytes: 300MB, 2GiB, ...")
    size.add_argument("--cache-fraction", type=float, help="cache size as a fraction of all experts")
    g.add_argument("--cache-policy", default=DEFAULT_POLICY,
                   help=f"eviction policy: {', '.join(POLICIES)} (default: {DEFAULT_POLICY})")
    g.add_argument("--store", choices=STORES, default="ram", help="slow tier for experts (default: ram)")
    g.add_argument("--cache-verify", action="store_true", help="checksum every slot on fill and read")


def cache_config(args) -> CacheConfig:
    mode = args.cache_mode
    if mode is None:
        sized = any(getattr(args, n, None) is not None for n in ("cache_experts", "cache_mem", "cache_fraction"))
        mode = "cache" if sized or args.store != "ram" or args.cache_verify else "resident"
    return CacheConfig(mode=mode, experts=args.cache_experts, mem=args.cache_mem, fraction=args.cache_fraction,
                       policy=args.cache_policy, store=args.store, verify=args.cache_verify)


def load_model(args):
    from ..engine import load

    return load(args.model, device=args.device, dtype=args.dtype, cache=cache_config(args),
                ctx_size=getattr(args, "ctx_size", None), threads=args.threads,
                kernels=args.kernels)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def read_text_file(path: str) -> str:
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ExpertCacheError(f"cannot read {path!r}: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ExpertCacheError(f"{path}: not valid UTF-8 (byte {e.start})") from None
