"""Edges of the kernels over quantized and float blocks: non-finite scales and activations, float
storage at an odd offset, and thread counts beyond two, against gguf-py's decoding and float64
products of the decoded weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from expertcache.checkpoint.storage import QuantTensor
from expertcache.kernels import ALL_ROWS, NativeKernels, dequant, load_native
from expertcache.kernels.quant_native import NATIVE_TYPES, load_quant_native
from gguf_blocks import FP16_FIELDS, random_rows
from conftest import with_threads

TYPES = [t.name for t in NATIVE_TYPES]
FLOATS = (Q.F32, Q.F16, Q.BF16)


@pytest.fixture(scope="module", params=["isa", "portable"])
def native(request):
    return load_quant_native(portable=request.param == "portable")


def cols_for(qtype: Q, blocks: int) -> int:
    size = GGML_QUANT_SIZES[qtype][0]
    return size * blocks if size > 1 else 32 * blocks


def decoded(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    with np.errstate(all="ignore"):  # inf * 0 in a block with an infinite scale
        return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype)))


def assert_same_or_both_nan(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit for bit where want is a number, NaN wherever want is NaN (a NaN's payload is
    not a value: torch's own casts do not agree on it)."""
    bits = {4: torch.int32, 2: torch.int16}[got.element_size()]
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"{int((got.isnan() != nan).sum())} elements differ in being NaN"
    assert torch.equal(got[~nan].view(bits), want[~nan].view(bits))


# ---- a NaN weight decoded to bf16 ----------------------------------------------------------------

NAN_FULL_PAYLOAD = 0x7FFF  # an fp16 NaN whose widened bits are 0x7fffe000: rounding them as a number carries


@pytest.mark.parametrize("name", [t for t in TYPES if Q[t] not in FLOATS])
def test_a_block_with_a_nan_scale_decodes_to_nan_in_bf16(native, name):
    """A NaN fp16 scale makes the block's weights NaN in gguf-py; decoded to bf16 for prefill's
    GEMM they stayed NaN in the portable build but became -0.0 in the AVX2 one, so a corrupt
    block multiplied as zeros."""
    qtype = Q[name]
    size, nbytes = GGML_QUANT_SIZES[qtype]
    cols = cols_for(qtype, 2)
    raw = random_rows(qtype, 3, cols, seed=5, lo=-12, hi=0).reshape(-1, nbytes)
    for j, at in enumerate(FP16_FIELDS[qtype]):  # one block per scale field, each with a NaN there
        raw[j + 1, at:at + 2] = np.array([NAN_FULL_PAYLOAD], dtype=np.uint16).view(np.uint8)
    raw = raw.reshape(3, -1)
    want = decoded(raw, qtype)
    assert want.isnan().any()
    out = torch.empty(3, cols, dtype=torch.bfloat16)
    native.dequantize_into(torch.from_numpy(raw), qtype, out)
    assert_same_or_both_nan(out, want.to(torch.bfloat16))
    out32 = torch.empty(3, cols)
    native.dequantize_into(torch.from_numpy(raw), qtype, out32)
    assert_same_or_both_nan(out32, want)


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_float_storage_keeps_its_nans_in_bf16(native, name):
    qtype = Q[name]
    rng = np.random.default_rng(1)
    cols = 48  # a whole run of 16 for the vector stores and a tail
    if qtype == Q.F32:
        v = rng.standard_normal((4, cols)).astype(np.float32)
        v.view(np.uint32)[:, ::5] = 0x7FFFFFFF
        v.view(np.uint32)[:, 1::7] = 0xFFFFFFFF
    else:
        v = rng.standard_normal((4, cols)).astype(np.float16 if qtype == Q.F16 else np.float32)
        if qtype == Q.BF16:
            v = (v.view(np.uint32) >> 16).astype(np.uint16)
        v.view(np.uint16)[:, ::5] = 0x7FFF
    raw = np.ascontiguousarray(v).view(np.uint8).reshape(4, -1)
    want = decoded(raw, qtype).reshape(4, cols)
    out = torch.empty(4, cols, dtype=torch.bfloat16)
    native.dequantize_into(torch.from_numpy(raw), qtype, out)
    assert_same_or_both_nan(out, want.to(torch.bfloat16))


