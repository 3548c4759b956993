"""Gemma 4 with the MoE block (sliding-window and full attention, k-eq-v, proportional RoPE, a
dense GeGLU MLP beside the experts) against transformers, on tiny random checkpoints saved as
real ones: text-only (Gemma4ForCausalLM) and multimodal (Gemma4ForConditionalGeneration, whose
vision tower is skipped); cache modes and errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers as tf

import expertcache
from conftest import VOCAB, assert_one_line_error, assert_prompt_keys_not_repeated, run_cli, save_checkpoint
from expertcache.config import CacheConfig
from expertcache.errors import ExpertCacheError
from test_parity import check_greedy_against_reference, ids_of

S, F = "sliding_attention", "full_attention"
WINDOW = 16


def text_config(layer_types=(S, F, S, S, F), **over) -> dict:
    c = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=len(layer_types),
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
             num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=WINDOW,
             layer_types=list(layer_types), enable_moe_block=True, num_experts=8, top_k_experts=2,
             moe_intermediate_size=16, hidden_size_per_layer_input=0, final_logit_softcapping=30.0,
             max_position_embeddings=1024, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2, pad_token_id=0)
    c.update(over)
    return c


VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=16, pooling_kernel_size=1)


def build(wrapped: bool = False, seed: int = 0, **opts):
    """A random reference model, widened so that every term matters (norm weights, router and
    expert scales around 1, the layer scalar not 1)."""
    tf.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    tc = text_config(**opts)
    if wrapped:
        model = tf.Gemma4ForConditionalGeneration(tf.Gemma4Config(text_config=tc, vision_config=VISION))
    else:
        model = tf.Gemma4ForCausalLM(tf.Gemma4TextConfig(**tc))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                p.normal_(1.0, 0.2)
            elif p.ndim >= 2:
                p.normal_(0.0, 0.09)
            else:
                p.normal_(0.0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.7, 1.3)
    return model.float().eval()


@pytest.fixture
def gemma4(tmp_path):
    """Factory: (wrapped=, seed=, **config options) -> (reference, checkpoint dir)."""

    made = []

    def make(wrapped: bool = False, seed: int = 0, **opts):
        ref = build(wrapped, seed, **opts)
        made.append(seed)
        d = save_checkpoint(ref, tmp_path / f"g4-{'wrap' if wrapped else 'text'}-{seed}-{len(made)}", fused=True)
        return ref, d

    return make


def ref_logits(ref, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=ids[None], use_cache=False).logits[0].float()


CASES = [
    pytest.param({}, id="k-eq-v-hd16-hd32"),
    pytest.param({"attention_k_eq_v": False}, id="separate-v-hd16-hd32"),
    pytest.param({"attention_k_eq_v": False, "global_head_dim": 16, "layer_types": (S, F, S, S, S, F)},
                 id="separate-v-same-head-dim"),
    pytest.param({"wrapped": True}, id="multimodal"),
]


@pytest.mark.parametrize("opts", CASES)
def test_logits_match_transformers(gemma4, capsys, opts):
    ref, d = gemma4(**opts)
    capsys.readouterr()
    model = expertcache.load(d)
    notice = capsys.readouterr().err
    if opts.get("wrapped"):
        assert notice.count("\n") == 1 and "skipping" in notice and "model.vision_tower.*" in notice, notice
    else:
        assert notice == ""
    layers = model.net.weights.layers
    full = [lw for lw in layers if lw.mixer.kind == F]
    assert full and all(lw.mixer.cfg.head_dim == (32 if "global_head_dim" not in opts else 16) for lw in full)
    k_eq_v = opts.get("attention_k_eq_v", True)
    assert all(lw.mixer.cfg.k_eq_v == k_eq_v and lw.mixer.cfg.kv_heads == (1 if k_eq_v else 2) for lw in full)
    for n in (1, 7, 64, 3 * WINDOW + 5):
        ids = ids_of(n)
        expected = ref_logits(ref, ids)
        assert expected.abs().max() > 1.0
        torch.testing.assert_close(model.logits(ids), expected, atol=1e-4, rtol=0)


def test_the_window_changes_the_logits(gemma4):
    """The sliding window is really applied: with it wider than the prompt the logits differ."""
    ref, d = gemma4(seed=4)
    ids = ids_of(3 * WINDOW, seed=3)
    wide, _ = gemma4(seed=4, sliding_window=1000)
    assert (ref_logits(wide, ids)[-1] - ref_logits(ref, ids)[-1]).abs().max() > 1e-2
    torch.testing.assert_close(expertcache.load(d).logits(ids), ref_logits(ref, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("opts", [CASES[0], CASES[1]])
def test_stepwise_decode_beyond_the_window_matches_one_forward(gemma4, opts):
    ref, d = gemma4(seed=1, **opts)
    model = expertcache.load(d)
    ids = ids_of(4 * WINDOW + 7, seed=2).tolist()
    full = model.logits(ids)
    torch.testing.assert_close(full, ref_logits(ref, torch.tensor(ids)), atol=1e-4, rtol=0)
    session = model.new_session()
    steps = [model.prefill(session, ids[:WINDOW + 3], ubatch=7, all_logits=True)]
    steps += [model.prefill(session, [t], all_logits=True) for t in ids[WINDOW + 3:]]
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("opts", [CASES[0], CASES[3]])
def test_greedy_generation_matches_transformers(gemma4, opts):
    ref, d = gemma4(seed=3, **opts)
    model = expertcache.load(d)
    compared = check_greedy_against_reference(ref, model, ids_of(12, seed=5).tolist())
    assert compared >= 16, "too many near-ties to make the comparison meaningful"


CACHES = [CacheConfig(mode="staging"), CacheConfig(experts=3), CacheConfig(experts=3, policy="lru"),
          CacheConfig(experts=5, store="disk")]


def test_logits_bitwise_equal_in_every_cache_mode(gemma4):
    _, d = gemma4(seed=5)
    ids = ids_of(60, seed=4).tolist()

    def run(cache):
        model = expertcache.load(d, cache=cache)
        s = model.new_session()
        out = [model.prefill(s, ids[:40], ubatch=16, all_logits=True)]
        out += [model.prefill(s, [t], all_logits=True) for t in ids[40:]]
        gen = model.generate(ids[:10], max_tokens=12, ignore_eos=True).token_ids
        return torch.cat(out), gen, model.telemetry()

    resident, gen, _ = run(CacheConfig(mode="resident"))
    for cache in CACHES:
        logits, tokens, tel = run(cache)
        assert torch.equal(logits, resident), cache
        assert tokens == gen, cache
        assert tel["total"]["copied_experts"] > 0, cache  # the slow tier was really used


def test_run_and_info_on_the_multimodal_checkpoint(gemma4, capsys):
    _, d = gemma4(wrapped=True)
    code, err = run_cli(capsys, "run", "-m", str(d), "-p", "w1 w2 w3", "-n", "4")
    assert code == 0, err
    code, err = run_cli(capsys, "info", "-m", str(d), "--json")
    assert code == 0, err


def _edit_config(d, wrapped: bool = False, **change):
    raw = json.loads((d / "config.json").read_text())
    target = raw["text_config"] if wrapped else raw
    for k, v in change.items():
        if v is None:
            target.pop(k, None)
        else:
            target[k] = v
    (d / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("key,value,needle", [
    ("hidden_size_per_layer_input", 256, "hidden_size_per_layer_input 256"),
    ("num_kv_shared_layers", 2, "num_kv_shared_layers 2"),
    ("hidden_activation", "relu2", "hidden_activation 'relu2'"),
    ("enable_moe_block", False, "enable_moe_block False"),
])
def test_unsupported_options_are_one_line_errors(gemma4, capsys, key, value, needle):
    _, d = gemma4()
    _edit_config(d, **{key: value})
    with pytest.raises(ExpertCacheError, match=needle):
        expertcache.load(d)
    assert_one_line_error(*run_cli(capsys, "run", "-m", str(d), "-p", "w1"), needle, "config.json")


def test_absent_keys_are_not_requests_for_their_class_defaults(gemma4):
    """transformers' class defaults hidden_size_per_layer_input to 256; a config without the key
    (or with null) is a model without per-layer inputs, here and in the reference."""
    ref, d = gemma4(seed=7)
    _edit_config(d, hidden_size_per_layer_input=None, num_kv_shared_layers=None, use_double_wide_mlp=None)
    ids = ids_of(20)
    torch.testing.assert_close(expertcache.load(d).logits(ids), ref_logits(ref, ids), atol=1e-4, rtol=0)


def test_global_head_dim_keys_without_per_layer_config(gemma4):
    """Other writers give the full layers' shape as global_head_dim / num_global_key_value_heads;
    the key/value-head override applies only with attention_k_eq_v."""
    ref, d = gemma4(seed=8)
    _edit_config(d, per_layer_config=None, global_head_dim=32, num_global_key_value_heads=1)
    ids = ids_of(30)
    torch.testing.assert_close(expertcache.load(d).logits(ids), ref_logits(ref, ids), atol=1e-4, rtol=0)
    _, d2 = gemma4(seed=8, attention_k_eq_v=False)
    _edit_config(d2, per_layer_config=None, global_head_dim=32, num_global_key_value_heads=1)
    full = [lw.mixer.cfg for lw in expertcache.load(d2).net.weights.layers if lw.mixer.kind == F]
    assert all(c.kv_heads == 2 and c.head_dim == 32 and not c.k_eq_v for c in full)


def test_sliding_layers_keep_only_the_window(gemma4):
    """After a prompt of four windows, a sliding layer's keys and values are a ring of W
    positions; the full layers hold every position."""
    ref, d = gemma4(seed=9)
    model = expertcache.load(d)
    ids = ids_of(4 * WINDOW + 7, seed=10).tolist()
    s = model.new_session()
    model.prefill(s, ids, ubatch=12)
    kv = s.kv
    layers = model.net.weights.layers
    sliding = [i for i, lw in enumerate(layers) if lw.mixer.kind == S]
    full = [i for i, lw in enumerate(layers) if lw.mixer.kind == F]
    assert sliding and full
    for i in sliding:
        assert i not in kv.k and tuple(kv.rings[i].k.shape) == (2, WINDOW, 16)
        assert sorted(kv.rings[i].pos.tolist()) == list(range(len(ids) - WINDOW, len(ids)))
    for i in full:
        assert kv.k[i].shape[0] == 1 and kv.k[i].shape[2] == 32 and kv.k[i].shape[1] >= len(ids)
    # and it still decodes as one full forward
    follow = ids_of(WINDOW + 3, seed=11).tolist()
    steps = torch.cat([model.prefill(s, [t], all_logits=True) for t in follow])
    torch.testing.assert_close(steps, ref_logits(ref, torch.tensor(ids + follow))[len(ids):], atol=1e-4, rtol=0)


def test_truncate_across_the_window_restores_a_snapshot(gemma4):
    _, d = gemma4(seed=12)
    model = expertcache.load(d)
    ids = ids_of(5 * WINDOW, seed=13).tolist()
    s = model.new_session()
    model.prefill(s, ids[:4 * WINDOW], ubatch=20)
    kv = s.kv
    assert [snap.position for snap in kv.snapshots] == [20, 40, 60, 64]
    fresh = model.logits(ids)
    for n, kept in ((63, 63), (62, 60), (45, 40), (10, 0)):
        c = s.copy()
        assert c.kv.truncate(n) == kept, n
        del c.tokens[kept:]
        out = model.prefill(c, ids[kept:], all_logits=True)
        torch.testing.assert_close(out, fresh[kept:], atol=1e-4, rtol=0)
    # the original is untouched by what its copies did
    torch.testing.assert_close(model.prefill(s, ids[4 * WINDOW:], all_logits=True), fresh[4 * WINDOW:],
                               atol=1e-4, rtol=0)


def test_generate_after_a_prefix_that_left_the_window_matches_fresh(gemma4):
    _, d = gemma4(seed=14)
    model = expertcache.load(d)
    s = model.new_session()
    prompt = ids_of(3 * WINDOW, seed=15).tolist()
    first = model.generate(prompt, max_tokens=WINDOW + 4, session=s, ignore_eos=True)
    edited = prompt + first.token_ids[:2] + [7, 8, 9]  # diverges more than a window before the end
    again = model.generate(edited, max_tokens=10, session=s, ignore_eos=True)
    assert again.cached_tokens == len(prompt)  # the snapshot at the prompt's end
    assert again.token_ids == model.generate(edited, max_tokens=10, ignore_eos=True).token_ids


def test_a_failed_forward_is_restored_by_truncate(gemma4):
    _, d = gemma4(seed=16)
    model = expertcache.load(d)
    ids = ids_of(3 * WINDOW, seed=17).tolist()
    s = model.new_session()
    model.prefill(s, ids[:2 * WINDOW])
    layers = model.net.weights.layers
    router = layers[2].router
    layers[2].router = router[:, :3]  # layer 2's MoE fails after layers 0-2 wrote their keys
    with pytest.raises(RuntimeError):
        model.prefill(s, ids[2 * WINDOW:])
    layers[2].router = router
    with pytest.raises(ExpertCacheError, match="incomplete after a failed forward"):
        model.prefill(s, ids[2 * WINDOW:])
    assert s.kv.truncate(2 * WINDOW) == 2 * WINDOW
    torch.testing.assert_close(model.prefill(s, ids[2 * WINDOW:], all_logits=True),
                               model.logits(ids)[2 * WINDOW:], atol=1e-4, rtol=0)


def test_a_copy_of_a_stopped_prefill_is_as_incomplete_as_its_original(gemma4):
    """A prefill stopped half-way wrote into the rings; a copy of that session must refuse to
    run on until truncated, and, truncated, give a fresh run's logits."""
    ref, d = gemma4(seed=18)
    model = expertcache.load(d)
    ids = ids_of(5 * WINDOW, seed=19).tolist()
    s = model.new_session()
    model.prefill(s, ids[:2 * WINDOW], ubatch=5)
    asked = []
    assert model.prefill(s, ids[2 * WINDOW:], ubatch=4, should_stop=lambda: asked.append(1) or len(asked) > 12) is None
    c = s.copy()
    with pytest.raises(ExpertCacheError, match="incomplete after a failed forward"):
        model.prefill(c, ids[2 * WINDOW:])
    assert c.truncate(2 * WINDOW) == 2 * WINDOW
    torch.testing.assert_close(model.prefill(c, ids[2 * WINDOW:], all_logits=True),
                               ref_logits(ref, torch.tensor(ids))[2 * WINDOW:], atol=1e-4, rtol=0)


