"""Random valid ggml blocks for the quantized-kernel tests: random bytes everywhere, except the
fp16 scale fields, which hold finite fp16 values over a wide range (subnormals included). Float
storage types hold such values as their weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

# Byte offsets of each block's fp16 fields (ggml's block structs).
FP16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
               Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
               Q.IQ4_NL: (0,), Q.IQ4_XS: (0,)}


def fp16_values(rng: np.random.Generator, n: int, lo: int = -24, hi: int = 4) -> np.ndarray:
    """n finite fp16 values of either sign with magnitudes 2^lo .. 2^hi, and a few zeros."""
    v = rng.standard_normal(n) * 2.0 ** rng.integers(lo, hi, n)
    v[rng.random(n) < 0.02] = 0.0
    return v.astype(np.float16)


def random_rows(qtype: Q, rows: int, cols: int, seed: int, lo: int = -24, hi: int = 4) -> np.ndarray:
    """`rows` rows of `cols` weights of type `qtype` as raw bytes: uint8 [rows, row_bytes]."""
    rng = np.random.default_rng(seed)
    size, nbytes = GGML_QUANT_SIZES[qtype]
    assert cols % size == 0
    blocks = rows * cols // size
    if qtype in (Q.F32, Q.F16, Q.BF16):
        v = fp16_values(rng, blocks, lo, hi).astype(np.float32)
        raw = {Q.F32: v, Q.F16: v.astype(np.float16), Q.BF16: (v.view(np.uint32) >> 16).astype(np.uint16)}[qtype]
        raw = raw.view(np.uint8)
    else:
        raw = rng.integers(0, 256, (blocks, nbytes), dtype=np.uint8)
        for at in FP16_FIELDS.get(qtype, ()):
            raw[:, at:at + 2] = fp16_values(rng, blocks, lo, hi).view(np.uint8).reshape(blocks, 2)
    return raw.reshape(rows, -1)


FIXTURES = Path(__file__).parent / "fixtures" / "gguf"


def llama_cpp_tensors() -> list[tuple[str, Q, tuple[int, ...], np.ndarray]]:
    """Every tensor of the GGUF fixtures quantized by llama.cpp's own tools (tests/fixtures/gguf):
    (file:name, type, torch shape, raw bytes uint8 [rows, row_bytes])."""
    from gguf import GGUFReader

    files = sorted(FIXTURES.glob("*.gguf"))
    assert files, f"no GGUF fixtures in {FIXTURES}"
    out = []
    for path in files:
        for t in GGUFReader(path).tensors:
            shape = tuple(int(n) for n in reversed(t.shape))  # ggml's ne[0] last
            raw = np.array(t.data, copy=True).view(np.uint8).reshape(-1)  # writable, off the mmap
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            out.append((f"{path.stem}:{t.name}", Q(t.tensor_type), shape, raw.reshape(rows, -1)))
    return out


def rewrite_gguf(src: Path, dst: Path, kv: dict | None = None, tensors: dict | None = None) -> Path:
    """GGUF file `src` written again as `dst` with metadata `kv` (key -> (value, type, item type),
    or None to drop the key) and `tensors` (name -> (bytes or floats, type), or None to drop it)
    changed or added."""
    reader = GGUFReader(src)
    w = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    fields = {k: (f.contents(), f.types[0], f.types[1] if len(f.types) > 1 else None)
              for k, f in reader.fields.items() if not k.startswith("GGUF.") and k != "general.architecture"}
    for key, value in {**fields, **(kv or {})}.items():
        if value is not None:
            w.add_key_value(key, *value)
    table = {t.name: (np.array(t.data), t.tensor_type) for t in reader.tensors}
    for name, value in {**table, **(tensors or {})}.items():
        if value is None:
            continue
        data, qtype = value
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data.view(np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
