"""Second review of the KV growth (by a quarter, one buffer at a time) and of the RoPE override
(`load(rope_scaling=...)`) on the families the first tests did not cover: results that do not
depend on how the keys and values grew, and Qwen3.5 (partial rotary) and Qwen2-MoE scaled as
transformers scales them when the same rope parameters are in their config."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import expertcache
import test_gemma4
import test_qwen35
from conftest import build_reference, save_checkpoint, tiny_config
from test_parity import ids_of

ORIGINAL = 64  # the plain models' context: the prompt runs well past it
SCALINGS = [
    pytest.param({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
                 {"rope_type": "yarn", "factor": 4.0}, id="yarn"),
    pytest.param({"rope_type": "linear", "factor": 2.0}, {"factor": 2.0}, id="linear"),
]


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    """Float32 checkpoints of three KV layouts: plain attention (Qwen3-MoE), sliding-window rings
    beside full layers (Gemma 4), recurrent state beside attention (Qwen3.5)."""
    root = tmp_path_factory.mktemp("kv-growth")
    c = tiny_config("qwen3_moe")
    c.max_position_embeddings = 1024
    return {"qwen3": save_checkpoint(build_reference(c), root / "qwen3"),
            "gemma4": save_checkpoint(test_gemma4.build(), root / "gemma4", fused=True),
            "qwen35": save_checkpoint(test_qwen35.build(), root / "qwen35")}


@pytest.mark.parametrize("name", ["qwen3", "gemma4", "qwen35"])
def test_decode_is_bitwise_the_same_however_the_keys_grew(grown, name):
    # Decoding from 250 to 420 tokens regrows the buffers at 256, 320 and 400; a session whose
    # buffers were reserved for the whole context once never regrows. The logits must not see it.
    model = expertcache.load(grown[name], dtype="float32", ctx_size=512)
    ids = ids_of(420, seed=3).tolist()
    runs = []
    for upfront in (False, True):
        session = model.new_session()
        if upfront:
            session.kv.reserve(512)
        out = [model.prefill(session, ids[:250], ubatch=64, all_logits=True)]
        out += [model.prefill(session, [t], all_logits=True) for t in ids[250:]]
        runs.append((torch.cat(out), session.kv.capacity))
        # A copy (the server's prompt cache) cut back and continued gives the same logits too.
        other = session.copy()
        kept = other.truncate(300)
        runs[-1] += (model.prefill(other, ids[kept:360], all_logits=True),)
    (grew, cap_grew, again_grew), (once, cap_once, again_once) = runs
    assert cap_grew < cap_once == 512  # the first run did regrow
    assert torch.equal(grew, once)
    assert torch.equal(again_grew, again_once)


_QWEN35_TEXT = test_qwen35.text_config


def _qwen35_config(**rope) -> dict:
    c = _QWEN35_TEXT()
    c["max_position_embeddings"] = ORIGINAL
    if rope:
        c["rope_parameters"] = {"rope_theta": 10000.0, "partial_rotary_factor": 0.25, **rope}
    return c


@pytest.mark.parametrize("in_config,given", SCALINGS)
def test_rope_override_on_qwen35_partial_rotary_is_transformers(tmp_path, in_config, given, monkeypatch):
    # Qwen3.5 rotates a quarter of each head: YaRN's ramp is over those 8 dims, not the head's 32.
    monkeypatch.setattr(test_qwen35, "text_config", lambda **o: {**_qwen35_config(), **o})
    plain = test_qwen35.build()
    d = save_checkpoint(plain, tmp_path / "plain")
    scaled = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**_qwen35_config(**in_config))).float().eval()
    scaled.load_state_dict(plain.state_dict())
    ids = ids_of(160)
    want = test_qwen35.ref_logits(scaled, ids)
    got = expertcache.load(d, dtype="float32", ctx_size=256, rope_scaling=given).logits(ids)
    assert (got - want).abs().max() < 1e-4
    assert (test_qwen35.ref_logits(plain, ids) - want).abs().max() > 1e-1  # the scaling is what is checked


@pytest.mark.parametrize("in_config,given", SCALINGS)
def test_rope_override_on_qwen2_moe_is_transformers(tmp_path, in_config, given):
    plain_cfg = tiny_config("qwen2_moe")
    plain_cfg.max_position_embeddings = ORIGINAL
    plain = build_reference(plain_cfg)
    d = save_checkpoint(plain, tmp_path / "plain")
    cfg = tiny_config("qwen2_moe", rope={"rope_theta": 10000.0, **in_config})
    cfg.max_position_embeddings = ORIGINAL
    scaled = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    scaled.load_state_dict(plain.state_dict())
    ids = ids_of(160)
    with torch.no_grad():
        want, unscaled = scaled(ids[None]).logits[0], plain(ids[None]).logits[0]
    got = expertcache.load(d, dtype="float32", ctx_size=256, rope_scaling=given).logits(ids)
    assert (got - want).abs().max() < 1e-4
    assert (unscaled - want).abs().max() > 1e-1
