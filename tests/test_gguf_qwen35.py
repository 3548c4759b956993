"""Qwen3.5/3.6-MoE GGUF files (`qwen35moe`) as llama.cpp's converter writes them: the fixtures in
tests/fixtures/gguf/qwen3_5_moe (tools/make_gguf_fixtures.py: a tiny random text-only checkpoint
with 2 key heads for 4 value heads, converted to F32 and quantized to Q8_0 by llama.cpp) load
and run. References: llama.cpp's recorded logits, token ids and perplexity on the same files, and
transformers on the checkpoint the tool rebuilds from its seed."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import expertcache
from gguf_recordings import check_cache_independence, check_token_ids, llama_logits, record

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "gguf" / "qwen3_5_moe"
F32, Q8 = "qwen3_5_moe-F32", "qwen3_5_moe-Q8_0"
L, F = "linear_attention", "full_attention"


def _record(name: str) -> dict:
    return record(FIXTURES, name)


def _llama_logits(name: str) -> torch.Tensor:
    return llama_logits(FIXTURES, name)


def test_config_comes_from_the_metadata():
    cfg = expertcache.load(FIXTURES / f"{Q8}.gguf").cfg
    hf = _record(Q8)["hf_config"]
    assert cfg.layer_types == tuple(hf["layer_types"]) == (L, L, L, F)
    d = cfg.deltanet
    assert (d.k_heads, d.v_heads, d.k_head_dim, d.v_head_dim, d.conv_kernel) == (
        hf["linear_num_key_heads"], hf["linear_num_value_heads"], hf["linear_key_head_dim"],
        hf["linear_value_head_dim"], hf["linear_conv_kernel_dim"])
    assert d.k_heads != d.v_heads and d.tiled_v_heads  # the converter's head order, taken as is
    a = cfg.attention
    assert (a.heads, a.kv_heads, a.head_dim, a.rotary_dim) == (
        hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"], hf["head_dim"] // 4)
    assert (cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (
        hf["num_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"],
        hf["shared_expert_intermediate_size"])
    assert cfg.norm_topk_prob and cfg.tie_word_embeddings and cfg.rope.theta == hf["rope_parameters"]["rope_theta"]


def test_f32_logits_match_llama_cpps_recording():
    rec = _record(F32)
    want = _llama_logits(F32)
    got = expertcache.load(FIXTURES / f"{F32}.gguf", dtype="float32").logits(rec["prompt"]["tokens"])
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < 1e-4, rel  # F32 weights: only the order of fp32 sums differs
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_f32_logits_match_transformers_on_the_checkpoint():
    # The tool rebuilds the checkpoint bit for bit from its seed; the GGUF holds its weights.
    import gguf

    sys.path.insert(0, str(ROOT / "tools"))
    from gguf_fixture_models import FAMILIES, build_model

    rec = _record(F32)
    torch.manual_seed(0)
    ref = build_model(FAMILIES["qwen3_5_moe"], ROOT / "src" / "expertcache" / "assets" / "tiny-qwen3-moe")
    embd = next(t for t in gguf.GGUFReader(FIXTURES / f"{F32}.gguf").tensors if t.name == "token_embd.weight")
    assert torch.equal(ref.get_input_embeddings().weight, torch.from_numpy(np.array(embd.data)))
    assert ref.config.layer_types == rec["hf_config"]["layer_types"]
    model = expertcache.load(FIXTURES / f"{F32}.gguf", dtype="float32")
    # the prompt, and 150 held-out tokens: DeltaNet's chunked form over more than one chunk
    for ids in (rec["prompt"]["tokens"], rec["heldout"]["tokens"][:150]):
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
        assert want.abs().max() > 5.0
        torch.testing.assert_close(model.logits(ids), want, atol=1e-4, rtol=0)


def test_q8_0_logits_are_close_to_llama_cpps():
    # llama.cpp rounds activations to 8 bits in its Q8_0 products: a loose bound only.
    rec = _record(Q8)
    want = _llama_logits(Q8)
    got = expertcache.load(FIXTURES / f"{Q8}.gguf", dtype="float32").logits(rec["prompt"]["tokens"])
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel < 0.05, rel
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


# F32: equal but for the order of fp32 sums (1.8e-7 seen). Q8_0 in bf16: llama.cpp's 8-bit
# activations and our bf16 ones move the perplexity of this random model (log ppl ~14, widely
# spread logits) by 1.4% (1.0% in fp32); a wrong weight or chunking moves it by far more.
# With llama.cpp's numerics (`--activations q8`, fp32) it is llama.cpp's: tests/test_act8.py.
@pytest.mark.parametrize("name,dtype,bound", [(F32, "float32", 1e-5), (Q8, "bfloat16", 0.03)])
def test_perplexity_agrees_with_llama_cpps_recording(name, dtype, bound):
    from expertcache.perplexity import perplexity

    rec = _record(name)
    model = expertcache.load(FIXTURES / f"{name}.gguf", dtype=dtype)
    got = perplexity(model, rec["heldout"]["tokens"], n_ctx=rec["perplexity"]["n_ctx"])
    assert len(got.chunks) == rec["perplexity"]["chunks"]
    assert all(c.count == rec["perplexity"]["scored_per_chunk"] for c in got.chunks)
    assert abs(got.ppl / rec["perplexity"]["ppl"] - 1) < bound, (got.ppl, rec["perplexity"]["ppl"])


@pytest.mark.parametrize("name", [F32, Q8])
def test_token_ids_equal_llama_cpps(name):
    check_token_ids(FIXTURES, name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_results_never_depend_on_the_cache(dtype):
    # the recurrent form after the prefill
    check_cache_independence(FIXTURES, Q8, dtype, tokens=90, prefill=80, ubatch=32)


def _without(monkeypatch, key: str) -> None:
    """GGUF files read as if their metadata lacked `key`."""
    from expertcache.models import gguf_loader

    class Without(gguf_loader.GGUFCheckpoint):
        def __init__(self, path):
            super().__init__(path)
            self.metadata = {k: v for k, v in self.metadata.items() if k != key}

    monkeypatch.setattr(gguf_loader, "GGUFCheckpoint", Without)


def test_without_recurrent_layers_the_interval_gives_the_layer_types(monkeypatch):
    # Converters before `attention.recurrent_layers` wrote only full_attention_interval.
    path = FIXTURES / f"{Q8}.gguf"
    ids = _record(Q8)["prompt"]["tokens"]
    want = expertcache.load(path, dtype="float32").logits(ids)
    _without(monkeypatch, "qwen35moe.attention.recurrent_layers")
    model = expertcache.load(path, dtype="float32")
    assert model.cfg.layer_types == (L, L, L, F)
    assert torch.equal(model.logits(ids), want)


@pytest.mark.parametrize("key", ["qwen35moe.ssm.group_count", "qwen35moe.ssm.inner_size"])
def test_a_missing_metadata_key_is_one_line_naming_it(monkeypatch, key):
    from expertcache.errors import ExpertCacheError

    _without(monkeypatch, key)
    with pytest.raises(ExpertCacheError) as e:
        expertcache.load(FIXTURES / f"{Q8}.gguf")
    msg = str(e.value)
    assert "\n" not in msg and key in msg and f"{Q8}.gguf" in msg, msg


@pytest.mark.parametrize("recurrent", [5, 4, None])
def test_a_multi_token_prediction_layer_is_skipped(tmp_path, capsys, recurrent):
    # llama.cpp's converter writes Qwen3.5/3.6's MTP head as one more block after the model's own
    # (blk.N.*: a full-attention layer with experts, and nextn.* tensors), counted in block_count
    # and named by nextn_predict_layers; only speculative decoding runs it. The logits are those of
    # the file without it, whether recurrent_layers covers the extra block or not (or is absent).
    from gguf import GGMLQuantizationType as Q, GGUFReader, GGUFValueType as VT
    from gguf_blocks import rewrite_gguf

    from expertcache.models.pack_gguf import pack_gguf

    src, n, d = FIXTURES / f"{Q8}.gguf", 4, 32
    mtp = {t.name.replace("blk.3.", f"blk.{n}.", 1): (np.array(t.data), t.tensor_type)
           for t in GGUFReader(src).tensors if t.name.startswith("blk.3.")}
    mtp[f"blk.{n}.nextn.eh_proj.weight"] = (np.random.default_rng(0).standard_normal((d, 2 * d), np.float32), Q.F32)
    mtp |= {f"blk.{n}.nextn.{x}.weight": (np.ones(d, np.float32), Q.F32) for x in ("enorm", "hnorm", "shared_head_norm")}
    types = {5: ([True, True, True, False, False], VT.ARRAY, VT.BOOL),
             4: ([True, True, True, False], VT.ARRAY, VT.BOOL), None: None}
    kv = {"qwen35moe.block_count": (n + 1, VT.UINT32, None), "qwen35moe.nextn_predict_layers": (1, VT.UINT32, None),
          "qwen35moe.attention.recurrent_layers": types[recurrent]}
    path = rewrite_gguf(src, tmp_path / "mtp.gguf", kv, mtp)
    ids = _record(Q8)["prompt"]["tokens"]
    want = expertcache.load(src).logits(ids)
    capsys.readouterr()
    model = expertcache.load(path)
    assert f"skipping the multi-token-prediction layer (blk.{n}.*: {len(mtp)} tensors)" in capsys.readouterr().err
    assert model.cfg.num_layers == n and model.cfg.layer_types == (L, L, L, F)
    assert torch.equal(model.logits(ids), want)
    # `pack` copies the block as it is; the packed file skips it too
    packed = pack_gguf(path, tmp_path / "packed.gguf", progress=False)
    assert torch.equal(expertcache.load(packed).logits(ids), want)


def test_a_packed_f32_file_computes_as_its_source(tmp_path):
    # An F32 file computes in fp32 by default; its packed copy (experts in one I8 tensor per layer)
    # computed in bf16 and gave other logits. The packed format's types decide now.
    from expertcache.models.pack_gguf import pack_gguf

    src = FIXTURES / f"{F32}.gguf"
    packed = pack_gguf(src, tmp_path / "packed.gguf", progress=False)
    ids = _record(F32)["prompt"]["tokens"]
    model = expertcache.load(packed)
    assert model.cfg.dtype == torch.float32
    assert torch.equal(model.logits(ids), expertcache.load(src).logits(ids))
