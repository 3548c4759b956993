"""What a person reads: progress bars stay out of logs, tables line up under headers that name
their units, no `nan` where a value is missing, plots tell their lines apart, `info` gives sizes
in units a person reads, and every flag of every command says what it does."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from expertcache.bench.trace import Trace, TraceHeader, save_trace
from expertcache.cli import build_parser, main
from expertcache.models.synth import synth
from conftest import run_cli

HELDOUT = Path(__file__).resolve().parents[1] / "src" / "expertcache" / "assets" / "heldout.txt"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("users") / "m", like="tiny", layers=2, experts=16, top_k=4,
                 vocab=300, dtype="float32", progress=False)


def _trace(path: Path) -> Path:
    rng = np.random.default_rng(0)
    layer, tokens, ids = [], [], []
    for i in range(12):
        for l in (0, 1):
            t = 3 if i == 0 else 1
            layer.append(l)
            tokens.append(t)
            ids.append(np.stack([rng.choice(16, 4, replace=False) for _ in range(t)]))
    header = TraceHeader(num_experts=16, num_layers=2, moe_layers=(0, 1), top_k=4, expert_bytes=4096)
    phase = np.array([0, 0] + [1] * (len(layer) - 2))
    save_trace(Trace(header, np.array(layer), np.array(tokens), phase, np.concatenate(ids).astype(np.uint8)), path)
    return path


def _word_ends(line: str) -> list[int]:
    return [m.end() for m in re.finditer(r"\S+", line)]


def _under_headers(row: str, head: str, skip: int) -> bool:
    """Whether each right-aligned cell of `row` after the first `skip` ends where a header does."""
    return set(_word_ends(row)[skip:]) <= set(_word_ends(head))


# ---- progress bars -----------------------------------------------------------------------------


def test_progress_bars_stay_out_of_a_log(model, tmp_path, capsys):
    """With stderr not a terminal (a log file, a pipe, a test's capture) no bar is drawn: its
    carriage returns made a log one unreadable line. (synth, pack and perplexity drew them.)"""
    code, err = run_cli(capsys, "synth", "--like", "tiny", "--layers", "1", "--vocab", "300", "-o",
                        str(tmp_path / "s"))
    assert code == 0 and "\r" not in err and "%|" not in err, err
    code, err = run_cli(capsys, "pack", "-m", str(model), "-o", str(tmp_path / "p"))
    assert code == 0 and "\r" not in err and "%|" not in err, err
    code, err = run_cli(capsys, "perplexity", "-f", str(HELDOUT), "-c", "64", "--chunks", "2", "-t", "1")
    assert code == 0 and "\r" not in err and "%|" not in err, err


# ---- trace stats and simulate ------------------------------------------------------------------


def test_trace_stats_columns_line_up_under_their_headers(tmp_path, capsys):
    """Every column of the per-layer table ends where its header ends (the entropy cell was one
    character short, so every column after it sat one to the left of its header)."""
    trace = _trace(tmp_path / "t.npz")
    assert main(["trace", "stats", str(trace)]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("layer"))
    rows = [line for line in lines[head + 1:] if line.strip()[:1].isdigit()]
    assert len(rows) == 2
    for row in rows:
        assert _word_ends(row) == _word_ends(lines[head]), (lines[head], row)
    json.loads(lines[-1])


def test_simulate_plot_tells_tied_policies_apart(tmp_path):
    """Policies that tie draw the same line; each has its own marker and line style (they were all
    solid circles, so one drawn last hid the others), and the axes say what they measure."""
    from expertcache.bench.simulate import compare
    from expertcache.bench.trace import load_trace
    from expertcache.commands.trace import _figure
    from expertcache.config import DEFAULT_POLICY, POLICY_NAMES

    trace = load_trace(_trace(tmp_path / "t.npz"))
    rows = compare(trace.ops(), [4, 16, 24], list(POLICY_NAMES), 4096, None)
    fig = _figure("t.npz", rows, 32)
    try:
        (ax,) = fig.axes
        lines = ax.get_lines()
        styles = [(line.get_marker(), line.get_fillstyle(), line.get_linestyle(), line.get_color()) for line in lines]
        assert len(lines) == len(POLICY_NAMES) + 1 and len(set(styles)) == len(styles)
        policies = [line for line in lines if line.get_label() != "Belady MIN"]
        assert len({line.get_marker() for line in policies}) == len(POLICY_NAMES)
        assert all(line.get_fillstyle() == "none" for line in policies)  # a hollow marker shows what is under it
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert f"{DEFAULT_POLICY} (default)" in labels and "Belady MIN" in labels
        assert "%" in ax.get_xlabel() and "hit rate" in ax.get_ylabel()
        assert "t.npz" in ax.get_title() and "capacity" in ax.get_title()
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


# ---- perplexity --------------------------------------------------------------------------------


def test_perplexity_table_prints_no_nan_for_a_missing_uncertainty(capsys):
    """A run with no uncertainty (its per-token NLL has no variance) shows "-" in the table, not
    `nan`."""
    from expertcache.commands.perplexity import _print_table

    class Result:
        ppl, uncertainty, seconds, n_ctx, chunks = 4.0, None, 1.0, 8, [object()]

    _print_table({"cache": (Result(), {"total": {"hit_rate": 0.5, "copied_bytes": 2e6}, "capacity": 4,
                                       "total_experts": 8})})
    out = capsys.readouterr().out
    assert "nan" not in out.lower()
    head, row, note = out.splitlines()
    assert row.split()[2] == "-" and _under_headers(row, head, 1)
    # The first mode's speed is not comparable with the others', and the table says so.
    assert note.startswith("tok/s:") and "cache's includes this process's one-time set-up" in note


# ---- bench tables ------------------------------------------------------------------------------


def _cache_row(mode: str, prefetch: bool) -> dict:
    phase = {"tokens": 4, "seconds": 0.1, "tok_s": 40.0, "hit_rate": 0.5, "copied_bytes_per_token": 1e6,
             "copy_seconds": 0.01, "copy_gb_s": 0.4, "stall_seconds": 0.002}
    return {"mode": mode, "store": "ram", "fraction": 0.25 if mode == "cache" else None, "device": "cpu",
            "prefetch": prefetch, "capacity": 8, "prefill": {**phase, "bytes_read_per_token": 1e6, "stretches": 1},
            "decode": phase, "expert_bytes_total": 16e6, "prefill_stretch": 4096,
            "stretch_activation_bytes": 2**20, "peak_rss_bytes": 3 * 2**30}


def test_bench_cache_table_names_prefetch_and_units_apart():
    """The prefetch column and the prefill read column had the same abbreviation (`pf`, `pf MB/tok`);
    peak RSS was in MiB under a header saying MB; prefetch off showed as "-" like "not applicable"."""
    from expertcache.bench.cache_bench import table

    rows = [_cache_row("resident", False), _cache_row("cache", False), _cache_row("cache", True)]
    lines = table(rows).splitlines()
    head = lines[0]
    assert "pf" not in head.split() and "prefetch" in head and "read MB/tok" in head
    assert "peak RSS MiB" in head and "peak RSS MB" not in head
    body = lines[2:5]
    assert [line.split()[4] for line in body] == ["-", "off", "on"]
    assert all(line.split()[-1] == "3072" for line in body)  # 3 GiB in MiB
    for line in body:
        assert _under_headers(line, head, 2), (head, line)
    legend = " ".join(lines[lines.index(next(x for x in lines if x.startswith("cap:"))):])
    assert "x res" in legend and "stall ms/tok" in legend
    assert all(len(x) <= len(head) for x in lines)  # the legend wrapped to the table's width


def test_bench_speed_time_split_adds_up_to_the_step():
    """route + attn + exprt + copy + rest is the step's ms/tok: parts without a column (a dense
    MLP layer's time) go to `rest` (they were dropped), and the legend gives the unit."""
    from expertcache.bench.speed import table

    split = {"attention": 1.0, "routing": 0.5, "experts": 2.0, "copies": 0.5, "dense_mlp": 3.0, "lm_head": 0.5,
             "rest": 0.5}
    row = {"mode": "resident", "fraction": None,
           "decode": {"tok_s": 125.0, "ms_per_token": 8.0, "split_ms": split, "read_gb_s": 1.0, "read_fraction": 0.5},
           "prefill": {"16": {"tok_s": 50.0, "gflop_s": 1.0, "matmul_fraction": 0.25}}}
    out = {"machine": {"read_bw": 2e9, "copy_bw": 1e9, "matmul_rate": 1e11}, "threads": 1, "kernels": "torch",
           "pairs": 1, "results": [row]}
    lines = table(out).splitlines()
    head = next(i for i, line in enumerate(lines) if "decode t/s" in line)
    cells = lines[head + 2].split()
    ms, parts = float(cells[3]), [float(x) for x in cells[4:9]]
    assert ms == 8.0 and parts[-1] == 4.0 and sum(parts) == pytest.approx(ms)
    assert "ms per decoded token" in " ".join(lines)


# ---- info --------------------------------------------------------------------------------------


def test_info_gives_sizes_in_binary_units_and_no_python_reprs(capsys):
    """Bytes beside KiB/MiB, every layer's expert size with separators and layer ranges, and a
    GGUF's storage types as a list, not a Python dict."""
    fixture = Path(__file__).parent / "fixtures" / "gguf" / "qwen3_moe-mix.gguf"
    assert main(["info", "-m", str(fixture)]) == 0
    out = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert out["bytes_per_expert"] == "127,488 (124.5 KiB)"
    assert out["bytes_per_expert_by_layer"] == "127,488 (124.5 KiB): layer 0; 71,168 (69.5 KiB): layer 1"
    assert out["expert_bytes_total"] == "1,589,248 (1.5 MiB)"
    assert "{" not in out["tensor_types"] and "'" not in out["tensor_types"]
    assert "ffn_down_exps: Q6_K, Q3_K" in out["tensor_types"] and "attn_norm: float32 x2" in out["tensor_types"]
    assert re.fullmatch(r"[\d,]+ \(\d+\.\dM\)", out["params_total"])
    assert main(["info", "-m", str(fixture), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_per_expert_by_layer"] == {"0": 127488, "1": 71168}


# ---- help --------------------------------------------------------------------------------------


def _parsers(parser: argparse.ArgumentParser, name: str = "expertcache"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from _parsers(p, f"{name} {sub}")


def test_every_flag_of_every_command_says_what_it_does():
    """`--help` explains every option and positional (info's -m, trace stats' --phase, bench speed's
    -t and --fractions, ... had no text at all)."""
    silent = [f"{name} {'/'.join(a.option_strings) or a.dest}"
              for name, p in _parsers(build_parser()) for a in p._actions
              if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help]
    assert silent == []


# ---- a long prompt's prefill -------------------------------------------------------------------


def test_prefill_reports_its_progress_layer_by_layer():
    """`progress(done, total)` after each layer of each stretch, a stretch's tokens counted in
    equal parts per layer: 25 tokens in stretches of 10 over the bundled model's layers, by hand."""
    import expertcache

    model = expertcache.load(prefill_stretch=10)
    layers = len(model.net.weights.layers)
    ids = list(range(5, 30))
    seen = []
    got = model.prefill(model.new_session(), ids, ubatch=4, progress=lambda d, t: seen.append((d, t)))
    want = [(s + n * (i + 1) // layers, 25) for s, n in ((0, 10), (10, 10), (20, 5)) for i in range(layers)]
    assert seen == want and seen[-1] == (25, 25)
    assert torch.equal(got, model.prefill(model.new_session(), ids, ubatch=4))


class _Terminal:
    """stdout and stderr as one terminal: what a user sees, in the order written."""

    def __init__(self):
        self.parts: list[str] = []

    def write(self, s: str) -> int:
        self.parts.append(s)
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True

    @property
    def text(self) -> str:
        return "".join(self.parts)


def test_run_shows_a_prefill_bar_on_a_terminal_and_the_prompt_after_it(monkeypatch, tmp_path):
    """On a terminal a long prompt's prefill draws a bar on stderr; it is gone before the prompt is
    echoed and the reply streams, so it never draws over them. stdout holds what it held before:
    the prompt, then the generated text."""
    import sys

    prompt = tmp_path / "p.txt"
    prompt.write_text("def parse(line):\n    return line.split(',')\n" * 40)
    term = _Terminal()
    monkeypatch.setattr(sys, "stdout", term)
    monkeypatch.setattr(sys, "stderr", term)
    assert main(["run", "-f", str(prompt), "-n", "3", "--ubatch", "16", "--prefill-stretch", "64"]) == 0
    text = term.text
    bars = [m.start() for m in re.finditer(r"prefill: +\d+%", text)]
    assert len(bars) >= 3, text[:500]
    assert text.index(prompt.read_text()) > bars[-1]


def test_run_writes_no_bar_where_stderr_is_not_a_terminal(capsys, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("import os\n" * 200)
    code, err = run_cli(capsys, "run", "-f", str(prompt), "-n", "2", "--ubatch", "16")
    assert code == 0 and "prefill:" not in err and "\r" not in err


@pytest.mark.parametrize("policies, footnote", [("lru,arc", False), ("lru,lrfu", True)])
def test_simulate_marks_the_default_policy_only_when_it_is_shown(tmp_path, capsys, policies, footnote):
    from expertcache.config import DEFAULT_POLICY

    trace = _trace(tmp_path / "t.npz")
    assert main(["trace", "simulate", str(trace), "--policy", policies]) == 0
    out = capsys.readouterr().out
    assert (f"* default policy ({DEFAULT_POLICY})" in out) is footnote and "x MIN:" in out
