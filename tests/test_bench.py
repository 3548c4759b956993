"""Benchmark commands: they run end to end, print a table and one JSON line, and the routing
replay forces the recorded routing."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

import expertcache
from expertcache.bench.cache_bench import RoutingReplay
from expertcache.bench.speed import median_ratio
from expertcache.bench.trace import Trace, TraceHeader
from expertcache.models.synth import synth
from expertcache.cli import main
from conftest import assert_one_line_error, run_cli


@pytest.fixture(scope="module")
def synth_model(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("bench") / "m", like="tiny", layers=2, experts=16, top_k=4,
                 vocab=300, dtype="float32", progress=False)


def make_trace(layers=(0, 1), experts=16, k=4, ops=6) -> Trace:
    rng = np.random.default_rng(0)
    layer, tokens, ids = [], [], []
    for i in range(ops):
        for l in layers:
            t = 3 if i == 0 else 1
            layer.append(l)
            tokens.append(t)
            ids.append(np.stack([rng.choice(experts, k, replace=False) for _ in range(t)]))
    header = TraceHeader(num_experts=experts, num_layers=len(layers), moe_layers=tuple(layers), top_k=k,
                         expert_bytes=1)
    return Trace(header, np.array(layer), np.array(tokens), np.array([0] * len(layers) + [1] * (len(layer) - len(layers))),
                 np.concatenate(ids).astype(np.uint8))


def test_routing_replay_follows_the_trace(synth_model):
    model = expertcache.load(synth_model)
    trace = make_trace()
    model.net.routing_override = RoutingReplay(trace, model.cfg)
    seen = {0: [], 1: []}
    model.net.routing_hook = lambda layer, r: seen[layer].append(r.ids.clone())
    model.generate([5, 6, 7], max_tokens=5, ignore_eos=True)
    starts = np.concatenate([[0], np.cumsum(trace.tokens)])
    for layer in (0, 1):
        expected = np.concatenate([trace.ids[starts[i]: starts[i + 1]] for i in np.flatnonzero(trace.layer == layer)])
        got = torch.cat(seen[layer]).numpy()
        assert np.array_equal(got, expected[: len(got)]) and len(got) == 3 + 4


def test_routing_replay_rejects_another_shape(synth_model):
    model = expertcache.load(synth_model)
    with pytest.raises(expertcache.ExpertCacheError, match="--experts 8 --top-k 4"):
        RoutingReplay(make_trace(experts=8), model.cfg)


@pytest.mark.parametrize("predictor", ["linear:maps.safetensors", "router"])
def test_bench_cache_auto_prefetches_as_the_runtime_would_with_the_traces_predictor(synth_model, predictor,
                                                                                     monkeypatch):
    """On a CPU, `--prefetch auto` replays a trace's predictions where they came from fitted maps and
    the disk store reads with O_DIRECT (synth's experts lie on pages), not where the routers made them."""
    from expertcache.bench import cache_bench
    from expertcache.bench.trace import save_trace
    from expertcache.tiers.store import DiskStore

    open_direct = DiskStore._open_direct
    monkeypatch.setattr(DiskStore, "_open_direct",  # a file system without O_DIRECT: stand-ins
                        lambda store: open_direct(store) or {p: os.open(p, os.O_RDONLY) for p in store._fds})
    from dataclasses import replace

    t = make_trace()
    pred = np.stack([np.roll(np.arange(16), -r)[:8] for r in range(len(t.ids))]).astype(np.uint8)
    t = replace(t, header=replace(t.header, pred_width=8, predictor=predictor), pred=pred,
                predicted=np.ones(t.num_ops, dtype=np.uint8))
    path = synth_model.parent / f"{predictor.split(':')[0]}.npz"
    save_trace(t, path)
    spec = {"model": str(synth_model), "threads": 1, "prefill": 3, "decode": 4, "ubatch": 512, "mode": "cache",
            "store": "disk", "fraction": 0.5, "route_trace": str(path), "prefetch": "auto"}
    got = cache_bench.run_one(spec)
    fitted = predictor != "router"
    assert got["prefetch"] is fitted
    assert (got["decode"]["prefetch_issued"] > 0) is fitted
    assert got["decode"]["probe_gb_s"] > 0  # the disk probed after the decode (`read_rate`)


def test_read_rate_reads_experts_as_a_demand_copy_does(monkeypatch):
    """`read_rate`: n experts through the store's copy_run, spread over layers and experts, into
    the cache's own slots in turn (emptied first: their bytes are overwritten); their bytes over
    the time."""
    from types import SimpleNamespace

    from expertcache.bench import cache_bench

    events = []
    pool = torch.zeros(3, 4096, dtype=torch.uint8)
    store = SimpleNamespace(copy_run=lambda layer, expert, dst: events.append(
        (layer, expert, (dst.data_ptr() - pool.data_ptr()) // 4096, tuple(dst.shape))))
    cache = SimpleNamespace(store=store, moe_layers=[1, 3], num_experts=16, capacity=3, pool=pool,
                            expert_bytes={1: 1000, 3: 3000}, clear=lambda: events.append("clear"))
    clock = iter([10.0, 10.5])
    monkeypatch.setattr(cache_bench.time, "perf_counter", lambda: next(clock))
    rate = cache_bench.read_rate(cache, n=8)
    assert events == ["clear", (1, 0, 0, (1, 4096)), (3, 7, 1, (1, 4096)), (1, 14, 2, (1, 4096)),
                      (3, 5, 0, (1, 4096)), (1, 12, 1, (1, 4096)), (3, 3, 2, (1, 4096)), (1, 10, 0, (1, 4096)),
                      (3, 1, 1, (1, 4096))]
    assert rate == pytest.approx(4 * (1000 + 3000) / 0.5)


def test_bench_cache_prints_table_and_json(synth_model, capsys, tmp_path):
    plot = tmp_path / "cache.png"
    assert main(["bench", "cache", "-m", str(synth_model), "--stores", "ram", "--fractions", "0.5",
                 "--prefill", "16", "--decode", "4", "-t", "1", "--plot", str(plot)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    modes = [r["mode"] for r in out["results"]]
    assert modes == ["resident", "staging", "cache"] and lines[0].startswith("mode")
    staging, cache = out["results"][1]["decode"], out["results"][2]["decode"]
    assert staging["hit_rate"] == 0 and staging["copied_bytes_per_token"] > cache["copied_bytes_per_token"]
    assert out["results"][0]["decode"]["copied_bytes_per_token"] == 0
    assert out["device"] == "cpu" and {r["device"] for r in out["results"]} == {"cpu"}
    assert out["prefetch_bounds"] == []  # no prefetch on/off pair was measured
    assert lines[-2] == f"wrote {plot}" and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name, needle", [("cache.jpg", "expected a .png"), ("no/such/dir/c.png", "does not exist")])
def test_bench_cache_refuses_a_bad_plot_path_before_measuring(synth_model, capsys, tmp_path, name, needle, monkeypatch):
    from expertcache.bench import cache_bench

    monkeypatch.setattr(cache_bench.subprocess, "run", lambda *a, **k: pytest.fail("measured before checking --plot"))
    assert_one_line_error(*run_cli(capsys, "bench", "cache", "-m", str(synth_model), "--plot", str(tmp_path / name)),
                          "--plot", needle)


def test_bench_cache_plot_draws_what_the_table_says():
    """`bench cache --plot`: each panel's points are the rows' values (decode tok/s, hit rate,
    prefill tok/s) at their capacities; the resident speed a level, staging's a point at 0%; two
    stores with equal hit rates both visible (their own markers and sizes)."""
    import matplotlib.pyplot as plt
    from expertcache.bench.cache_bench import figure

    def row(mode, store, fraction=None, prefetch=False, dec=0.0, hit=0.0, pre=0.0):
        return {"mode": mode, "store": store, "fraction": fraction, "prefetch": prefetch,
                "decode": {"tok_s": dec, "hit_rate": hit}, "prefill": {"tok_s": pre}}

    rows = []
    for store, k in (("ram", 1.0), ("disk", 0.5)):
        rows += [row("resident", store, dec=40 * k, hit=1.0, pre=400 * k), row("staging", store, dec=5 * k, pre=50 * k),
                 row("cache", store, 0.5, False, 20 * k, 0.7, 200 * k), row("cache", store, 0.25, False, 10 * k, 0.5, 100 * k),
                 row("cache", store, 0.25, True, 15 * k, 0.6, 120 * k)]
    fig = figure(rows, "/x/model", 2)
    try:
        decode, hits, prefill = fig.axes
        def curves(ax):
            return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
        d, h, p = curves(decode), curves(hits), curves(prefill)
        assert d["ram: cache, prefetch off"] == ([25, 50], [10, 20]) and d["disk: cache, prefetch on"] == ([25], [7.5])
        assert d["ram: staging"] == ([0], [5]) and d["disk: resident"][1] == [20, 20]
        assert h["ram: cache, prefetch off"] == h["disk: cache, prefetch off"] == ([25, 50], [0.5, 0.7])
        assert not any("resident" in k or "staging" in k for k in h)  # no hit rate to draw for them
        assert p["disk: cache, prefetch off"] == ([25, 50], [50, 100]) and p["ram: resident"][1] == [400, 400]
        ram, disk = (next(line for line in hits.get_lines() if line.get_label() == f"{s}: cache, prefetch off")
                     for s in ("ram", "disk"))
        assert (ram.get_marker(), ram.get_markersize()) != (disk.get_marker(), disk.get_markersize())
        assert "tokens / s" in decode.get_ylabel() and "hit rate" in hits.get_ylabel() and "%" in hits.get_xlabel()
        assert "model" in fig._suptitle.get_text() and "2 threads" in fig._suptitle.get_text()
    finally:
        plt.close(fig)


def test_overlap_bound_by_hand():
    """Resident 20 ms a token; prefetch off 50 ms with 40 MB copied a token in 0.2 s over 10 tokens
    (2 GB/s: 20 ms of reads); prefetch on 40 ms with 50 MB (25 ms of reads)."""
    from expertcache.bench.cache_bench import bounds_text, overlap_bounds

    def row(mode, tok_s, prefetch=False, mb=0.0, copy_s=0.0, device="cpu", read_mb=None):
        return {"mode": mode, "store": "disk", "fraction": 0.25, "prefetch": prefetch, "device": device,
                "decode": {"tok_s": tok_s, "tokens": 10, "copied_bytes_per_token": mb * 1e6, "copy_seconds": copy_s,
                           "read_bytes_per_token": (mb if read_mb is None else read_mb) * 1e6}}

    # With prefetch, 56 MB a token counted as copied, of which 6 MB of prefetches whose copy never
    # ran (their expert lost its slot first): the reads are the 50 MB read.
    rows = [row("resident", 50), row("staging", 5), row("cache", 20, False, 40, 0.2),
            row("cache", 25, True, 56, 0.1, read_mb=50)]
    (b,) = overlap_bounds(rows)
    assert b["read_gb_s"] == pytest.approx(2.0) and b["reads_s"] == pytest.approx(0.025)
    assert (b["x_bound"], b["speedup"], b["ceiling"]) == pytest.approx((1.6, 1.25, 2.0))
    assert "= 1.60x max(compute 20.0 ms, reads 25.0 ms at 2.00 GB/s)" in bounds_text([b])
    # Against the 20 ms of reads without prefetch: 40 / 20, which the on run's extra 10 MB do not lower.
    assert b["x_bound_needed"] == pytest.approx(2.0) and b["reads_needed_s"] == pytest.approx(0.02)
    assert "2.00x with the reads without prefetch (20.0 ms)" in bounds_text([b])
    assert b["off_copies_gb_s"] == pytest.approx(2.0) and b["x_bound_off_copies"] == pytest.approx(1.6)
    # With the disk probed after prefetch on's decode (2.5 GB/s: 50 MB in 20 ms), the bound is
    # taken at that rate; prefetch off's copies stay beside it.
    rows[3]["decode"]["probe_gb_s"] = 2.5
    (b,) = overlap_bounds(rows)
    assert b["read_gb_s"] == pytest.approx(2.5) and b["reads_s"] == pytest.approx(0.02)
    assert (b["x_bound"], b["x_bound_needed"]) == pytest.approx((2.0, 2.0))  # 40 / max(20, 20), 40 / max(20, 16)
    assert b["x_bound_off_copies"] == pytest.approx(1.6)
    assert "reads 20.0 ms at 2.50 GB/s" in bounds_text([b]) and "1.60x at the rate of prefetch off's copies" \
        in bounds_text([b])
    # Without the pair, or on a GPU (whose copy time is the time to issue them): nothing.
    assert overlap_bounds(rows[:3]) == []
    assert overlap_bounds([row("resident", 50, device="cuda")] + rows[1:]) == []


@pytest.mark.parametrize("device,needle", [("cuda:99", "cuda:99"), ("meta", "not supported")])
def test_bench_cache_refuses_a_device_it_cannot_use_in_one_line(synth_model, capsys, device, needle):
    from conftest import assert_one_line_error, run_cli

    assert_one_line_error(*run_cli(capsys, "bench", "cache", "-m", str(synth_model), "--device", device), needle)


def test_bench_speed_prints_table_and_json(synth_model, capsys):
    assert main(["bench", "speed", "-m", str(synth_model), "--fractions", "0.5", "--prefill", "16,32",
                 "--decode", "3", "-t", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert [r["mode"] for r in out["results"]] == ["resident", "cache", "staging"]
    res = out["results"][0]
    assert set(res["prefill"]) == {"16", "32"} and res["decode"]["tok_s"] > 0
    assert 0 < res["overhead"]["outside_matmul_fraction"] < 1
    copy_bw = out["machine"]["copy_bw"]
    for r in out["results"][1:]:  # cache, staging: timed in pairs right after the resident mode
        d = r["decode"]
        assert len(d["bound_pairs"]) == 3
        for pair in d["bound_pairs"]:
            assert pair["bound_ms"] == pytest.approx(pair["resident_ms"] + 1e3 * pair["missed_bytes_per_token"] / copy_bw)
        assert d["ratio_to_bound"] == median_ratio([p["ms"] for p in d["bound_pairs"]],
                                                   [p["bound_ms"] for p in d["bound_pairs"]])
    # staging copies every expert it uses, and every decode step uses some
    assert all(p["missed_bytes_per_token"] > 0 for p in out["results"][2]["decode"]["bound_pairs"])


def test_median_ratio_pairs_each_run_with_its_partner():
    # per-pair ratios 2, 1, 5: the median is 2, whatever the medians of either side alone (3 and 2)
    assert median_ratio([2.0, 3.0, 10.0], [1.0, 3.0, 2.0]) == 2.0
    with pytest.raises(ValueError):
        median_ratio([1.0, 2.0], [1.0])


# Stands in for llama_cpp.Llama in the child process bench speed runs llama.cpp in (found there
# through sys.path, which a spawned child inherits): it records what it is asked to evaluate, in
# order, one line per call in the file $FAKE_LLAMA_CALLS.
FAKE_LLAMA = """
import os
import numpy as np


def _log(*what):
    with open(os.environ["FAKE_LLAMA_CALLS"], "a") as f:
        f.write(" ".join(map(str, what)) + "\\n")


class Llama:
    def __init__(self, model_path, n_ctx, **kw):
        self.n_ctx, self.n_tokens = n_ctx, 0
        self.scores = np.zeros((n_ctx, 300), dtype=np.float32)
        _log("load", model_path, os.getpid())

    def reset(self):
        self.n_tokens = 0

    def eval(self, tokens):
        assert self.n_tokens + len(tokens) <= self.n_ctx
        self.n_tokens += len(tokens)
        _log("eval", len(tokens))
"""


def test_bench_speed_vs_llamacpp_alternates_pairs(synth_model, capsys, monkeypatch, tmp_path):
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "llama_cpp.py").write_text(FAKE_LLAMA)
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("FAKE_LLAMA_CALLS", str(calls))
    gguf = tmp_path / "w.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    assert main(["bench", "speed", "-m", str(synth_model), "--fractions", "0.5", "--prefill", "16,32",
                 "--decode", "3", "-t", "1", "--vs-llamacpp", str(gguf), "--pairs", "3"]) == 0
    text = capsys.readouterr().out
    lc = json.loads(text.strip().splitlines()[-1])["llamacpp"]
    assert lc["pairs"] == 3 and set(lc["runs"]) == {"decode", "prefill_16", "prefill_32"}
    for k, v in lc["runs"].items():
        assert len(v["ours"]) == len(v["llamacpp"]) == 3
        assert lc["ratios"][k] == median_ratio(v["ours"], v["llamacpp"])
    lines = [line.split() for line in calls.read_text().splitlines()]
    # loaded once, in another process than ours
    assert lines[0][:2] == ["load", str(gguf)] and int(lines[0][2]) != os.getpid()
    # one untimed warm-up of the longest prompt, then per pair: decode (64-token prompt + 3 steps),
    # and each prefill twice (untimed, timed)
    evals = [int(n) for c, n, *_ in lines[1:] if c == "eval"]
    assert evals == [32, 32] + 3 * ([64, 1, 1, 1] + [16, 16, 32, 32])
    assert "ratios (ours / llama.cpp): decode" in text


def test_bench_speed_vs_llamacpp_says_in_one_line_when_llamacpp_cannot_load(synth_model, capsys, monkeypatch,
                                                                            tmp_path):
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "llama_cpp.py").write_text(
        "class Llama:\n    def __init__(self, model_path, **kw):\n"
        "        raise ValueError(f'Failed to load model from file: {model_path}')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    gguf = tmp_path / "w.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    code, err = run_cli(capsys, "bench", "speed", "-m", str(synth_model), "--fractions", "0.5", "--prefill", "16",
                        "--decode", "2", "-t", "1", "--vs-llamacpp", str(gguf), "--pairs", "1")
    assert_one_line_error(code, err, "llama.cpp could not load it", "w.gguf")


def test_bench_speed_vs_llamacpp_rejects_a_bad_file_before_running(synth_model, capsys, tmp_path):
    code, err = run_cli(capsys, "bench", "speed", "-m", str(synth_model), "--vs-llamacpp", str(tmp_path / "no.gguf"))
    assert_one_line_error(code, err, "no.gguf", "cannot read", "GGUF")
    text = tmp_path / "w.safetensors"
    text.write_bytes(b"\x08\x00\x00\x00{}")
    code, err = run_cli(capsys, "bench", "speed", "-m", str(synth_model), "--vs-llamacpp", str(text))
    assert_one_line_error(code, err, "w.safetensors", "not a GGUF file")


def test_the_side_by_side_runs_wait_until_both_processes_stop_spinning(monkeypatch):
    from expertcache.bench import speed

    assert speed._cpu_seconds([os.getpid()]) > 0  # this process's CPU time, from /proc
    slept = []
    monkeypatch.setattr(speed.time, "sleep", slept.append)
    # CPU seconds the two processes have used, one reading per window: spinning for two windows
    # (0.2 s of CPU in each 0.1 s: two cores), then idle
    readings = iter([1.0, 1.2, 1.4, 1.41])
    monkeypatch.setattr(speed, "_cpu_seconds", lambda pids: next(readings))
    speed.wait_idle([1, 2])
    assert slept == [speed.IDLE_WINDOW_S] * 3
    # never more than the limit, however long they spin
    slept.clear()
    spinning = iter(range(10 ** 6))
    monkeypatch.setattr(speed, "_cpu_seconds", lambda pids: float(next(spinning)))
    clock = iter(range(100))
    monkeypatch.setattr(speed.time, "perf_counter", lambda: float(next(clock)) * speed.IDLE_WINDOW_S)
    speed.wait_idle([1])
    assert len(slept) == round(speed.IDLE_LIMIT_S / speed.IDLE_WINDOW_S)
    # where /proc cannot be read: a fixed pause
    slept.clear()
    monkeypatch.setattr(speed, "_cpu_seconds", lambda pids: None)
    speed.wait_idle([1])
    assert slept == [speed.SETTLE_S]


def test_the_decode_profile_counts_the_products_over_quantized_blocks():
    # On a GGUF file the experts and dense matrices are multiplied by the quantized kernels: the
    # split of a step into products and the rest must count them (it once left them all "outside").
    from pathlib import Path

    from expertcache.bench.speed import overhead_profile

    model = expertcache.load(Path(__file__).parent / "fixtures" / "gguf" / "olmoe-Q8_0.gguf", kernels="native")
    out = overhead_profile(model, list(range(1, 9)), n=2)
    by_op = out["matmul_ms_by_op"]
    assert "quant::experts" in by_op and by_op["quant::experts"] > 0
    assert any(k in by_op for k in ("quant::gemv", "quant::gemm_tiles"))  # the dense matrices
    assert out["matmul_ms"] == pytest.approx(sum(by_op.values()))
    assert out["outside_matmul_ms"] == pytest.approx(out["step_ms"] - out["matmul_ms"])
    # the rest by op: none of the products among them, the costliest first, each a real op of the step
    rest = out["outside_ms_by_op"]
    assert rest and not set(rest) & set(by_op)
    assert list(rest.values()) == sorted(rest.values(), key=lambda v: -v["ms"])
    assert "native::rms_norm" in rest or any(k.startswith("aten::") for k in rest)
    assert all(v["calls"] > 0 for v in rest.values()) and out["outside_ops_per_step"] >= len(rest)


def _measured(spec: dict) -> dict:
    """What `run_one` returns for `spec`, with made-up figures (the table's and the bounds' fields)."""
    phase = {"tokens": 4, "seconds": 0.1, "tok_s": 40.0, "hit_rate": 0.5, "copied_bytes_per_token": 1e6,
             "copy_seconds": 0.01, "prefetch_copy_seconds": 0.0, "copy_gb_s": 0.4, "stall_seconds": 0.0}
    return {"mode": spec["mode"], "store": spec["store"], "fraction": spec.get("fraction"), "device": "cpu",
            "prefetch": spec.get("prefetch") == "on", "capacity": 8,
            "prefill": {**phase, "bytes_read_per_token": 1e6, "stretches": 1}, "decode": phase,
            "expert_bytes_total": 16e6, "prefill_stretch": 4096, "stretch_activation_bytes": 2**20,
            "peak_rss_bytes": 2**30}


def test_bench_cache_keeps_the_other_configurations_when_one_fails(synth_model, capsys, monkeypatch):
    """A configuration that fails (here the cache at 50%) is named in the table and in the JSON's
    `failed`; the others are still printed and reported, and the exit code says one failed. (The
    first failure ended the run with nothing printed of what had been measured.)"""
    import subprocess

    from expertcache.bench import cache_bench

    def run(argv, **kw):
        spec = json.loads(argv[-1])
        if spec.get("fraction") == 0.5:
            return subprocess.CompletedProcess(argv, 1, "", "Traceback ...\nExpertCacheError: cannot allocate 4 expert slots")
        return subprocess.CompletedProcess(argv, 0, json.dumps(_measured(spec)) + "\n", "")

    monkeypatch.setattr(cache_bench.subprocess, "run", run)
    assert main(["bench", "cache", "-m", str(synth_model), "--stores", "ram", "--fractions", "0.25,0.5",
                 "--prefill", "4", "--decode", "4", "-t", "1"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert [(r["mode"], r["fraction"]) for r in out["results"]] == [("resident", None), ("staging", None), ("cache", 0.25)]
    assert out["failed"] == [{"mode": "cache", "store": "ram", "fraction": 0.5, "prefetch": "auto",
                              "error": "ExpertCacheError: cannot allocate 4 expert slots"}]
    assert sum(line.startswith(("resident", "staging", "cache")) for line in lines) == 3
    assert "failed: cache ram 50% prefetch auto: ExpertCacheError: cannot allocate 4 expert slots" in lines
    # every configuration failing is still an error, in one line after the progress bar, as before
    monkeypatch.setattr(cache_bench.subprocess, "run", lambda argv, **kw: subprocess.CompletedProcess(argv, 1, "", "boom"))
    code, err = run_cli(capsys, "bench", "cache", "-m", str(synth_model), "--stores", "ram", "--fractions", "0.5",
                        "-t", "1")
    assert code == 2 and err.strip().splitlines()[-1] == "expertcache: error: configuration resident ram failed: boom"


def test_bench_speed_names_the_prompt_length_of_its_flop_rate():
    """Without a 512-token prompt the FLOP rate is the first prompt length's: the header says so (it
    said "GFLOP/s (512)" whatever was measured)."""
    from expertcache.bench.speed import table

    def row(mode, gflop_s):
        return {"mode": mode, "fraction": None,
                "decode": {"tok_s": 10.0, "ms_per_token": 100.0, "split_ms": {}, "read_gb_s": 1.0, "read_fraction": 0.5},
                "prefill": {"16": {"tok_s": 50.0, "gflop_s": gflop_s, "matmul_fraction": 0.25},
                            "64": {"tok_s": 80.0, "gflop_s": 99.0, "matmul_fraction": 0.5}}}

    out = {"machine": {"read_bw": 2e9, "copy_bw": 1e9, "matmul_rate": 1e11}, "threads": 1, "kernels": "torch",
           "pairs": 1, "results": [row("resident", 12.5)]}
    lines = table(out).splitlines()
    head = next(line for line in lines if line.startswith("mode") and "GFLOP/s" in line)
    assert "GFLOP/s (16)" in head and "(512)" not in head
    assert lines[lines.index(head) + 2].split()[-2:] == ["12.5", "25%"]


def test_bench_serve_compare_keeps_the_other_modes_when_one_fails(monkeypatch, capsys, tmp_path):
    """A mode whose server fails (here cache's) is said in its place and in the JSON's `failed`; the
    modes measured are still reported, and the exit code says one failed. (The first failure ended
    the run with no JSON line.)"""
    import subprocess

    from expertcache.bench import serve

    class Server:
        def __init__(self, argv, **kw):
            self.mode = argv[argv.index("--cache-mode") + 1]

        def terminate(self):
            pass

        def wait(self, timeout=None):
            return 0

    def healthy(url, proc, log, timeout):
        if proc.mode == "cache":
            raise expertcache.ExpertCacheError("the server exited with code 2: cache too small")

    monkeypatch.setattr(subprocess, "Popen", Server)
    monkeypatch.setattr(serve, "_wait_healthy", healthy)
    monkeypatch.setattr(serve, "run_suite", lambda args, url: {"suite": "prefill", "url": url, "model": "m",
                                                              "text": "t", "max_tokens": 4, "prompt_tps": 100.0})
    model = str(tmp_path)
    assert main(["bench", "serve", "-m", model, "--compare", "staging,cache,resident", "--suite", "prefill"]) == 1
    text = capsys.readouterr().out
    out = json.loads(text.strip().splitlines()[-1])
    assert list(out["modes"]) == ["staging", "resident"]
    assert out["failed"] == [{"mode": "cache", "error": "the server exited with code 2: cache too small"}]
    assert out["deltas"] == [{"metric": "prompt_tps", "staging": 100.0, "resident": 100.0,
                              "resident vs staging": "+0.0%"}]
    assert "mode cache failed: the server exited with code 2: cache too small" in text
    # every mode failing is still one line, as before
    assert_one_line_error(*run_cli(capsys, "bench", "serve", "-m", model, "--compare", "cache", "--suite", "prefill"),
                          "the server exited with code 2: cache too small")
