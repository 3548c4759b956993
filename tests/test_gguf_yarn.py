"""GGUF files with YaRN RoPE scaling (`{arch}.rope.scaling.type = yarn`), as llama.cpp's
convert_hf_to_gguf.py writes them for Qwen3's "128K" configs (rope_scaling {yarn, factor 4,
original_max_position_embeddings 32768}): the type, `rope.scaling.factor` and
`rope.scaling.original_context_length`, nothing else. They were refused in one line; llama.cpp
runs them. The references: the same weights as a Hugging Face checkpoint in transformers and in
our safetensors path, and llama.cpp's YaRN transcribed from its sources (llama-model.cpp reads
the keys, llama-context.cpp derives ext_factor and the magnitude, ggml's rope_yarn computes)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGUFReader, GGUFValueType as VT

import expertcache
from expertcache.models.layers import Rotary
from expertcache.models.synth import synth
from gguf_blocks import rewrite_gguf
from test_load_errors import _info_fails

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

ORIGINAL = 128  # the context before YaRN: the prompt below runs well past it
YARN = {"qwen3moe.rope.scaling.type": ("yarn", VT.STRING, None),
        "qwen3moe.rope.scaling.factor": (4.0, VT.FLOAT32, None),
        "qwen3moe.rope.scaling.original_context_length": (ORIGINAL, VT.UINT32, None)}
PROMPT = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(checkpoint, its GGUF without the scaling keys, its GGUF with them): a Qwen3-MoE whose
    config.json carries the rope_scaling Qwen's model cards give for 128K, scaled down."""
    from to_gguf import convert

    d = tmp_path_factory.mktemp("yarn")
    hf = synth(d / "hf", like="tiny", layers=2, experts=4, top_k=2, vocab=300, dtype="float32", progress=False,
               overrides={"max_position_embeddings": 4 * ORIGINAL, "rope_theta": 10000.0,
                          "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": ORIGINAL}})
    converted = d / "converted.gguf"
    convert(hf, converted)  # tools/to_gguf.py writes the scaling keys as llama.cpp's converter does
    written = GGUFReader(converted).fields
    assert {k: written[k].contents() for k in YARN} == {k: v[0] for k, v in YARN.items()}
    plain = rewrite_gguf(converted, d / "plain.gguf", {k: None for k in YARN})
    return hf, plain, rewrite_gguf(plain, d / "yarn.gguf", YARN)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_a_yarn_gguf_computes_its_checkpoint_past_the_original_context(files):
    import transformers as tf

    hf, plain, yarn = files
    ref = tf.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assert ref.config.rope_parameters["rope_type"] == "yarn"
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    got = expertcache.load(yarn, dtype="float32").logits(PROMPT)
    safetensors = expertcache.load(hf, dtype="float32").logits(PROMPT)
    past = slice(ORIGINAL, None)
    assert _rel(got[past], want[past]) < 1e-5
    assert _rel(got, safetensors) < 1e-6
    # Without the keys the same weights are another model there: the scaling is what is checked.
    unscaled = expertcache.load(plain, dtype="float32").logits(PROMPT)
    assert _rel(unscaled[past], want[past]) > 1e-2


