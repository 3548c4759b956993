"""`--activations q8` (llama.cpp's numerics) against ggml's rules where they were not followed:

- Q4_1 and Q5_1 take Q8_1 activation blocks in ggml, whose s = fp16(d * sum(q)) (d the fp32
  scale before its own fp16 rounding) multiplies the weight block's minimum m: a block's product
  is d_w d_a sum(q_w q_a) + m s (ggml-cpu's ggml_vec_dot_q4_1_q8_1 / q5_1, quantize_row_q8_1);
  the decoded weights times the rounded row (what we took) drop s's rounding, 3e-5 of a product.
- F16 and BF16 matrices take the input rounded to fp16 (bf16) in ggml; dense ones were dequantized
  at load and multiplied with the input as it was.
- q8 on a model without quantized experts changed nothing at all (not even ggml's norms and GELU).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

import expertcache
from expertcache import kernels
from expertcache.checkpoint.storage import QuantTensor, RowParts
from expertcache.kernels.quant_native import load_quant_native
from gguf_blocks import random_rows
from gguf_recordings import llama_logits, record

FIXTURES = Path(__file__).parent / "fixtures" / "gguf"
MIX = FIXTURES / "qwen3_moe-mix.gguf"  # layer 1's attention: q Q4_1, k Q5_1, v F16, o BF16
# Where the minimum m sits in a block (after d), where the weights' bytes start, and Q5_1's fifth bits.
LAYOUT = {Q.Q4_1: (20, 4), Q.Q5_1: (24, 8)}


@pytest.fixture(scope="module", params=["isa", "portable"])
def native(request):
    return load_quant_native(portable=request.param == "portable")


def ggml_q8_1(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_row_q8_1 as ggml's x86 build does it, for x [K] float32: per block of 32 the fp16
    scale d, the integers q (x * 127/amax to nearest even) and s = fp16(fp32(amax / 127) * sum(q))."""
    b = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(b).max(-1)
    d32 = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(b * inv[:, None]).astype(np.int32)
    s = (d32 * q.sum(-1).astype(np.float32)).astype(np.float32).astype(np.float16).astype(np.float64)
    return d32.astype(np.float16).astype(np.float64), q, s


def ggml_min_product(raw: np.ndarray, qtype: Q, x: np.ndarray) -> np.ndarray:
    """ggml's Q4_1/Q5_1 x Q8_1 products of rows `raw` [N, row bytes] with x, in float64:
    sum over blocks of d_w d_a sum(q_w q_a) + m s."""
    size, start = LAYOUT[qtype]
    blocks = raw.reshape(raw.shape[0], -1, size)
    d_w = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    qs = blocks[..., start:start + 16].astype(np.int32)
    q_w = np.concatenate([qs & 15, qs >> 4], -1)  # weights 0-15, then 16-31 of each block
    if qtype == Q.Q5_1:
        qh = blocks[..., 4:8].copy().view(np.uint32)[..., 0].astype(np.int64)
        q_w = q_w | (((qh[..., None] >> np.arange(32)) & 1) << 4).astype(np.int32)
    d_a, q_a, s = ggml_q8_1(x)
    return (d_w * d_a * (q_w * q_a).sum(-1) + m * s).sum(-1)


@pytest.mark.parametrize("name", ["Q4_1", "Q5_1"])
def test_the_minimum_multiplies_ggmls_fp16_block_sum(native, name):
    """Blocks of zeros with m = 1: ggml's product is the sum of the row's fp16 block sums s, each
    rounded from the fp32 scale (hand-computed here); the decoded weights (all 1) times the
    rounded row gave the sum of d * sum(q) with d rounded to fp16 first, which is not it."""
    qtype = Q[name]
    size, _ = LAYOUT[qtype]
    blocks = np.zeros((1, 4, size), dtype=np.uint8)
    blocks[..., 0:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)  # d_w (its products are 0)
    blocks[..., 2:4] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)  # m
    raw = blocks.reshape(1, -1)
    x = np.full(128, 0.75, dtype=np.float32)
    x[0::32] = [100.0, -3.3, 61.7, 9.1]   # each block's largest: scales of 100/127, 3.3/127, ... not fp16 values
    d16, q, s = ggml_q8_1(x)
    want = np.float32(0)
    for v in s:  # m * s summed in block order, in fp32, as ggml does
        want = np.float32(want + np.float32(v))
    got = native.gemv(torch.from_numpy(raw), qtype, torch.from_numpy(x), act8=True)
    assert got.item() == want
    dropped = float(np.sum(d16 * q.sum(-1)))  # what the rounded row times the decoded weights gives
    assert abs(dropped - float(want)) > 1e-3
    xs = torch.from_numpy(np.stack([x, x, -x]))
    assert torch.equal(native.gemm_act8(torch.from_numpy(raw), qtype, xs)[:, 0],
                       torch.stack([got[0], got[0], native.gemv(torch.from_numpy(raw), qtype, -xs[0], act8=True)[0]]))


