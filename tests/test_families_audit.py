"""The four older families (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral) at the edges of their configs,
against transformers: keys each family's transformers code reads (or ignores) are read the same
way here, or refused in one line. Logits are compared in fp32 over prompts longer than any
window, whole, in micro-batches and decoded token by token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import expertcache
from conftest import VOCAB, assert_one_line_error, build_reference, run_cli, save_checkpoint, tiny_config
from expertcache.errors import ExpertCacheError


def ids_of(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def edited(ref, directory: Path, edit) -> tuple[object, Path]:
    """`ref` saved to `directory` with its config.json edited by `edit(raw)`, and the reference
    transformers builds from the edited files (so that it reads the config as we must)."""
    import transformers

    d = save_checkpoint(ref, directory)
    raw = json.loads((d / "config.json").read_text())
    edit(raw)
    (d / "config.json").write_text(json.dumps(raw))
    return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval(), d


def assert_matches_reference(ref, d: Path, n: int = 40) -> None:
    """Our logits equal the reference's: the whole prompt at once, then a prefill in micro-batches
    followed by one token at a time."""
    ids = ids_of(n)
    with torch.no_grad():
        want = ref(ids[None]).logits[0].float()
    model = expertcache.load(d)
    torch.testing.assert_close(model.logits(ids), want, atol=1e-5, rtol=0)
    session = model.new_session()
    parts = [model.prefill(session, ids[:13].tolist(), ubatch=5, all_logits=True)]
    parts += [model.prefill(session, [t], all_logits=True) for t in ids[13:].tolist()]
    torch.testing.assert_close(torch.cat(parts), want, atol=1e-5, rtol=0)


def no_layer_types_and(**keys):
    """A config as transformers 4.x wrote it (no `layer_types`), with `keys` set."""
    def edit(raw):
        raw.pop("layer_types")
        raw.update(keys)
    return edit


@pytest.mark.parametrize("layers,opts,edit", [
    # transformers 5.x writes layer_types: layers 0 and 2 slide (max_window_layers 28)
    (3, {}, lambda raw: None),
    # dense layers beside the windows
    (4, {"dense": True, "max_window_layers": 3}, lambda raw: None),
    # a 4.x config: the kinds come from max_window_layers (only layer 0 slides)
    (4, {}, no_layer_types_and(max_window_layers=1)),
    # layer_types as given, whatever max_window_layers says
    (3, {}, lambda raw: raw.update(layer_types=["full_attention", "sliding_attention", "full_attention"])),
], ids=["layer-types", "dense", "max-window-layers", "explicit"])
def test_qwen2_moe_window_applies_only_to_the_sliding_layers(tmp_path, layers, opts, edit):
    # The window was applied to every layer: logits off by ~2 against transformers.
    config = tiny_config("qwen2_moe", layers=layers, use_sliding_window=True, sliding_window=8, **opts)
    ref, d = edited(build_reference(config), tmp_path / "m", edit)
    assert_matches_reference(ref, d)


def test_qwen2_moe_bad_layer_types_are_refused(tmp_path, capsys):
    config = tiny_config("qwen2_moe", use_sliding_window=True, sliding_window=8)
    d = save_checkpoint(build_reference(config), tmp_path / "m")
    raw = json.loads((d / "config.json").read_text())
    raw["layer_types"] = ["sliding_attention", "chunked_attention", "full_attention"]
    (d / "config.json").write_text(json.dumps(raw))
    code, err = run_cli(capsys, "info", "-m", str(d))
    assert_one_line_error(code, err, "config.json", "layer_types", "chunked_attention")


def test_olmoe_never_slides(tmp_path):
    # transformers builds OLMoE's mask causal whatever the config holds; a window was applied here.
    ref, d = edited(build_reference(tiny_config("olmoe")), tmp_path / "m",
                    lambda raw: raw.update(use_sliding_window=True, sliding_window=8))
    assert_matches_reference(ref, d)


def test_mixtral_has_no_attention_biases(tmp_path):
    # `attention_bias` is not a Mixtral key: transformers ignores it; here it asked for bias tensors.
    ref, d = edited(build_reference(tiny_config("mixtral")), tmp_path / "m",
                    lambda raw: raw.update(attention_bias=True))
    assert_matches_reference(ref, d)


def _without(*keys):
    def edit(raw):
        for k in keys:
            raw.pop(k, None)
    return edit


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral"])
def test_family_defaults_for_keys_a_config_leaves_out(tmp_path, arch):
    # A config.json without rope_theta, rms_norm_eps or max_position_embeddings takes the family's
    # transformers defaults: Mixtral's theta is 1e6 (10000 was taken here), its eps and OLMoE's
    # 1e-5, the context the class default.
    ref, d = edited(build_reference(tiny_config(arch)), tmp_path / "m",
                    _without("rope_parameters", "rope_theta", "rms_norm_eps", "max_position_embeddings"))
    model = expertcache.load(d)
    assert model.cfg.rope.theta == ref.config.rope_parameters["rope_theta"]
    assert model.cfg.rms_norm_eps == ref.config.rms_norm_eps
    assert model.cfg.max_position == ref.config.max_position_embeddings
    assert_matches_reference(ref, d)


def test_rope_scaling_beside_rope_parameters_is_refused_when_they_disagree(tmp_path, capsys):
    # A 5.x config with rope_scaling added by hand: transformers reads rope_scaling alone (and not
    # rope_parameters' theta); the two were merged here, rope_parameters winning, so the scaling
    # was dropped without a word.
    ref = build_reference(tiny_config("qwen3_moe", rope={"rope_type": "default", "rope_theta": 10000.0}))
    scaling = {"type": "linear", "factor": 2.0}
    _, d = edited(ref, tmp_path / "m", lambda raw: raw.update(rope_scaling=scaling))
    code, err = run_cli(capsys, "info", "-m", str(d))
    assert_one_line_error(code, err, "config.json", "rope_scaling", "rope_parameters", "disagree")
    with pytest.raises(ExpertCacheError, match="disagree"):
        expertcache.load(d)
    # The same parameters in both (4.x's `type` spelling in one) are one reading: loaded, and equal.
    same = {"type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    ref2, d2 = edited(ref, tmp_path / "m2", lambda raw: raw.update(
        rope_scaling=same, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}))
    assert expertcache.load(d2).cfg.rope.type == "linear"
    assert_matches_reference(ref2, d2)
