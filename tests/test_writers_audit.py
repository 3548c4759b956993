"""The commands that write models (`synth`, `pack`), checked against what others read: the
checkpoints `synth` writes load in transformers complete and give our logits; `pack` keeps every
tensor and the dtype the source computes in; flags that cannot apply are refused."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from gguf import GGUFReader
from safetensors.torch import load_file, save_file

import expertcache
from conftest import assert_one_line_error, run_cli, save_checkpoint
from expertcache.models.pack import pack
from expertcache.models.synth import PRESETS, synth

IDS = torch.tensor([3, 100, 7, 200, 55, 9, 12, 250, 1, 2, 40, 41, 258, 17, 99, 64])

# Each preset's layer kinds at a width that loads in a blink (qwen3.6 with 4 layers: a full
# attention layer after three Gated DeltaNet ones).
SMALL = {
    "qwen3-30b-a3b": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          moe_intermediate_size=32, intermediate_size=96),
    "qwen3.6-35b-a3b": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=8, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                            max_position_embeddings=4096),
    "gemma-4-26b-a4b": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            global_head_dim=32, num_global_key_value_heads=1, intermediate_size=64,
                            moe_intermediate_size=32, sliding_window=8, max_position_embeddings=4096),
    "tiny": {},
}


@pytest.mark.parametrize("like", sorted(PRESETS))
def test_synth_checkpoints_load_in_transformers_whole_with_our_logits(tmp_path, like):
    """Every preset's checkpoint is one transformers loads with no weight missing or left over
    (Gemma 4's layer_scalar was missing, which transformers reported and initialised itself),
    and its logits are ours."""
    assert set(SMALL) == set(PRESETS)
    layers = 4 if like.startswith("qwen3.6") else 2
    d = synth(tmp_path / "m", like=like, layers=layers, experts=8, top_k=2, vocab=300, dtype="float32", seed=3,
              progress=False, overrides=SMALL[like])
    tf.utils.logging.disable_progress_bar()
    ref, info = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        want = ref.eval()(IDS[None]).logits[0]
    torch.testing.assert_close(expertcache.load(d).logits(IDS), want, atol=1e-4, rtol=0)


def test_synth_gguf_takes_a_negative_seed_as_torch_does(tmp_path, capsys):
    """--seed takes signed 64-bit seeds; with --quant, -1 ended in numpy's traceback. It is read
    as torch reads it (two's complement), as the safetensors checkpoint's generator does."""
    assert torch.Generator().manual_seed(-1).initial_seed() == 2**64 - 1
    small = ["--like", "tiny", "--quant", "q4_k_m", "--layers", "1", "--experts", "4", "--top-k", "2",
             "--vocab", "300"]
    code, err = run_cli(capsys, "synth", *small, "--seed", "-1", "-o", str(tmp_path / "neg.gguf"))
    assert code == 0, err
    code, err = run_cli(capsys, "synth", *small, "--seed", str(2**64 - 1), "-o", str(tmp_path / "pos.gguf"))
    assert code == 0, err
    assert (tmp_path / "neg.gguf").read_bytes() == (tmp_path / "pos.gguf").read_bytes()
    assert GGUFReader(tmp_path / "neg.gguf").fields["general.architecture"].contents() == "qwen3moe"


def test_synth_refuses_a_dtype_its_gguf_file_ignores(tmp_path, capsys):
    """--dtype with --quant (a bogus one too) was ignored: a Q4_K_M file and exit 0."""
    for dtype in ("float32", "bogus"):
        code, err = run_cli(capsys, "synth", "--like", "tiny", "--quant", "q4_k_m", "--layers", "1", "--dtype", dtype,
                            "-o", str(tmp_path / "x.gguf"))
        assert_one_line_error(code, err, "--dtype")
    assert list(tmp_path.iterdir()) == []


def test_pack_keeps_each_tensors_dtype(tmp_path):
    """A bf16 checkpoint with a float32 router and norms (values bf16 does not hold): its packed
    copy holds those tensors as they are (read back with the safetensors library), so computed in
    float32 it gives the source's logits bit for bit; they were rounded to the experts' bf16."""
    d = synth(tmp_path / "m", like="tiny", layers=2, experts=8, top_k=2, vocab=300, progress=False)
    weights = load_file(d / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name, t in weights.items():
        if "norm" in name:
            weights[name] = 1 + 0.1 * torch.randn(t.shape, generator=g)
        elif name.endswith("mlp.gate.weight"):
            weights[name] = 0.3 * torch.randn(t.shape, generator=g)
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    packed = pack(d, tmp_path / "p", progress=False)
    out = load_file(packed / "model.safetensors")
    kept = [n for n, t in weights.items() if ".experts." not in n]
    assert any(weights[n].dtype == torch.float32 for n in kept)
    for name in kept:
        assert out[name].dtype == weights[name].dtype and torch.equal(out[name], weights[name]), name
    assert torch.equal(expertcache.load(packed, dtype="float32").logits(IDS),
                       expertcache.load(d, dtype="float32").logits(IDS))


def test_pack_computes_in_the_dtype_the_source_computes_in(tmp_path):
    """bf16 weights under a config that says float32 compute in float32; their packed copy's
    config said bfloat16 (the experts' dtype), so the copy computed in bf16, other logits."""
    d = synth(tmp_path / "m", like="tiny", layers=2, experts=8, top_k=2, vocab=300, progress=False)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "dtype": "float32"}))
    packed = pack(d, tmp_path / "p", progress=False)
    assert torch.equal(expertcache.load(packed).logits(IDS), expertcache.load(d).logits(IDS))


def test_pack_dtype_reaches_a_multimodal_configs_text_config(tmp_path):
    """`pack --dtype float32` of a multimodal checkpoint whose text_config says bfloat16: the copy
    computes in float32, as the source loaded with --dtype float32 (the help's promise); the
    text_config's dtype, which the loader reads over the outer one, kept it in bf16."""
    from test_qwen35 import build

    d = save_checkpoint(build(wrapped=True), tmp_path / "m", fused=True, dtype=torch.bfloat16)
    raw = json.loads((d / "config.json").read_text())
    raw["text_config"]["dtype"] = "bfloat16"
    (d / "config.json").write_text(json.dumps(raw))
    packed = pack(d, tmp_path / "p", dtype="float32", progress=False)
    ids = IDS % raw["text_config"]["vocab_size"]
    assert torch.equal(expertcache.load(packed).logits(ids), expertcache.load(d, dtype="float32").logits(ids))


def test_pack_copies_the_side_files_but_no_other_weights(tmp_path):
    """A directory with PyTorch weights beside the safetensors (as hub repositories have): the
    packed copy holds the tokenizer and the generation config, not those weights again."""
    d = synth(tmp_path / "m", like="tiny", layers=1, experts=4, top_k=2, vocab=300, progress=False)
    weights = load_file(d / "model.safetensors")
    torch.save(weights, d / "pytorch_model.bin")
    (d / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": dict.fromkeys(weights, "pytorch_model.bin")}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 257}))
    packed = pack(d, tmp_path / "p", progress=False)
    names = {p.name for p in packed.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json",
            "model.safetensors"} <= names
    assert not names & {"pytorch_model.bin", "pytorch_model.bin.index.json"}, names
    assert (packed / "tokenizer.json").read_bytes() == (d / "tokenizer.json").read_bytes()
