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
    assert_one_line_error(code, err, str(foreign), "not written by expertcache")
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
