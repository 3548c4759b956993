"""`--activations q8` (llama.cpp's numerics) on a GGUF's F16 and BF16 *expert* matrices.

ggml multiplies F16 (BF16) weights with the input rounded to fp16 (bf16) first (their
`vec_dot_type`), in fp32. Expert matrices of those types are held in float32 slots (widened,
exactly) and were multiplied with the input as it was, so q8 was not llama.cpp's numerics for
them, neither in an expert of float matrices nor for a float matrix among quantized ones. The
files here are qwen3_moe-mix with its experts' weights written again as F16/BF16 (the gguf
package's values of the file's blocks); llama.cpp's logits on them were taken with
tools/llamacpp_ref.py's `Reference` (llama-cpp-python 0.3.36, one thread, F32 K/V cache).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType as Q

import expertcache
from expertcache import CacheConfig, kernels
from expertcache.tiers.layout import ExpertFormat, expert_weights, slot_nbytes
from expertcache.tiers.store import convert
from gguf_blocks import rewrite_gguf
from gguf_recordings import record

FIXTURES = Path(__file__).parent / "fixtures" / "gguf"
MIX = FIXTURES / "qwen3_moe-mix.gguf"  # experts: layer 0 Q4_K/Q4_K/Q6_K, layer 1 Q2_K/Q2_K/Q3_K
CPU = torch.device("cpu")
TYPES = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}
# Experts of float matrices only: layer 0's F16, layer 1's BF16.
FLOAT_EXPERTS = {f"blk.{i}.ffn_{p}_exps.weight": q for i, q in ((0, Q.F16), (1, Q.BF16)) for p in ("gate", "up", "down")}
# A float matrix among quantized ones (llama.cpp's quantizer keeps such matrices in F16).
MIXED_EXPERTS = {"blk.0.ffn_down_exps.weight": Q.BF16, "blk.1.ffn_down_exps.weight": Q.F16}

# llama.cpp's logits of the recorded prompt at POSITIONS, for token ids IDS, and the largest
# magnitude of all its prompt logits (the scale differences are taken against).
POSITIONS = (1, 4, 7, 10, 13)
IDS = [3320, 1075, 1384, 2825, 7, 100, 1000, 4000]
LLAMA = {
    "mixed": (11.968303680419922, {
        1: [1.2332234382629395, 0.5794312357902527, -4.0060954093933105, 5.780943870544434, 1.0744518041610718,
            3.876960515975952, 0.17359644174575806, 2.2271275520324707],
        4: [2.251107692718506, 4.1575236320495605, 4.313708305358887, 4.435673236846924, -2.2548484802246094,
            1.2191805839538574, 0.4939989447593689, 5.056460380554199],
        7: [3.1844630241394043, 7.8240742683410645, 6.210691928863525, 5.816274166107178, -1.317081332206726,
            3.5988073348999023, -0.18259447813034058, 1.5497339963912964],
        10: [3.959528684616089, 3.222081184387207, 6.825258731842041, 1.276965618133545, -1.3663653135299683,
             1.353760004043579, -3.004598617553711, 5.021708011627197],
        13: [10.91755199432373, 10.867398262023926, 10.726517677307129, 10.707317352294922, -2.0892274379730225,
             -1.9141994714736938, -2.3776187896728516, 0.2826104164123535],
    }),
    "float": (11.97542667388916, {
        1: [1.2623487710952759, 0.5882470011711121, -3.9923088550567627, 5.798478603363037, 1.1069681644439697,
            3.8850560188293457, 0.23091770708560944, 2.2638025283813477],
        4: [2.277963161468506, 4.123117923736572, 4.275606632232666, 4.3849945068359375, -2.2657830715179443,
            1.2070021629333496, 0.43809428811073303, 5.040160179138184],
        7: [3.2297515869140625, 7.817946434020996, 6.292636871337891, 5.799076080322266, -1.311407208442688,
            3.6136248111724854, -0.16025160253047943, 1.490729570388794],
        10: [3.93129825592041, 3.174692153930664, 6.854783535003662, 1.2524741888046265, -1.3350331783294678,
             1.349036455154419, -2.961329936981201, 5.012580394744873],
        13: [10.95986557006836, 10.849091529846191, 10.676437377929688, 10.692227363586426, -2.1586735248565674,
             -1.8485488891601562, -2.3545029163360596, 0.24452023208141327],
    }),
}


def _rewritten(path: Path, plan: dict) -> Path:
    """The mix file with the tensors of `plan` written again in its types (F16/BF16) from the gguf
    package's values of their blocks."""
    tensors = {t.name: t for t in gguf.GGUFReader(MIX).tensors}
    out = {}
    for name, qtype in plan.items():
        t = tensors[name]
        x = torch.from_numpy(gguf.quants.dequantize(np.array(t.data), t.tensor_type).astype(np.float32))
        data = x.half().numpy() if qtype == Q.F16 else x.bfloat16().view(torch.int16).numpy()
        out[name] = (data, qtype)
    return rewrite_gguf(MIX, path, tensors=out)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("q8_float_experts")
    return {"float": _rewritten(d / "float_experts.gguf", FLOAT_EXPERTS),
            "mixed": _rewritten(d / "mixed_experts.gguf", MIXED_EXPERTS)}


