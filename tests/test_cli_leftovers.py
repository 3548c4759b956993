"""What the command line prints, in small things: JSON lines that are JSON (RFC 8259) where a value
is not finite, the prefill bar's rate, an output path under a file said as such, and no torch
profiler chatter from `bench speed`."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import expertcache
from conftest import assert_one_line_error, run_cli
from expertcache.cli import main

BUNDLED_MODEL = Path(expertcache.__file__).parent / "assets" / "tiny-qwen3-moe"


def strict_json(line: str):
    """json.loads as RFC 8259 (and jq, and JavaScript's JSON.parse) reads: no Infinity, no NaN."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(line, parse_constant=refuse)


# ---- perplexity --json -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["inf", "nan"])
def test_perplexity_json_is_json_where_a_value_is_not_finite(tiny_checkpoint, tmp_path, capsys, monkeypatch,
                                                             kind):
    # A model far off on the text (mean NLL past ~709.78 nats: exp overflows a double) or with NaN
    # logits (a broken checkpoint). Python's json wrote Infinity/NaN there, which jq refuses;
    # docs/perplexity.md: such a value is null, and every finite value is kept as it is.
    import expertcache.perplexity as ppl_module

    _, d = tiny_checkpoint("qwen3_moe", layers=1)
    rng = __import__("random").Random(0)
    (tmp_path / "t.txt").write_text(" ".join(f"w{rng.randrange(60)}" for _ in range(2 * 16)))
    real = ppl_module.token_nll
    if kind == "inf":
        fake = lambda logits, targets: real(logits, targets) * 1e3 + 1e3  # noqa: E731
    else:
        fake = lambda logits, targets: real(logits, targets) * math.nan  # noqa: E731
    monkeypatch.setattr(ppl_module, "token_nll", fake)
    code = main(["perplexity", "-m", str(d), "-f", str(tmp_path / "t.txt"), "-c", "16", "--json"])
    out = strict_json(capsys.readouterr().out)
    assert code == 0 and out["chunks"] == 2
    assert out["ppl"] is None and out["ppl_uncertainty"] is None
    assert out["ppl_cumulative"] == [None, None] and out["chunk_ppl"] == [None, None]
    if kind == "inf":  # the NLL sums themselves are finite (above 1e3 nats per token) and kept
        assert all(v > 1e3 * 7 for v in out["chunk_nll"])
    else:
        assert out["chunk_nll"] == [None, None]
    assert out["chunk_tokens"] == [7, 7] and out["scored_tokens"] == 14


def test_perplexity_compare_json_is_json_where_a_value_is_not_finite(tiny_checkpoint, tmp_path, capsys,
                                                                     monkeypatch):
    import expertcache.perplexity as ppl_module

    _, d = tiny_checkpoint("qwen3_moe", layers=1)
    (tmp_path / "t.txt").write_text(" ".join(f"w{i % 50}" for i in range(2 * 16)))
    real = ppl_module.token_nll
    monkeypatch.setattr(ppl_module, "token_nll", lambda logits, targets: real(logits, targets) * 1e3 + 1e3)
    code = main(["perplexity", "-m", str(d), "-f", str(tmp_path / "t.txt"), "-c", "16", "--compare",
                 "resident,cache", "--json"])
    out = strict_json(capsys.readouterr().out)
    assert code == 0 and out["bitwise_equal"] is True
    assert all(m["ppl"] is None and m["chunk_ppl"] == [None, None] for m in out["modes"].values())


def test_json_line_writes_null_for_values_that_are_not_finite():
    from expertcache.flags import json_line

    obj = {"a": [1.5, math.inf, -math.inf, math.nan], "b": {"c": (2, math.nan)}, "d": "inf", "e": None, "f": 0}
    assert strict_json(json_line(obj)) == {"a": [1.5, None, None, None], "b": {"c": [2, None]}, "d": "inf",
                                           "e": None, "f": 0}


# ---- the prefill bar ---------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:  # tqdm(disable=None) draws on a terminal only
        return True


def test_prefill_bar_rate_counts_the_tokens_since_it_started(monkeypatch):
    # The first progress call comes when the first layer is done (Model.prefill), and the bar
    # starts its clock then. tqdm's rate is the units done since the bar started over the time
    # since: the tokens done before it are not in it. Counted in, the first rate shown was those
    # tokens over a few microseconds (44,938,971 tok/s for a 1500-token prompt here).
    import tqdm.std

    from expertcache.commands.common import PrefillBar

    now = [1000.0]

    def clock() -> float:  # a microsecond passes at each reading, as on a real clock
        now[0] += 1e-6
        return now[0]

    monkeypatch.setattr(tqdm.std, "time", clock)
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    bar = PrefillBar()
    bar(256, 1024)  # layer 1 of 4 done: the bar starts
    first = term.getvalue().split("\r")[-1]
    assert "256/1024" in first and "?tok/s" in first, first  # no time has passed: no rate yet
    now[0] += 2.0
    bar(512, 1024)  # 256 tokens more, 2 s later
    second = term.getvalue().split("\r")[-1]
    assert "512/1024" in second and "128.00tok/s" in second, second  # 256 tok / 2 s
    now[0] += 2.0
    bar(1024, 1024)
    bar.close()
    assert "1024/1024" in term.getvalue() and "192.00tok/s" in term.getvalue()  # 768 tok / 4 s


# ---- an output path under a file ---------------------------------------------------------------


@pytest.fixture
def a_file(tmp_path) -> Path:
    f = tmp_path / "notes.txt"
    f.write_text("not a directory\n")
    return f


@pytest.mark.parametrize("argv,output", [
    (["pack", "-m", str(BUNDLED_MODEL)], "sub"),
    (["synth", "--layers", "1", "--experts", "8", "--vocab", "512"], "sub"),
    (["synth", "--layers", "1", "--experts", "8", "--vocab", "512", "--quant", "bf16"], "sub.gguf"),
    (["synth", "--layers", "1", "--experts", "8", "--vocab", "512"], "deeper/sub"),
    (["trace", "record", "-m", str(BUNDLED_MODEL), "-f", "t.txt", "-o"], "t.npz"),
    (["trace", "fit-predictor", "-m", str(BUNDLED_MODEL), "-f", "t.txt", "-o"], "p.safetensors"),
], ids=["pack", "synth", "synth-gguf", "synth-deeper", "trace-record", "fit-predictor"])
def test_an_output_under_a_file_says_the_file_is_in_the_way(capsys, a_file, argv, output):
    # `-o notes.txt/sub` said "directory notes.txt does not exist": it does, as a file.
    target = str(a_file / output)
    argv = argv + [target] if argv[-1] == "-o" else argv + ["-o", target]
    code, err = run_cli(capsys, *argv)
    assert_one_line_error(code, err, repr(target), repr(str(a_file)), "is a file, not a directory")
    assert "does not exist" not in err
    assert a_file.read_text() == "not a directory\n"
    # Where the directory is missing indeed, that is still what is said.
    missing = str(a_file.parent / "absent" / output)
    argv[-1] = missing
    code, err = run_cli(capsys, *argv)
    assert_one_line_error(code, err, repr(str(Path(missing).parent)))
    assert "is a file" not in err


@pytest.mark.parametrize("plot", ["x.png", "deeper/x.png"])
def test_a_plot_under_a_file_says_the_file_is_in_the_way(capsys, a_file, plot):
    target = str(a_file / plot)
    code, err = run_cli(capsys, "bench", "cache", "-m", str(BUNDLED_MODEL), "--plot", target)
    assert_one_line_error(code, err, repr(target), repr(str(a_file)), "is a file, not a directory")


def test_a_predictor_that_is_a_directory_is_said_to_be_one(capsys, tmp_path):
    # It said "no such file": the directory is there, and is not what --predictor takes.
    code, err = run_cli(capsys, "run", "-p", "Hi", "-n", "1", "--cache-fraction", "0.5", "--prefetch", "on",
                        "--predictor", str(tmp_path))
    assert_one_line_error(code, err, str(tmp_path), "a directory")
    assert "no such file" not in err


# ---- bench speed and torch's profiler ----------------------------------------------------------


PROFILE = """
import os, torch
torch.set_num_threads(1)
import expertcache
from expertcache.bench.speed import overhead_profile
model = expertcache.load(None)
out = overhead_profile(model, list(range(8)), n=2)
assert out["matmul_ms_by_op"], out
print(os.environ.get("KINETO_LOG_LEVEL"))
"""


def test_bench_speed_profile_prints_nothing_on_stderr():
    # torch 2.13's profiler (kineto) logged "USDT: ... profiler_start" and "... profiler_stop" on
    # stderr at its default level, in the middle of `bench speed`'s output. In a process of its own:
    # kineto reads its log level once, at the process's first profile.
    env = {k: v for k, v in __import__("os").environ.items() if k != "KINETO_LOG_LEVEL"}
    p = subprocess.run([sys.executable, "-c", PROFILE], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "profiler_start" not in p.stderr and "profiler_stop" not in p.stderr, p.stderr
    assert p.stderr == ""
    assert p.stdout.strip() == "None"  # the setting is the profile's own: not left for the rest of the process