@pytest.mark.parametrize("name", ["Q4_1", "Q5_1"])
@pytest.mark.parametrize("cols", [32, 256, 2048])
def test_q4_1_and_q5_1_products_are_ggmls(native, name, cols):
    """Random valid blocks, an activation row with outliers: one row and several rows give ggml's
    products (a float64 reference of its formula) up to the order of fp32 sums; the decoded weights
    times the rounded row are 30x further off or more."""
    qtype = Q[name]
    raw = random_rows(qtype, 64, cols, seed=cols, lo=-14, hi=-4)
    rng = np.random.default_rng(cols)
    x = (rng.standard_normal(cols) * np.where(rng.random(cols) < 0.1, 30, 1)).astype(np.float32)
    want = torch.from_numpy(ggml_min_product(raw, qtype, x))
    w = torch.from_numpy(raw)
    scale = float(want.abs().max())
    got = native.gemv(w, qtype, torch.from_numpy(x), act8=True).double()
    assert float((got - want).abs().max()) / scale < 1e-6
    rows = torch.from_numpy(np.stack([x, 2 * x, x[::-1].copy()]))
    many = native.gemm_act8(w, qtype, rows)
    assert torch.equal(many[0], got.float())
    assert float((many[1].double() - torch.from_numpy(ggml_min_product(raw, qtype, 2 * x))).abs().max()) / scale < 3e-6
    decoded = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).double()
    rounded = native.round_activations(torch.from_numpy(x)[None], qtype)[0].double()
    assert float((decoded @ rounded - want).abs().max()) / scale > 30 * float((got - want).abs().max()) / scale


def test_the_vector_and_the_plain_build_give_q4_1_and_q5_1_the_same_bits():
    # integer block sums in both builds, the same float steps: the same bits (the float path did not)
    isa, plain = load_quant_native(), load_quant_native(portable=True)
    for qtype in (Q.Q4_1, Q.Q5_1):
        raw = torch.from_numpy(random_rows(qtype, 40, 512, seed=3))
        x = torch.randn(5, 512, generator=torch.Generator().manual_seed(4)) * 3
        assert torch.equal(isa.gemm_act8(raw, qtype, x), plain.gemm_act8(raw, qtype, x))
        assert torch.equal(isa.gemv(raw, qtype, x[0], act8=True), plain.gemv(raw, qtype, x[0], act8=True))


def _file_matrix(name: str) -> torch.Tensor:
    """A tensor of the mix file as the gguf package dequantizes it, [rows, cols] float64."""
    t = next(t for t in gguf.GGUFReader(MIX).tensors if t.name == name)
    data = np.asarray(t.data)
    if t.tensor_type == Q.BF16:  # gguf's reader hands BF16 out as raw 16-bit words
        data = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return torch.from_numpy(np.asarray(data, dtype=np.float64).reshape(int(t.shape[1]), int(t.shape[0])))


def test_q8_keeps_f16_and_bf16_dense_matrices_and_rounds_their_input():
    """With llama.cpp's numerics, a dense F16 (BF16) matrix's product is the input rounded to fp16
    (bf16) times the file's weights (the gguf package's values), in fp32; it was the input as it
    was, times the matrix dequantized at load."""
    model = expertcache.load(MIX, dtype="float32", activations="q8")
    k, attn = model.kernels, model.net.weights.layers[1].attn
    qkv, o = attn.qkv, attn.o
    assert isinstance(qkv, RowParts) and isinstance(qkv.parts[2], QuantTensor) and qkv.parts[2].qtype == Q.F16
    assert isinstance(o, QuantTensor) and o.qtype == Q.BF16
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)) * 7
    for w, name, dtype in ((qkv.parts[2], "blk.1.attn_v.weight", torch.float16),
                           (o, "blk.1.attn_output.weight", torch.bfloat16)):
        ref = _file_matrix(name)
        want = x.to(dtype).double() @ ref.T
        exact = x.double() @ ref.T
        got = k.linear(x, w).double()
        slack = 1e-6 * (x.to(dtype).double().abs() @ ref.abs().T)
        assert ((got - want).abs() <= slack).all(), name
        assert ((exact - want).abs() > 10 * slack).any(), name  # the rounding is what is tested
        assert torch.equal(k.linear(x[:1], w), k.linear(x, w)[:1])  # one row: the decode kernel's bits


