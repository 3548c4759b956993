"""`pack` and `synth` never delete what they did not write: -o naming the current directory, a
source or a directory above one, or an existing path that is not an earlier output of theirs, is
a one-line error before anything is written; --force replaces only their own outputs."""

from __future__ import annotations

import pytest

from conftest import assert_one_line_error, build_reference, run_cli, save_checkpoint, tiny_config


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_checkpoint(build_reference(tiny_config("qwen3_moe")), tmp_path_factory.mktemp("src") / "model")


def _snapshot(d):
    return sorted((p.relative_to(d), p.read_bytes()) for p in d.rglob("*") if p.is_file())


def test_pack_refuses_the_current_directory(source, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    for out in (".", str(work), ".."):
        code, err = run_cli(capsys, "pack", "-m", str(source), "-o", out, "--force")
        assert_one_line_error(code, err, repr(out), "current directory")
    assert (work / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("where", ["source", "parent"])
def test_pack_refuses_the_source_and_what_holds_it(source, capsys, where):
    before = _snapshot(source.parent)
    out = source if where == "source" else source.parent
    code, err = run_cli(capsys, "pack", "-m", str(source), "-o", str(out), "--force")
    assert_one_line_error(code, err, str(out), "source")
    assert _snapshot(source.parent) == before


def test_force_never_replaces_what_it_did_not_write(source, tmp_path, capsys):
    other = tmp_path / "photos"
    other.mkdir()
    (other / "a.jpg").write_bytes(b"\xff\xd8")
    afile = tmp_path / "file.bin"
    afile.write_bytes(b"data")
    for cmd in (["pack", "-m", str(source)], ["synth", "--like", "tiny", "--layers", "1"]):
        code, err = run_cli(capsys, *cmd, "-o", str(other), "--force")
        assert_one_line_error(code, err, str(other), "not written by expertcache")
        code, err = run_cli(capsys, *cmd, "-o", str(afile), "--force")
        assert_one_line_error(code, err, str(afile), "not a directory")
    assert (other / "a.jpg").read_bytes() == b"\xff\xd8" and afile.read_bytes() == b"data"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial output left


def test_force_replaces_an_earlier_output(source, tmp_path, capsys):
    out = tmp_path / "packed"
    assert run_cli(capsys, "pack", "-m", str(source), "-o", str(out))[0] == 0
    first = _snapshot(out)
    code, err = run_cli(capsys, "pack", "-m", str(source), "-o", str(out))
    assert_one_line_error(code, err, str(out), "already exists")
    assert run_cli(capsys, "pack", "-m", str(source), "-o", str(out), "--force")[0] == 0
    assert _snapshot(out) == first
    syn = tmp_path / "syn"
    assert run_cli(capsys, "synth", "--like", "tiny", "--layers", "1", "-o", str(syn))[0] == 0
    assert run_cli(capsys, "synth", "--like", "tiny", "--layers", "1", "-o", str(syn), "--force", "--seed", "3")[0] == 0
    assert (syn / ".expertcache-output").is_file()


def test_synth_quant_writes_a_q4_k_m_gguf_and_replaces_only_its_own(tmp_path, capsys):
    import gguf
    import torch

    import expertcache
    from expertcache.models.synth_gguf import q4_k_m_type

    out = tmp_path / "q.gguf"
    argv = ["synth", "--like", "qwen3-30b-a3b", "--layers", "2", "--experts", "4", "--top-k", "2",
            "--vocab", "300", "--quant", "q4_k_m", "-o", str(out)]
    assert run_cli(capsys, *argv)[0] == 0
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "Q4_K" and types["blk.1.ffn_down_exps.weight"] == "Q6_K"
    assert types["blk.0.ffn_down_exps.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    assert q4_k_m_type("blk.5.ffn_down_exps.weight", 5, 48).name == "Q6_K" == q4_k_m_type("output.weight", 0, 48).name
    assert q4_k_m_type("blk.7.ffn_down_exps.weight", 7, 48).name == "Q4_K"
    model = expertcache.load(out)
    logits = model.logits([5, 6, 7])
    assert torch.isfinite(logits).all() and logits.float().std() > 0
    assert [m.storage.name for m in model.experts.formats[1].matrices] == ["Q4_K", "Q4_K", "Q6_K"]
    code, err = run_cli(capsys, *argv)
    assert_one_line_error(code, err, str(out), "already exists")
    assert run_cli(capsys, *argv, "--force", "--seed", "2")[0] == 0
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"not ours")
    code, err = run_cli(capsys, *argv[:-1], str(foreign), "--force")
    assert_one_line_error(code, err, str(foreign), "is not a file written by expertcache")
    assert foreign.read_bytes() == b"not ours"


@pytest.mark.parametrize("which", ["bundled", "gguf"])
def test_info_counts_the_dense_tensors_bytes_not_the_headers(capsys, which):
    # dense_bytes_in_file was the files' size less the experts': the safetensors header and a
    # GGUF's metadata (its whole tokenizer) counted as dense weights.
    import json
    from pathlib import Path

    import gguf
    from safetensors import safe_open

    import expertcache
    from expertcache.cli import main

    if which == "bundled":
        path = Path(expertcache.__file__).parent / "assets" / "tiny-qwen3-moe"
        with safe_open(path / "model.safetensors", "pt") as f:
            tensor_bytes = sum(f.get_tensor(k).nbytes for k in f.keys())
    else:
        path = Path(__file__).parent / "fixtures" / "gguf" / "qwen3_moe-mix.gguf"
        tensor_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    capsys.readouterr()
    assert main(["info", "-m", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["dense_bytes_in_file"] == tensor_bytes - info["expert_bytes_total"]
    assert info["dense_bytes_in_file"] + info["expert_bytes_total"] < sum(p.stat().st_size for p in (
        [path / "model.safetensors"] if which == "bundled" else [path]))


def test_pack_of_a_packed_gguf_gives_the_same_logits(tmp_path, capsys):
    # The packed tensor of a packed source was copied and then written again: gguf-py refused the
    # second tensor of the same name with a traceback.
    import shutil
    from pathlib import Path

    import torch

    import expertcache

    src = tmp_path / "src.gguf"
    shutil.copy(Path(__file__).parent / "fixtures" / "gguf" / "qwen3_moe-mix.gguf", src)
    once, twice = tmp_path / "once.gguf", tmp_path / "twice.gguf"
    assert run_cli(capsys, "pack", "-m", str(src), "-o", str(once))[0] == 0
    assert run_cli(capsys, "pack", "-m", str(once), "-o", str(twice))[0] == 0
    ids = [5, 6, 7, 8, 9]
    assert torch.equal(expertcache.load(src).logits(ids), expertcache.load(twice).logits(ids))


def test_force_keeps_what_was_added_to_an_earlier_output(source, tmp_path, capsys):
    # --force replaced the whole directory: a file the user had put in it since was deleted.
    out = tmp_path / "packed"
    assert run_cli(capsys, "pack", "-m", str(source), "-o", str(out))[0] == 0
    (out / "NOTES.md").write_text("mine")
    before = _snapshot(out)
    code, err = run_cli(capsys, "pack", "-m", str(source), "-o", str(out), "--force")
    assert_one_line_error(code, err, str(out), "'NOTES.md'", "did not write")
    assert _snapshot(out) == before
    (out / "NOTES.md").unlink()
    assert run_cli(capsys, "pack", "-m", str(source), "-o", str(out), "--force")[0] == 0


@pytest.mark.parametrize("what", ["directory", "gguf"])
def test_sigterm_mid_write_leaves_no_partial_output(source, tmp_path, what):
    # Python's default SIGTERM (and SIGHUP) ends the process without running the cleanup, so a
    # `kill` or `timeout` mid-write left the hidden partial output (the model's size) behind.
    import subprocess
    import sys
    from pathlib import Path

    if what == "directory":
        argv, hook = ["pack", "-m", str(source), "-o", str(tmp_path / "out")], "expertcache.models.pack.convert"
    else:
        src = Path(__file__).parent / "fixtures" / "gguf" / "qwen3_moe-mix.gguf"
        argv, hook = ["pack", "-m", str(src), "-o", str(tmp_path / "out.gguf")], \
            "gguf.gguf_writer.GGUFWriter.write_tensor_data"
    module, _, name = hook.rpartition(".")
    script = f"""
import os, signal, importlib, sys
from expertcache.cli import main
try:
    owner = importlib.import_module({module!r})
except ImportError:  # a class: its module, then the class
    mod, _, cls = {module!r}.rpartition(".")
    owner = getattr(importlib.import_module(mod), cls)
real = getattr(owner, {name!r})
def hooked(*a, **k):
    real(*a, **k)
    os.kill(os.getpid(), signal.SIGTERM)  # the output is open and partly written
setattr(owner, {name!r}, hooked)
sys.exit(main({argv!r}))
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 128 + 15, proc.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_pack_refuses_a_dtype_that_cannot_hold_a_weight(tmp_path, capsys):
    # float16 holds at most 65504: a bf16 weight beyond it was written as inf without a word, and
    # the packed model's logits were NaN.
    import torch

    ref = build_reference(tiny_config("qwen3_moe"))
    with torch.no_grad():
        ref.model.layers[0].mlp.experts.down_proj[1].view(-1)[3] = 1e6  # expert 1's down matrix
    src = save_checkpoint(ref, tmp_path / "src", dtype=torch.bfloat16)
    out = tmp_path / "out"
    code, err = run_cli(capsys, "pack", "-m", str(src), "-o", str(out), "--dtype", "float16")
    # Found mid-write: the progress bar is on stderr before the error's one line.
    errors = [line for line in err.splitlines() if line.startswith("expertcache: error:")]
    assert code == 2 and "Traceback" not in err and len(errors) == 1, err
    assert "layer 0 expert 1 down" in errors[0] and "beyond the range of --dtype float16" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert run_cli(capsys, "pack", "-m", str(src), "-o", str(out), "--dtype", "float32")[0] == 0


def test_synth_quant_checks_the_config_before_writing(tmp_path, capsys):
    # --quant wrote the file and only the loader refused it (top-k 8 of 4 experts); synth without
    # --quant refused before writing.
    out = tmp_path / "g.gguf"
    code, err = run_cli(capsys, "synth", "--like", "gemma-4-26b-a4b", "--layers", "2", "--experts", "4",
                        "--quant", "q4_k_m", "-o", str(out))
    assert_one_line_error(code, err, "--experts 4", "top-k of 8", "--top-k 4")  # names the flag that fixes it
    assert not out.exists() and not list(tmp_path.iterdir())
