"""8-bit activations (`act8`), llama.cpp's CPU numerics: the row is rounded to the weight type's
partner format exactly as ggml's rules say (checked against an independent numpy rounding), and
each product is then the rounded row times the exactly decoded weights (float64 reference); the
vector and the plain builds give the same bits; an expert wave is its one-row products."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from expertcache import kernels
from expertcache.kernels.quant_native import NATIVE_TYPES, load_quant_native
from gguf_blocks import llama_cpp_tensors
from test_quant_kernels import cols_for, weights
from conftest import with_threads

TYPES = [t.name for t in NATIVE_TYPES]
Q8_0_PARTNERS = {Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL}


@pytest.fixture(scope="module", params=["isa", "portable"])
def native(request):
    return load_quant_native(portable=request.param == "portable")


def rounded_reference(x: np.ndarray, qtype: Q) -> np.ndarray:
    """x [T, K] float32 rounded as ggml rounds a product's activations for weights of `qtype`."""
    x = x.astype(np.float32)
    if qtype == Q.F32:
        return x
    if qtype == Q.F16:
        return x.astype(np.float16).astype(np.float32)
    if qtype == Q.BF16:
        return torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    if qtype in Q8_0_PARTNERS:  # blocks of 32: scale max|x| / 127 kept as fp16, x * 127 / max|x| to nearest even
        b = x.reshape(x.shape[0], -1, 32)
        amax = np.abs(b).max(-1, keepdims=True)
        d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
        with np.errstate(divide="ignore"):
            inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        q = np.rint(b * inv) + np.float32(0)  # integers: no negative zero
        return (d * q).astype(np.float32).reshape(x.shape)
    # Q8_K, blocks of 256: the first value of largest magnitude maps to -127, ties to even, at most 127
    b = x.reshape(x.shape[0], -1, 256)
    idx = np.abs(b).argmax(-1)[..., None]
    mx = np.take_along_axis(b, idx, -1)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.float32(-127) / mx
        q = np.minimum(127, np.rint(b * iscale)) + np.float32(0)
        d = np.float32(1) / iscale
    out = np.where(mx == 0, np.float32(0), d * q).astype(np.float32)
    return out.reshape(x.shape)


