"""Native one-row products straight from ggml quantized blocks (`native/quant.cpp`), for decode.

`load_quant_native()` builds the module on first use (then torch caches it under
~/.cache/torch_extensions) and returns it; it offers, for W given as raw ggml rows
`uint8 [N, row_bytes]` of one of `NATIVE_TYPES` (ggml type ids; GGMLQuantizationType members work):

- `gemv(w, qtype, x) -> float32 [N]`: y = W x, x float32 or bfloat16 [K];
- `experts(x, gates, ups, downs, gate_type, up_type, down_type) -> float32 [n, D]`: a wave of n
  SwiGLU experts on one token, y[e] = down[e] (silu(gate[e] x) * (up[e] x)), with gate[e] and
  up[e] raw rows [I, row_bytes(type, D)] and down[e] raw rows [D, row_bytes(type, I)], each matrix
  kind of one type for the whole wave, the intermediate in float32;
- `dequantize(w, qtype, K) -> float32 [N, K]`: the weights as the products see them, and
  `dequantize_into(w, qtype, out)` into out [N, K] float32 or bfloat16 (rounded once), rows split
  across threads: the CPU path for prefill (decode a wave into one reused buffer, then a GEMM);
- `isa`: "avx2" or "portable".

Weights are decoded exactly as gguf-py decodes them (`dequantize` is bit-identical to
`gguf.quants.dequantize`), products accumulate in float32, and each output element is one row
summed by one thread in a fixed order: results do not depend on the thread count or on which other
experts share a wave. They differ from dequantize-then-`torch.mv` in the last bits (another
summation order). Bad arguments raise RuntimeError naming the argument and what was expected.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from types import ModuleType

from gguf.constants import GGMLQuantizationType as Q

from ..errors import ExpertCacheError
from . import _cpu_flags

SOURCE = Path(__file__).parent.parent / "native" / "quant.cpp"
NATIVE_TYPES: tuple[Q, ...] = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K,
                               Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS)

_loaded: dict[bool, ModuleType] = {}


def load_quant_native(portable: bool = False) -> ModuleType:
    """Build (first use) or load the quantized-block kernels; one line of error if that cannot
    be done. `portable=True` builds the loop that CPUs without AVX2/FMA get, on any CPU."""
    if portable in _loaded:
        return _loaded[portable]
    from torch.utils import cpp_extension

    # -march=native: the build is named after this CPU's features, so a shared cache directory
    # never hands it a build for another CPU. -ffp-contract=off: each weight is decoded with the
    # separate roundings gguf-py uses (a fused multiply-add would change its last bit).
    tag = hashlib.sha1(_cpu_flags().encode()).hexdigest()[:10]
    name = f"expertcache_quant_{tag}" + ("_portable" if portable else "")
    flags = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"] + (["-DEXPERTCACHE_PORTABLE"] if portable else [])
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        raise ExpertCacheError("native quantized kernels: ninja was not found; expected it on PATH "
                               "(pip install ninja, or pip install 'expertcache[native]')") from None
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    if not any(build_dir.glob("*.so")):
        print("expertcache: building the native quantized kernels (first use only, about a minute)",
              file=sys.stderr, flush=True)
    try:
        _loaded[portable] = cpp_extension.load(name, sources=[str(SOURCE)], extra_cflags=flags,
                                               extra_ldflags=["-fopenmp"], verbose=False)
    except (RuntimeError, OSError, ImportError) as e:
        text = str(e).strip()
        first = text.splitlines()[0] if text else type(e).__name__
        raise ExpertCacheError(f"native quantized kernels could not be built ({first}); expected "
                               "a C++ compiler (g++) and the Python headers") from None
    return _loaded[portable]
