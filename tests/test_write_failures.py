"""Writes that fail: a full disk or Ctrl-C part-way through, and -o paths that cannot be written.
Each is one line (exit 2; Ctrl-C exits 130), leaves what was at the output before, and leaves no
temporary file and nothing removed that the command did not write."""

from __future__ import annotations

import builtins
import os
from pathlib import Path

import pytest

from conftest import assert_one_line_error, build_reference, run_cli, save_checkpoint, tiny_config


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_checkpoint(build_reference(tiny_config("qwen3_moe")), tmp_path_factory.mktemp("src") / "model")


def _tree(d: Path) -> list:
    """Every file under `d`, hidden ones too, with its bytes: what a failed write must not change."""
    return sorted((str(p.relative_to(d)), p.read_bytes() if p.is_file() else None) for p in d.rglob("*"))


class _Filling:
    """A file whose writes fail after `limit` bytes with `exc`, as a disk that fills up (or a
    Ctrl-C that lands) mid-write: the bytes before it are written, so a half file exists."""

    def __init__(self, f, limit: int, exc: BaseException):
        self.f, self.left, self.exc = f, limit, exc

    def write(self, data) -> int:
        data = bytes(data)
        if len(data) > self.left:
            self.f.write(data[: self.left])
            self.left = 0
            raise self.exc
        self.left -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def _fail_writes(monkeypatch, module, exc: BaseException, limit: int = 1000) -> None:
    """`open` in `module` gives files beside the output (`.NAME.partial-PID`) that fail after `limit` bytes."""
    def fake(file, mode="r", *a, **kw):
        f = builtins.open(file, mode, *a, **kw)
        return _Filling(f, limit, exc) if "w" in mode and ".partial-" in str(file) else f

    monkeypatch.setattr(module, "open", fake, raising=False)


def _enospc() -> OSError:
    return OSError(28, "No space left on device")


FAILURES = {"full disk": _enospc, "ctrl-c": KeyboardInterrupt}


def _check_failed(code: int, err: str, kind: str, out: str) -> None:
    if kind == "ctrl-c":
        assert code == 130 and "Traceback" not in err, err
    else:
        assert_one_line_error(code, err, f"cannot write {out!r}", "No space left on device")


# ---- directories: synth and pack --------------------------------------------------------------

@pytest.mark.parametrize("kind", FAILURES)
@pytest.mark.parametrize("command", ["synth", "pack"])
def test_a_directory_write_that_fails_midway_leaves_the_earlier_output(source, tmp_path, capsys, monkeypatch,
                                                                       command, kind):
    from expertcache.checkpoint import writer

    args = ["synth", "--like", "tiny", "--layers", "1"] if command == "synth" else ["pack", "-m", str(source)]
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    out = work / "out"
    # First a write with nothing there before, then one replacing an earlier output (--force).
    _fail_writes(monkeypatch, writer, FAILURES[kind]())
    code, err = run_cli(capsys, *args, "-o", str(out))
    _check_failed(code, err, kind, str(out))
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt"]
    monkeypatch.undo()
    assert run_cli(capsys, *args, "-o", str(out))[0] == 0
    before = _tree(work)
    _fail_writes(monkeypatch, writer, FAILURES[kind]())
    code, err = run_cli(capsys, *args, "-o", str(out), "--force")
    _check_failed(code, err, kind, str(out))
    assert _tree(work) == before


@pytest.mark.parametrize("failure", [KeyboardInterrupt, lambda: OSError(5, "Input/output error")])
def test_force_keeps_the_earlier_output_when_the_final_rename_fails(tmp_path, capsys, monkeypatch, failure):
    # --force moves the earlier output aside, then renames the new one in: a Ctrl-C or an error
    # between the two renames left the output path empty, the earlier output under `.out.old-PID`.
    out = tmp_path / "out"
    args = ["synth", "--like", "tiny", "--layers", "1"]
    assert run_cli(capsys, *args, "-o", str(out))[0] == 0
    before = _tree(tmp_path)
    real = os.replace

    def replace(src, dst):
        if ".partial-" in str(src):
            raise failure()
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    code, err = run_cli(capsys, *args, "-o", str(out), "--force", "--seed", "1")
    assert code in (2, 130) and "Traceback" not in err, err
    assert _tree(tmp_path) == before


