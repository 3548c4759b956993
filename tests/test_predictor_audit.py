"""Recording traces and the predictors at their edges: a prompt stopped part-way, a checkpoint
rewritten between recorded calls, a prefetch wider than the recorder's default ranking, fitted
maps with the model loaded in another compute dtype, and `trace fit-predictor`'s refusals."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import expertcache
from expertcache import CacheConfig
from expertcache.bench.simulate import simulate
from expertcache.bench.trace import TraceRecorder
from conftest import assert_one_line_error, run_cli
from test_linear_predictor import rewrite_router

ASSETS = Path(expertcache.__file__).parent / "assets"
BUNDLED_MAPS = ASSETS / "tiny-qwen3-moe.predictor.safetensors"
PROMPT = torch.randint(4, 500, (20,), generator=torch.Generator().manual_seed(11)).tolist()


def test_a_prompt_stopped_part_way_is_recorded_as_prefill():
    model = expertcache.load(None)
    # Asked before each micro-batch but the prompt's first (4 in layer 0, then from layer 1's
    # first on): the sixth question, in layer 1's mixer, stops the prompt after layer 0's MoE op.
    asked = []

    def should_stop() -> bool:
        asked.append(1)
        return len(asked) >= 6

    seen = []
    model.net.routing_hook = lambda layer, routing: seen.append((layer, routing.ids.shape[0]))
    model.generate(PROMPT, max_tokens=4, ubatch=4, should_stop=should_stop)  # the reference: what ran
    model.net.routing_hook = None
    asked.clear()
    rec = TraceRecorder.for_model(model, predict=True)
    res = rec.generate(model, PROMPT, max_tokens=4, ubatch=4, should_stop=should_stop)
    trace = rec.trace()
    assert res.finish_reason == "abort" and res.token_ids == []
    assert seen and list(zip(trace.layer.tolist(), trace.tokens.tolist())) == seen
    # Nothing was decoded: every op that ran carried prompt tokens.
    assert trace.phase.tolist() == [0] * len(seen)
    assert trace.decode_tokens() == 0 and trace.prefill_tokens() == sum(n for _, n in seen)


def test_a_checkpoint_rewritten_between_recorded_calls(tmp_path):
    path = shutil.copytree(ASSETS / "tiny-qwen3-moe", tmp_path / "m")
    cache = CacheConfig(fraction=0.25, prefetch="on")
    model = expertcache.load(path, cache=cache)
    rec = TraceRecorder.for_model(model, predict=True)
    rec.generate(model, PROMPT[:6], max_tokens=3, ignore_eos=True)
    before = rec.trace()
    rewrite_router(path)
    rec.generate(model, PROMPT[:6], max_tokens=3, ignore_eos=True)
    trace = rec.trace()
    # The reference: the rewritten checkpoint loaded afresh and recorded once.
    fresh = expertcache.load(path, cache=cache)
    ref_rec = TraceRecorder.for_model(fresh, predict=True)
    ref_rec.generate(fresh, PROMPT[:6], max_tokens=3, ignore_eos=True)
    ref = ref_rec.trace()
    rows, ops = len(before.ids), before.num_ops
    assert np.array_equal(trace.ids[rows:], ref.ids) and np.array_equal(trace.predicted[ops:], ref.predicted)
    assert ref.predicted.all() and np.array_equal(trace.pred[rows:], ref.pred)
    # The recorder left the decoder that now runs: nothing more is recorded, and prefetch ranks
    # with the new routers again.
    n = len(rec)
    model.logits(PROMPT)
    assert len(rec) == n and model.net.routing_hook is None
    assert model.net.residual_hook is model.experts.predict.own and "forward" not in vars(model.net)


def test_recording_a_prefetch_wider_than_two_prefetches_what_it_would_without():
    cache = CacheConfig(fraction=0.5, prefetch="on", prefetch_width=3.0)
    plain = expertcache.load(None, cache=cache)
    plain.generate(PROMPT, max_tokens=5, ignore_eos=True)
    model = expertcache.load(None, cache=cache)
    rec = TraceRecorder.for_model(model, predict=True)
    rec.generate(model, PROMPT, max_tokens=5, ignore_eos=True)
    trace = rec.trace()
    K, E = model.cfg.top_k, model.cfg.num_experts
    assert trace.header.pred_width == min(E, 3 * K)
    want, got = plain.telemetry()["total"], model.telemetry()["total"]
    keys = ("demand_misses", "prefetch_issued", "prefetch_used", "prefetch_wasted")
    assert [got[k] for k in keys] == [want[k] for k in keys]
    sim = simulate(trace.ops(), model.experts.capacity, model.experts.config.policy, trace.header.expert_bytes,
                   trace.predictions(3.0))
    assert [sim.misses, sim.prefetch_issued, sim.prefetch_used, sim.prefetch_wasted] == [want[k] for k in keys]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fitted_maps_load_with_the_model_in_another_compute_dtype(dtype):
    # The bundled checkpoint is bf16 and its maps were fitted on it; widened to fp32 its routers
    # are the same numbers.
    resident = expertcache.load(None, dtype=dtype, cache=CacheConfig(mode="resident"))
    want = resident.logits(PROMPT)
    model = expertcache.load(None, dtype=dtype, cache=CacheConfig(fraction=0.25, prefetch="on",
                                                                  predictor=str(BUNDLED_MAPS)))
    assert model.net.dtype == getattr(torch, dtype)
    assert model.experts.predict.own.name == f"linear:{BUNDLED_MAPS.name}"
    assert torch.equal(model.logits(PROMPT), want)
    assert model.telemetry()["total"]["prefetch_issued"] > 0


def test_maps_of_other_routers_are_still_refused_in_every_dtype(tmp_path, capsys):
    from expertcache.models.linear_predictor import LinearMaps

    maps = LinearMaps.load(BUNDLED_MAPS)
    path = shutil.copytree(ASSETS / "tiny-qwen3-moe", tmp_path / "m")
    rewrite_router(path)
    for dtype in ("float32", "bfloat16"):
        code, err = run_cli(capsys, "run", "-m", str(path), "-p", "hi", "-n", "1", "--dtype", dtype,
                            "--cache-fraction", "0.5", "--predictor", str(BUNDLED_MAPS))
        assert_one_line_error(code, err, "fitted on another model")
    assert maps.routers  # the file names routers, which the rewritten checkpoint no longer has


@pytest.mark.parametrize("extra, option", [(["--seed", "3"], "--seed"), (["--hidden", "0"], "--hidden"),
                                           (["--epochs", "2"], "--epochs"),
                                           (["--objective", "used", "--ridge", "2"], "--ridge")])
def test_fit_predictor_refuses_an_option_of_the_other_objective(tmp_path, capsys, extra, option):
    text = tmp_path / "t.txt"
    text.write_text((ASSETS / "heldout.txt").read_text()[:2000])
    out = tmp_path / "p.safetensors"
    code, err = run_cli(capsys, "trace", "fit-predictor", "-f", str(text), "-o", str(out), *extra)
    assert_one_line_error(code, err, option, "--objective")
    assert not out.exists()


def test_fit_predictor_refusals_are_one_line(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text((ASSETS / "heldout.txt").read_text()[:2000])
    (tmp_path / "bad.txt").write_bytes(b"abc \xff\xfe def")
    (tmp_path / "dir").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    cases = [(["-f", str(text), "-o", str(tmp_path / "a.safetensors")], "tokens to fit on"),
             (["-f", str(tmp_path / "bad.txt"), "-o", str(tmp_path / "b.safetensors")], "UTF-8"),
             (["-f", str(text), "-o", str(tmp_path / "dir")], "directory"),
             (["-f", str(text), "-o", str(tmp_path / "notes.txt")], "not a predictor file")]
    for argv, needle in cases:
        code, err = run_cli(capsys, "trace", "fit-predictor", *argv)
        assert_one_line_error(code, err, needle)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.txt", "dir", "notes.txt", "t.txt"]