def test_bf16_error_is_of_the_size_of_transformers_own(gemma4):
    """bf16 prefill and decode against the fp32 reference: our error is no larger than
    transformers' own bf16 run's (by more than a margin)."""
    ref, d = gemma4(seed=3)
    ids = ids_of(40, seed=2)
    exact = ref_logits(ref, ids)
    model = expertcache.load(d, dtype="bfloat16")
    s = model.new_session()
    ours = torch.cat([model.prefill(s, ids[:30].tolist(), all_logits=True)]
                     + [model.prefill(s, [t], all_logits=True) for t in ids[30:].tolist()]).float()
    theirs = ref_logits(ref.to(torch.bfloat16), ids)
    ours_err, theirs_err = (ours - exact).abs().mean(), (theirs - exact).abs().mean()
    assert 0 < ours_err < 1.5 * theirs_err, (ours_err, theirs_err)


def test_the_dense_mlp_counts_as_fast_tier_weights(gemma4):
    from expertcache.bench.speed import weight_bytes_per_token

    _, d = gemma4()
    model = expertcache.load(d)
    layers = model.net.weights.layers
    # sliding: q, k, v [64|32|32, 64] + o [64, 64]; full (k-eq-v, head dim 32, one kv head): q [128, 64],
    # k [32, 64] + o [64, 128]; per layer a router [8, 64] and the dense MLP 3 x [48, 64]; fp32
    per_kind = {S: (128 * 64 + 64 * 64) * 4, F: (160 * 64 + 64 * 128) * 4}
    expected = sum(per_kind[lw.mixer.kind] + (8 * 64 + 3 * 48 * 64) * 4 for lw in layers)
    assert weight_bytes_per_token(model)["dense"] == expected


