"""RoPE scaling set at load time over the checkpoint's own: `--rope-scaling {none,linear,yarn}`,
`--rope-scale F` and `--yarn-orig-ctx N` on every command that loads a model, and
`load(rope_scaling=...)`, with llama.cpp's semantics (common/arg.cpp sets rope_scaling_type,
rope_freq_scale = 1/F and yarn_orig_ctx; llama-context.cpp keeps the model's value for each one
left out, 0 for the original context being the model's own, a model without a type scaling
linearly, and `none` forcing freq_scale 1). Qwen's model cards give a plain 32K Qwen3 file 128K
with `--rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 32768`. The references: the same weights
whose config.json carries that rope_scaling, in transformers and in our own loader, here scaled
down to an original context of 128 tokens."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import expertcache
from expertcache.cli import build_parser
from expertcache.commands.common import load_model
from expertcache.config import RopeConfig, RopeOverride
from expertcache.models.loader import open_model
from expertcache.models.synth import synth
from conftest import assert_one_line_error, run_cli

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

ORIGINAL = 128  # the plain model's context: the prompt runs well past it
PROMPT = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0)).tolist()
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
LINEAR = {"rope_type": "linear", "factor": 2.0}


def _with_config(src: Path, dst: Path, **keys) -> Path:
    """A copy of checkpoint `src` (the same weights) with `keys` set in its config.json."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**raw, **keys}))
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A plain Qwen3-MoE with a context of ORIGINAL tokens, as a checkpoint and a GGUF; the same
    weights with the model card's YaRN and with linear scaling in config.json; the YaRN one as
    a GGUF, with the scaling keys llama.cpp's converter writes."""
    from to_gguf import convert

    d = tmp_path_factory.mktemp("rope")
    plain = synth(d / "plain", like="tiny", layers=2, experts=4, top_k=2, vocab=300, dtype="float32",
                  progress=False, overrides={"max_position_embeddings": ORIGINAL, "rope_theta": 10000.0})
    out = {"plain": plain, "yarn": _with_config(plain, d / "yarn", rope_scaling=YARN),
           "linear": _with_config(plain, d / "linear", rope_scaling=LINEAR)}
    for name in ("plain", "yarn"):
        convert(out[name], d / f"{name}.gguf")
        out[f"{name}.gguf"] = d / f"{name}.gguf"
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _transformers(path: Path) -> torch.Tensor:
    import transformers as tf

    ref = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([PROMPT])).logits[0]


def _cli_model(command: str, path: Path, *flags: str):
    """The model `command` loads with these flags (its own parser, `load_model`)."""
    argv = {"trace": ["trace", "record", "-f", "x", "-o", "x.npz"], "perplexity": ["perplexity", "-f", "x"]}
    argv = argv.get(command, [command])
    args = build_parser().parse_args([*argv, "-m", str(path), "--dtype", "float32", *flags])
    if command == "perplexity":
        from expertcache.commands.perplexity import _load
        from expertcache.config import CacheConfig

        return _load(args, CacheConfig())
    return load_model(args)


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_yarn_flags_on_a_plain_file_compute_the_model_cards_yarn(models, fmt):
    plain = models["plain.gguf" if fmt == "gguf" else "plain"]
    # --yarn-orig-ctx 0: the model's own context (llama.cpp: yarn_orig_ctx 0 -> n_ctx_train).
    model = _cli_model("run", plain, "-c", "512", "--rope-scaling", "yarn", "--rope-scale", "4",
                       "--yarn-orig-ctx", "0")
    assert model.cfg.rope == RopeConfig(theta=10000.0, type="yarn", factor=4.0, original_max_position=ORIGINAL)
    got = model.logits(PROMPT)
    want = _transformers(models["yarn"])
    configured = expertcache.load(models["yarn"], dtype="float32", ctx_size=512).logits(PROMPT)
    past = slice(ORIGINAL, None)
    assert _rel(got[past], want[past]) < 1e-5
    assert _rel(got, configured) < 1e-6
    if fmt == "safetensors":
        assert torch.equal(got, configured)  # the same RoPE tables: the same computation
    # Without the flags the same weights are another model there: the scaling is what is checked.
    unscaled = expertcache.load(plain, dtype="float32", ctx_size=512).logits(PROMPT)
    assert _rel(unscaled[past], want[past]) > 1e-2


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_rope_scale_alone_on_a_plain_file_scales_linearly(models, fmt):
    # llama.cpp: "defaults to linear unless specified by the model".
    plain = models["plain.gguf" if fmt == "gguf" else "plain"]
    got = expertcache.load(plain, dtype="float32", ctx_size=512, rope_scaling={"factor": 2.0}).logits(PROMPT)
    want = _transformers(models["linear"])
    assert _rel(got, want) < 1e-5
    assert _rel(expertcache.load(plain, dtype="float32", ctx_size=512).logits(PROMPT), want) > 1e-2


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_none_turns_a_files_yarn_off(models, fmt):
    yarn, plain = (models["yarn.gguf"], models["plain.gguf"]) if fmt == "gguf" else (models["yarn"], models["plain"])
    assert open_model(yarn).cfg.rope.type == "yarn"
    got = expertcache.load(yarn, dtype="float32", ctx_size=512, rope_scaling={"rope_type": "none"}).logits(PROMPT)
    assert torch.equal(got, expertcache.load(plain, dtype="float32", ctx_size=512).logits(PROMPT))
    # transformers' name for no scaling is "default"
    again = expertcache.load(yarn, dtype="float32", ctx_size=512, rope_scaling={"rope_type": "default"})
    assert torch.equal(again.logits(PROMPT), got)