def test_the_native_kernels_dense_weights_keep_a_nan_block():
    """What prefill multiplies (`NativeKernels.dense`): the torch kernels' decoding, NaN for NaN."""
    raw = random_rows(Q.Q4_K, 8, 512, seed=2, lo=-12, hi=0)
    raw[3, 0:2] = np.array([NAN_FULL_PAYLOAD], dtype=np.uint16).view(np.uint8)
    w = QuantTensor(torch.from_numpy(raw), Q.Q4_K, (8, 512))
    got = NativeKernels(load_native()).dense(w, torch.bfloat16)
    assert got[3, :256].isnan().all()
    assert_same_or_both_nan(got, dequant.dequantize(w.raw, w.qtype, w.shape).to(torch.bfloat16))


# ---- non-finite activations rounded to 8 bits ----------------------------------------------------

def bad_rows(cols: int) -> torch.Tensor:
    """Rows of activations: finite, one NaN, one +inf, one -inf, all NaN (a norm of a row that
    overflowed), all zero."""
    x = torch.randn(6, cols, generator=torch.Generator().manual_seed(cols))
    x[1, 5] = float("nan")
    x[2, cols - 1] = float("inf")
    x[3, cols // 2] = -float("inf")
    x[4] = float("nan")
    x[5] = 0.0
    return x


@pytest.mark.parametrize("name", TYPES)
def test_act8_products_of_a_row_with_a_nan_or_inf_are_not_finite(native, name):
    """With 8-bit activations a NaN in the row was skipped by the block's maximum and converted
    to an integer (undefined behaviour; 0 in practice): the products came out finite, an
    overflow upstream (all-NaN hidden states) became plausible logits, and the error that
    non-finite logits raise never came. The float64 product of the decoded weights is not
    finite there, and neither must ours be; other rows are untouched."""
    qtype = Q[name]
    cols = cols_for(qtype, 2)
    raw = random_rows(qtype, 24, cols, seed=3, lo=-12, hi=-4)
    w = decoded(raw, qtype).double()
    W = torch.from_numpy(raw)
    x = bad_rows(cols)
    with np.errstate(all="ignore"):
        exact = x.double() @ w.T                                     # [6, 24]
    assert (~exact[1:5].isfinite()).all() and exact[0].isfinite().all()
    rows = torch.stack([native.gemv(W, qtype, x[t], True) for t in range(6)])
    assert torch.equal(rows.isfinite(), exact.isfinite())
    assert torch.equal(rows[5], torch.zeros(24))                     # a zero row: zeros, no 0/0
    many = native.gemm_act8(W, qtype, x)
    assert torch.equal(many.isfinite(), exact.isfinite())
    assert torch.equal(many[[0, 5]].view(torch.int32), rows[[0, 5]].view(torch.int32))
    if native.isa == "avx2" and qtype in (Q.Q4_K, Q.Q8_0, Q.Q6_K, Q.Q4_0, Q.Q5_0, Q.IQ4_NL):
        tiled = native.gemm_tiles(native.tile_rows(W, qtype, cols), qtype, x)
        assert torch.equal(tiled.isfinite(), exact.isfinite())


@pytest.mark.parametrize("name", [t for t in TYPES if Q[t] not in FLOATS])
def test_a_non_finite_value_makes_its_block_nan_when_rounded(native, name):
    """The rounded row (what the integer products multiply): NaN over the block that holds a
    NaN or an infinity, as numpy's rounding by ggml's rules gives it; every other block as in a
    finite row. A block too small for a scale (amax < 127 / FLT_MAX) rounds to zeros."""
    qtype = Q[name]
    cols = cols_for(qtype, 3)
    x = bad_rows(cols)[:4]
    x[0, :] = x[0] * 1e-38                     # every value below 127 / FLT_MAX ...
    x[0, 7] = 0.0                              # ... and a zero among them (0 * inf was a NaN)
    block = 256 if cols % 256 == 0 and qtype not in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL) else 32
    got = native.round_activations(x, qtype)
    finite = torch.where(x.isfinite(), x, torch.zeros(()))
    ok = native.round_activations(finite, qtype)
    bad = (~x.isfinite()).reshape(4, -1, block).any(-1, keepdim=True).expand(-1, -1, block).reshape(4, -1)
    assert torch.equal(got.isnan(), bad)
    assert torch.equal(got[~bad].view(torch.int32), ok[~bad].view(torch.int32))
    assert torch.equal(got[0].abs(), torch.zeros(cols))
    D = cols
    I = cols_for(qtype, 1)
    g = torch.from_numpy(random_rows(qtype, I, D, seed=1, lo=-10, hi=-4))
    u = torch.from_numpy(random_rows(qtype, I, D, seed=2, lo=-10, hi=-4))
    d = torch.from_numpy(random_rows(qtype, D, I, seed=3, lo=-10, hi=-4))
    for t in (1, 2):
        y = native.experts(x[t], [g], [u], [d], qtype, qtype, qtype, "silu", True)
        assert y.isnan().all()


