"""Native products straight from ggml blocks (`kernels/quant_native.py`): decoding bit-identical to
gguf-py, products against float64 ones of the exactly decoded weights, results that depend neither
on thread count nor on the company an expert keeps in a wave, and clear errors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from expertcache.kernels import _cpu_flags
from expertcache.kernels.quant_native import NATIVE_TYPES, load_quant_native
from gguf_blocks import llama_cpp_tensors, random_rows
from conftest import with_threads

TYPES = [t.name for t in NATIVE_TYPES]


@pytest.fixture(scope="module", params=["isa", "portable"])
def native(request):
    """The kernels this CPU gets, and the portable loop other CPUs get, built here too."""
    return load_quant_native(portable=request.param == "portable")


def weights(qtype: Q, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw rows uint8 [rows, row_bytes], gguf-py's decoding of them float32 [rows, cols])."""
    raw = random_rows(qtype, rows, cols, seed, lo=-14, hi=-4)
    return torch.from_numpy(raw), torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype)))


def vector(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def assert_close_to_exact(y: torch.Tensor, w: torch.Tensor, x: torch.Tensor, rel: float = 1e-5) -> None:
    """y is w x summed in fp32: within rel of the row's sum of |w||x| of the float64 product."""
    assert y.dtype == torch.float32 and y.shape == (w.shape[0],)
    exact = w.double() @ x.double()
    slack = rel * (w.double().abs() @ x.double().abs()) + 1e-30
    assert ((y.double() - exact).abs() <= slack).all(), ((y.double() - exact).abs() / slack).max()


def cols_for(qtype: Q, blocks: int) -> int:
    return GGML_QUANT_SIZES[qtype][0] * blocks if GGML_QUANT_SIZES[qtype][0] > 1 else 32 * blocks + 5


def test_each_build_uses_the_instructions_it_was_built_for(native, request):
    flags = _cpu_flags().split()
    if request.node.callspec.params["native"] == "portable":
        assert native.isa == "portable"
    else:
        assert native.isa == ("avx2" if {"avx2", "fma"} <= set(flags) else "portable")


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_is_bit_identical_to_gguf(native, name):
    qtype = Q[name]
    cols = cols_for(qtype, 3)
    raw, want = weights(qtype, 7, cols, seed=1)
    got = native.dequantize(raw, qtype, cols)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q5_0", "IQ4_XS", "F16", "BF16"])
def test_dequantize_into_writes_float32_or_rounds_to_bf16_once(native, name):
    qtype = Q[name]
    cols = cols_for(qtype, 3)
    raw, want = weights(qtype, 20, cols, seed=3)
    out = torch.full((20, cols), float("nan"))
    native.dequantize_into(raw, qtype, out)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    outb = torch.full((20, cols), float("nan"), dtype=torch.bfloat16)
    native.dequantize_into(raw, qtype, outb)
    assert torch.equal(outb.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))
    with pytest.raises(RuntimeError, match="w: expected 19 rows, as out has, got 20"):
        native.dequantize_into(raw, qtype, torch.empty(19, cols))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows,blocks", [(1, 1), (37, 2), (130, 8)])
def test_gemv_matches_float64_products_of_the_decoded_weights(native, name, rows, blocks):
    qtype = Q[name]
    cols = cols_for(qtype, blocks)
    raw, w = weights(qtype, rows, cols, seed=rows + blocks)
    x = vector(cols, seed=blocks)
    y = native.gemv(raw, qtype, x)
    assert_close_to_exact(y, w, x)
    # A bf16 input is widened exactly: the same product as its fp32 copy.
    xb = x.to(torch.bfloat16)
    assert torch.equal(native.gemv(raw, qtype, xb), native.gemv(raw, qtype, xb.float()))


