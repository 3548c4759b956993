"""torch dequantization of ggml blocks against gguf-py's, bit for bit, for every supported type."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from expertcache.errors import ExpertCacheError
from expertcache.kernels import dequant
from gguf_blocks import llama_cpp_tensors, random_rows

TYPES = [t.name for t in dequant.SUPPORTED]


def reference(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype))).reshape(shape)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit for bit: NaN payloads and the sign of zero included."""
    assert got.dtype == want.dtype and got.shape == want.shape
    bits = {4: torch.int32, 2: torch.int16}[got.element_size()]
    assert torch.equal(got.view(bits), want.view(bits)), (got.float() - want.float()).abs().nan_to_num().max()


def test_the_supported_types_are_the_ones_promised():
    assert set(TYPES) == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
                          "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("blocks_per_row,lead", [(1, (1,)), (4, (3,)), (2, (2, 3)), (8, (37,))])
def test_bit_identical_to_gguf(name, blocks_per_row, lead):
    qtype = Q[name]
    cols = GGML_QUANT_SIZES[qtype][0] * blocks_per_row
    rows = int(np.prod(lead))
    raw = random_rows(qtype, rows, cols, seed=rows * 31 + cols)
    shape = (*lead, cols)
    want = reference(raw, qtype, shape)
    assert_same_bits(dequant.dequantize(torch.from_numpy(raw.reshape(-1)), qtype, shape), want)
    assert_same_bits(dequant.dequantize(torch.from_numpy(raw), int(qtype), shape), want)  # [rows, row_bytes]


@pytest.mark.parametrize("name", TYPES)
def test_bit_identical_across_chunks(name):
    """A tensor larger than one CPU chunk: every chunk starts and ends where it should."""
    qtype = Q[name]
    cols = max(GGML_QUANT_SIZES[qtype][0], 512)
    rows = 2 * dequant.CPU_CHUNK // cols + 3
    raw = random_rows(qtype, rows, cols, seed=7)
    want = reference(raw, qtype, (rows, cols))
    assert_same_bits(dequant.dequantize(torch.from_numpy(raw), qtype, (rows, cols)), want)


def test_bit_identical_on_every_tensor_llama_cpp_quantized():
    """Real blocks, as llama-quantize writes them, of every supported type (the fixtures hold
    all fifteen), including 3-D expert tensors."""
    seen = set()
    for name, qtype, shape, raw in llama_cpp_tensors():
        got = dequant.dequantize(torch.from_numpy(raw), qtype, shape)
        assert_same_bits(got, reference(raw, qtype, shape))
        seen.add(qtype.name)
    assert seen == set(TYPES)


def test_random_f32_and_bf16_bytes_keep_their_bits():
    """Every bit pattern, NaNs and infinities included, comes through unchanged."""
    raw = np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8)
    for qtype, n in ((Q.F32, 1024), (Q.BF16, 2048)):
        assert_same_bits(dequant.dequantize(torch.from_numpy(raw), qtype, (n,)), reference(raw, qtype, (n,)))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "IQ4_XS", "BF16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_into_rounds_the_float32_values_once(name, dtype):
    qtype = Q[name]
    cols = GGML_QUANT_SIZES[qtype][0] * 2
    raw = random_rows(qtype, 5, cols, seed=11, lo=-12, hi=0)
    out = torch.full((5, cols), float("nan"), dtype=dtype)
    assert dequant.dequantize_into(torch.from_numpy(raw), qtype, (5, cols), out) is out
    assert_same_bits(out, reference(raw, qtype, (5, cols)).to(dtype))


def test_row_bytes_uses_ggml_block_sizes():
    assert dequant.row_bytes(Q.Q4_K, 2048) == 8 * 144
    assert dequant.row_bytes(Q.Q8_0, 768) == 24 * 34
    assert dequant.row_bytes(int(Q.Q6_K), 768) == 3 * 210
    assert dequant.row_bytes(Q.F16, 5) == 10


@pytest.mark.parametrize("qtype,named", [(Q.Q8_1, "Q8_1"), (Q.IQ2_XXS, "IQ2_XXS"), (int(Q.TQ1_0), "TQ1_0"),
                                         (999, "999")])
def test_unsupported_type_is_a_one_line_error_naming_it(qtype, named):
    raw = torch.zeros(64, dtype=torch.uint8)
    for call in (lambda: dequant.dequantize(raw, qtype, (256,)), lambda: dequant.row_bytes(qtype, 256)):
        with pytest.raises(ExpertCacheError) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and named in msg and "Q4_K" in msg and "IQ4_XS" in msg


def test_bad_sizes_are_errors_naming_the_value():
    with pytest.raises(ExpertCacheError, match="takes 288 bytes; got 287"):
        dequant.dequantize(torch.zeros(287, dtype=torch.uint8), Q.Q4_K, (2, 256))
    with pytest.raises(ExpertCacheError, match="100 weights is not a whole number of Q4_K blocks"):
        dequant.dequantize(torch.zeros(144, dtype=torch.uint8), Q.Q4_K, (100,))
    with pytest.raises(ExpertCacheError, match="expected torch.uint8"):
        dequant.dequantize(torch.zeros(36), Q.Q4_K, (256,))
    with pytest.raises(ExpertCacheError, match="expected a contiguous floating tensor of shape"):
        dequant.dequantize_into(torch.zeros(34, dtype=torch.uint8), Q.Q8_0, (32,), torch.empty(32, dtype=torch.int32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", TYPES)
def test_bit_identical_on_cuda(name):
    qtype = Q[name]
    cols = GGML_QUANT_SIZES[qtype][0] * 4
    raw = random_rows(qtype, 9, cols, seed=5)
    got = dequant.dequantize(torch.from_numpy(raw).cuda(), qtype, (9, cols))
    assert got.device.type == "cuda"
    assert_same_bits(got.cpu(), reference(raw, qtype, (9, cols)))