def _exact_values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Weights k/16, k in -8..8: exact in fp16 and bf16, and their products with the inputs below
    sum exactly in fp32 in any order."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-8, 9, shape, generator=g).float() / 16).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_float_experts_products_take_the_input_rounded_to_the_files_type(dtype):
    """An expert the file stores as fp16 (bf16), held in a float32 slot: under q8 its gate and up
    products take x rounded to fp16 (bf16) and its down product the intermediate so rounded, each
    multiplied in fp32 (ggml's formula, by hand in float64). x is a/64 (a odd, 8 bits) plus less
    than half a step of either type, which the rounding removes: the gate/up sums are then exact in
    any order, and the intermediate is torch's SiLU of them, rounded. Exact activations stay the
    plain product of the widened weights, bit for bit."""
    D, I, T = 256, 128, 6
    gate, up, down = _exact_values((I, D), dtype, 1), _exact_values((I, D), dtype, 2), _exact_values((D, I), dtype, 3)
    src_fmt = ExpertFormat.of([("gate", dtype, (I, D)), ("up", dtype, (I, D)), ("down", dtype, (D, I))])
    fmt = src_fmt.with_dtype(torch.float32)
    assert [m.file_dtype for m in fmt.matrices] == [dtype] * 3
    assert all(m.file_dtype is None for m in src_fmt.with_dtype(torch.bfloat16).matrices)  # not widened: nothing kept
    src = torch.cat([m.contiguous().view(torch.uint8).reshape(-1) for m in (gate, up, down)])[None]
    slot = torch.zeros((1, slot_nbytes([fmt])), dtype=torch.uint8)
    convert(src, src_fmt, slot, fmt)  # the store's conversion of a slot fill
    w = expert_weights(slot[0], fmt)
    assert isinstance(w.gate_up, torch.Tensor) and w.gate_up.dtype == torch.float32

    g = torch.Generator().manual_seed(4)
    a = (torch.randint(0, 128, (T, D), generator=g) * 2 + 1) * torch.where(torch.rand(T, D, generator=g) < 0.5, -1, 1)
    x = a.float() / 64 + torch.rand(T, D, generator=g) * 2.0 ** -20
    xr = x.to(dtype).float()
    assert torch.equal(xr, a.float() / 64) and not torch.equal(xr, x)
    gate_up = xr.double() @ torch.cat((gate, up)).double().T  # [T, 2I], exactly the fp32 sums
    h = (F.silu(gate_up[:, :I].float()) * gate_up[:, I:].float()).to(dtype).double()
    want = h @ down.double().T
    slack = 1e-6 * (h.abs() @ down.double().abs().T)

    q8 = kernels.select("torch", CPU, torch.float32, quantized=False, activations="q8")
    got = q8.expert(x, w).double()
    assert ((got - want).abs() <= slack).all(), float(((got - want).abs() / slack).max())
    assert torch.equal(q8.expert(x[2:3], w), q8.expert(x, w)[2:3])  # a row alone: its bits among others

    exact = kernels.select("torch", CPU, torch.float32, quantized=False, activations="exact")
    plain = exact.expert(x, w)
    assert torch.equal(plain, exact.swiglu(x, w.gate_up, w.down))
    assert ((plain.double() - want).abs() > 10 * slack).any()  # the rounding is what is tested


