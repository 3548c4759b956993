"""Checks the 8-bit-activation products (`--activations q8`) against ggml's own CPU kernels.

Needs llama-cpp-python (its bundled libggml-cpu); never run in CI. For each quantized type it
takes random valid rows, rounds a random activation row with ggml's `from_float` for the type's
partner format and multiplies with ggml's `vec_dot`, then compares with expertcache's
`gemv(..., act8=True)`. Prints a table and one JSON line. `--record FILE` writes ggml's products
with the seeds that remake the inputs (tests/fixtures/ggml_dot.json is such a recording; the tests
compare against it without llama.cpp).

    python tools/ggml_dot_check.py [--rows 256] [--cols 2048] [--record FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gguf_blocks import random_rows  # noqa: E402

from expertcache.kernels.quant_native import load_quant_native  # noqa: E402

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]


class Traits(ctypes.Structure):
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


def ggml_cpu():
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-cpu.so"))
    lib.ggml_cpu_init()
    lib.ggml_get_type_traits_cpu.restype = ctypes.POINTER(Traits)
    return lib


FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                           ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def ggml_products(lib, qtype: Q, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    t = lib.ggml_get_type_traits_cpu(int(qtype)).contents
    partner = Q(t.vec_dot_type)
    size, nbytes = GGML_QUANT_SIZES[partner]
    xq = np.zeros(x.size // size * nbytes, dtype=np.uint8)
    xf = np.ascontiguousarray(x, dtype=np.float32)
    FROM_FLOAT(lib.ggml_get_type_traits_cpu(int(partner)).contents.from_float)(xf.ctypes.data, xq.ctypes.data, x.size)
    dot = VEC_DOT(t.vec_dot)
    out = np.zeros(raw.shape[0], dtype=np.float32)
    s = ctypes.c_float()
    for r in range(raw.shape[0]):
        row = np.ascontiguousarray(raw[r])
        dot(x.size, ctypes.addressof(s), 0, row.ctypes.data, 0, xq.ctypes.data, 0, 1)
        out[r] = s.value
    return out


def inputs(qtype: Q, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """The weights (random valid blocks) and the activation row (outliers included) of a check."""
    rng = np.random.default_rng(0)
    raw = random_rows(qtype, rows, cols, seed=1, lo=-14, hi=-4)
    x = (rng.standard_normal(cols) * np.where(rng.random(cols) < 0.1, 30, 1)).astype(np.float32)
    return raw, x


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--cols", type=int, default=2048)
    p.add_argument("--record", help="write ggml's products and the inputs' seeds to this JSON file")
    args = p.parse_args(argv)
    lib, ours = ggml_cpu(), load_quant_native()
    results, record = {}, {}
    print(f"{'type':<8} {'max |diff| / max |y|':>22} {'bitwise equal rows':>20}")
    for name in TYPES:
        qtype = Q[name]
        raw, x = inputs(qtype, args.rows, args.cols)
        want = ggml_products(lib, qtype, raw, x)
        record[name] = [float(v) for v in want]
        got = ours.gemv(torch.from_numpy(raw), qtype, torch.from_numpy(x), act8=True).numpy()
        rel = float(np.abs(got - want).max() / np.abs(want).max())
        equal = int((got.view(np.int32) == want.view(np.int32)).sum())
        results[name] = {"rel": rel, "equal_rows": equal, "rows": args.rows}
        print(f"{name:<8} {rel:>22.2e} {equal:>14} / {args.rows}")
    if args.record:
        import llama_cpp

        data = {"llama_cpp_python": llama_cpp.__version__, "rows": args.rows, "cols": args.cols,
                "inputs": "tools/ggml_dot_check.py inputs(): random_rows(seed 1, lo -14, hi -4), x from seed 0",
                "products": record}
        tmp = Path(args.record).with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(args.record)
    print(json.dumps({"tool": "ggml_dot_check", "cols": args.cols, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
