"""Seeded random configurations: the runtime cache's counters equal exactly those of the trace
simulator replaying the trace recorded of the same run, after every call (prefill and decode, a
second prompt on the session's prefix, a fresh logits call), and the logits and tokens are
bitwise those of the all-resident model. Policy, capacity (a slot up to every expert), prefetch,
its width and probability floor, the store, prompt lengths and micro-batches are drawn, on four
architectures' tiny models and with the router or fitted maps predicting."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import expertcache
from expertcache import CacheConfig
from expertcache.bench.simulate import simulate
from expertcache.bench.trace import TraceRecorder
from expertcache.tiers.policy import POLICIES, make_policy
from expertcache.tiers.residency import Residency
from conftest import VOCAB, build_reference, save_checkpoint, tiny_config

ASSETS = Path(expertcache.__file__).parent / "assets"
# fitted maps of two kinds: a logits map (softmax) and a map of use (sigmoid)
MAPS = [str(ASSETS / f"tiny-qwen3-moe.{kind}.safetensors") for kind in ("predictor", "predictor-used")]
CONFIGS_PER_MODEL = 10


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (checkpoint dir, the fitted maps it may run with). The bundled model (32 experts,
    top-4) has maps; the others' routers predict."""
    from test_gemma4 import build as build_gemma4
    from test_qwen35 import build as build_qwen35

    root = tmp_path_factory.mktemp("agree")
    q3 = save_checkpoint(build_reference(tiny_config("qwen3_moe"), seed=11), root / "qwen3")
    q35 = save_checkpoint(build_qwen35(seed=12), root / "qwen35")
    g4 = save_checkpoint(build_gemma4(seed=13), root / "gemma4", fused=True)
    return {"qwen3_moe": (q3, []), "qwen3_5_moe": (q35, []), "gemma4": (g4, []),
            "bundled": (ASSETS / "tiny-qwen3-moe", MAPS)}


def draw(rng: random.Random, total: int, top_k: int, maps: list[str]) -> dict:
    """One configuration. Half the capacities are below a prompt's distinct experts (waves)."""
    small = rng.randint(1, 4 * top_k)
    capacity = min(total, small if rng.random() < 0.5 else rng.randint(1, total))
    prefetch = rng.random() < 0.8
    return dict(
        policy=rng.choice(sorted(POLICIES)), capacity=capacity, prefetch=prefetch,
        width=rng.choice([0.5, 1.0, 1.5, 2.0, 2.5, 3.0]) if prefetch else 1.0,
        min_prob=rng.choice([0.0, 0.0, 0.05, 0.2, 0.5, 0.9]) if prefetch else 0.0,
        store=rng.choice(["ram", "mmap", "disk"]),
        prompt=[rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 24))],
        ubatch=rng.choice([1, 3, 5, 8, 512]), decode=rng.randint(0, 6),
        # the second prompt: the first with its reply and more, or a shorter prefix of it and more
        cut=rng.choice([None, rng.randint(1, 8)]),
        more=[rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 10))], decode2=rng.randint(0, 5),
        logits=[rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 20))],
        # a short prefill stretch: a prompt in several forwards, each layer's op once per stretch
        stretch=rng.choice([4096, 4096, 5, 9]), maps=rng.choice([None, *maps]),
    )


def script(model, c: dict, rec: TraceRecorder | None, reused: list[int]):
    """The calls of a configuration; yields (tokens or logits) after each call. `reused` gets the
    prompt tokens the second call took from the session."""
    run = rec.generate if rec is not None else (lambda m, p, **kw: m.generate(p, **kw))
    session = model.new_session()
    first = run(model, c["prompt"], max_tokens=c["decode"], ubatch=c["ubatch"], ignore_eos=True, session=session)
    yield first.token_ids
    head = c["prompt"] + first.token_ids if c["cut"] is None else c["prompt"][: c["cut"]]
    second = run(model, head + c["more"], max_tokens=c["decode2"], ubatch=c["ubatch"], ignore_eos=True,
                 session=session)
    reused.append(second.cached_tokens)
    yield second.token_ids
    if rec is not None:
        with rec.attached(model):
            yield model.logits(c["logits"])
    else:
        yield model.logits(c["logits"])


