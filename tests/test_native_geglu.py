"""GeGLU (`gelu_pytorch_tanh`, Gemma 4's experts) in the native one-row expert calls: the bf16
call (`native/decode.cpp`) and the one over quantized blocks (`native/quant.cpp`) against float64
references with the tolerances of their SwiGLU tests, results that do not depend on the wave or the
thread count, SwiGLU unchanged by the new argument, and Gemma 4 models (a tiny bf16 checkpoint and
the llama.cpp-quantized Q8_0 GGUF fixture) decoding through them: identical across cache modes and
close to torch's kernels."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType as Q

import expertcache
from expertcache import CacheConfig, kernels
from expertcache.kernels.quant_native import load_quant_native
from conftest import CountingModule, save_checkpoint, with_threads
from test_kernels import assert_close_to_exact, bf16
from test_quant_kernels import vector, wave

GELU = "gelu_pytorch_tanh"


def gelu64(x: torch.Tensor) -> torch.Tensor:
    """The tanh-approximated gelu in float64, from its formula."""
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def test_the_formula_is_torchs():
    x = torch.linspace(-8, 8, 4001, dtype=torch.float64)
    torch.testing.assert_close(gelu64(x), F.gelu(x, approximate="tanh"), rtol=1e-15, atol=1e-15)


@pytest.fixture(scope="module", params=["isa", "portable"])
def native(request):
    """The bf16 kernels this CPU gets, and the portable loop other CPUs get."""
    return kernels.load_native(portable=request.param == "portable")


@pytest.fixture(scope="module", params=["isa", "portable"])
def quant(request):
    """The quantized-block kernels this CPU gets, and the portable loop other CPUs get."""
    return load_quant_native(portable=request.param == "portable")


# ---- the bf16 call ---------------------------------------------------------------------------

def test_bf16_experts_match_exact_geglu_and_do_not_depend_on_the_wave(native):
    D, I, n = 96, 48, 5
    x = bf16(D, seed=0)
    gate_ups = [bf16(2 * I, D, seed=10 + e, scale=0.3) for e in range(n)]
    downs = [bf16(D, I, seed=20 + e, scale=0.1) for e in range(n)]
    wave = native.experts(x, gate_ups, downs, GELU)
    assert wave.shape == (n, D) and wave.dtype == torch.bfloat16
    for e in range(n):
        assert torch.equal(native.experts(x, gate_ups[e:e + 1], downs[e:e + 1], GELU)[0], wave[e])
        # Each step rounded to bf16 as torch rounds it: products, the activation, the gating product.
        gu = native.gemv(gate_ups[e], x)
        h = (gelu64(gu[:I].double()).to(torch.bfloat16).double() * gu[I:].double()).to(torch.bfloat16)
        assert_close_to_exact(wave[e], downs[e], h)
    assert torch.equal(native.experts(x, gate_ups[3:], downs[3:], GELU), wave[3:])
    # Another activation than SwiGLU's: the gate really went through gelu.
    assert not torch.equal(native.experts(x, gate_ups, downs), wave)
    assert native.experts(x, [], [], GELU).shape == (0, D)


def test_bf16_experts_do_not_depend_on_thread_count(native):
    D, I, n = 256, 128, 4
    x = bf16(D, seed=1)
    gate_ups = [bf16(2 * I, D, seed=30 + e, scale=0.2) for e in range(n)]
    downs = [bf16(D, I, seed=40 + e, scale=0.1) for e in range(n)]
    assert torch.equal(with_threads(1, lambda: native.experts(x, gate_ups, downs, GELU)),
                       with_threads(2, lambda: native.experts(x, gate_ups, downs, GELU)))


def test_bf16_swiglu_is_the_default_and_unknown_activations_are_errors(native):
    D, I = 64, 32
    x, gu, dn = bf16(D, seed=2), [bf16(2 * I, D, seed=3, scale=0.2)], [bf16(D, I, seed=4, scale=0.1)]
    assert torch.equal(native.experts(x, gu, dn), native.experts(x, gu, dn, "silu"))
    with pytest.raises(RuntimeError, match="act: expected silu or gelu_pytorch_tanh, got relu"):
        native.experts(x, gu, dn, "relu")


# ---- the call over quantized blocks ----------------------------------------------------------

D, I = 512, 256
# Gemma 4's Q4_K_M experts (gate/up Q4_K, down Q5_0 or Q8_0, as llama.cpp's quantizer writes rows
# of 704), and the other hot formats.
WAVE_TYPES = [("Q4_K", "Q4_K", "Q5_0"), ("Q4_K", "Q4_K", "Q8_0"), ("Q8_0", "Q5_0", "Q6_K"), ("Q6_K", "Q8_0", "Q4_K")]


@pytest.mark.parametrize("types", WAVE_TYPES, ids=["-".join(t) for t in WAVE_TYPES])
def test_quant_experts_match_float64_geglu(quant, types):
    n = 4
    g, u, d = wave(n, types)
    qtypes = [Q[t] for t in types]
    # Scaled so that many of the gate's products fall in gelu's curved part, |g| of 0.2 to 4.
    x = vector(D, seed=1) * 0.1
    y = quant.experts(x, [r for r, _ in g], [r for r, _ in u], [r for r, _ in d], *qtypes, GELU)
    assert y.shape == (n, D) and y.dtype == torch.float32
    for e in range(n):
        # gate and up are the one-row products; h is formed in fp32 (a few ulps from float64)
        gate = quant.gemv(g[e][0], qtypes[0], x).double()
        assert ((gate.abs() > 0.2) & (gate.abs() < 4)).double().mean() > 0.3
        upv = quant.gemv(u[e][0], qtypes[1], x).double()
        h = gelu64(gate) * upv
        down = d[e][1].double()
        exact = down @ h
        slack = 1e-5 * (down.abs() @ h.abs()) + down.abs() @ (h.abs() * 4e-7)
        assert ((y[e].double() - exact).abs() <= slack).all()
        # and end to end against float64 all the way
        h64 = gelu64(g[e][1].double() @ x.double()) * (u[e][1].double() @ x.double())
        torch.testing.assert_close(y[e].double(), down @ h64, rtol=1e-4, atol=1e-4 * (down.abs() @ h64.abs()).max().item())


def test_quant_expert_is_the_same_in_any_wave_and_any_thread_count(quant):
    qtypes = [Q[t] for t in WAVE_TYPES[0]]
    n = 6
    g, u, d = wave(n, WAVE_TYPES[0], seed=5)
    x = (vector(D, seed=2) * 0.1).to(torch.bfloat16)
    G, U, Dn = [r for r, _ in g], [r for r, _ in u], [r for r, _ in d]
    full = quant.experts(x, G, U, Dn, *qtypes, GELU)
    for e in range(n):
        assert torch.equal(quant.experts(x, G[e:e + 1], U[e:e + 1], Dn[e:e + 1], *qtypes, GELU)[0], full[e])
    order = [4, 1, 5]
    other = quant.experts(x, [G[i] for i in order], [U[i] for i in order], [Dn[i] for i in order], *qtypes, GELU)
    assert torch.equal(other, full[order])
    assert torch.equal(with_threads(1, lambda: quant.experts(x, G, U, Dn, *qtypes, GELU)),
                       with_threads(2, lambda: quant.experts(x, G, U, Dn, *qtypes, GELU)))
    assert quant.experts(x, [], [], [], *qtypes, GELU).shape == (0, D)


def test_quant_swiglu_is_the_default_and_unknown_activations_are_errors(quant):
    qtypes = [Q[t] for t in WAVE_TYPES[0]]
    g, u, d = wave(2, WAVE_TYPES[0], seed=7)
    x = vector(D, seed=3) * 0.1
    G, U, Dn = [r for r, _ in g], [r for r, _ in u], [r for r, _ in d]
    silu = quant.experts(x, G, U, Dn, *qtypes)
    assert torch.equal(silu, quant.experts(x, G, U, Dn, *qtypes, "silu"))
    assert not torch.equal(silu, quant.experts(x, G, U, Dn, *qtypes, GELU))
    with pytest.raises(RuntimeError, match="act: expected silu or gelu_pytorch_tanh, got gelu"):
        quant.experts(x, G, U, Dn, *qtypes, "gelu")


# ---- Gemma 4 models decoding through the native calls ----------------------------------------

CACHES = [CacheConfig(mode="staging"), CacheConfig(experts=3), CacheConfig(experts=3, policy="lru"),
          CacheConfig(experts=5, store="disk")]


def decode(model, ids: list[int], prefill: int) -> torch.Tensor:
    """Logits of a prefill of ids[:prefill], then one decode step per remaining id: [T, V]."""
    s = model.new_session()
    out = [model.prefill(s, ids[:prefill], all_logits=True)]
    out += [model.prefill(s, [t], all_logits=True) for t in ids[prefill:]]
    return torch.cat(out)


@pytest.fixture(scope="module")
def gemma4_bf16(tmp_path_factory):
    """A tiny random Gemma 4 (tests/test_gemma4.py's), its fp32 reference and a bf16 checkpoint."""
    from test_gemma4 import build

    ref = build(seed=3)
    return ref, save_checkpoint(ref, tmp_path_factory.mktemp("g4-geglu") / "ckpt", fused=True, dtype=torch.bfloat16)


def test_gemma4_bf16_decode_takes_the_native_calls_in_every_cache_mode(gemma4_bf16, monkeypatch):
    from test_parity import ids_of

    _, d = gemma4_bf16
    ids = ids_of(40, seed=4).tolist()
    model = expertcache.load(d, dtype="bfloat16", kernels="native", cache=CacheConfig(mode="resident"))
    counting = CountingModule(model.kernels.native, "experts", "attend_scaled")
    monkeypatch.setattr(model.kernels, "native", counting)
    want = decode(model, ids, 24)
    # every decode step's MoE layers, and its attention (sliding past the window, and full)
    assert counting.calls == {"experts": 16 * 5, "attend_scaled": 16 * 5}, counting.calls
    for cache in CACHES:
        got = expertcache.load(d, dtype="bfloat16", kernels="native", cache=cache)
        assert torch.equal(decode(got, ids, 24), want), cache
        assert got.telemetry()["total"]["copied_experts"] > 0, cache


def test_gemma4_bf16_native_decode_is_as_close_to_the_reference_as_torchs(gemma4_bf16):
    """Decode against transformers in fp32 on the same weights: the native kernels' error is of the
    size of torch's bf16 kernels' (median over positions of each position's largest error, as
    test_kernels does: a near tie in routing can move one position), and the two are closer to
    each other than torch's is to the reference (their roundings differ: attention, for one, is a
    single native call that rounds once where torch rounds after each op)."""
    from test_parity import ids_of

    ref, d = gemma4_bf16
    ids = ids_of(32, seed=9)
    with torch.no_grad():
        exact = copy.deepcopy(ref).to(torch.bfloat16).float()(input_ids=ids[None], use_cache=False).logits[0, 8:].float()  # [24, V]
    logits, errors = {}, {}
    for choice in ("torch", "native"):
        model = expertcache.load(d, dtype="bfloat16", kernels=choice)
        logits[choice] = decode(model, ids.tolist(), 8)[8:].float()
        errors[choice] = (logits[choice] - exact).abs().amax(-1).median().item()
    assert errors["native"] <= 1.5 * errors["torch"] + 1e-2, errors
    gap = (logits["native"] - logits["torch"]).abs().amax(-1).median().item()
    assert gap <= errors["torch"], (gap, errors)


def test_gemma4_q8_0_gguf_decodes_through_the_quantized_geglu_call(monkeypatch):
    """The llama.cpp-quantized Gemma 4 fixture in bf16: every decode step's experts run in the
    quantized GeGLU call; the same logits in every cache mode, close to torch's kernels with the
    same activations (exact, and rounded to 8 bits)."""
    from gguf_recordings import record
    from test_gguf_gemma4 import FIXTURES, Q8

    path = FIXTURES / f"{Q8}.gguf"
    ids = record(FIXTURES, Q8)["heldout"]["tokens"][:48]
    for acts in ("exact", "q8"):
        model = expertcache.load(path, dtype="bfloat16", kernels="native", activations=acts,
                                 cache=CacheConfig(mode="resident"))
        assert model.kernels.act8 == (acts == "q8")
        counting = CountingModule(model.kernels.quant, "experts")
        monkeypatch.setattr(model.kernels, "_quant", counting)
        want = decode(model, ids, 32)
        assert counting.calls["experts"] >= 16
        for cache in CACHES:
            got = expertcache.load(path, dtype="bfloat16", kernels="native", activations=acts, cache=cache)
            assert torch.equal(decode(got, ids, 32), want), cache
        torch_model = expertcache.load(path, dtype="bfloat16", kernels="torch", activations=acts)
        torch_logits = decode(torch_model, ids, 32)[32:].float()
        scale = torch_logits.abs().max()
        gap = (want[32:].float() - torch_logits).abs().amax(-1).median()
        assert gap <= 0.05 * scale, (acts, gap, scale)