def test_server_prompt_cache_across_the_window_replies_equal_a_fresh_servers(gemma4):
    """Turns longer than the window: the reused prefix reaches past where the rings forget."""
    from test_qwen35 import _serve_conversation

    _, d = gemma4(seed=18)
    turns = [[f"w{i}" for i in range(5, 25)], [f"w{i}" for i in range(30, 42)], [f"w{i}" for i in range(50, 70)]]
    cached = _serve_conversation(d, True, turns)
    fresh = _serve_conversation(d, False, turns)
    assert [text for text, _ in cached] == [text for text, _ in fresh]
    assert all(t["cache_n"] == 0 for _, t in fresh)
    assert cached[1][1]["cache_n"] > WINDOW and cached[2][1]["cache_n"] > cached[1][1]["cache_n"]


def test_packed_checkpoint_gives_the_same_logits(gemma4, tmp_path, capsys):
    """`pack` keeps every tensor the model reads, the layer scalars included."""
    _, d = gemma4(seed=19, wrapped=True)
    ids = ids_of(3 * WINDOW, seed=20)
    code, err = run_cli(capsys, "pack", "-m", str(d), "-o", str(tmp_path / "packed"))
    assert code == 0, err
    packed = expertcache.load(tmp_path / "packed")
    assert packed.net.weights.layers[0].block_w.layer_scalar is not None
    assert torch.equal(packed.logits(ids), expertcache.load(d).logits(ids))