# ---- single files: synth --quant and pack of a GGUF -------------------------------------------

@pytest.mark.parametrize("kind", FAILURES)
def test_a_gguf_write_that_fails_midway_leaves_the_earlier_file(tmp_path, capsys, monkeypatch, kind):
    import gguf.gguf_writer

    src, packed = tmp_path / "s.gguf", tmp_path / "p.gguf"
    synth = ["synth", "--like", "tiny", "--layers", "1", "--quant", "q4_k_m"]
    assert run_cli(capsys, *synth, "-o", str(src))[0] == 0
    assert run_cli(capsys, "pack", "-m", str(src), "-o", str(packed))[0] == 0
    before = _tree(tmp_path)
    _fail_writes(monkeypatch, gguf.gguf_writer, FAILURES[kind](), limit=5000)
    for argv, out in ((synth + ["--seed", "1"], src), (["pack", "-m", str(src)], packed)):
        code, err = run_cli(capsys, *argv, "-o", str(out), "--force")
        _check_failed(code, err.strip().splitlines()[-1] if kind != "ctrl-c" else err, kind, str(out))
        assert _tree(tmp_path) == before
    # With nothing there before: nothing there after.
    code, err = run_cli(capsys, *synth, "-o", str(tmp_path / "new.gguf"))
    _check_failed(code, err, kind, str(tmp_path / "new.gguf"))
    assert _tree(tmp_path) == before


# ---- paths that cannot be written -------------------------------------------------------------

def test_output_paths_that_cannot_be_written_are_one_line_and_change_nothing(source, tmp_path, capsys):
    gg = tmp_path / "s.gguf"
    assert run_cli(capsys, "synth", "--like", "tiny", "--layers", "1", "--quant", "q4_k_m", "-o", str(gg))[0] == 0
    a_dir, a_file = tmp_path / "adir", tmp_path / "afile.gguf"
    a_dir.mkdir()
    (a_dir / "x").write_text("mine")
    a_file.write_bytes(b"mine")
    before, src_before = _tree(tmp_path), _tree(source)
    missing = tmp_path / "nope" / "out"
    cases = [
        (["synth", "--like", "tiny"], missing, "does not exist"),
        (["synth", "--like", "tiny", "--quant", "q4_k_m"], missing, "does not exist"),
        (["pack", "-m", str(source)], missing, "does not exist"),
        (["pack", "-m", str(gg)], missing, "does not exist"),
        (["synth", "--like", "tiny", "--quant", "q4_k_m", "--force"], a_dir, "is a directory"),
        (["pack", "-m", str(gg), "--force"], a_dir, "is a directory"),
        (["synth", "--like", "tiny", "--quant", "q4_k_m", "--force"], a_file, "is not a file written by expertcache"),
        (["pack", "-m", str(gg), "--force"], a_file, "is not a file written by expertcache"),
        (["pack", "-m", str(gg), "--force"], gg, "is the source"),
        (["pack", "-m", str(source), "--force"], source / "model.safetensors", "overlaps the source"),
        (["synth", "--like", "tiny", "--force"], a_file, "not a directory"),
        (["pack", "-m", str(source), "--force"], a_dir, "not written by expertcache"),
    ]
    for argv, out, needle in cases:
        code, err = run_cli(capsys, *argv, "-o", str(out))
        assert_one_line_error(code, err, str(out), needle)
        assert _tree(tmp_path) == before and _tree(source) == src_before, argv


# ---- trace record, fit-predictor, --plot ------------------------------------------------------

def _prompt(d: Path) -> Path:
    p = d / "prompt.txt"
    p.write_text("w1 w2 w3 w4 w5 w6")
    return p


def test_ctrl_c_while_saving_a_trace_leaves_the_earlier_trace(tmp_path, capsys, monkeypatch):
    import numpy as np

    prompt, out = _prompt(tmp_path), tmp_path / "t.npz"
    assert run_cli(capsys, "trace", "record", "-f", str(prompt), "-n", "1", "-o", str(out))[0] == 0
    before = _tree(tmp_path)

    def half(f, **arrays):
        f.write(b"PK half")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez_compressed", half)
    code, err = run_cli(capsys, "trace", "record", "-f", str(prompt), "-n", "1", "-o", str(out))
    assert code == 130 and "Traceback" not in err
    assert _tree(tmp_path) == before