def vector(n: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    x[::7] *= 30  # outliers, as real activations have: the rounding is relative to each block's largest
    return x


def q8_1_slack(raw: torch.Tensor, qtype: Q, xt: torch.Tensor) -> torch.Tensor | float:
    """What ggml's Q8_1 rounding adds to a Q4_1/Q5_1 row's product: each block's minimum m times
    the block's sum s of the rounded row, which ggml keeps in fp16 (off by up to |m s| 2^-11)."""
    if qtype not in (Q.Q4_1, Q.Q5_1):
        return 0.0
    blocks = raw.view(raw.shape[0], -1, raw.shape[1] // (xt.shape[0] // 32))        # [N, nb, block bytes]
    m = blocks[..., 2:4].contiguous().view(torch.float16).double()[..., 0]           # [N, nb]
    s = xt.double().view(-1, 32).sum(-1)                                             # [nb]
    return (m.abs() * s.abs()).sum(-1) * 2.0 ** -11


def assert_close_to(y: torch.Tensor, w: torch.Tensor, xt: torch.Tensor, rel: float = 1e-5,
                    extra: torch.Tensor | float = 0.0) -> None:
    """y is w xt summed in fp32: within rel of the row's sum of |w||xt| of the float64 product
    (plus `extra`, per row)."""
    exact = w.double() @ xt.double()
    slack = rel * (w.double().abs() @ xt.double().abs()) + extra + 1e-30
    assert ((y.double() - exact).abs() <= slack).all(), ((y.double() - exact).abs() / slack).max()


@pytest.mark.parametrize("name", TYPES)
def test_the_row_is_rounded_by_ggmls_rules(native, name):
    qtype = Q[name]
    cols = cols_for(qtype, 4) if qtype not in Q8_0_PARTNERS else 32 * 9
    x = torch.stack([vector(cols, seed=s) for s in range(5)])
    x[1] = 0.0                  # an all-zero row: zeros, no division by zero
    x[2, :40] = 0.0             # a zero block inside a row
    x[3] = -x[3].abs()          # the largest value negative
    got = native.round_activations(x, qtype)
    want = torch.from_numpy(rounded_reference(x.numpy(), qtype))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    if qtype not in (Q.F32, Q.F16, Q.BF16):
        assert not torch.equal(got, x)  # it did round


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows,blocks", [(1, 1), (37, 2), (130, 8)])
def test_act8_gemv_is_the_rounded_row_times_the_decoded_weights(native, name, rows, blocks):
    qtype = Q[name]
    cols = cols_for(qtype, blocks)
    raw, w = weights(qtype, rows, cols, seed=rows + blocks)
    x = vector(cols, seed=blocks)
    xt = native.round_activations(x[None], qtype)[0]
    y = native.gemv(raw, qtype, x, act8=True)
    assert_close_to(y, w, xt, extra=q8_1_slack(raw, qtype, xt))
    # and it is not the exact product: the rounding is real
    if qtype not in (Q.F32,):
        assert not torch.equal(y, native.gemv(raw, qtype, x))


@pytest.mark.parametrize("name", TYPES)
def test_gemm_act8_rows_are_the_one_row_products(native, name):
    """Many rows at once (up to four against each decoded block) give each row's one-row product
    bit for bit, so a token's result does not depend on how many share the product."""
    qtype = Q[name]
    cols = cols_for(qtype, 2)
    raw, _ = weights(qtype, 45, cols, seed=21)
    for T in (1, 3, 4, 9, 70):
        x = torch.stack([vector(cols, seed=100 + t) for t in range(T)])
        y = native.gemm_act8(raw, qtype, x)
        assert y.shape == (T, 45) and y.dtype == torch.float32
        for t in range(T):
            assert torch.equal(y[t], native.gemv(raw, qtype, x[t], act8=True)), (name, T, t)
    assert torch.equal(with_threads(1, lambda: native.gemm_act8(raw, qtype, x)),
                       with_threads(2, lambda: native.gemm_act8(raw, qtype, x)))


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q5_0", "IQ4_NL", "Q2_K"])
def test_a_row_gives_the_same_bits_alone_and_among_others(native, name):
    """Kernels that take eight weight rows at once (decode) or interleave them (prefill) give each
    row the bits of a product of that row alone, whatever the split across threads."""
    qtype = Q[name]
    cols = cols_for(qtype, 3)
    raw, _ = weights(qtype, 45, cols, seed=5)
    x = torch.stack([vector(cols, seed=6 + t) for t in range(5)])
    alone = torch.stack([torch.cat([native.gemv(raw[r:r + 1], qtype, x[t], act8=True) for r in range(45)])
                         for t in range(5)])
    for threads in (1, 2, 3):
        assert torch.equal(with_threads(threads, lambda: native.gemm_act8(raw, qtype, x)), alone), (name, threads)
        for t in range(5):
            assert torch.equal(with_threads(threads, lambda: native.gemv(raw, qtype, x[t], act8=True)), alone[t])
    n, I = 3, 256  # a wave: its gate/up/down rows split into runs of each matrix across threads
    G = [weights(qtype, I, cols, seed=30 + e)[0] for e in range(n)]
    Dn = [weights(qtype, cols, I, seed=50 + e)[0] for e in range(n)]
    waves = [with_threads(k, lambda: native.experts(x[0], G, G, Dn, qtype, qtype, qtype, "silu", act8=True))
             for k in (1, 2, 3)]
    assert torch.equal(waves[0], waves[1]) and torch.equal(waves[0], waves[2]), name


def test_the_vector_and_the_plain_build_give_the_same_bits():
    isa, plain = load_quant_native(), load_quant_native(portable=True)
    for name in TYPES:
        qtype = Q[name]
        cols = cols_for(qtype, 4)
        raw, _ = weights(qtype, 40, cols, seed=11)
        x = vector(cols, seed=12)
        a, b = isa.gemv(raw, qtype, x, act8=True), plain.gemv(raw, qtype, x, act8=True)
        xs = torch.stack([x, -x, 2 * x, x.flip(0)])
        assert torch.equal(isa.gemm_act8(raw, qtype, xs), plain.gemm_act8(raw, qtype, xs)) or \
            qtype in (Q.F32, Q.F16, Q.BF16, Q.Q2_K, Q.Q3_K, Q.IQ4_XS), name
        if qtype in (Q.F32, Q.F16, Q.BF16, Q.Q2_K, Q.Q3_K, Q.IQ4_XS):
            continue  # float lanes (no integer kernel): the builds sum in another order, as without act8
        assert torch.equal(a, b), name


def test_llama_cpp_quantized_tensors_with_act8():
    native = load_quant_native()
    for name, qtype, shape, raw in llama_cpp_tensors():
        if len(shape) < 2 or shape[-1] % 32:
            continue
        want = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype))).reshape(-1, shape[-1])
        rows = torch.from_numpy(raw)[: shape[-2]]
        x = vector(shape[-1], seed=len(name))
        if qtype not in (Q.F32, Q.F16, Q.BF16) and shape[-1] % 256 and qtype not in Q8_0_PARTNERS:
            continue
        xt = native.round_activations(x[None], qtype)[0]
        assert_close_to(native.gemv(rows, qtype, x, act8=True), want[: shape[-2]], xt, extra=q8_1_slack(rows, qtype, xt))