def test_synth_preset_has_the_published_shapes():
    """`synth --like gemma-4-26b-a4b`: google/gemma-4-26B-A4B's text config (docs/model.md)."""
    from expertcache.models import for_model_type
    from expertcache.models.synth import synth_config

    raw = synth_config("gemma-4-26b-a4b", layers=2)
    cfg = for_model_type(raw["model_type"], "synth").config_from_hf(raw)
    assert cfg.layer_types == (S, F)
    assert (cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size, cfg.intermediate_size,
            cfg.vocab_size, cfg.hidden_act, cfg.final_logit_softcapping) == (
        2816, 128, 8, 704, 2112, 262144, "gelu_pytorch_tanh", 30.0)
    s, f = cfg.sliding, cfg.full
    assert (s.heads, s.kv_heads, s.head_dim, s.window, s.theta, s.k_eq_v) == (16, 8, 256, 1024, 1e4, False)
    assert (f.heads, f.kv_heads, f.head_dim, f.window, f.theta, f.rotary_factor, f.k_eq_v) == (
        16, 2, 512, None, 1e6, 0.25, True)


@pytest.mark.parametrize("quant,types", [("q4_k_m", [("Q4_K", "Q5_0"), ("Q4_K", "Q8_0")]),
                                         ("bf16", [("BFLOAT16", "BFLOAT16")] * 2)])
