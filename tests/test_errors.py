"""Bad input: each case is one line on stderr naming the file, tensor or value, exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from conftest import assert_one_line_error, run_cli


@pytest.fixture
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe")[1]


def test_missing_directory(capsys, tmp_path):
    assert_one_line_error(*run_cli(capsys, "run", "-m", str(tmp_path / "nope"), "-p", "w1"), "nope", "does not exist")


def test_missing_config(capsys, ckpt):
    (ckpt / "config.json").unlink()
    assert_one_line_error(*run_cli(capsys, "info", "-m", str(ckpt)), "config.json", "missing")


def test_unsupported_model_type_lists_supported(capsys, ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    raw["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(raw))
    code, err = run_cli(capsys, "run", "-m", str(ckpt), "-p", "w1")
    assert_one_line_error(code, err, "'llama'", "qwen3_moe", "mixtral", "olmoe", "qwen2_moe")


def _rewrite(ckpt, fn):
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor(capsys, ckpt):
    _rewrite(ckpt, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    assert_one_line_error(*run_cli(capsys, "run", "-m", str(ckpt), "-p", "w1"),
                          "missing tensor", "model.layers.1.self_attn.k_proj.weight")


def test_unexpected_tensor(capsys, ckpt):
    import torch

    _rewrite(ckpt, lambda t: t.__setitem__("model.layers.0.mlp.extra.weight", torch.zeros(2)))
    assert_one_line_error(*run_cli(capsys, "run", "-m", str(ckpt), "-p", "w1"),
                          "unexpected tensor", "model.layers.0.mlp.extra.weight")


def test_shape_mismatch(capsys, ckpt):
    import torch

    _rewrite(ckpt, lambda t: t.__setitem__("model.layers.0.mlp.experts.3.up_proj.weight", torch.zeros(31, 64)))
    assert_one_line_error(*run_cli(capsys, "run", "-m", str(ckpt), "-p", "w1"),
                          "model.layers.0.mlp.experts.3.up_proj.weight", "[31, 64]", "[32, 64]")


def test_truncated_safetensors(capsys, ckpt):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    assert_one_line_error(*run_cli(capsys, "run", "-m", str(ckpt), "-p", "w1"), "model.safetensors", "truncated")


def test_corrupt_safetensors_header(capsys, ckpt):
    path = ckpt / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"\xff" * 12
    path.write_bytes(bytes(data))
    assert_one_line_error(*run_cli(capsys, "info", "-m", str(ckpt)), "model.safetensors", "corrupt")


def test_non_utf8_prompt_file(capsys, ckpt, tmp_path):
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"w1 \xff\xfe w2")
    assert_one_line_error(*run_cli(capsys, "run", "-m", str(ckpt), "-f", str(bad)), "prompt.txt", "UTF-8")


@pytest.mark.parametrize("argv,needle", [
    (["-n", "lots"], "'lots'"),
    (["-t", "0"], "0 must be at least 1"),
    (["--top-p", "1.5"], "top_p 1.5"),
    (["--dtype", "int3"], "'int3'"),
    (["--cache-mem", "12 parsecs"], "12 parsecs"),
])
def test_bad_flag_values(capsys, ckpt, argv, needle):
    assert_one_line_error(*run_cli(capsys, "run", "-m", str(ckpt), "-p", "w1", *argv), needle)


def test_prompt_too_long_for_context(capsys, ckpt):
    assert_one_line_error(*run_cli(capsys, "run", "-m", str(ckpt), "-c", "4", "-p", "w1 w2 w3 w4 w5"),
                          "5 tokens", "context of 4")


def test_no_traceback_from_the_installed_command(ckpt):
    p = subprocess.run([sys.executable, "-m", "expertcache.cli", "run", "-m", str(ckpt / "missing"), "-p", "x"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr


def test_every_subcommand_has_help(capsys):
    from expertcache.cli import build_parser

    commands = [["run"], ["info"], ["pack"], ["synth"], ["perplexity"], ["serve"], ["trace", "record"],
                ["trace", "simulate"], ["trace", "stats"], ["bench", "cache"], ["bench", "speed"], ["bench", "serve"]]
    for argv in commands:
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args([*argv, "--help"])
        assert e.value.code == 0, argv
        assert "usage: expertcache" in capsys.readouterr().out


def test_a_context_beyond_the_trained_one_is_a_warning(capsys):
    from conftest import run_cli

    code, err = run_cli(capsys, "run", "-c", "8192", "-p", "def f", "-n", "1")
    assert code == 0
    warning = [line for line in err.splitlines() if "warning" in line]
    assert len(warning) == 1 and "8192" in warning[0] and "4096" in warning[0]


def test_bad_token_ids_are_errors_and_leave_the_session_as_it_was(ckpt):
    import expertcache
    from expertcache import ExpertCacheError

    model = expertcache.load(ckpt)
    session = model.new_session()
    model.prefill(session, [1, 2, 3])
    for ids, needle in (([1.5], "token ids must be integers, got [1.5]"),
                        ([4, 10 ** 6], "token id 1000000 out of range")):
        with pytest.raises(ExpertCacheError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            model.prefill(session, ids)
        assert session.kv.length == 3 and session.tokens == [1, 2, 3]
    assert model.prefill(session, [4]).shape == (model.cfg.vocab_size,)
