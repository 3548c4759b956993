"""GGUF metadata that changes the math: each key llama.cpp reads for these families is honoured as
llama.cpp honours it, or refused with one line naming it, never dropped without a word. The
references are transformers holding the file's dequantized weights (test_gguf_model.reference)
and the unchanged fixtures, which test_gguf_model checks against transformers and llama.cpp."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType as VT

import expertcache
from gguf_blocks import rewrite_gguf
from test_gguf_model import PROMPT, reference
from test_load_errors import _info_fails

FIXTURES = Path(__file__).parent / "fixtures" / "gguf"
MIX = FIXTURES / "qwen3_moe-mix.gguf"


def _f32(v):
    return v, VT.FLOAT32, None


def _u32(v):
    return v, VT.UINT32, None


def _s(v):
    return v, VT.STRING, None


@pytest.mark.parametrize("kv", [
    {"qwen3moe.rope.scaling.factor": _f32(4.0)},       # no type: llama.cpp's default type is linear
    {"qwen3moe.rope.scale_linear": _f32(4.0)},         # the key older converters wrote
    {"qwen3moe.rope.scaling.type": _s("linear"), "qwen3moe.rope.scaling.factor": _f32(4.0)},
], ids=["factor-only", "scale_linear", "linear"])
def test_linear_rope_scaling_is_honoured_as_llama_cpp_reads_it(tmp_path, kv):
    # The factor was dropped unless the type was given (and refused when it was): positions past
    # 0 rotated by other angles than llama.cpp's, without a word.
    path = rewrite_gguf(MIX, tmp_path / "m.gguf", kv)
    ref = reference("qwen3_moe-mix", {"rope_parameters": {"rope_type": "linear", "factor": 4.0,
                                                          "rope_theta": 10000.0}})
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    got = expertcache.load(path, dtype="float32").logits(PROMPT)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    unscaled = expertcache.load(MIX, dtype="float32").logits(PROMPT)
    assert float((unscaled - want).abs().max() / want.abs().max()) > 1e-2  # the factor matters here


@pytest.mark.parametrize("kv", [
    {"qwen3moe.rope.scaling.type": _s("none"), "qwen3moe.rope.scaling.factor": _f32(4.0)},
    {"qwen3moe.rope.scaling.factor": _f32(0.0)},  # llama.cpp reads 0 as no factor
    {"qwen3moe.rope.scaling.type": _s("linear"), "qwen3moe.rope.scaling.factor": _f32(1.0)},
    {"qwen3moe.rope.dimension_count": _u32(64), "qwen3moe.attention.value_length": _u32(64),
     "qwen3moe.expert_gating_func": _u32(1), "qwen3moe.expert_weights_scale": _f32(1.0),
     "qwen3moe.rope.scaling.attn_factor": _f32(1.0)},
], ids=["type-none", "factor-0", "factor-1", "identity-values"])
def test_metadata_that_changes_nothing_gives_the_files_logits(tmp_path, kv):
    path = rewrite_gguf(MIX, tmp_path / "m.gguf", kv)
    assert torch.equal(expertcache.load(path, dtype="float32").logits(PROMPT),
                       expertcache.load(MIX, dtype="float32").logits(PROMPT))


GEMMA4 = FIXTURES / "gemma4" / "gemma4-Q8_0.gguf"


@pytest.mark.parametrize("src,kv,needle", [
    # llama.cpp asserts n_rot == head dim for qwen3moe and refuses it for llama: every dim rotated
    # here would be another model than the file's.
    (MIX, {"qwen3moe.rope.dimension_count": _u32(32)}, "qwen3moe.rope.dimension_count 32: expected the head dim 64"),
    (FIXTURES / "mixtral-Q8_0.gguf", {"llama.rope.dimension_count": _u32(8)},
     "llama.rope.dimension_count 8: expected the head dim 16"),
    (MIX, {"qwen3moe.attention.value_length": _u32(32)},
     "qwen3moe.attention.value_length 32: expected the key length 64"),
    (MIX, {"qwen3moe.rope.scaling.type": _s("longrope"), "qwen3moe.rope.scaling.factor": _f32(4.0)},
     "qwen3moe.rope.scaling.type 'longrope' is not supported: expected none, linear or yarn"),
    (MIX, {"qwen3moe.rope.scaling.factor": _s("4")}, "qwen3moe.rope.scaling.factor '4': expected a number >= 0"),
    (MIX, {"qwen3moe.rope.scaling.attn_factor": _f32(2.0)}, "qwen3moe.rope.scaling.attn_factor 2.0 is not supported"),
    (MIX, {"qwen3moe.expert_gating_func": _u32(2)},
     "qwen3moe.expert_gating_func 2 is not supported: expected 1 (softmax)"),
    (MIX, {"qwen3moe.expert_weights_scale": _f32(2.5)}, "qwen3moe.expert_weights_scale 2.5 is not supported"),
    # Gemma 4's layers take their own RoPE tables (theta only): a linear factor is refused there.
    (GEMMA4, {"gemma4.rope.scaling.factor": _f32(2.0)}, "gemma4.rope.scaling.factor 2.0: linear RoPE scaling"),
], ids=["rot-qwen3moe", "rot-llama", "value-length", "longrope", "factor-string", "attn-factor", "gating-sigmoid",
        "weights-scale", "gemma4-linear"])
def test_metadata_that_would_change_the_math_is_refused_in_one_line(tmp_path, capsys, src, kv, needle):
    # Each was ignored: the file loaded and computed another model than llama.cpp's.
    _info_fails(capsys, rewrite_gguf(src, tmp_path / "m.gguf", kv), "m.gguf", needle)


def test_a_vocabulary_that_disagrees_with_the_embedding_is_refused(tmp_path, capsys):
    # llama.cpp refuses such a file (token_embd has the wrong shape); here it loaded, sampled ids
    # the tokenizer does not have (decoded as nothing) or failed at the first prompt that held one.
    r = GGUFReader(MIX)
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    for n in (4000, 4100):
        extra = [f"[X{i}]" for i in range(max(n - len(tokens), 0))]
        kv = {"tokenizer.ggml.tokens": ((tokens + extra)[:n], VT.ARRAY, VT.STRING),
              "tokenizer.ggml.token_type": ((types + [1] * len(extra))[:n], VT.ARRAY, VT.INT32)}
        _info_fails(capsys, rewrite_gguf(MIX, tmp_path / f"m{n}.gguf", kv), f"m{n}.gguf",
               f"tokenizer.ggml.tokens holds {n} tokens but tensor 'token_embd.weight' has 4096 rows")


def test_a_shared_expert_without_its_width_key_takes_its_tensors_width(tmp_path):
    # llama.cpp falls back to feed_forward_length where expert_shared_feed_forward_length is absent
    # (files from converters that did not write it); here the shared expert's tensors were refused
    # as unexpected.
    src = FIXTURES / "qwen2_moe-Q4_K_M.gguf"
    path = rewrite_gguf(src, tmp_path / "m.gguf", {"qwen2moe.expert_shared_feed_forward_length": None})
    model = expertcache.load(path, dtype="float32")
    assert model.cfg.shared_expert_intermediate_size == 128
    assert torch.equal(model.logits(PROMPT), expertcache.load(src, dtype="float32").logits(PROMPT))
    np.testing.assert_array_equal(model.tokenizer.encode("def f(x):"),
                                  expertcache.load(src).tokenizer.encode("def f(x):"))


def test_per_expert_tensors_of_old_files_are_named_as_such(tmp_path, capsys):
    # Mixtral files converted before llama.cpp stacked the experts (April 2024) hold
    # blk.N.ffn_{gate,down,up}.E.weight; the error named only the missing stacked tensor, as if the
    # file had no experts.
    src = FIXTURES / "mixtral-Q8_0.gguf"
    tensors = {}
    for t in GGUFReader(src).tensors:
        if "_exps." in t.name:
            tensors[t.name] = None
            part = t.name.split(".")[2].removeprefix("ffn_").removesuffix("_exps")
            data = np.array(t.data)
            for e in range(data.shape[0]):
                tensors[f"blk.{t.name.split('.')[1]}.ffn_{part}.{e}.weight"] = (data[e], t.tensor_type)
    path = rewrite_gguf(src, tmp_path / "m.gguf", tensors=tensors)
    _info_fails(capsys, path, "m.gguf", "missing tensor 'blk.0.ffn_gate_exps.weight'",
           "one tensor per expert ('blk.0.ffn_gate.0.weight'")


QWEN35 = FIXTURES / "qwen3_5_moe" / "qwen3_5_moe-Q8_0.gguf"


@pytest.mark.parametrize("src,key", [
    # Raw TypeErrors from inside the family's config (a string in `%` or `<`) ...
    (QWEN35, "qwen35moe.ssm.inner_size"), (QWEN35, "qwen35moe.ssm.state_size"),
    (QWEN35, "qwen35moe.rope.dimension_count"),
    # ... a check of another key blamed (value_length_swa against a key length of '4') ...
    (GEMMA4, "gemma4.attention.key_length_swa"),
    # ... or the string read as the number it spells (float('4')), without a word.
    (GEMMA4, "gemma4.rope.freq_base_swa"), (GEMMA4, "gemma4.final_logit_softcapping"),
], ids=lambda v: v if isinstance(v, str) else v.stem)
def test_a_family_key_holding_text_is_named(tmp_path, capsys, src, key):
    _info_fails(capsys, rewrite_gguf(src, tmp_path / "m.gguf", {key: _s("4")}), "m.gguf", f"{key} '4': expected a number")