def test_synth_gguf_has_the_presets_shapes_and_runs(tmp_path, quant, types):
    """The GGUF form (as llama.cpp's converter writes a gemma4): the config read back from its
    metadata is the preset's; Q4_K_M's expert rows of 704 take llama.cpp's fallback types."""
    from expertcache.models import for_model_type
    from expertcache.models.synth import synth_config
    from expertcache.models.synth_gguf import synth_gguf

    kw = dict(layers=2, experts=2, top_k=1, vocab=300)
    path = synth_gguf(tmp_path / f"g4-{quant}.gguf", "gemma-4-26b-a4b", quant=quant, progress=False, **kw)
    model = expertcache.load(path, cache=CacheConfig(mode="cache", experts=1))
    want = for_model_type("gemma4_text", "synth").config_from_hf(synth_config("gemma-4-26b-a4b", **kw))
    got = model.cfg
    for field in ("layer_types", "sliding", "full", "hidden_size", "num_experts", "top_k", "moe_intermediate_size",
                  "intermediate_size", "vocab_size", "final_logit_softcapping", "hidden_act", "tie_word_embeddings"):
        g, w = getattr(got, field), getattr(want, field)
        if field in ("sliding", "full"):  # GGUF holds eps as a float32
            g, w = dataclasses.replace(g, eps=0.0), dataclasses.replace(w, eps=0.0)
        assert g == w, field
    fmts = [[m.storage for m in model.experts.formats[i].matrices] for i in range(2)]
    assert [tuple(getattr(t, "name", str(t).removeprefix("torch.").upper()) for t in f) for f in fmts] == types
    out = model.generate([5, 6, 7], max_tokens=2, ignore_eos=True)
    assert len(out.token_ids) == 2


def test_prompt_attention_reads_each_groups_keys_once(gemma4, monkeypatch):
    """Grouped-query attention over a prompt (fresh, and after cached tokens) gets each group's
    keys and values once, never a copy per query head (docs/prefill.md)."""
    _, d = gemma4()
    ids = torch.randint(2, VOCAB, (40,), generator=torch.Generator().manual_seed(3))
    assert_prompt_keys_not_repeated(expertcache.load(d), ids, monkeypatch)