@pytest.mark.parametrize("name", ["yarn", "yarn.gguf"])
@pytest.mark.parametrize("given,want", [
    # What is not given is the file's (llama-context.cpp): its type and original context stay.
    ({"factor": 8.0}, RopeConfig(theta=10000.0, type="yarn", factor=8.0, original_max_position=ORIGINAL)),
    ({"original_max_position_embeddings": 64},
     RopeConfig(theta=10000.0, type="yarn", factor=4.0, original_max_position=64)),
    # ... and its factor (rope_freq_scale_train) under another type.
    ({"rope_type": "linear"}, RopeConfig(theta=10000.0, type="linear", factor=4.0)),
], ids=["factor", "original", "type"])
def test_flags_left_out_are_the_files_own(models, name, given, want):
    assert open_model(models[name], RopeOverride.from_dict(given)).cfg.rope == want


def test_every_command_that_loads_a_model_takes_the_flags(models):
    flags = ("--rope-scaling", "yarn", "--rope-scale", "4", "--yarn-orig-ctx", "64")
    want = RopeConfig(theta=10000.0, type="yarn", factor=4.0, original_max_position=64)
    for command in ("run", "serve", "trace", "perplexity"):
        assert _cli_model(command, models["plain.gguf"], *flags).cfg.rope == want, command
    args = build_parser().parse_args(["trace", "fit-predictor", "-m", "x", "-f", "x", "-o", "x", *flags])
    assert (args.rope_scaling, args.rope_scale, args.yarn_orig_ctx) == ("yarn", 4.0, 64)


def test_perplexity_with_the_flags_is_the_yarn_models(models, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)

    def ppl(path: Path, *flags: str) -> float:
        from expertcache.cli import main

        capsys.readouterr()
        assert main(["perplexity", "-m", str(path), "--dtype", "float32", "-c", "256", "-f", str(text),
                     "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ppl"]

    want = ppl(models["yarn"])
    assert ppl(models["plain"], "--rope-scaling", "yarn", "--rope-scale", "4") == want
    assert ppl(models["plain"]) != want


GEMMA4 = Path(__file__).parent / "fixtures" / "gguf" / "gemma4" / "gemma4-Q8_0.gguf"


@pytest.mark.parametrize("model,flags,needle", [
    ("plain", ["--rope-scale", "0"], "argument --rope-scale: 0 must be a positive number"),
    ("plain", ["--rope-scale", "-2"], "argument --rope-scale: -2 must be a positive number"),
    ("plain", ["--rope-scale", "nan"], "argument --rope-scale: 'nan' is not a finite number"),
    ("plain", ["--yarn-orig-ctx", "-1"], "argument --yarn-orig-ctx: -1 must be >= 0"),
    ("plain", ["--rope-scaling", "ntk"], "argument --rope-scaling: invalid choice: 'ntk'"),
    ("plain", ["--rope-scaling", "yarn"], "--rope-scaling yarn needs --rope-scale > 1: the model gives no factor"),
    ("plain", ["--rope-scaling", "yarn", "--rope-scale", "0.5"],
     "--rope-scale 0.5: YaRN extends the context by a factor > 1"),
    ("plain", ["--rope-scaling", "yarn", "--rope-scale", "1"], "--rope-scale 1: YaRN extends the context"),
    ("plain", ["--rope-scaling", "linear"], "--rope-scaling linear needs --rope-scale: the model gives no factor"),
    # llama.cpp would scale linearly and drop the original context without a word.
    ("plain", ["--rope-scale", "4", "--yarn-orig-ctx", "32"],
     "--yarn-orig-ctx 32 applies to YaRN only, and the scaling is linear (add --rope-scaling yarn)"),
    ("plain", ["--rope-scaling", "linear", "--rope-scale", "4", "--yarn-orig-ctx", "32"],
     "--yarn-orig-ctx 32 applies to YaRN only, not to --rope-scaling linear"),
    ("yarn", ["--rope-scaling", "none", "--rope-scale", "4"], "--rope-scale 4: --rope-scaling none never scales"),
    ("yarn", ["--rope-scale", "0.5"], "--rope-scale 0.5: YaRN extends the context by a factor > 1"),
    # Gemma 4's layers build their own RoPE tables (theta per layer kind, rope_freqs).
    (GEMMA4, ["--rope-scaling", "yarn", "--rope-scale", "4"],
     "--rope-scaling yarn --rope-scale 4: RoPE scaling is not supported for gemma4"),
    (GEMMA4, ["--rope-scaling", "none"], "--rope-scaling none: RoPE scaling is not supported for gemma4"),
], ids=["scale-0", "scale-negative", "scale-nan", "orig-negative", "type", "yarn-no-factor", "yarn-below-1",
        "yarn-1", "linear-no-factor", "orig-linear-default", "orig-linear", "none-with-scale", "yarn-file-below-1",
        "gemma4", "gemma4-none"])
def test_bad_rope_flags_are_one_line(models, capsys, model, flags, needle):
    path = models[model] if isinstance(model, str) else model
    code, err = run_cli(capsys, "run", "-m", str(path), "-p", "hi", "-n", "1", *flags)
    assert_one_line_error(code, err, needle)


@pytest.mark.parametrize("argv", [
    ["perplexity", "-f", "{text}"], ["serve", "--port", "0"], ["trace", "record", "-f", "{text}", "-o", "{out}"],
    ["trace", "fit-predictor", "-f", "{text}", "-o", "{out}"],
], ids=["perplexity", "serve", "trace-record", "fit-predictor"])
def test_other_commands_refuse_a_yarn_without_a_factor(models, capsys, tmp_path, argv):
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 20)
    argv = [a.format(text=text, out=tmp_path / "out") for a in argv]
    code, err = run_cli(capsys, *argv, "-m", str(models["plain.gguf"]), "--rope-scaling", "yarn")
    assert_one_line_error(code, err, "--rope-scaling yarn needs --rope-scale > 1")


