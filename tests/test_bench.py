"""Benchmark commands: they run end to end, print a table and one JSON line, and the routing
replay forces the recorded routing."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import expertcache
from expertcache.bench.cache_bench import RoutingReplay
from expertcache.bench.trace import Trace, TraceHeader
from expertcache.checkpoint.synth import synth
from expertcache.cli import main


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


def test_bench_cache_prints_table_and_json(synth_model, capsys):
    assert main(["bench", "cache", "-m", str(synth_model), "--stores", "ram", "--fractions", "0.5",
                 "--prefill", "16", "--decode", "4", "-t", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    modes = [r["mode"] for r in out["results"]]
    assert modes == ["resident", "staging", "cache"] and lines[0].startswith("mode")
    staging, cache = out["results"][1]["decode"], out["results"][2]["decode"]
    assert staging["hit_rate"] == 0 and staging["copied_bytes_per_token"] > cache["copied_bytes_per_token"]
    assert out["results"][0]["decode"]["copied_bytes_per_token"] == 0


def test_bench_speed_prints_table_and_json(synth_model, capsys):
    assert main(["bench", "speed", "-m", str(synth_model), "--fractions", "0.5", "--prefill", "16,32",
                 "--decode", "3", "-t", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    out = json.loads(lines[-1])
    assert [r["mode"] for r in out["results"]] == ["resident", "cache", "staging"]
    res = out["results"][0]
    assert set(res["prefill"]) == {"16", "32"} and res["decode"]["tok_s"] > 0
    assert 0 < res["overhead"]["outside_matmul_fraction"] < 1
    assert out["results"][1]["decode"]["ratio_to_bound"] > 0