def test_the_native_kernels_carry_a_nan_row_through_quantized_products():
    """`Kernels.linear` on quantized weights with 8-bit activations (a decode step's products, the
    LM head): an all-NaN row gives NaN, as the exact products do, where it gave zeros."""
    k = NativeKernels(load_native())
    k.act8_rows = ALL_ROWS
    raw = random_rows(Q.Q6_K, 16, 512, seed=4, lo=-12, hi=-4)
    w = QuantTensor(torch.from_numpy(raw), Q.Q6_K, (16, 512))
    x = torch.full((1, 512), float("nan"), dtype=torch.bfloat16)
    assert k.linear(x, w).isnan().all()
    xs = torch.randn(3, 512).bfloat16()
    xs[1] = float("nan")
    y = k.linear(xs, w)
    assert y[1].isnan().all() and y[[0, 2]].isfinite().all()


# ---- float storage at an odd offset (torch's decoding) -------------------------------------------

@pytest.mark.parametrize("name,n", [("F32", 96), ("F16", 96), ("BF16", 96), ("Q8_0", 96), ("Q4_K", 256)])
def test_raw_bytes_at_an_odd_offset_decode_bit_for_bit(name, n):
    """dequantize takes raw bytes wherever they lie: the quantized types' fp16 fields were read
    through a copy where unaligned, but float storage was viewed in place and raised torch's
    'storage_offset() must be divisible by 4' instead."""
    qtype = Q[name]
    raw = random_rows(qtype, 2, n, seed=6).reshape(-1)
    buf = torch.zeros(raw.size + 1, dtype=torch.uint8)
    buf[1:] = torch.from_numpy(raw)
    got = dequant.dequantize(buf[1:], qtype, (2, n))
    want = decoded(raw.reshape(2, -1), qtype).reshape(2, n)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    out = torch.empty(2, n, dtype=torch.bfloat16)
    dequant.dequantize_into(buf[1:].view(2, -1), qtype, (2, n), out)
    assert torch.equal(out.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))


# ---- thread counts beyond two, shapes that do not split evenly ------------------------------------

@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q2_K", "IQ4_XS", "F16"])
def test_products_are_the_same_bits_at_one_to_four_threads(native, name):
    """Rows not a multiple of 8 or of the thread split, one and several activation rows, a wave
    of experts (widths not whole eights where the storage allows it): the same bits at 1, 2, 3
    and 4 threads."""
    qtype = Q[name]
    K = 99 if qtype in FLOATS else cols_for(qtype, 3)
    I = 13 if qtype in FLOATS else cols_for(qtype, 1)

    def rows(n: int, k: int, seed: int) -> torch.Tensor:
        return torch.from_numpy(random_rows(qtype, n, k, seed=seed, lo=-10, hi=-4))

    raw = rows(53, K, 8)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(8))
    G, U, Dn = [rows(I, K, 20 + e) for e in range(3)], [rows(I, K, 30 + e) for e in range(3)], \
        [rows(K, I, 40 + e) for e in range(3)]

    def run():
        return [native.gemv(raw, qtype, x[0]), native.gemv(raw, qtype, x[0], True), native.gemm_act8(raw, qtype, x),
                native.dequantize(raw, qtype, K)] + \
               [native.experts(x[1], G, U, Dn, qtype, qtype, qtype, "silu", act8) for act8 in (False, True)]

    first = with_threads(1, run)
    for threads in (2, 3, 4):
        for a, b in zip(first, with_threads(threads, run)):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), threads


def test_a_build_lock_left_by_a_killed_build_is_removed_not_waited_for(tmp_path):
    # torch marks a build with a lock file that only a process ending normally removes; one killed
    # during its first build left it, and every later process waited for it forever, silently.
    import subprocess
    import sys
    from pathlib import Path

    import expertcache.kernels as K

    module = load_native()  # built (or loaded) here first, so the child only loads it
    stale = Path(module.__file__).parent / "lock"
    stale.write_text("")
    try:
        child = subprocess.run([sys.executable, "-c", "from expertcache.kernels import load_native; load_native()"],
                               capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("the child waited for a lock file no build holds")
    finally:
        leftover = stale.exists()
        stale.unlink(missing_ok=True)
    assert child.returncode == 0, child.stderr
    assert not leftover and "left by a build of the" in child.stderr
    assert K.load_native() is module