def _llama_cpp_yarn(dim: int, base: float, factor: float, n_ctx_orig: int) -> tuple[torch.Tensor, float]:
    """llama.cpp's YaRN for a file that gives only type, factor and original context: per rotated
    pair the angle per position, and the factor on cos and sin. llama-context.cpp: ext_factor -1
    (unset) becomes 1 for YaRN; yarn_attn_factor = get_mscale(factor) / (1 + 0.1 ln factor), times
    rope.scaling.attn_factor (1). ggml (ggml.c, ops.cpp): corr dims floor/ceil of
    n_dims ln(n_ctx_orig / (2 pi beta)) / (2 ln base) for beta 32 and 1, clamped to [0, n_dims - 1];
    ramp_mix = 1 - clamp((i0/2 - low) / max(0.001, high - low), 0, 1); the angle
    theta_interp (1 - ramp_mix) + theta_extrap ramp_mix with theta_interp = theta_extrap / factor;
    the magnitude times 1 + 0.1 ln(1 / freq_scale)."""
    freq_scale, ext_factor = 1.0 / factor, 1.0

    def corr_dim(beta: float) -> float:
        return dim * math.log(n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(0.0, math.floor(corr_dim(32.0))), min(dim - 1.0, math.ceil(corr_dim(1.0)))
    per_position = []
    for i0 in range(0, dim, 2):
        extrap = base ** (-i0 / dim)
        mix = (1 - min(1.0, max(0.0, (i0 // 2 - low) / max(0.001, high - low)))) * ext_factor
        per_position.append(freq_scale * extrap * (1 - mix) + extrap * mix)
    get_mscale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    attn_factor = get_mscale / (1.0 + 0.1 * math.log(factor)) * 1.0
    return torch.tensor(per_position, dtype=torch.float64), attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale))


@pytest.mark.parametrize("base,context,original", [(1e6, 131072, 32768), (10000.0, 512, ORIGINAL)],
                         ids=["qwen3-128k", "tiny"])
def test_the_rope_tables_are_llama_cpps_yarn(files, base, context, original):
    # Qwen3-30B-A3B-128K's metadata on the tiny model (16 dims rotated: a ramp over dims 2..5).
    kv = {**YARN, "qwen3moe.rope.freq_base": (base, VT.FLOAT32, None),
          "qwen3moe.context_length": (context, VT.UINT32, None),
          "qwen3moe.rope.scaling.original_context_length": (original, VT.UINT32, None)}
    path = rewrite_gguf(files[1], files[1].parent / f"yarn-{context}.gguf", kv)
    cfg = expertcache.load(path, dtype="float32").cfg
    want, scale = _llama_cpp_yarn(cfg.head_dim, base, 4.0, original)
    inv_freq, got_scale = cfg.rope.inv_freq(cfg.head_dim)
    extrapolated = base ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    assert (want == extrapolated).any() and (want < extrapolated / 3.9).any()  # both ends of the ramp
    torch.testing.assert_close(inv_freq.double(), want, rtol=1e-6, atol=0)
    assert got_scale == pytest.approx(scale, rel=1e-6) and scale == pytest.approx(1 + 0.1 * math.log(4.0))
    # The tables the attention reads, past the original context: cos and sin of those angles, scaled.
    rot = Rotary(cfg, torch.device("cpu"), torch.float32)
    cos, sin = rot(original, 64, limit=context)
    angles = torch.arange(original, original + 64, dtype=torch.float64)[:, None] * want[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    atol = 2 * (original + 64) * 2.0 ** -24 + 1e-6  # fp32 angles: both engines round p * frequency
    torch.testing.assert_close(cos.double(), angles.cos() * scale, rtol=0, atol=atol)
    half = cfg.head_dim // 2
    torch.testing.assert_close(sin[:, half:].double(), (angles.sin() * scale)[:, half:], rtol=0, atol=atol)


def _kv(**extra):
    return {**YARN, **{f"qwen3moe.rope.scaling.{k}": v for k, v in extra.items()}}


def test_yarn_keys_as_llama_cpp_defaults_them(files, tmp_path):
    _, plain, yarn = files
    want = expertcache.load(yarn, dtype="float32").logits(PROMPT[:160])
    # llama.cpp: original context 0 or absent is the context length; a factor of 0 or none is no
    # scaling; the yarn_* keys at the values llama.cpp computes these families with change nothing.
    kv = _kv(original_context_length=None)
    assert expertcache.load(rewrite_gguf(plain, tmp_path / "a.gguf", kv)).cfg.rope.original_max_position == 4 * ORIGINAL
    kv = _kv(original_context_length=(0, VT.UINT32, None))
    assert expertcache.load(rewrite_gguf(plain, tmp_path / "b.gguf", kv)).cfg.rope.original_max_position == 4 * ORIGINAL
    kv = _kv(factor=None)
    assert expertcache.load(rewrite_gguf(plain, tmp_path / "c.gguf", kv)).cfg.rope.type == "default"
    kv = _kv(yarn_beta_fast=(32.0, VT.FLOAT32, None), yarn_beta_slow=(1.0, VT.FLOAT32, None),
             yarn_ext_factor=(1.0, VT.FLOAT32, None), yarn_attn_factor=(1.0, VT.FLOAT32, None),
             yarn_log_multiplier=(0.0, VT.FLOAT32, None), finetuned=(True, VT.BOOL, None))
    got = expertcache.load(rewrite_gguf(plain, tmp_path / "d.gguf", kv), dtype="float32").logits(PROMPT[:160])
    assert torch.equal(got, want)


@pytest.mark.parametrize("kv,needle", [
    # llama.cpp reads these for DeepSeek, Grok, Mistral 3, not for these families: it computes with
    # beta_fast 32 whatever the file says, so a file's 8 is a model neither engine runs.
    (_kv(yarn_beta_fast=(8.0, VT.FLOAT32, None)),
     "qwen3moe.rope.scaling.yarn_beta_fast 8.0 is not supported: expected 32.0"),
    (_kv(yarn_log_multiplier=(0.1, VT.FLOAT32, None)), "qwen3moe.rope.scaling.yarn_log_multiplier"),
    (_kv(original_context_length=("32768", VT.STRING, None)),
     "qwen3moe.rope.scaling.original_context_length '32768': expected an integer >= 0"),
    ({**YARN, "qwen3moe.rope.scaling.type": ("longrope", VT.STRING, None)},
     "qwen3moe.rope.scaling.type 'longrope' is not supported: expected none, linear or yarn"),
    ({**YARN, "qwen3moe.rope.scaling.type": ("su", VT.STRING, None)}, "qwen3moe.rope.scaling.type 'su'"),
], ids=["beta-fast", "log-multiplier", "original-string", "longrope", "su"])
def test_what_llama_cpp_would_not_compute_is_refused_in_one_line(files, tmp_path, capsys, kv, needle):
    _info_fails(capsys, rewrite_gguf(files[1], tmp_path / "m.gguf", kv), "m.gguf", needle)


def test_gemma4_refuses_yarn_in_one_line(tmp_path, capsys):
    # Gemma 4's layers build their own RoPE tables (theta per layer kind, rope_freqs).
    src = Path(__file__).parent / "fixtures" / "gguf" / "gemma4" / "gemma4-Q8_0.gguf"
    kv = {"gemma4.rope.scaling.type": ("yarn", VT.STRING, None), "gemma4.rope.scaling.factor": (4.0, VT.FLOAT32, None)}
    _info_fails(capsys, rewrite_gguf(src, tmp_path / "m.gguf", kv), "m.gguf",
                "gemma4.rope.scaling.factor 4.0: yarn RoPE scaling is not supported for gemma4")
