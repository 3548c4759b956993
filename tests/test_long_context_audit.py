"""Positions over long contexts against transformers: RoPE scalings past the context the model
was trained on, the cos/sin tables (their precision and how far they grow), and what a config
with a head size RoPE cannot rotate gets."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import expertcache
from conftest import assert_one_line_error, build_reference, run_cli, save_checkpoint, tiny_config
from test_gemma4 import WINDOW, gemma4, ref_logits  # noqa: F401 (gemma4: the fixture)
from test_parity import ids_of, reference_logits

# original_max_position_embeddings of the scaled cases: every prompt below runs well past it.
ORIGINAL = 64


def _checkpoint(tmp_path, rope: dict, layers: int = 2, max_position: int = 1024):
    config = tiny_config("qwen3_moe", rope=rope, layers=layers)
    config.max_position_embeddings = max_position
    ref = build_reference(config)
    return ref, save_checkpoint(ref, tmp_path / "m")


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL, "rope_theta": 5e5,
     "attention_factor": 1.25, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "rope_theta": 10000.0,
     "mscale": 0.707, "mscale_all_dim": 1.0},
], ids=["linear", "yarn", "yarn-attention-factor-betas-untruncated", "yarn-mscale"])
def test_rope_scalings_match_transformers_past_the_original_context(tmp_path, rope):
    ref, d = _checkpoint(tmp_path, rope)
    model = expertcache.load(d, kernels="torch")
    ids = ids_of(5 * ORIGINAL, seed=4)
    expected = reference_logits(ref, ids)
    torch.testing.assert_close(model.logits(ids), expected, atol=1e-5, rtol=0)
    # Prompt in micro-batches, then token by token: the positions each call starts from.
    session = model.new_session()
    cut = 4 * ORIGINAL + 3
    got = [model.prefill(session, ids[:cut].tolist(), ubatch=37, all_logits=True)]
    got += [model.prefill(session, [t], all_logits=True) for t in ids[cut:].tolist()]
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_rotary_tables_are_transformers_bits_and_stop_at_the_context(tmp_path, dtype):
    """The tables are computed in fp32 and rounded once, as transformers' rotary embedding does
    (bit for bit at every position, past the original context too), and grow in doublings that
    never pass the context: a 400-token prompt and then 150 more made a table of 800 positions
    for a context of 600."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "rope_theta": 10000.0}
    ref, d = _checkpoint(tmp_path, rope, layers=1)
    ctx = 600
    model = expertcache.load(d, dtype=dtype, ctx_size=ctx, kernels="torch")
    session = model.new_session()
    ids = ids_of(550, seed=2).tolist()
    model.prefill(session, ids[:400])
    model.prefill(session, ids[400:])
    table = model.net.rotary
    assert table.cos.shape[0] == ctx and table.sin.shape[0] == ctx

    rotary = ref.model.rotary_emb
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1, dtype=dtype), torch.arange(ctx)[None])
    half = cos.shape[-1] // 2
    assert torch.equal(table.cos, cos[0])
    assert torch.equal(table.sin, torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1))


def test_gemma4_holds_only_its_layers_tables_each_up_to_the_context(gemma4):  # noqa: F811
    """Gemma 4's layers rotate with their own tables (sliding and full head sizes); the shared
    table of the config's head size was built and grown with the context as well, read by no
    layer (at Gemma 4 26B's 262,144 positions, 256 MiB of bf16 held for nothing). The logits
    stay transformers' past the window, in micro-batches and token by token."""
    ref, d = gemma4(max_position_embeddings=4096)
    ctx = 200
    model = expertcache.load(d, ctx_size=ctx, kernels="torch")
    ids = ids_of(ctx, seed=6)
    expected = ref_logits(ref, ids)
    session = model.new_session()
    got = [model.prefill(session, ids[:150].tolist(), ubatch=WINDOW + 1, all_logits=True)]
    got += [model.prefill(session, [t], all_logits=True) for t in ids[150:].tolist()]
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=0)

    assert model.net.rotary is None
    tables = [t for lw in model.net.weights.layers for t in lw.mixer._tables.values()]
    dims = {t.cos.shape[1] for t in tables}
    assert dims == {16, 32}  # the sliding and the full layers' head sizes (test_gemma4's config)
    assert all(t.cos.shape[0] == ctx for t in tables)


def test_odd_head_size_is_a_one_line_error(tmp_path, capsys):
    """Rotate-half pairs dim i with i + Dh/2: a head size of 15 passed `info` and then failed
    the first forward with a shape error's traceback. transformers refuses it too ("RoPE
    requires an even rotary dimension"), so the checkpoint is cut down from one of 16."""
    _, d = _checkpoint(tmp_path, {"rope_type": "default", "rope_theta": 10000.0}, layers=1)
    raw = json.loads((d / "config.json").read_text())
    H, G, Dh = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    raw["head_dim"] = Dh - 1
    (d / "config.json").write_text(json.dumps(raw))
    tensors = load_file(d / "model.safetensors")
    for name, t in tensors.items():
        if ".self_attn." in name:
            heads = {"q_proj": H, "k_proj": G, "v_proj": G, "o_proj": H}.get(name.split(".")[-2])
            if name.endswith("norm.weight"):
                t = t[:-1]
            elif name.endswith("o_proj.weight"):
                t = t.view(t.shape[0], heads, Dh)[:, :, :-1].reshape(t.shape[0], -1)
            else:
                t = t.view(heads, Dh, -1)[:, :-1].reshape(heads * (Dh - 1), -1)
            tensors[name] = t.contiguous()
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    code, err = run_cli(capsys, "run", "-m", str(d), "-p", "w5 w6", "-n", "2", "--kernels", "torch")
    assert_one_line_error(code, err, "head_dim 15", "even")