@pytest.mark.parametrize("value,needle", [
    ({"rope_type": "ntk", "factor": 2.0}, "rope_scaling rope_type 'ntk': expected one of none, linear, yarn"),
    ({"factor": 0}, "rope_scaling factor 0: expected a positive number"),
    ({"factor": True}, "rope_scaling factor True: expected a positive number"),
    ({"factor": "4"}, "rope_scaling factor '4': expected a positive number"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": -1},
     "rope_scaling original_max_position_embeddings -1: expected an integer >= 0"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 8}, "rope_scaling key 'beta_fast' is not supported"),
    ({"rope_type": "yarn", "type": "linear", "factor": 4.0}, "rope_scaling rope_type 'yarn' and type 'linear' disagree"),
    ({"rope_type": "yarn"}, "rope_scaling rope_type yarn needs rope_scaling factor > 1: the model gives no factor"),
    ("yarn", "rope_scaling 'yarn': expected a dict"),
], ids=["type", "zero", "bool", "string", "orig-negative", "unknown-key", "disagree", "yarn-no-factor", "not-a-dict"])
def test_bad_rope_scaling_in_load_is_one_line(models, value, needle):
    with pytest.raises(expertcache.ExpertCacheError) as e:
        expertcache.load(models["plain"], rope_scaling=value)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_model_cards_dict_as_4x_spells_it(models):
    # transformers 4.x configs (and older model cards) spell the type `type`.
    got = open_model(models["plain"], RopeOverride.from_dict({"type": "yarn", "factor": 4.0})).cfg.rope
    assert got == RopeConfig(theta=10000.0, type="yarn", factor=4.0, original_max_position=ORIGINAL)


def test_gemma4_refuses_rope_scaling_in_load(models):
    with pytest.raises(expertcache.ExpertCacheError) as e:
        expertcache.load(GEMMA4, rope_scaling={"rope_type": "yarn", "factor": 4})
    assert str(e.value) == ("rope_scaling {'rope_type': 'yarn', 'factor': 4.0}: RoPE scaling is not supported for "
                            "gemma4, whose layers build their own RoPE tables")


def test_gemma4_takes_a_rope_scaling_that_asks_nothing(models):
    # Every value the model's own: nothing to scale, so nothing to refuse.
    assert expertcache.load(GEMMA4, rope_scaling={}).cfg.model_type == "gemma4"


def test_a_reload_keeps_the_scaling(models):
    # The weights are read again when the checkpoint changes on disk (`Model.begin_call`).
    model = expertcache.load(models["plain.gguf"], dtype="float32", ctx_size=512, rope_scaling=YARN)
    want = model.logits(PROMPT)
    model._reload()
    assert model.cfg.rope.type == "yarn" and torch.equal(model.logits(PROMPT), want)