def replay(ops, capacity: int, policy: str, predictions) -> dict:
    """The simulator's counters as the runtime names them (at 1 byte per expert, bytes moved are
    the experts copied). `waves` is not in `SimResult`: counted
    here with the same `Residency` steps as `simulate`, whose other counts it must then equal."""
    sim = simulate(ops, capacity, policy, 1, predictions)
    res = Residency(capacity, make_policy(policy, capacity))
    waves = hits = 0
    for i, (layer, experts) in enumerate(ops):
        plan = res.plan(layer, experts)
        waves += len(plan.waves)
        hits += len(plan.hits)
        if predictions is not None and i + 1 < len(ops) and predictions[i + 1]:
            res.plan_prefetch(ops[i + 1][0], predictions[i + 1])
    assert hits == sim.hits
    return {"ops_seen": sim.ops, "resident_hits": sim.hits, "resident_misses": sim.misses,
            "demand_misses": sim.misses, "copied_experts": sim.bytes_moved, "evictions": sim.evictions,
            "waves": waves, "prefetch_issued": sim.prefetch_issued, "prefetch_used": sim.prefetch_used,
            "prefetch_wasted": sim.prefetch_wasted}


@pytest.mark.parametrize("name, seed", [("qwen3_moe", 1), ("qwen3_5_moe", 2), ("gemma4", 3), ("bundled", 4)])
def test_runtime_counters_equal_the_simulator_on_random_configurations(checkpoints, name, seed):
    path, maps = checkpoints[name]
    resident = {}  # stretch -> the all-resident model
    cfg = expertcache.load(path, cache=CacheConfig(mode="resident")).cfg
    total = cfg.num_experts * len(cfg.moe_layers)
    rng = random.Random(seed)
    waved = prefetched = floored = 0
    reused: list[int] = []
    for n in range(CONFIGS_PER_MODEL):
        c = draw(rng, total, cfg.top_k, maps)
        if c["stretch"] not in resident:
            resident[c["stretch"]] = expertcache.load(path, cache=CacheConfig(mode="resident"),
                                                      prefill_stretch=c["stretch"])
        want = list(script(resident[c["stretch"]], c, None, []))
        model = expertcache.load(path, prefill_stretch=c["stretch"], cache=CacheConfig(
            mode="cache", experts=c["capacity"], policy=c["policy"], store=c["store"], predictor=c["maps"],
            prefetch="on" if c["prefetch"] else "off", prefetch_width=c["width"], prefetch_min_prob=c["min_prob"]))
        assert model.experts.capacity == c["capacity"] and model.experts.prefetching == c["prefetch"]
        rec = TraceRecorder.for_model(model, predict=True)
        assert (rec.header.predictor == "router") == (c["maps"] is None)
        where = (name, n, {k: v for k, v in c.items() if k not in ("prompt", "more", "logits")})
        for call, got in enumerate(script(model, c, rec, reused)):
            # logits (last call) and tokens bitwise those of the all-resident model
            if isinstance(got, torch.Tensor):
                assert torch.equal(got, want[call]), where
            else:
                assert got == want[call], where
            # after every call, the counters so far are the replay of the trace so far
            t = rec.trace()
            predictions = t.predictions(c["width"], c["min_prob"]) if c["prefetch"] else None
            sim = replay(t.ops(), c["capacity"], c["policy"], predictions)
            total_now = model.telemetry()["total"]
            assert {k: total_now[k] for k in sim} == sim, (where, call)
        # both phases were checked: a call of n tokens decodes n - 1 forwards after its prefill
        assert t.prefill_tokens() > 0 and (1 in t.phase) == (max(c["decode"], c["decode2"]) > 1), where
        waved += sim["waves"] > sim["ops_seen"]
        prefetched += sim["prefetch_used"] > 0
        floored += c["prefetch"] and c["min_prob"] > 0 and predictions != t.predictions(c["width"])
    # the draws exercised what they are for
    assert waved >= 2 and prefetched >= 2 and floored >= 1, (waved, prefetched, floored)
    assert sum(r > 0 for r in reused) >= CONFIGS_PER_MODEL // 2, reused
