"""Native one-row products straight from ggml quantized blocks (`native/quant.cpp`), for decode.

`load_quant_native()` builds the module on first use (then torch caches it under
~/.cache/torch_extensions) and returns it; it offers, for W given as raw ggml rows
`uint8 [N, row_bytes]` of one of `NATIVE_TYPES` (ggml type ids; GGMLQuantizationType members work):

- `gemv(w, qtype, x) -> float32 [N]`: y = W x, x float32 or bfloat16 [K];
- `experts(x, gates, ups, downs, gate_type, up_type, down_type, act="silu") -> float32 [n, D]`: a
  wave of n gated experts on one token, y[e] = down[e] (act(gate[e] x) * (up[e] x)), act "silu"
  (SwiGLU) or "gelu_pytorch_tanh" (GeGLU: torch's tanh-approximated gelu, in fp32 with its
  formula), with gate[e] and up[e] raw rows [I, row_bytes(type, D)] and down[e] raw rows
  [D, row_bytes(type, I)], each matrix kind of one type for the whole wave, the intermediate in
  float32;
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

from pathlib import Path
from types import ModuleType

from gguf.constants import GGMLQuantizationType as Q

from . import build_native

SOURCE = Path(__file__).parent.parent / "native" / "quant.cpp"
NATIVE_TYPES: tuple[Q, ...] = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K,
                               Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS)

_loaded: dict[bool, ModuleType] = {}


def load_quant_native(portable: bool = False) -> ModuleType:
    """Build (first use) or load the quantized-block kernels; one line of error if that cannot
    be done. `portable=True` builds the loop that CPUs without AVX2/FMA get, on any CPU."""
    if portable not in _loaded:
        # -ffp-contract=off: each weight is decoded with the separate roundings gguf-py uses (a
        # fused multiply-add would change its last bit).
        _loaded[portable] = build_native("quant", SOURCE, "native quantized kernels", ("-ffp-contract=off",),
                                         portable)
    return _loaded[portable]