D, I = 512, 256
WAVE_TYPES = [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q5_0", "Q5_K"), ("IQ4_XS", "Q4_0", "BF16")]


def wave_of(types: tuple[str, str, str], n: int = 5):
    """n experts' random gate, up and down matrices of the three types, and an input row."""
    qtypes = [Q[t] for t in types]
    G = [weights(qtypes[0], I, D, seed=10 + e)[0] for e in range(n)]
    U = [weights(qtypes[1], I, D, seed=40 + e)[0] for e in range(n)]
    Dn = [weights(qtypes[2], D, I, seed=70 + e)[0] for e in range(n)]
    return qtypes, G, U, Dn, vector(D, seed=1)


@pytest.mark.parametrize("types", WAVE_TYPES, ids=["-".join(t) for t in WAVE_TYPES])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_an_act8_wave_is_its_one_row_products(native, types, act):
    qtypes, G, U, Dn, x = wave_of(types)
    n = len(G)
    y = native.experts(x, G, U, Dn, *qtypes, act, act8=True)
    f = torch.nn.functional.silu if act == "silu" else (lambda v: torch.nn.functional.gelu(v, approximate="tanh"))
    for e in range(n):
        h = f(native.gemv(G[e], qtypes[0], x, act8=True)) * native.gemv(U[e], qtypes[1], x, act8=True)
        want = native.gemv(Dn[e], qtypes[2], h, act8=True)
        torch.testing.assert_close(y[e], want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    # the same in any wave and at any thread count
    assert torch.equal(native.experts(x, G[2:3], U[2:3], Dn[2:3], *qtypes, act, act8=True)[0], y[2])
    assert torch.equal(with_threads(1, lambda: native.experts(x, G, U, Dn, *qtypes, act, act8=True)),
                       with_threads(2, lambda: native.experts(x, G, U, Dn, *qtypes, act, act8=True)))


TILED_WAVES = [("Q4_K", "Q4_K", "Q6_K"), ("Q4_K", "Q4_K", "Q4_K"), ("Q8_0", "Q8_0", "Q5_0")]


@pytest.mark.parametrize("types", TILED_WAVES, ids=["-".join(t) for t in TILED_WAVES])
def test_a_wave_held_as_tiles_gives_the_rows_bits(native, types):
    """Expert slots may hold Q4_K and Q8_0 matrices as `tile_rows`'s tiles: a wave with any of
    its matrix kinds so held gives the bits of the file's rows, in rank rows too. The portable
    build has no tiles and refuses them."""
    qtypes, G, U, Dn, x = wave_of(types)
    n = len(G)
    if native.isa != "avx2":
        with pytest.raises(RuntimeError, match="tiles need act8, a type with tiles on this build"):
            native.experts(x, [g.reshape(I // 8, -1) for g in G], U, Dn, *qtypes, "silu", act8=True,
                           tiled=[True, False, False])
        return
    want = native.experts(x, G, U, Dn, *qtypes, "silu", act8=True)
    tiled = [t in kernels.TILED_TYPES for t in qtypes]
    held = [[native.tile_rows(w, q, w_cols) if t else w for w in ws]
            for ws, q, t, w_cols in zip((G, U, Dn), qtypes, tiled, (D, D, I))]
    assert any(tiled)
    assert torch.equal(native.experts(x, *held, *qtypes, "silu", act8=True, tiled=tiled), want)
    for one in range(3):  # one kind held as tiles at a time
        flags = [t and j == one for j, t in enumerate(tiled)]
        mats = [h if f else w for h, w, f in zip(held, (G, U, Dn), flags)]
        assert torch.equal(native.experts(x, *mats, *qtypes, "gelu_pytorch_tanh", act8=True, tiled=flags),
                           native.experts(x, G, U, Dn, *qtypes, "gelu_pytorch_tanh", act8=True))
    out = torch.zeros(n + 1, D)
    native.experts(x, *held, *qtypes, "silu", act8=True, out=out, rows=[5, 0, 3, 1, 2], tiled=tiled)
    assert torch.equal(out[[5, 0, 3, 1, 2]], want)
    with pytest.raises(RuntimeError, match="tiles need act8"):
        native.experts(x, *held, *qtypes, "silu", act8=False, tiled=tiled)
    with pytest.raises(RuntimeError, match="expected contiguous uint8 tiles"):
        native.experts(x, G, U, Dn, *qtypes, "silu", act8=True, tiled=tiled)
    with pytest.raises(RuntimeError, match="none or three flags"):
        native.experts(x, *held, *qtypes, "silu", act8=True, tiled=[True])


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_products_in_the_inputs_dtype_are_the_fp32_ones_rounded(native, name):
    # `in_dtype`: a decode step's row [1, K] in bf16 gives [1, N] in bf16, rounded as .to rounds the
    # fp32 result, so the Python side needs no conversion or reshaping calls.
    qtype = Q[name]
    cols = cols_for(qtype, 2)
    raw, _ = weights(qtype, 40, cols, seed=3)
    x = vector(cols, seed=4).bfloat16()
    want = native.gemv(raw, qtype, x, act8=True).to(torch.bfloat16)
    got = native.gemv(raw, qtype, x[None], act8=True, in_dtype=True)
    assert got.shape == (1, 40) and got.dtype == torch.bfloat16 and torch.equal(got[0], want)
    strided = torch.stack((x, x), dim=1)[:, 0][None]  # [1, K], not contiguous
    assert torch.equal(native.gemv(raw, qtype, strided, act8=True, in_dtype=True)[0], want)
    assert torch.equal(native.gemv(raw, qtype, x.float(), act8=True, in_dtype=True), native.gemv(raw, qtype, x.float(),
                                                                                              act8=True))
    if native.isa == "avx2" and qtype in (Q.Q4_K, Q.Q8_0):
        tiles = native.tile_rows(raw, qtype, cols)
        xs = torch.stack([vector(cols, seed=9 + t) for t in range(3)]).bfloat16()
        assert torch.equal(native.gemm_tiles(tiles, qtype, xs, in_dtype=True),
                           native.gemm_tiles(tiles, qtype, xs).to(torch.bfloat16))
    I = 256
    G = [weights(qtype, I, cols, seed=60 + e)[0] for e in range(2)]
    Dn = [weights(qtype, cols, I, seed=70 + e)[0] for e in range(2)]
    wave = native.experts(x, G, G, Dn, qtype, qtype, qtype, "silu", act8=True)
    got = native.experts(x[None], G, G, Dn, qtype, qtype, qtype, "silu", act8=True, in_dtype=True)
    assert got.dtype == torch.bfloat16 and torch.equal(got, wave.to(torch.bfloat16))


def test_a_row_that_is_not_whole_blocks_is_an_error(native):
    raw, _ = weights(Q.Q4_K, 4, 512, seed=0)
    with pytest.raises(RuntimeError, match="not a whole number of Q8_K blocks of 256"):
        native.round_activations(torch.ones(2, 300), Q.Q4_K)
    with pytest.raises(RuntimeError, match="not a whole number of Q8_0 blocks of 32"):
        native.round_activations(torch.ones(2, 40), Q.Q8_0)
    with pytest.raises(RuntimeError, match="ggml type 9 has no native kernel"):
        native.round_activations(torch.ones(2, 64), Q.Q8_1)


# ---- whole models: llama.cpp's numerics, and the dense matrices kept as the file's blocks ----

from pathlib import Path  # noqa: E402

import expertcache  # noqa: E402
from expertcache import CacheConfig  # noqa: E402
from expertcache.checkpoint.storage import QuantTensor, RowParts  # noqa: E402
from gguf_recordings import llama_logits, record  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "gguf"


# Every product of these files has an integer kernel and every matrix is Q8_0, Q5_0 (qwen2_moe's
# rows of 64 fall back from Q4_K) or F32: with the activations rounded as ggml rounds them, the
# only difference left from llama.cpp is the order of fp32 sums (1.2e-7 to 1.6e-7 seen), where
# exact activations are 1e-2 to 8e-2 away. Mixtral's
# q/k rows are reordered on the blocks (the converter's rotary permutation undone), Qwen3.5's
# DeltaNet projections and shared expert are blocks too.
@pytest.mark.parametrize("name", ["olmoe-Q8_0", "mixtral-Q8_0", "qwen2_moe-Q4_K_M", "qwen3_5_moe/qwen3_5_moe-Q8_0"])
def test_q8_activations_give_llama_cpps_logits(name):
    fixtures, stem = (FIXTURES / name).parent, Path(name).name
    rec, want = record(fixtures, stem), llama_logits(fixtures, stem)
    path = fixtures / f"{stem}.gguf"
    q8 = expertcache.load(path, dtype="float32", activations="q8")
    got = q8.logits(rec["prompt"]["tokens"])
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < 2e-6, rel
    exact = expertcache.load(path, dtype="float32").logits(rec["prompt"]["tokens"])
    assert float((exact - want).abs().max() / want.abs().max()) > 1e-3  # the rounding is what closes it


def _ggml_rms_norm_row(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """ggml_compute_forward_rms_norm_f32 (ggml-cpu/ops.cpp) element by element: fp64 sum of the
    fp32 squares in order, the mean as float, scale = 1.0f/sqrtf(mean + eps), (x * scale) * w."""
    s = 0.0
    for v in x:
        s += float(np.float32(v * v))
    mean = np.float32(s / len(x))
    scale = np.float32(1.0) / np.sqrt(np.float32(mean + np.float32(eps)))
    return (x * scale).astype(np.float32) * w


def test_llama_cpps_numerics_take_ggmls_rms_norm_bit_for_bit(monkeypatch):
    from expertcache.kernels import rms_norm_ggml, select

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 32, generator=g) * torch.rand(512, 1, generator=g) * 4
    w = torch.rand(32, generator=g) + 0.5
    want = np.stack([_ggml_rms_norm_row(r, w.numpy(), 1e-6) for r in x.numpy()])
    assert np.array_equal(rms_norm_ggml(x, w, 1e-6).numpy(), want)
    monkeypatch.setattr(kernels, "GGML_NORM_BLOCK", 32 * 7)  # the fp64 sums taken seven rows at a time
    assert np.array_equal(rms_norm_ggml(x.view(8, 64, 32), w, 1e-6).view(512, 32).numpy(), want)
    torch_rows = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w).numpy()
    assert not np.array_equal(torch_rows, want)  # torch's float root and sum order differ somewhere
    k = select("torch", torch.device("cpu"), torch.float32, quantized=True, activations="q8")
    assert k.ggml_norms and np.array_equal(k.rms_norm(x, w, 1e-6).numpy(), want)
    assert np.array_equal(k.rms_norm_scaled(x, None, 1e-6, reference=None).numpy(),
                          np.stack([_ggml_rms_norm_row(r, np.float32(1), 1e-6) for r in x.numpy()]))
    # bf16 compute, or exact activations: the family's own norms
    assert not select("torch", torch.device("cpu"), torch.bfloat16, quantized=True, activations="q8").ggml_norms
    assert not select("torch", torch.device("cpu"), torch.float32, quantized=True, activations="exact").ggml_norms


def test_llama_cpps_numerics_take_ggmls_gelu_table():
    # ggml-cpu/vec.h (GGML_GELU_FP16): 0 at or below -10, x at or above 10, else the fp16 input looked
    # up in a table of fp16(gelu_tanh(float(input))) computed in fp32.
    import math

    from expertcache.kernels import gelu_ggml, select

    x = torch.cat((torch.linspace(-12, 12, 4001), torch.randn(4000, generator=torch.Generator().manual_seed(1)) * 3))
    want = []
    for v in x.tolist():
        if v <= -10:
            want.append(0.0)
        elif v >= 10:
            want.append(np.float32(v))
        else:
            f = np.float32(np.float16(v))
            inner = np.float32(np.float32(np.float32(0.7978845608028654) * f)
                               * np.float32(1 + np.float32(np.float32(np.float32(0.044715) * f) * f)))
            t = np.float32(math.tanh(float(inner)))
            want.append(np.float32(np.float16(np.float32(np.float32(0.5) * f) * np.float32(1 + t))))
    assert np.array_equal(gelu_ggml(x).numpy(), np.array(want, dtype=np.float32))
    k = select("torch", torch.device("cpu"), torch.float32, quantized=True, activations="q8")
    assert k.activation("gelu_pytorch_tanh") is gelu_ggml and k.activation("silu") is torch.nn.functional.silu


# With llama.cpp's numerics throughout (8-bit activations, ggml's norms and GELU) the perplexity of
# each fixture is llama.cpp's but for rounding flips left by the order of fp32 sums elsewhere
# (attention, DeltaNet): 0.00-0.05% here (tools/fixture_perplexity.py). With torch's norms,
# qwen3_5_moe-Q8_0 was 0.74% off: two of its 8-bit roundings fell the other way.
@pytest.mark.parametrize("name", ["olmoe-Q8_0", "mixtral-Q8_0", "qwen2_moe-Q4_K_M", "qwen3_5_moe/qwen3_5_moe-Q8_0",
                                  "gemma4/gemma4-Q8_0"])
def test_q8_activations_give_llama_cpps_perplexity(name):
    from expertcache.perplexity import perplexity, perplexity_bos_id

    fixtures, stem = (FIXTURES / name).parent, Path(name).name
    rec = record(fixtures, stem)
    model = expertcache.load(fixtures / f"{stem}.gguf", dtype="float32", activations="q8")
    bos = perplexity_bos_id(model.tokenizer) if rec["perplexity"].get("add_bos") else None
    got = perplexity(model, rec["heldout"]["tokens"], n_ctx=rec["perplexity"]["n_ctx"], bos_id=bos).ppl
    assert abs(got / rec["perplexity"]["ppl"] - 1) < 0.005, (got, rec["perplexity"]["ppl"])


def test_dense_matrices_stay_blocks_only_where_the_kernels_multiply_blocks():
    path = FIXTURES / "qwen3_moe-mix.gguf"  # q/k/v of one layer in three types, another's in two quantized + F16
    native = expertcache.load(path, dtype="bfloat16", kernels="native")
    w = native.net.weights
    assert isinstance(w.lm_head, QuantTensor) and w.lm_head.qtype == Q.Q5_K
    assert isinstance(w.embed, QuantTensor) and w.embed.qtype == Q.IQ4_XS
    qkv0, qkv1 = w.layers[0].attn.qkv, w.layers[1].attn.qkv
    assert isinstance(qkv0, RowParts) and [p.qtype for p in qkv0.parts] == [Q.Q8_0, Q.Q4_0, Q.Q5_0]
    # F16 (and BF16) stay the file's rows too: ggml rounds their products' input to fp16 (bf16)
    assert isinstance(qkv1, RowParts) and [p.qtype for p in qkv1.parts] == [Q.Q4_1, Q.Q5_1, Q.F16]
    assert w.layers[1].attn.o.qtype == Q.BF16
    assert isinstance(w.layers[0].attn.o, QuantTensor) and not isinstance(w.layers[0].router, QuantTensor)
    reference = expertcache.load(path, dtype="float32")  # the exact path dequantizes at load
    assert all(isinstance(t, torch.Tensor) for t in (reference.net.weights.lm_head, reference.net.weights.embed,
                                                    reference.net.weights.layers[0].attn.qkv))
    # blocks: less memory than bf16, and the embedding rows are the exactly decoded ones
    assert w.lm_head.nbytes < reference.net.weights.lm_head.numel() * 2
    ids = torch.tensor([3, 17, 250])
    assert torch.equal(native.net.embed(ids), reference.net.embed(ids).to(torch.bfloat16))
    # with exact activations a bf16 matrix dequantized at load is the faster: no blocks then
    exact_native = expertcache.load(path, dtype="bfloat16", kernels="native", activations="exact")
    assert isinstance(exact_native.net.weights.lm_head, torch.Tensor)
    # products over blocks: more rows than auto rounds are the exact rows times the decoded
    # weights; one row is the integer kernel; side-by-side parts are each part's product
    k = native.kernels
    k.act8_rows = kernels.AUTO_ACT8_ROWS  # auto's limit on a CPU with bf16 matrix instructions
    x = torch.randn(k.act8_rows + 12, w.lm_head.shape[1], generator=torch.Generator().manual_seed(0)).bfloat16()
    assert torch.equal(k.linear(x, w.lm_head), k.linear(x, k.dense(w.lm_head, torch.bfloat16)))
    assert torch.equal(k.linear(x[:8], w.lm_head), k.quant.gemm_act8(w.lm_head.raw, int(w.lm_head.qtype), x[:8])
                       .to(torch.bfloat16))
    one = k.quant.gemv(w.lm_head.raw, int(w.lm_head.qtype), x[0], act8=True).to(torch.bfloat16)
    assert torch.equal(k.linear(x[:1], w.lm_head)[0], one)
    parts = [k.linear(x, p if isinstance(p, torch.Tensor) else k.dense(p, torch.bfloat16)) for p in qkv1.parts]
    assert torch.equal(k.linear(x, qkv1), torch.cat(parts, dim=-1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_q8_results_do_not_depend_on_the_cache(dtype):
    path = FIXTURES / "qwen2_moe-Q4_K_M.gguf"
    ids = record(FIXTURES, "qwen2_moe-Q4_K_M")["heldout"]["tokens"][:40]

    def run(cache):
        m = expertcache.load(path, dtype=dtype, activations="q8", cache=cache)
        s = m.new_session()
        out = [m.prefill(s, ids[:24], ubatch=8, all_logits=True)] + [m.prefill(s, [t], all_logits=True) for t in ids[24:]]
        return torch.cat(out), m.telemetry()

    want, _ = run(CacheConfig(mode="resident"))
    for cache in (CacheConfig(mode="cache", experts=1), CacheConfig(mode="cache", fraction=0.5, store="disk", policy="lfu"),
                  CacheConfig(mode="staging", store="mmap")):
        got, tel = run(cache)
        assert torch.equal(got, want), cache
        assert tel["total"]["copied_experts"] > 0


@pytest.mark.parametrize("bf16_gemm", [True, False])
def test_auto_rounds_more_rows_where_the_cpu_has_no_bf16_matrix_instructions(monkeypatch, bf16_gemm):
    """auto: up to 8 rows where a bf16 GEMM has instructions of its own (AVX512-BF16, AMX), every
    product where it would be widened to fp32; exact and torch's kernels never round."""
    monkeypatch.setitem(kernels._has, torch.bfloat16, bf16_gemm)
    k = kernels.select("auto", torch.device("cpu"), torch.bfloat16, quantized=True)
    assert k.act8_rows == (kernels.AUTO_ACT8_ROWS if bf16_gemm else kernels.ALL_ROWS)
    assert kernels.select("auto", torch.device("cpu"), torch.bfloat16, quantized=True, activations="exact").act8_rows == 0
    assert kernels.select("torch", torch.device("cpu"), torch.bfloat16, quantized=True).act8_rows == 0
    assert kernels.select("auto", torch.device("cpu"), torch.bfloat16, quantized=True, activations="q8").act8_rows \
        == kernels.ALL_ROWS


def test_bad_activation_choices_are_one_line_errors():
    from expertcache.errors import ExpertCacheError

    with pytest.raises(ExpertCacheError, match="activations 'q4' is not one of auto, exact, q8"):
        expertcache.load(FIXTURES / "olmoe-Q8_0.gguf", activations="q4")


def test_act8_products_equal_ggmls_recorded_ones(native):
    """ggml's own CPU kernels (`vec_dot` after `from_float`, through llama-cpp-python's library;
    recorded by tools/ggml_dot_check.py --record) on random rows of every type: ours differ only
    by the order of fp32 sums, where exact activations are far off (Q4_1 and Q5_1 too: their
    minimums multiply ggml's fp16 sums of the rounded row's blocks, 4e-5 off when they did not)."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from ggml_dot_check import inputs

    rec = json.loads((FIXTURES.parent / "ggml_dot.json").read_text())
    assert set(rec["products"]) == {t.name for t in NATIVE_TYPES} - {"F32", "F16", "BF16"}
    for name, want in rec["products"].items():
        qtype = Q[name]
        raw, x = (torch.from_numpy(a) for a in inputs(qtype, rec["rows"], rec["cols"]))
        want = torch.tensor(want)
        scale = want.abs().max()
        got = native.gemv(raw, qtype, x, act8=True)
        rel = float((got - want).abs().max() / scale)
        assert rel < 1e-6, (name, rel)
        assert float((native.gemv(raw, qtype, x) - want).abs().max() / scale) > 20 * rel, name


def _blocks(obj, out: list, depth: int = 0) -> list:
    """The QuantTensors reachable from a model's dense weights."""
    if isinstance(obj, QuantTensor):
        out.append(obj)
    elif isinstance(obj, RowParts):
        for p in obj.parts:
            _blocks(p, out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _blocks(v, out, depth + 1)
    elif depth < 4 and hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            _blocks(getattr(obj, name, None), out, depth + 1)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_blocks_interleaved_for_the_kernels_give_the_same_bits(monkeypatch, dtype):
    """Q4_K and Q8_0 matrices that only the integer kernels multiply are held as tiles of eight
    rows, dense ones and experts in slots filled once; prompt and decode logits equal those of the
    file's rows bit for bit."""
    path = FIXTURES / "qwen2_moe-Q4_K_M.gguf"
    ids = record(FIXTURES, "qwen2_moe-Q4_K_M")["heldout"]["tokens"][:30]

    def run():
        m = expertcache.load(path, dtype=dtype, activations="q8", cache=CacheConfig(store="ram", experts=6))
        s = m.new_session()
        out = [m.prefill(s, ids[:20], ubatch=8, all_logits=True)] + [m.prefill(s, [t], all_logits=True) for t in ids[20:]]
        experts = [mf for f in m.experts.formats.values() for mf in f.matrices]
        return torch.cat(out), _blocks(m.net.weights, []), experts

    got, blocks, experts = run()
    tiled = [b for b in blocks if b.tiled]
    assert {b.qtype for b in tiled} <= set(kernels.TILED_TYPES)
    assert {m.storage for m in experts if m.tiled} <= set(kernels.TILED_TYPES)
    if load_quant_native().isa == "avx2":
        assert tiled and all(b.raw.shape[0] * 8 == b.shape[0] for b in tiled)
        assert not any(b.tiled for b in blocks if b is not None and b.qtype not in kernels.TILED_TYPES)
        assert any(m.tiled for m in experts)
    monkeypatch.setattr(kernels.Kernels, "holds_tiles", lambda self, storage, shape: False)
    want, blocks, experts = run()
    assert not any(b.tiled for b in blocks) and not any(m.tiled for m in experts)
    assert torch.equal(got, want)
    tiles = QuantTensor(torch.zeros(1, 1152, dtype=torch.uint8), Q.Q4_K, (8, 256), tiled=True)
    assert tiles.rows(0, 8).raw.shape == (1, 1152) and tiles.rows(0, 8).tiled  # whole tiles slice as tiles
    for use in (lambda: tiles.rows(0, 4), lambda: tiles.take(torch.tensor([0])), lambda: QuantTensor.cat([tiles])):
        with pytest.raises(TypeError, match="tiles"):  # the file's rows are not there to slice
            use()


def test_q8_activations_with_float16_are_refused_in_one_line(capsys):
    """The 8-bit kernels round fp32 or bf16 rows: --dtype float16 with --activations q8 on a
    quantized model ended in a traceback at the first decode step; now one line before loading,
    on a model without quantized weights too (where q8 went silently ignored). Without q8 it runs."""
    from conftest import assert_one_line_error, run_cli

    gg = str(Path(__file__).parent / "fixtures" / "gguf" / "qwen3_moe-mix.gguf")
    assert_one_line_error(*run_cli(capsys, "run", "-m", gg, "-p", "def f(x):", "-n", "2", "--dtype", "float16",
                                   "--activations", "q8"), "--activations q8", "float16")
    assert run_cli(capsys, "run", "-m", gg, "-p", "def f(x):", "-n", "2", "--dtype", "float16")[0] == 0
    assert_one_line_error(*run_cli(capsys, "run", "-p", "def f(x):", "-n", "2", "--dtype", "float16", "--activations",
                                   "q8"), "--activations q8", "float16")
