"""Checks of command-line values that argparse's own types let through: floats that are NaN or
infinite, seeds beyond 64 bits, and devices that do not exist or are not available here. Each
failure is one line naming the flag, the value and what was expected."""

from __future__ import annotations

import argparse
import ipaddress

from ..config import ROPE_SCALING_TYPES, RopeOverride
from ..errors import ExpertCacheError
# Kept in `flags`, where the benchmarks (which may not import `commands`) find them too.
from ..flags import finite_float, threads  # noqa: F401
from ..sampling import SEED_MAX, SEED_MIN


def seed(text: str) -> int:
    """An argparse type: an integer the sampler's generator takes (64 bits, signed or unsigned)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if not SEED_MIN <= v <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"{text} is beyond 64 bits: a seed is in [{SEED_MIN}, {SEED_MAX}]")
    return v


def byte_count(text: str) -> int:
    """An argparse type: a positive number of bytes, plain or with a unit (512KiB, 8MiB, 1MB)."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    scale = 1
    for unit, n in units.items():
        if t.endswith(unit):
            t, scale = t[: -len(unit)].strip(), n
            break
    if not t.isdigit() or int(t) * scale < 1:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected a positive number of bytes "
                                         "(e.g. 8388608, 512KiB, 8MiB)")
    return int(t) * scale


def rope_scale(text: str) -> float:
    """An argparse type: a RoPE scaling factor, a finite number > 0."""
    v = finite_float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a positive number (the context is extended by this "
                                         "factor, e.g. 4)")
    return v


def yarn_orig_ctx(text: str) -> int:
    """An argparse type: YaRN's original context, an integer >= 0 (0: the model's own)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} must be >= 0 (the context the model was trained on before YaRN; "
                                         "0: the model's own)")
    return v


ROPE_FLAGS = ("--rope-scaling", "--rope-scale", "--yarn-orig-ctx")


def add_rope_flags(p: argparse.ArgumentParser) -> None:
    """llama.cpp's RoPE scaling flags, with its meaning: each left out is the model's own."""
    p.add_argument("--rope-scaling", choices=ROPE_SCALING_TYPES,
                   help="RoPE frequency scaling: none, linear or yarn (default: the model's; linear where it has "
                        "none and --rope-scale is given)")
    p.add_argument("--rope-scale", type=rope_scale, metavar="F",
                   help="RoPE scaling factor: the context is extended F times (default: the model's)")
    p.add_argument("--yarn-orig-ctx", type=yarn_orig_ctx, default=0, metavar="N",
                   help="YaRN: the context the model was trained on before scaling (default: 0, the model's own)")


def rope_options(args) -> dict:
    """`load`'s rope_scaling from `add_rope_flags`' flags, checked here, before a model loads."""
    if args.rope_scaling is None and args.rope_scale is None and not args.yarn_orig_ctx:
        return {}
    return {"rope_scaling": RopeOverride(args.rope_scaling, args.rope_scale, args.yarn_orig_ctx, ROPE_FLAGS)}


def check_device(name: str) -> None:
    """Raise an ExpertCacheError unless `name` is a torch device that exists and can be used here."""
    import torch

    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ExpertCacheError(f"--device {name!r} is not a device: expected cpu, cuda, cuda:N, mps, xpu") from None
    if dev.type == "cpu":
        return
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ExpertCacheError(f"--device {name!r} is not available: {why}")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise ExpertCacheError(f"--device {name!r} does not exist: there are {n} CUDA device(s), 0..{n - 1}")
        return
    backend = {"mps": getattr(torch.backends, "mps", None), "xpu": getattr(torch, "xpu", None)}.get(dev.type)
    if backend is None:
        raise ExpertCacheError(f"--device {name!r}: the {dev.type} device type is not supported "
                               "(expected cpu, cuda, mps or xpu)")
    if not backend.is_available():
        raise ExpertCacheError(f"--device {name!r} is not available on this machine")


def open_listener_warning(host: str, has_key: bool) -> str | None:
    """The warning to print when a server listens on `host` (an address) beyond this machine
    without an API key; None when it listens on loopback only or wants a key."""
    if has_key:
        return None
    try:
        loopback = ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:  # not an address: be safe and warn
        loopback = False
    if loopback:
        return None
    return (f"listening on {host}, beyond this machine, without an API key: anyone who can reach the port "
            "can use the model (give --api-key or --api-key-file)")
