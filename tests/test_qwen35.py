"""Qwen3.5/3.6-MoE (Gated DeltaNet + gated attention, a shared expert) against transformers, on
tiny random checkpoints saved as real ones: text-only (Qwen3_5MoeForCausalLM) and multimodal
(Qwen3_5MoeForConditionalGeneration, whose vision tower and MTP weights are skipped), in both
expert layouts; cache modes, sessions, snapshots and errors."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

import expertcache
from conftest import VOCAB, assert_one_line_error, assert_prompt_keys_not_repeated, run_cli, save_checkpoint
from expertcache.config import CacheConfig
from expertcache.errors import ExpertCacheError
from expertcache.models.state import SequenceState
from test_parity import check_greedy_against_reference, ids_of, reference_logits

L, F = "linear_attention", "full_attention"


def text_config(k_heads: int = 2, v_heads: int = 4, layer_types=(L, L, L, F), **over) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=len(layer_types), num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, linear_num_key_heads=k_heads, linear_num_value_heads=v_heads,
                linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                max_position_embeddings=1024, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=None,
                pad_token_id=None, layer_types=list(layer_types), **over)


VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
              num_position_embeddings=16)


def build(wrapped: bool = False, seed: int = 0, **opts):
    """A random reference model, widened so that every term matters (init leaves most weights tiny)."""
    tf.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    tc = text_config(**opts)
    if wrapped:
        model = tf.Qwen3_5MoeForConditionalGeneration(tf.Qwen3_5MoeConfig(text_config=tc, vision_config=VISION))
    else:
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**tc))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.linspace(-4.0, 2.5, p.numel()))  # long and short memories
            elif name.endswith(("conv1d.weight", "dt_bias")):
                p.normal_(0.0, 0.5)
            elif name.endswith("linear_attn.norm.weight"):
                p.normal_(1.0, 0.1)  # the gated norm scales by w
            elif "norm" in name:
                p.normal_(0.0, 0.1)  # the others by 1 + w
            elif p.ndim >= 2:
                # (much wider and a random model amplifies fp32 rounding ~10x per layer)
                p.normal_(0.0, 0.09)
            else:
                p.normal_(0.0, 0.05)
    return model.float().eval()


@pytest.fixture
def qwen35(tmp_path):
    """Factory: (fused=, wrapped=, **config options) -> (reference, checkpoint dir)."""

    def make(fused: bool = False, wrapped: bool = False, seed: int = 0, **opts):
        ref = build(wrapped, seed, **opts)
        d = save_checkpoint(ref, tmp_path / f"q35-{'wrap' if wrapped else 'text'}-{'fused' if fused else 'per'}-{seed}",
                            fused)
        return ref, d

    return make


def ref_logits(ref, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=ids[None], use_cache=False).logits[0].float()


CASES = [
    pytest.param({}, id="hk2-hv4-LLLF"),
    pytest.param({"k_heads": 4, "v_heads": 4, "layer_types": (F, L, L, F, L)}, id="hk4-hv4-FLLFL"),
    pytest.param({"k_heads": 2, "v_heads": 6, "layer_types": (L, F, L, L, L, F)}, id="hk2-hv6-LFLLLF"),
    pytest.param({"layer_types": (L, L)}, id="deltanet-only"),
    pytest.param({"wrapped": True}, id="multimodal-LLLF"),
]


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
@pytest.mark.parametrize("opts", CASES)
def test_logits_match_transformers(qwen35, capsys, opts, fused):
    ref, d = qwen35(fused=fused, **opts)
    capsys.readouterr()
    model = expertcache.load(d)
    notice = capsys.readouterr().err
    if opts.get("wrapped"):
        assert notice.count("\n") == 1 and "skipping" in notice and "model.visual.*" in notice, notice
    else:
        assert notice == ""
    assert model.cfg.shared_expert_intermediate_size == 24
    for n in (1, 7, 64, 300):
        ids = ids_of(n)
        expected = ref_logits(ref, ids)
        assert expected.abs().max() > 1.0
        torch.testing.assert_close(model.logits(ids), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("opts", [CASES[0], CASES[2]])
def test_stepwise_decode_matches_one_forward(qwen35, opts):
    ref, d = qwen35(seed=1, **opts)
    model = expertcache.load(d)
    ids = ids_of(150, seed=2).tolist()
    full = model.logits(ids)
    torch.testing.assert_close(full, ref_logits(ref, torch.tensor(ids)), atol=1e-4, rtol=0)
    session = model.new_session()
    steps = [model.prefill(session, ids[:70], ubatch=33, all_logits=True)]
    steps += [model.prefill(session, [t], all_logits=True) for t in ids[70:]]
    torch.testing.assert_close(torch.cat(steps), full, atol=1e-4, rtol=0)


def test_decode_runs_the_recurrent_form_and_prefill_the_chunked_one(qwen35):
    _, d = qwen35()
    model = expertcache.load(d)
    mixers = {lw.mixer.kind: lw.mixer for lw in model.net.weights.layers}
    assert sorted(mixers) == ["deltanet", "gated_attention"]
    paths = mixers["deltanet"].paths  # one instance serves the model's 3 DeltaNet layers
    session = model.new_session()
    model.prefill(session, ids_of(100).tolist(), ubatch=64)
    assert (paths.chunked, paths.recurrent) == (2 * 3, 0)
    model.generate(ids_of(100).tolist(), max_tokens=6, session=session, ignore_eos=True)
    # The prompt's last token must run again to give logits; the recurrent state cannot be cut
    # back by one token, so the snapshot at 64 is restored and tokens 64..99 are prefilled again
    # (chunked, once per layer); then 5 decode steps, all recurrent.
    assert (paths.chunked, paths.recurrent) == (3 * 3, 5 * 3)


@pytest.mark.parametrize("opts", [CASES[0], CASES[1], CASES[4]])
def test_greedy_generation_matches_transformers(qwen35, opts):
    ref, d = qwen35(seed=3, **opts)
    compared = check_greedy_against_reference(ref, expertcache.load(d), ids_of(12, seed=5).tolist())
    assert compared >= 16, "too many near-ties to make the comparison meaningful"


CACHES = [CacheConfig(mode="staging"), CacheConfig(experts=3), CacheConfig(experts=3, policy="lru"),
          CacheConfig(experts=5, store="disk"), CacheConfig(fraction=0.5, store="mmap")]


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_logits_bitwise_equal_in_every_cache_mode(qwen35, fused):
    _, d = qwen35(fused=fused, layer_types=(L, F, L, L))
    ids = ids_of(90, seed=4).tolist()

    def run(cache):
        model = expertcache.load(d, cache=cache)
        s = model.new_session()
        out = [model.prefill(s, ids[:80], ubatch=32, all_logits=True)]
        out += [model.prefill(s, [t], all_logits=True) for t in ids[80:]]
        gen = model.generate(ids[:20], max_tokens=12, ignore_eos=True).token_ids
        return torch.cat(out), gen, model.telemetry()

    resident, gen, _ = run(CacheConfig(mode="resident"))
    for cache in CACHES:
        logits, tokens, tel = run(cache)
        assert torch.equal(logits, resident), cache
        assert tokens == gen, cache
        assert tel["total"]["copied_experts"] > 0, cache  # the slow tier was really used


def test_multi_turn_session_reuses_its_prefix(qwen35):
    ref, d = qwen35(seed=6)
    model = expertcache.load(d)
    session = model.new_session()
    prompt = ids_of(40, seed=7).tolist()
    held = 0
    for turn in range(3):
        res = model.generate(prompt, max_tokens=8, session=session, ignore_eos=True)
        fresh = model.generate(prompt, max_tokens=8, ignore_eos=True)
        assert res.token_ids == fresh.token_ids
        assert res.cached_tokens == held  # everything the session held: the last prompt and reply
        held = len(session.tokens)
        # the logits of the state the session holds equal a fresh forward over the same tokens
        # (to rounding: the DeltaNet chunks and the attention blocks start elsewhere)
        follow = ids_of(30, seed=8 + turn).tolist()
        probe = session.copy()
        reused = model.prefill(probe, follow, all_logits=True)
        full = model.logits(session.tokens + follow)[-30:]
        torch.testing.assert_close(reused, full, atol=1e-4, rtol=0)
        prompt = prompt + res.token_ids + follow + [5]


def test_truncate_restores_a_snapshot_and_the_rest_is_prefilled(qwen35):
    _, d = qwen35(seed=9)
    model = expertcache.load(d)
    ids = ids_of(300, seed=10).tolist()
    s = model.new_session()
    model.prefill(s, ids[:260], ubatch=64)
    kv = s.kv
    assert isinstance(kv, SequenceState)
    assert [snap.position for snap in kv.snapshots] == [64, 128, 192, 256, 260]
    per = kv.snapshots[0].nbytes
    assert per == 3 * 4 * (4 * 16 * 8 + (2 * 2 * 16 + 4 * 8) * 3)  # 3 layers of [Hv, dk, dv] + [C, K-1] fp32
    assert kv.snapshot_bytes() == 5 * per
    fresh = model.logits(ids)
    for n in (259, 200, 128, 40):
        c = s.copy()
        kept = c.kv.truncate(n)
        assert kept == max([p for p in (0, 64, 128, 192, 256) if p <= n])
        del c.tokens[kept:]
        out = model.prefill(c, ids[kept:], all_logits=True)
        torch.testing.assert_close(out, fresh[kept:], atol=1e-5, rtol=0)
    # the original is untouched by what its copies did
    torch.testing.assert_close(model.prefill(s, ids[260:], all_logits=True), fresh[260:], atol=1e-5, rtol=0)
    # truncating keeps nothing after the kept position; truncating at the end keeps everything
    assert kv.truncate(kv.length) == 300 and len(kv.snapshots) == 6
    assert kv.truncate(150) == 128 and [snap.position for snap in kv.snapshots] == [64, 128]
    assert kv.truncate(0) == 0 and kv.snapshots == [] and kv.snapshot_bytes() == 0
    assert all(not st.recurrent.any() and not st.conv.any() for st in kv.recurrent.values())


def test_snapshots_are_bounded_and_decoding_takes_them_at_intervals(qwen35):
    _, d = qwen35()
    model = expertcache.load(d)
    s = model.new_session()
    s.kv.snapshot_every = 16
    model.prefill(s, ids_of(200).tolist(), ubatch=10)
    positions = [snap.position for snap in s.kv.snapshots]
    assert len(positions) == s.kv.max_snapshots == 8 and positions == list(range(130, 210, 10))
    s.kv.truncate(200)
    for t in ids_of(40, seed=3).tolist():
        model.prefill(s, [t])
    # decode steps take one every 16 tokens; the start of the next prompt is where the last ended
    assert [p.position for p in s.kv.snapshots][-3:] == [208, 224, 240]
    model.prefill(s, [5, 6, 7])
    assert [p.position for p in s.kv.snapshots][-2:] == [240, 243]


def test_a_failed_forward_is_restored_by_truncate(qwen35):
    _, d = qwen35()
    model = expertcache.load(d)
    ids = ids_of(80).tolist()
    s = model.new_session()
    model.prefill(s, ids[:64])
    layers = model.net.weights.layers
    router = layers[2].router
    layers[2].router = router[:, :3]  # layer 2's MoE fails after layers 0-2 advanced their state
    with pytest.raises(RuntimeError):
        model.prefill(s, ids[64:])
    layers[2].router = router
    with pytest.raises(ExpertCacheError, match="incomplete after a failed forward"):
        model.prefill(s, ids[64:])
    assert s.kv.truncate(64) == 64
    torch.testing.assert_close(model.prefill(s, ids[64:], all_logits=True), model.logits(ids)[64:],
                               atol=1e-5, rtol=0)


def test_generate_after_a_shorter_common_prefix_matches_fresh(qwen35):
    """The prompt diverges inside the last reply: generate restores the snapshot at the end of
    the last prompt and prefills from there."""
    _, d = qwen35(seed=11)
    model = expertcache.load(d)
    s = model.new_session()
    prompt = ids_of(50, seed=12).tolist()
    first = model.generate(prompt, max_tokens=10, session=s, ignore_eos=True)
    edited = prompt + first.token_ids[:4] + [7, 8, 9]
    again = model.generate(edited, max_tokens=10, session=s, ignore_eos=True)
    assert again.cached_tokens == len(prompt)  # the snapshot at the prompt's end
    assert s.tokens == edited + again.token_ids[:-1]
    assert again.token_ids == model.generate(edited, max_tokens=10, ignore_eos=True).token_ids


def test_info_and_run_on_the_multimodal_checkpoint(qwen35, capsys):
    _, d = qwen35(wrapped=True, fused=True)
    code, err = run_cli(capsys, "run", "-m", str(d), "-p", "w1 w2 w3", "-n", "4")
    assert code == 0, err
    code, err = run_cli(capsys, "info", "-m", str(d), "--json")
    assert code == 0, err


def test_unsupported_layer_type_is_a_one_line_error(qwen35, capsys):
    _, d = qwen35()
    raw = json.loads((d / "config.json").read_text())
    raw["layer_types"][1] = "sliding_attention"
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ExpertCacheError, match=r"unsupported layer type 'sliding_attention' \(layer 1"):
        expertcache.load(d)
    assert_one_line_error(*run_cli(capsys, "run", "-m", str(d), "-p", "w1"), "sliding_attention", "config.json")


def test_missing_deltanet_tensor_is_a_one_line_error(qwen35, capsys):
    _, d = qwen35()
    path = d / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.linear_attn.A_log"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ExpertCacheError, match=r"missing tensor 'model.layers.1.linear_attn.A_log' \(expected shape \[4\]"):
        expertcache.load(d)
    assert_one_line_error(*run_cli(capsys, "run", "-m", str(d), "-p", "w1"), "model.layers.1.linear_attn.A_log")


def test_layer_types_default_and_pattern():
    from expertcache.models import for_model_type
    from expertcache.models.mixers import describe_layers
    from expertcache.models.synth import synth_config

    raw = synth_config("qwen3.6-35b-a3b", layers=40)
    arch = for_model_type(raw["model_type"], "test")
    assert describe_layers(arch.mixers(arch.config_from_hf(raw))) == "(deltanet x3, gated_attention) x10"
    del raw["layer_types"]  # transformers' default: full attention every full_attention_interval-th layer
    raw["full_attention_interval"] = 2
    cfg = arch.config_from_hf(raw)
    assert cfg.layer_types[:4] == (L, F, L, F)
    assert (cfg.deltanet.k_heads, cfg.deltanet.v_heads, cfg.attention.rotary_dim) == (16, 32, 64)
    wrapped = arch.config_from_hf({"model_type": "qwen3_5_moe", "dtype": "bfloat16",
                                   "text_config": {**raw, "model_type": "qwen3_5_moe_text"}})
    assert wrapped.wrapped and wrapped.dtype == torch.bfloat16 and arch.names(wrapped)["layer"].startswith(
        "model.language_model.")
    with pytest.raises(ExpertCacheError, match="layer_types .*expected a list of 40 layer types"):
        arch.config_from_hf({**raw, "layer_types": [L] * 39})


def _serve_conversation(d, cache_prompt: bool, turns: list[list[str]]) -> list[tuple[str, dict]]:
    """Chat turns through the server (in-process): each reply text and its timings."""
    from fastapi.testclient import TestClient

    from expertcache.server.app import create_app

    model = expertcache.load(d, ctx_size=512)
    out, msgs = [], []
    with TestClient(create_app(model, cache_prompt=cache_prompt)) as c:
        for words in turns:
            msgs.append({"role": "user", "content": " ".join(words)})
            r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            out.append((body["choices"][0]["message"]["content"], body["timings"]))
            msgs.append({"role": "assistant", "content": out[-1][0]})
    return out


def test_server_prompt_cache_replies_equal_a_fresh_servers(qwen35):
    _, d = qwen35(seed=13)
    turns = [["w5", "w6", "w7"], ["w8", "w9"], ["w10", "w11", "w12"]]
    cached = _serve_conversation(d, True, turns)
    fresh = _serve_conversation(d, False, turns)
    assert [text for text, _ in cached] == [text for text, _ in fresh]
    assert all(t["cache_n"] == 0 for _, t in fresh)
    assert cached[1][1]["cache_n"] > 0 and cached[2][1]["cache_n"] > cached[1][1]["cache_n"]


def test_bf16_error_is_of_the_size_of_transformers_own(qwen35):
    ref, d = qwen35(seed=14)
    ids = ids_of(100, seed=15)
    exact = ref_logits(ref, ids)
    ref16 = ref.to(torch.bfloat16)
    with torch.no_grad():
        theirs = ref16(input_ids=ids[None], use_cache=False).logits[0].float()
    model = expertcache.load(d, dtype="bfloat16")
    s = model.new_session()
    ours = torch.cat([model.prefill(s, ids[:90].tolist(), all_logits=True)]
                     + [model.prefill(s, [t], all_logits=True) for t in ids[90:].tolist()]).float()
    ours_err, ref_err = (ours - exact).abs().mean(), (theirs - exact).abs().mean()
    assert ours_err <= 1.5 * ref_err + 1e-3, (ours_err, ref_err)


def test_prompt_attention_reads_each_groups_keys_once(qwen35, monkeypatch):
    """Grouped-query attention over a prompt (fresh, and after cached tokens) gets each group's
    keys and values once, never a copy per query head (docs/prefill.md)."""
    _, d = qwen35()
    ids = torch.randint(2, VOCAB, (40,), generator=torch.Generator().manual_seed(3))
    assert_prompt_keys_not_repeated(expertcache.load(d), ids, monkeypatch)
