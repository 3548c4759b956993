"""Which kernels run the decode step: torch's own (the default) or the small native ones in
`native/decode.cpp` (`--kernels native`).

A decode step streams every active weight once through one-row products, and between them runs
a few hundred small torch ops that each cost a dispatch. torch's one-row bf16 product widens
every weight to fp32 before its multiply-add and streams the weights well below the rate this
kind of CPU can read them (`tools/gemv_probe.py`). The native kernels multiply bf16 pairs
directly where the CPU has AVX512-BF16, run a whole wave of a decode step's experts in one call
instead of five torch ops per expert, and do an RMSNorm, and all of attention between the two
projections (q/k norm, rotary, the cache append, softmax over the cache), in one call each.
They are opt-in because:

- they are compiled on first use (about a minute; then cached by torch under
  ~/.cache/torch_extensions), which needs a C++ compiler, the Python headers and ninja;
- their sums are taken in a different order than torch's (and rotary and attention are
  rounded once, in fp32, where torch rounds each op in bf16), so bf16 results differ from the
  default kernels in the last bits. Within one kernel choice results are still identical
  across cache modes, sizes, policies and thread counts: each output element is one row's dot
  product, summed by one thread in a fixed order.

Only one-row bf16 work on the CPU takes the native path (a decode step, the last row of a
prompt); prefill's many-row products and other dtypes use torch. Attention stays on torch for
sliding windows, clipped q/k/v and whole-projection q/k norms (OLMoE).
The choice belongs to a model: `MoEModel.forward` makes its kernels the active ones for the
duration of a call (`active`), which is what `layers` and the MoE block consult. That is one
process-wide setting, so forwards of models with different choices must not run at the same
time in two threads (the server runs all of its forwards on one worker thread).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from types import ModuleType

import torch

from .errors import ExpertCacheError

KERNELS = ("torch", "native")
SOURCE = Path(__file__).parent.parent / "native" / "decode.cpp"

# The native module while a forward that uses it runs; None means torch's kernels.
active: ModuleType | None = None

_loaded: dict[bool, ModuleType] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def load_native(portable: bool = False) -> ModuleType:
    """Build (first use) or load the native kernels; one line of error if that cannot be done.

    `portable=True` builds the loop that CPUs without AVX512-BF16 get, on any CPU (for the tests)."""
    if portable in _loaded:
        return _loaded[portable]
    from torch.utils import cpp_extension

    # -fopenmp: at::parallel_for is inline and splits work across threads only when compiled
    # with OpenMP. -march=native compiles for this CPU, so the build is named after the CPU's
    # features: a cache directory shared with another machine never hands it a build for a
    # different CPU.
    tag = hashlib.sha1(_cpu_flags().encode()).hexdigest()[:10]
    name = f"expertcache_decode_{tag}" + ("_portable" if portable else "")
    flags = ["-O3", "-march=native", "-fopenmp"] + (["-DEXPERTCACHE_PORTABLE"] if portable else [])
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        raise ExpertCacheError("--kernels native: ninja was not found; expected it on PATH "
                               "(pip install ninja, or pip install 'expertcache[native]')") from None
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    if not any(build_dir.glob("*.so")):
        print("expertcache: building the native decode kernels (first use only, about a minute)",
              file=sys.stderr, flush=True)
    try:
        _loaded[portable] = cpp_extension.load(name, sources=[str(SOURCE)], extra_cflags=flags, verbose=False)
    except (RuntimeError, OSError, ImportError) as e:
        text = str(e).strip()
        first = text.splitlines()[0] if text else type(e).__name__
        raise ExpertCacheError(f"--kernels native: the kernels could not be built ({first}); expected "
                               "a C++ compiler (g++) and the Python headers") from None
    return _loaded[portable]


def select(kernels: str, device: torch.device, dtype: torch.dtype) -> ModuleType | None:
    """The native module for `kernels="native"`, None for torch's; checks that the choice applies."""
    if kernels not in KERNELS:
        raise ExpertCacheError(f"kernels {kernels!r} is not one of {', '.join(KERNELS)}")
    if kernels == "torch":
        return None
    if device.type != "cpu":
        raise ExpertCacheError(f"--kernels native runs on the CPU; got device {device}, expected cpu")
    if dtype != torch.bfloat16:
        raise ExpertCacheError(f"--kernels native computes in bfloat16; got dtype {str(dtype).removeprefix('torch.')}, "
                               "expected bfloat16 (--dtype bfloat16)")
    return load_native()