def _safetensors_full() -> Exception:
    """What safetensors' save_file raises on a full disk (seen on a small tmpfs): not an OSError."""
    from safetensors import SafetensorError

    return SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


@pytest.mark.parametrize("kind", [*FAILURES, "safetensors full disk"])
def test_a_failed_predictor_save_leaves_the_earlier_predictor(tmp_path, capsys, monkeypatch, kind):
    # A full disk was a SafetensorError traceback (exit 1): safetensors does not raise OSError.
    import shutil

    import safetensors.torch

    import expertcache

    assets = Path(expertcache.__file__).parent / "assets"
    text, out = tmp_path / "t.txt", tmp_path / "p.safetensors"
    text.write_text((assets / "heldout.txt").read_text()[:40_000])
    shutil.copy(assets / "tiny-qwen3-moe.predictor.safetensors", out)  # an earlier predictor, replaceable
    before = _tree(tmp_path)

    def half(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half")
        raise _safetensors_full() if kind == "safetensors full disk" else FAILURES[kind]()

    monkeypatch.setattr(safetensors.torch, "save_file", half)
    code, err = run_cli(capsys, "trace", "fit-predictor", "-f", str(text), "-n", "4600", "--chunk", "1000",
                        "-t", "1", "-o", str(out))
    _check_failed(code, err.strip().splitlines()[-1] if kind != "ctrl-c" else err, kind, str(out))
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("kind", FAILURES)
def test_a_failed_plot_leaves_the_earlier_plot(tmp_path, capsys, monkeypatch, kind):
    import matplotlib.figure

    prompt, trace, plot = _prompt(tmp_path), tmp_path / "t.npz", tmp_path / "hit.png"
    assert run_cli(capsys, "trace", "record", "-f", str(prompt), "-n", "2", "-o", str(trace))[0] == 0
    plot.write_bytes(b"an earlier plot")
    before = _tree(tmp_path)

    def half(self, fname, **kw):
        Path(fname).write_bytes(b"\x89PNG half")
        raise FAILURES[kind]()

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half)
    code, err = run_cli(capsys, "trace", "simulate", str(trace), "--plot", str(plot))
    _check_failed(code, err, kind, str(plot))
    assert _tree(tmp_path) == before
    for bad, needle in ((tmp_path / "nope" / "x.png", "does not exist"), (tmp_path, "expected a .png"),
                        (trace, "expected a .png")):
        assert_one_line_error(*run_cli(capsys, "trace", "simulate", str(trace), "--plot", str(bad)), str(bad), needle)
    assert _tree(tmp_path) == before


def test_a_short_write_on_a_full_disk_says_the_disk_may_be_full(tmp_path, capsys, monkeypatch):
    # numpy's tofile (gguf-py writes tensors with it) reports a full disk as "180224 requested and
    # 119648 written", with no errno (seen on a small tmpfs): the message was that alone.
    import gguf.gguf_writer

    out = tmp_path / "s.gguf"
    _fail_writes(monkeypatch, gguf.gguf_writer, OSError("180224 requested and 119648 written"), limit=5000)
    code, err = run_cli(capsys, "synth", "--like", "tiny", "--layers", "1", "--quant", "q4_k_m", "-o", str(out))
    assert_one_line_error(code, err, f"cannot write {str(out)!r}", "180224 bytes requested, 119648 written",
                          "disk full")
    assert list(tmp_path.iterdir()) == []


def test_to_gguf_never_writes_over_its_source_and_bad_paths_are_one_line(tmp_path):
    # tools/to_gguf.py replaced the model's own weights when -o named them (the bundled model,
    # which it converts), and a missing directory or a directory as -o ended in a traceback.
    import shutil
    import subprocess
    import sys

    import expertcache

    source = Path(shutil.copytree(expertcache.engine.default_model_path(), tmp_path / "model"))
    tool = Path(__file__).resolve().parents[1] / "tools" / "to_gguf.py"
    before = _tree(source)
    for out, words in ((source / "model.safetensors", "is not to_gguf's output"),
                       (tmp_path / "nope" / "x.gguf", "does not exist"), (tmp_path, "is a directory")):
        r = subprocess.run([sys.executable, str(tool), "-m", str(source), "-o", str(out)],
                           capture_output=True, text=True)
        assert_one_line_error(r.returncode, r.stderr, words)
    assert _tree(source) == before