@pytest.mark.parametrize("name", ["mixed", "float"])
def test_q8_on_f16_and_bf16_experts_gives_llama_cpps_logits(files, name):
    """The prompt's logits against llama.cpp's: with every product's input rounded as ggml rounds
    it, within 1e-6 of the largest logit at the positions checked (a float matrix among quantized
    ones), or at all but one (experts of float matrices only, where an fp16 rounding of the
    intermediate lands on the other side now and then: the order of fp32 sums is still ours).
    Before, every position checked was 1e-3 or more away, as with exact activations."""
    scale, want = LLAMA[name]
    tokens = record(FIXTURES, "qwen3_moe-mix")["prompt"]["tokens"]

    def off(activations: str) -> list[float]:
        got = expertcache.load(files[name], dtype="float32", activations=activations).logits(tokens)
        return [float((got[p, IDS].double() - torch.tensor(want[p], dtype=torch.float64)).abs().max()) / scale
                for p in POSITIONS]

    q8 = off("q8")
    assert sum(d < 1e-6 for d in q8) >= len(POSITIONS) - (name == "float"), q8
    assert all(d > 1e-4 for d in off("exact"))


@pytest.mark.parametrize("name", ["mixed", "float"])
def test_q8_float_experts_do_not_depend_on_the_cache(files, name):
    """Prefill in micro-batches, then one token at a time: the same bits in every cache mode and
    store, prefetch on, one slot, as with every expert resident."""
    ids = record(FIXTURES, "qwen3_moe-mix")["heldout"]["tokens"][:30]

    def run(cache):
        m = expertcache.load(files[name], dtype="float32", activations="q8", cache=cache)
        assert any(mf.file_dtype is not None for mf in m.experts.formats[1].matrices)
        s = m.new_session()
        out = [m.prefill(s, ids[:20], ubatch=8, all_logits=True)] + [m.prefill(s, [t], all_logits=True) for t in ids[20:]]
        return torch.cat(out), m.telemetry()

    want, _ = run(CacheConfig(mode="resident"))
    for cache in (CacheConfig(mode="cache", experts=1), CacheConfig(mode="cache", fraction=0.5, store="disk", policy="lfu"),
                  CacheConfig(mode="cache", experts=4, store="mmap", prefetch="on"),
                  CacheConfig(mode="staging", store="mmap")):
        got, tel = run(cache)
        assert torch.equal(got, want), cache
        assert tel["total"]["copied_experts"] > 0, cache


def test_bf16_and_exact_runs_hold_and_multiply_float_experts_as_before(files):
    """Nothing changes where nothing rounds: in bf16 (the CPU default) a float expert matrix is
    held in bf16 with no file type beside it, and with exact activations an expert's product from
    its slot is the plain product of the widened weights, bit for bit, where q8's is not."""
    m = expertcache.load(files["mixed"], dtype="bfloat16")
    assert all(mf.file_dtype is None for f in m.experts.formats.values() for mf in f.matrices)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    outs = {}
    for activations in ("exact", "q8"):
        model = expertcache.load(files["float"], dtype="float32", activations=activations)
        assert [mf.file_dtype for mf in model.experts.formats[0].matrices] == [torch.float16] * 3
        for wave in model.experts.acquire(0, [3]):
            (_, w), = wave
            outs[activations] = model.kernels.expert(x, w)
            plain = model.kernels.swiglu(x, w.gate_up, w.down)
    assert torch.equal(outs["exact"], plain) and not torch.equal(outs["q8"], plain)