def test_q8_on_the_mix_file_gives_llama_cpps_logits_but_for_rounding_flips():
    """qwen3_moe-mix holds Q4_1, Q5_1, F16 and BF16 matrices: with both fixes, the recorded
    llama.cpp logits are ours up to the order of fp32 sums (1e-7 of the largest) at all but the
    rare position where such a difference lands an fp16/bf16/8-bit rounding on the other side
    (one of 14 here). Before, every position was 8e-3 to 1.4e-2 off."""
    rec, want = record(FIXTURES, "qwen3_moe-mix"), llama_logits(FIXTURES, "qwen3_moe-mix")
    got = expertcache.load(MIX, dtype="float32", activations="q8").logits(rec["prompt"]["tokens"])
    rows = (got - want).abs().amax(-1) / want.abs().max()
    assert int((rows < 1e-6).sum()) >= 11, rows.tolist()


def test_bf16_matrices_kept_as_the_files_rows_multiply_bf16_rows_as_before():
    """The CPU default (bf16, auto: 8-bit activations on quantized files) keeps BF16 dense matrices
    as the file's rows too: a bf16 input is its own bf16 rounding, so their products are those of
    the bf16 matrix dequantized at load, bit for bit, on the same kernels."""
    model = expertcache.load(MIX, dtype="bfloat16")
    k, o = model.kernels, model.net.weights.layers[1].attn.o
    assert isinstance(o, QuantTensor) and o.qtype == Q.BF16 and k.act8
    dense = _file_matrix("blk.1.attn_output.weight").to(torch.bfloat16).contiguous()
    for T in (1, 5, 30):
        x = (torch.randn(T, 256, generator=torch.Generator().manual_seed(T)) * 3).bfloat16()
        assert torch.equal(k.linear(x, o), k.linear(x, dense)), T


@pytest.mark.parametrize("name", ["gemma4/gemma4-F32", "gemma4/gemma4_v-F32"])
def test_q8_on_a_file_without_quantized_weights_is_llama_cpps_numerics(name):
    """On an F32 file, llama.cpp's numerics are its norms and GELU (no product rounds its input
    beside F32 weights): q8 turns them on, and the logits come 10x closer to llama.cpp's recorded
    ones. Before, q8 there changed nothing at all."""
    fixtures, stem = (FIXTURES / name).parent, Path(name).name
    rec, want = record(fixtures, stem), llama_logits(fixtures, stem)
    q8 = expertcache.load(fixtures / f"{stem}.gguf", dtype="float32", activations="q8")
    assert q8.kernels.ggml_norms and q8.kernels.activation("gelu_pytorch_tanh") is kernels.gelu_ggml
    exact = expertcache.load(fixtures / f"{stem}.gguf", dtype="float32", activations="exact")
    off = [float((m.logits(rec["prompt"]["tokens"]) - want).abs().max() / want.abs().max()) for m in (q8, exact)]
    assert off[0] * 5 < off[1], off


def test_q8_on_a_model_without_quantized_experts_in_bf16_is_refused_in_one_line(capsys):
    """In bf16 neither ggml's norms nor any rounding q8 would add applies there (a bf16 input is its
    own bf16 rounding): refused in one line rather than silently ignored."""
    from conftest import assert_one_line_error, run_cli
    from expertcache.errors import ExpertCacheError

    f32 = str(FIXTURES / "gemma4" / "gemma4-F32.gguf")
    assert_one_line_error(*run_cli(capsys, "run", "-m", f32, "-p", "hi", "-n", "1", "--dtype", "bfloat16",
                                   "--activations", "q8"), "--activations q8", "bfloat16", "--dtype float32")
    with pytest.raises(ExpertCacheError, match="without quantized experts .* expected --dtype float32"):
        kernels.select("auto", torch.device("cpu"), torch.bfloat16, quantized=False, activations="q8")
    # the defaults of such a model are untouched: auto leaves it exact, without ggml's norms
    k = kernels.select("auto", torch.device("cpu"), torch.bfloat16, quantized=False)
    assert k.act8_rows == 0 and not k.ggml_norms
