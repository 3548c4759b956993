"""Bad input: each case is one line on stderr naming the file, tensor or value, exit code 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

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


# ---- the command line's own checks (commands/, cli.py) ------------------------------------------

ASSETS = Path(__file__).resolve().parents[1] / "src" / "expertcache" / "assets"


def _installed(*argv, **kw):
    return subprocess.run([sys.executable, "-m", "expertcache.cli", *argv], capture_output=True, text=True, **kw)


def test_a_thread_count_beyond_what_can_start_is_refused():
    # torch was asked for them: libgomp aborted, or the process died of SIGSEGV, after loading.
    p = _installed("run", "-t", "100000", "-p", "def f", "-n", "1")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p
    assert "100000" in p.stderr and "1..1024" in p.stderr


@pytest.mark.parametrize("argv", [
    ["synth", "--like", "tiny", "--seed", str(2 ** 64)],
    ["trace", "fit-predictor", "-f", str(ASSETS / "heldout.txt"), "-n", "5000", "--objective", "used",
     "--epochs", "1", "--hidden", "4", "--seed", str(2 ** 64)],
])
def test_a_seed_beyond_64_bits_is_a_flag_error(capsys, tmp_path, argv):
    out = tmp_path / "out"
    assert_one_line_error(*run_cli(capsys, *argv, "-o", str(out)), "--seed", str(2 ** 64), "64 bits")
    assert not out.exists()


def test_perplexity_uses_the_tokenizer_it_is_given(capsys, tmp_path):
    code, err = run_cli(capsys, "perplexity", "-f", str(ASSETS / "heldout.txt"), "-c", "64", "--chunks", "1",
                        "--tokenizer", str(tmp_path / "nope"))
    assert_one_line_error(code, err, "nope", "tokenizer.json")


def test_system_without_chat_is_an_error(capsys, ckpt):
    assert_one_line_error(*run_cli(capsys, "run", "-m", str(ckpt), "-p", "w1", "-n", "1", "--system", "be brief"),
                          "--system", "--chat")


def test_a_closed_stdout_pipe_ends_quietly():
    p = subprocess.Popen([sys.executable, "-m", "expertcache.cli", "info"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # like `expertcache info | head -0`: gone before the first line
    err = p.stderr.read()
    assert p.wait() == 141 and err == "", err


def test_a_full_stdout_is_one_line():
    # /dev/full (Linux, where CI runs): every write fails with ENOSPC.
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "expertcache.cli", "info"], stdout=full, stderr=subprocess.PIPE,
                           text=True)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "No space left on device" in p.stderr, p.stderr


@pytest.mark.parametrize("command", ["synth", "pack"])
def test_an_output_directory_that_cannot_be_written_is_one_line(capsys, ckpt, tmp_path, monkeypatch, command):
    # A read-only directory, as chmod cannot make one for root: the temporary directory beside the
    # output cannot be made.
    real = Path.mkdir

    def mkdir(self, *a, **kw):
        if ".partial-" in self.name:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    src = ["--like", "tiny"] if command == "synth" else ["-m", str(ckpt)]
    out = tmp_path / "out"
    assert_one_line_error(*run_cli(capsys, command, *src, "-o", str(out)), f"cannot write {str(out)!r}",
                          "Permission denied")
    assert not out.exists()


def _prompt(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("w1 w2 w3 w4 w5 w6")
    return prompt


def test_trace_record_does_not_overwrite_its_input_or_a_model(capsys, ckpt, tmp_path):
    prompt = _prompt(tmp_path)
    weights = ckpt / "model.safetensors"
    before = weights.read_bytes()
    for out in (prompt, weights):
        code, err = run_cli(capsys, "trace", "record", "-m", str(ckpt), "-f", str(prompt), "-n", "1", "-o", str(out))
        assert_one_line_error(code, err, f"cannot write {str(out)!r}", "is not a trace")
    assert prompt.read_text() == "w1 w2 w3 w4 w5 w6" and weights.read_bytes() == before


def test_trace_record_checks_its_output_before_the_run(capsys, ckpt, tmp_path, monkeypatch):
    prompt = _prompt(tmp_path)
    code, err = run_cli(capsys, "trace", "record", "-m", str(ckpt), "-f", str(prompt), "-n", "1",
                        "-o", str(tmp_path / "nope" / "t.npz"))
    assert_one_line_error(code, err, "does not exist")  # one line: not the run's, then this
    monkeypatch.setattr("os.access", lambda path, mode: False)  # a read-only directory, even to root
    code, err = run_cli(capsys, "trace", "record", "-m", str(ckpt), "-f", str(prompt), "-n", "1",
                        "-o", str(tmp_path / "t.npz"))
    assert_one_line_error(code, err, "not writable")
    assert not (tmp_path / "t.npz").exists()


def test_trace_record_replaces_an_earlier_trace_whole_or_not_at_all(capsys, ckpt, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    prompt, out = _prompt(work), work / "t.npz"
    assert run_cli(capsys, "trace", "record", "-m", str(ckpt), "-f", str(prompt), "-n", "1", "-o", str(out))[0] == 0
    earlier = out.read_bytes()
    assert run_cli(capsys, "trace", "record", "-m", str(ckpt), "-f", str(prompt), "-n", "2", "-o", str(out))[0] == 0
    assert out.read_bytes() != earlier  # an earlier trace is replaced
    earlier = out.read_bytes()

    import numpy as np

    def half(f, **arrays):  # a disk that fills up mid-write
        f.write(b"PK half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez_compressed", half)
    code, err = run_cli(capsys, "trace", "record", "-m", str(ckpt), "-f", str(prompt), "-n", "1", "-o", str(out))
    assert code == 2 and "No space left on device" in err
    assert out.read_bytes() == earlier and sorted(p.name for p in work.iterdir()) == ["prompt.txt", "t.npz"]


def test_fit_predictor_does_not_overwrite_its_input_or_a_model(capsys, ckpt, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("w1 w2 w3")
    weights = ckpt / "model.safetensors"
    before = weights.read_bytes()
    for out in (text, weights, tmp_path):
        code, err = run_cli(capsys, "trace", "fit-predictor", "-m", str(ckpt), "-f", str(text), "-o", str(out))
        assert_one_line_error(code, err, f"cannot write {str(out)!r}")
    assert text.read_text() == "w1 w2 w3" and weights.read_bytes() == before


def test_a_plot_is_written_whole_or_not_at_all(capsys, tmp_path, monkeypatch):
    import matplotlib.figure

    trace, plot = tmp_path / "t.npz", tmp_path / "hit.png"
    prompt = _prompt(tmp_path)
    assert run_cli(capsys, "trace", "record", "-f", str(prompt), "-n", "2", "-o", str(trace))[0] == 0
    plot.write_bytes(b"an earlier plot")

    def half(self, fname, **kw):  # a disk that fills up mid-write
        Path(fname).write_bytes(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half)
    code, err = run_cli(capsys, "trace", "simulate", str(trace), "--plot", str(plot))
    assert code == 2 and "No space left on device" in err
    assert plot.read_bytes() == b"an earlier plot" and sorted(p.name for p in tmp_path.iterdir()) == \
        ["hit.png", "prompt.txt", "t.npz"]


# ---- bad input the audit found: each was silent, several lines, or named the wrong thing ---------

@pytest.mark.parametrize("size", [["--cache-experts", "3"], ["--cache-mem", "3MB"], ["--cache-fraction", "0.5"]])
def test_a_cache_size_with_the_resident_mode_is_an_error(capsys, size):
    # Resident holds every expert: the size was ignored without a word.
    code, err = run_cli(capsys, "run", "-p", "def f", "-n", "1", "--cache-mode", "resident", *size)
    assert_one_line_error(code, err, "--cache-mode resident", size[0])
    from expertcache import CacheConfig, ExpertCacheError

    with pytest.raises(ExpertCacheError, match="resident"):
        CacheConfig(mode="resident", experts=3)


@pytest.mark.parametrize("value,needle", [("0.5", "'0.5' must be at least 1 byte"), ("abc", "'abc'")])
def test_cache_mem_errors_name_the_flag_and_the_value_as_typed(capsys, value, needle):
    # Were "cache mem 0 must be ..." (the value rounded down) and a message without the flag.
    assert_one_line_error(*run_cli(capsys, "run", "-p", "def f", "-n", "1", "--cache-mem", value),
                          "--cache-mem", needle)
    from expertcache import CacheConfig, ExpertCacheError

    with pytest.raises(ExpertCacheError, match=re.escape(f"{value!r}")):  # through the API too
        CacheConfig(mem=value)


def _unreadable(monkeypatch, name: str) -> None:
    """Opening a file called `name` fails as it would without read permission (which root has)."""
    import builtins

    real = builtins.open

    def fake(file, *a, **kw):
        if Path(str(file)).name == name:
            raise PermissionError(13, "Permission denied", str(file))
        return real(file, *a, **kw)

    monkeypatch.setattr(builtins, "open", fake)


@pytest.mark.parametrize("command", [["trace", "stats"], ["bench", "cache", "-m", str(ASSETS / "tiny-qwen3-moe"),
                                                          "--route-trace"]])
def test_a_file_that_is_not_a_trace_or_cannot_be_read_is_one_short_line(capsys, tmp_path, monkeypatch, command):
    # Were numpy's paragraph about pickled data and allow_pickle, and "not an expertcache trace:
    # ... Permission denied" for a trace that could not be read.
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    code, err = run_cli(capsys, *command, str(text))
    assert_one_line_error(code, err, "notes.txt", "not an expertcache trace", "expected an .npz file")
    assert "pickle" not in err and len(err) < 200, err
    trace = tmp_path / "t.npz"
    assert run_cli(capsys, "trace", "record", "-f", str(_prompt(tmp_path)), "-n", "1", "-o", str(trace))[0] == 0
    _unreadable(monkeypatch, "t.npz")
    code, err = run_cli(capsys, *command, str(trace))
    assert_one_line_error(code, err, f"cannot read trace {str(trace)!r}: Permission denied")
    assert "not an expertcache trace" not in err


def test_a_full_disk_while_saving_a_trace_names_the_output(capsys, tmp_path, monkeypatch):
    # Named the temporary file ".t.npz.partial-PID" the trace is written through, not -o.
    import numpy as np

    def full(f, **arrays):
        raise OSError(28, "No space left on device")

    prompt, out = _prompt(tmp_path), tmp_path / "t.npz"
    monkeypatch.setattr(np, "savez_compressed", full)
    code, err = run_cli(capsys, "trace", "record", "-f", str(prompt), "-n", "1", "-o", str(out))
    *progress, last = err.strip().splitlines()  # the run's progress line, then the error
    assert_one_line_error(code, last, f"cannot write trace {str(out)!r}: No space left on device")
    assert ".partial" not in err and not out.exists()


@pytest.mark.parametrize("where", ["config.json", "nope"])
def test_a_tokenizer_path_that_is_not_a_directory_says_so_before_loading(capsys, monkeypatch, where):
    # Were "<path>/tokenizer.json: missing (a model directory needs tokenizer.json)", after the
    # model's weights had been read.
    import expertcache.engine

    def assemble(*a, **kw):
        raise AssertionError("the weights were read before the tokenizer was checked")

    monkeypatch.setattr(expertcache.engine, "_assemble", assemble)
    path = str(ASSETS / "tiny-qwen3-moe" / where)
    assert_one_line_error(*run_cli(capsys, "run", "-p", "def f", "-n", "1", "--tokenizer", path),
                          f"tokenizer {path!r} is not an existing directory", "tokenizer.json")


@pytest.mark.parametrize("argv,needles", [
    (["--url", "notaurl"], ["--url", "'notaurl'", "http://HOST:PORT"]),
    (["--url", "http://127.0.0.1:abc"], ["--url", "'http://127.0.0.1:abc'"]),
    (["--url", "http://127.0.0.1:1", "--duration", "nan"], ["--duration", "'nan'", "finite"]),
    (["--url", "http://127.0.0.1:1", "--timeout", "0"], ["--timeout", "0 seconds", "positive"]),
    (["--url", "http://127.0.0.1:1", "--warmup", "-1"], ["--warmup", "-1"]),
    (["-m", str(ASSETS / "tiny-qwen3-moe"), "--startup-timeout", "-1"], ["--startup-timeout", "-1 seconds"]),
])
def test_bench_serve_checks_its_flags_before_any_request_or_server(capsys, monkeypatch, argv, needles):
    # --url notaurl was a ValueError traceback from urllib; --duration nan was taken, and
    # --startup-timeout -1 started a server only to give up on it.
    import subprocess as sp

    def popen(*a, **kw):
        raise AssertionError("a server was started")

    monkeypatch.setattr(sp, "Popen", popen)
    assert_one_line_error(*run_cli(capsys, "bench", "serve", "--suite", "steady", *argv), *needles)


@pytest.fixture
def no_benchmark(monkeypatch):
    """A benchmark that starts fails the test: its flags were to be refused first."""
    import subprocess as sp

    import expertcache.bench.speed

    def started(*a, **kw):
        raise AssertionError("the benchmark started")

    monkeypatch.setattr(sp, "run", started)
    monkeypatch.setattr(expertcache.bench.speed, "run", started)


@pytest.mark.parametrize("argv,needles", [
    (["cache", "--dtype", "int3"], ["--dtype", "'int3'", "float32"]),
    (["cache", "--cache-policy", "foo"], ["--cache-policy", "'foo'", "lrfu"]),
    (["speed", "--dtype", "int3"], ["--dtype", "'int3'"]),
    (["speed", "--prefill", "abc"], ["--prefill", "'abc'", "prompt lengths"]),
    (["speed", "--prefill", "256,0"], ["--prefill", "'256,0'", "at least 1"]),
    (["cache", "-t", "100000"], ["--threads", "100000", "1..1024"]),
    (["speed", "-t", "100000"], ["--threads", "100000", "1..1024"]),
])
def test_bench_cache_and_speed_check_their_flags_when_parsed(capsys, no_benchmark, argv, needles):
    # --dtype and --cache-policy failed in each configuration's process, in 3 lines; --prefill abc
    # was "invalid <lambda> value", --prefill 0 "the prompt is empty" after the bench started; -t
    # 100000 reached torch (SIGSEGV or libgomp's abort).
    assert_one_line_error(*run_cli(capsys, "bench", argv[0], "-m", str(ASSETS / "tiny-qwen3-moe"), *argv[1:]),
                          *needles)


def test_synth_q4_k_m_of_narrow_rows_takes_llama_cpps_fallback_types(capsys, tmp_path):
    # --like tiny's rows (64 and 32 weights) are narrower than a Q4_K/Q6_K super-block of 256:
    # gguf-py raised a ValueError traceback. llama.cpp's quantizer writes Q5_0/Q8_0 for such rows.
    from gguf import GGUFReader

    import expertcache

    out = tmp_path / "tiny.gguf"
    code, err = run_cli(capsys, "synth", "--like", "tiny", "--quant", "q4_k_m", "-o", str(out))
    assert code == 0, err
    types = {t.name: t.tensor_type.name for t in GGUFReader(out).tensors}
    assert types["blk.0.ffn_up_exps.weight"] == "Q5_0" and types["output.weight"] == "Q8_0"
    model = expertcache.load(out)
    assert len(model.generate([1, 2, 3], max_tokens=2, ignore_eos=True).token_ids) == 2


def test_a_write_removes_the_partial_outputs_a_killed_write_left(tmp_path, capsys):
    """A write killed where no handler runs (SIGKILL, the OOM killer) leaves `.NAME.partial-PID`
    (gigabytes, for synth). The next write of NAME removes those whose process is gone and that
    nothing wrote to for STALE_PARTIAL_SECONDS, and says so; it keeps one of a running process, a
    recent one (maybe another machine's write on a shared file system), other names' and
    `.old-PID` (which may hold the only copy of an earlier output)."""
    import os
    import subprocess

    from expertcache.checkpoint.writer import STALE_PARTIAL_SECONDS, atomic_file, atomic_output_dir

    dead = [subprocess.Popen([sys.executable, "-c", ""]) for _ in range(2)]
    for p in dead:
        p.wait()
    old = time.time() - STALE_PARTIAL_SECONDS - 60
    stale_file, stale_dir = tmp_path / f".m.gguf.partial-{dead[0].pid}", tmp_path / f".d.partial-{dead[1].pid}"
    stale_file.write_bytes(b"half")
    stale_dir.mkdir()
    (stale_dir / "model.safetensors").write_bytes(b"half")
    keep = [tmp_path / f".m.gguf.partial-{os.getppid()}", tmp_path / f".m.gguf.partial-{dead[1].pid}",
            tmp_path / f".other.partial-{dead[0].pid}", tmp_path / f".d.old-{dead[0].pid}"]
    for p in keep:
        p.write_bytes(b"x")
    for p in [stale_file, stale_dir, *keep]:
        os.utime(p, (old, old))
    os.utime(keep[1], None)  # written to just now
    with atomic_file(tmp_path / "m.gguf") as tmp:
        tmp.write_bytes(b"new")
    with atomic_output_dir(tmp_path / "d") as tmp:
        (tmp / "w.bin").write_bytes(b"new")
    assert not stale_file.exists() and not stale_dir.exists()
    assert all(p.exists() for p in keep)
    assert (tmp_path / "m.gguf").read_bytes() == b"new" and (tmp_path / "d" / "w.bin").read_bytes() == b"new"
    err = capsys.readouterr().err
    assert str(dead[0].pid) in err and str(dead[1].pid) in err and err.count("\n") == 2