@pytest.mark.parametrize("name", TYPES)
def test_register_level_decoding_gives_the_plain_decoders_sums(native, name):
    """Types with a fused decode-and-multiply give the same bits as decoding into a buffer with
    the decoders `dequantize` checks against gguf-py, then adding it into the same lanes."""
    qtype = Q[name]
    cols = cols_for(qtype, 4)
    raw, _ = weights(qtype, 50, cols, seed=9)
    x = vector(cols, seed=4)
    assert torch.equal(native.gemv(raw, qtype, x), native.gemv_decoded(raw, qtype, x))


def test_llama_cpp_quantized_tensors(native):
    """Every 2-D and 3-D tensor of the fixtures, as llama-quantize wrote it: decoded bit for bit
    as gguf-py decodes it, and its product (each expert of a 3-D tensor apart) close to float64."""
    for name, qtype, shape, raw in llama_cpp_tensors():
        if len(shape) < 2:
            continue
        want = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype))).reshape(-1, shape[-1])
        rows = torch.from_numpy(raw)
        assert torch.equal(native.dequantize(rows, qtype, shape[-1]).view(torch.int32), want.view(torch.int32)), name
        per = shape[-2]
        x = vector(shape[-1], seed=len(name))
        for m in range(len(rows) // per):
            assert_close_to_exact(native.gemv(rows[m * per:(m + 1) * per], qtype, x), want[m * per:(m + 1) * per], x)


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0"])
def test_gemv_on_expert_shapes(native, name):
    qtype = Q[name]
    for n, k in ((768, 2048), (2048, 768)):
        raw, w = weights(qtype, n, k, seed=n)
        x = vector(k, seed=k)
        assert_close_to_exact(native.gemv(raw, qtype, x), w, x)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q5_0", "IQ4_XS", "BF16"])
def test_gemv_does_not_depend_on_thread_count(native, name):
    qtype = Q[name]
    raw, _ = weights(qtype, 3000, 512, seed=2)
    x = vector(512, seed=3)
    one = with_threads(1, lambda: native.gemv(raw, qtype, x))
    two = with_threads(2, lambda: native.gemv(raw, qtype, x))
    assert torch.equal(one, two)


D, I = 512, 256
WAVE_TYPES = [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q5_0", "Q5_K"), ("IQ4_XS", "Q4_0", "BF16")]


def wave(n: int, types: tuple[str, str, str], seed: int = 0):
    """n experts' raw gate, up and down rows and their decoded weights."""
    gate, up, down = (Q[t] for t in types)
    g = [weights(gate, I, D, seed=seed + 10 + e) for e in range(n)]
    u = [weights(up, I, D, seed=seed + 40 + e) for e in range(n)]
    d = [weights(down, D, I, seed=seed + 70 + e) for e in range(n)]
    return g, u, d


@pytest.mark.parametrize("types", WAVE_TYPES, ids=["-".join(t) for t in WAVE_TYPES])
def test_experts_match_float64_swiglu(native, types):
    n = 4
    g, u, d = wave(n, types)
    qtypes = [Q[t] for t in types]
    x = vector(D, seed=1)
    y = native.experts(x, [r for r, _ in g], [r for r, _ in u], [r for r, _ in d], *qtypes)
    assert y.shape == (n, D) and y.dtype == torch.float32
    for e in range(n):
        # gate and up are the one-row products; h is formed in fp32 (a few ulps from float64)
        gate = native.gemv(g[e][0], qtypes[0], x).double()
        upv = native.gemv(u[e][0], qtypes[1], x).double()
        h = torch.nn.functional.silu(gate) * upv
        down = d[e][1].double()
        exact = down @ h
        slack = 1e-5 * (down.abs() @ h.abs()) + down.abs() @ (h.abs() * 4e-7)
        assert ((y[e].double() - exact).abs() <= slack).all()
        # and end to end against float64 all the way
        h64 = torch.nn.functional.silu(g[e][1].double() @ x.double()) * (u[e][1].double() @ x.double())
        torch.testing.assert_close(y[e].double(), down @ h64, rtol=1e-4, atol=1e-4 * (down.abs() @ h64.abs()).max().item())


def test_an_expert_is_the_same_in_any_wave_and_any_thread_count(native):
    types = WAVE_TYPES[0]
    qtypes = [Q[t] for t in types]
    n = 6
    g, u, d = wave(n, types, seed=5)
    x = vector(D, seed=2).to(torch.bfloat16)
    G, U, Dn = [r for r, _ in g], [r for r, _ in u], [r for r, _ in d]
    full = native.experts(x, G, U, Dn, *qtypes)
    for e in range(n):
        alone = native.experts(x, G[e:e + 1], U[e:e + 1], Dn[e:e + 1], *qtypes)
        assert torch.equal(alone[0], full[e])
    order = [4, 1, 5]
    other = native.experts(x, [G[i] for i in order], [U[i] for i in order], [Dn[i] for i in order], *qtypes)
    assert torch.equal(other, full[order])
    assert torch.equal(with_threads(1, lambda: native.experts(x, G, U, Dn, *qtypes)),
                       with_threads(2, lambda: native.experts(x, G, U, Dn, *qtypes)))
    assert native.experts(x, [], [], [], *qtypes).shape == (0, D)


def test_experts_write_their_rank_rows_unrounded_whatever_the_waves(native):
    types = WAVE_TYPES[0]
    qtypes = [Q[t] for t in types]
    g, u, d = wave(5, types, seed=7)
    x = vector(D, seed=3).to(torch.bfloat16)
    G, U, Dn = [r for r, _ in g], [r for r, _ in u], [r for r, _ in d]
    fp32 = native.experts(x, G, U, Dn, *qtypes, act8=True)                 # [5, D], as computed
    ranks = [3, 0, 4, 1, 2]                                                 # expert e's router rank
    out = torch.full((5, D), float("nan"))
    # Two waves, the second first: each expert lands in its rank's row, the same bits as alone.
    for part in ([3, 4], [0, 1, 2]):
        got = native.experts(x, [G[e] for e in part], [U[e] for e in part], [Dn[e] for e in part], *qtypes,
                             act8=True, in_dtype=True, out=out, rows=[ranks[e] for e in part])
        assert got is out or got.data_ptr() == out.data_ptr()
    for e in range(5):
        assert torch.equal(out[ranks[e]], fp32[e])
    with pytest.raises(RuntimeError, match="rows: expected one per expert"):
        native.experts(x, G[:2], U[:2], Dn[:2], *qtypes, out=out, rows=[0])
    with pytest.raises(RuntimeError, match="rows: expected indices below 5"):
        native.experts(x, G[:1], U[:1], Dn[:1], *qtypes, out=out, rows=[5])
    with pytest.raises(RuntimeError, match="out: expected a contiguous fp32"):
        native.experts(x, G[:1], U[:1], Dn[:1], *qtypes, out=out.double(), rows=[0])


def test_bad_arguments_are_errors_not_crashes(native):
    raw, _ = weights(Q.Q4_K, 4, 512, seed=0)
    x = vector(512, seed=0)
    with pytest.raises(RuntimeError, match="expected 144 bytes per Q4_K row of 256 weights, got 288"):
        native.gemv(raw, Q.Q4_K, x[:256])
    with pytest.raises(RuntimeError, match="not a whole number of blocks"):
        native.gemv(raw, Q.Q4_K, x[:300])
    with pytest.raises(RuntimeError, match="ggml type 9 has no native kernel"):
        native.gemv(raw, Q.Q8_1, x)
    with pytest.raises(RuntimeError, match="uint8"):
        native.gemv(raw.float(), Q.Q4_K, x)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        native.gemv(raw, Q.Q4_K, x.double())
    with pytest.raises(RuntimeError, match="as many gate, up and down"):
        native.experts(x, [raw], [raw], [], Q.Q4_K, Q.Q4_K, Q.Q4_K)
