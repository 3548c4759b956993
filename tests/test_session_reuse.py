"""Sessions reused across many requests, driven by seeded random sequences of calls on tiny
Qwen3-MoE, Qwen3.5-MoE (DeltaNet snapshots) and Gemma 4 (sliding-window rings) checkpoints.

Prompts share a prefix with what the session holds and diverge anywhere: at position 0, at a
snapshot position and one either side of it, at the window's edge, inside the last reply, at the
end (the same prompt again), or not at all (a strict prefix); they come with other micro-batches
and stretches than the calls before, after generations, after a prefill stopped half-way, after
a forward that failed half-way, after the oldest snapshot was dropped, and longer than the
context (refused, the session unchanged). Three checks on every call:

- its logits equal one fresh forward over the same tokens within rounding (a reused prefix ran
  in another batch shape, so the last bits may differ: docs/server.md);
- they are bitwise those of a copy of the session that first went elsewhere (a detour: another
  prompt, a stopped or failed call, a truncation) and kept the same prefix: what a session held
  beyond the prefix it keeps never reaches a result;
- the whole sequence gives bitwise the same results in the expert cache as all resident.

The routers' choice is pinned by (layer, token): a router near-tie, which the last bits of
another batch shape can flip, would move the logits far more than rounding (seen here on the
Qwen3.5 model: a fresh 68-token forward against 10 then 58 tokens, 0.38 apart).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

import expertcache
import test_gemma4
import test_qwen35
from conftest import build_reference, save_checkpoint, tiny_config
from expertcache import engine
from expertcache.config import CacheConfig
from expertcache.engine import common_prefix
from expertcache.errors import ExpertCacheError
from expertcache.models.moe import Routing

CTX = 200
SNAPSHOT_EVERY, MAX_SNAPSHOTS = 16, 4  # small, so that decoding takes some and the oldest go
ATOL = 1e-3  # rounding here stays under 1e-4; state from the wrong positions moves logits by 0.1+
ARCHS = ["qwen3_moe", "qwen3_5_moe", "gemma4"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("reuse")
    return {"qwen3_moe": save_checkpoint(build_reference(tiny_config("qwen3_moe"), seed=0), root / "q3"),
            "qwen3_5_moe": save_checkpoint(test_qwen35.build(seed=0), root / "q35"),
            "gemma4": save_checkpoint(test_gemma4.build(seed=0), root / "g4", fused=True)}


class Boom(Exception):
    """A forward made to fail half-way (in one layer's MoE op)."""


class Recording(engine.Sampler):
    """The sampler `generate` uses, keeping the logits it was given."""

    seen: list[torch.Tensor] = []

    def __call__(self, logits):
        Recording.seen.append(logits.clone())
        return super().__call__(logits)


def load(path, cache=None, dtype=None, kernels="auto"):
    model = expertcache.load(path, ctx_size=CTX, cache=cache, dtype=dtype, kernels=kernels)
    model.net.snapshot_every, model.net.max_snapshots = SNAPSHOT_EVERY, MAX_SNAPSHOTS
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    table = torch.stack([torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.top_k]
                                      for _ in range(cfg.vocab_size)]) for _ in range(cfg.num_layers)])
    tokens = {}
    hook = model.net.forward_hook

    def begin(t):
        tokens["now"] = t  # a forward's MoE ops run over all of its tokens at once
        if hook is not None:
            hook(t)

    model.fail_at = None  # [layer, n]: the n-th MoE op of that layer from now raises Boom

    def pinned(layer, routing):
        if model.fail_at is not None and model.fail_at[0] == layer:
            model.fail_at[1] -= 1
            if not model.fail_at[1]:
                model.fail_at = None
                raise Boom()
        return Routing(routing.weights, table[layer][tokens["now"]].to(routing.ids.dtype))

    model.net.forward_hook, model.net.routing_override = begin, pinned
    return model


def make_call(rng: random.Random, held: list[int], snapshots: list[int], window: int | None, layers: int) -> dict:
    """One request: its kind, its prompt (sharing a prefix with `held`) and its settings."""
    at = [0, len(held), len(held) - 1, rng.randrange(len(held) + 1), rng.randrange(4)]
    for p in snapshots:
        at += [p - 1, p, p + 1]
    if window:
        at += [len(held) - window + d for d in (-1, 0, 1)]
    j = min(max(0, rng.choice(at)), len(held))
    kind = rng.choice(["generate"] * 3 + ["prefill"] * 2 + ["prefix", "same", "stop", "fail", "truncate", "long"])
    new = [rng.randrange(4, 128) for _ in range(rng.choice([1, 2, rng.randrange(1, 80)]))]
    if kind == "prefix" and held:
        ids = held[:rng.randrange(1, len(held) + 1)]
    elif kind == "same" and held:
        ids = list(held)
    elif kind == "long":
        ids = held[:j] + [rng.randrange(4, 128) for _ in range(CTX + 1 - j)]
    else:
        ids = (held[:j] + new)[:CTX]
    return dict(kind=kind, ids=ids, ubatch=rng.choice([1, 2, 5, 7, 16, 33, 512]),
                stretch=rng.choice([None, None, 4, 16, 24, 4096]),
                max_tokens=rng.choice([0, 1, 2, rng.randrange(3, 40)]),
                temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(1000), truncate=rng.randrange(len(held) + 1),
                stop_after=rng.randrange(8), fail=[rng.randrange(layers), rng.randrange(1, 5)])


def run_call(model, session, call: dict) -> tuple:
    """Run one request on `session`; returns what a rerun must give bitwise."""
    if call["stretch"] is not None:
        model.stretch = call["stretch"]
    kind, ids = call["kind"], call["ids"]
    if kind == "truncate":
        return ("truncate", session.truncate(call["truncate"]))
    if kind == "long":
        held = list(session.tokens)
        with pytest.raises(ExpertCacheError, match="do not fit the context"):
            model.generate(ids, max_tokens=2, session=session, ubatch=call["ubatch"])
        assert session.tokens == held
        return ("long",)
    if kind == "prefill":  # what generate does, through the lower-level calls
        kept = session.truncate(min(common_prefix(session.tokens, ids), len(ids) - 1))
        return ("prefill", kept, model.prefill(session, ids[kept:], ubatch=call["ubatch"], all_logits=True), ids)
    Recording.seen = []
    asked = []
    stop = (lambda: asked.append(1) or len(asked) > call["stop_after"]) if kind == "stop" else None
    if kind == "fail":
        model.fail_at = list(call["fail"])
    try:
        r = model.generate(ids, max_tokens=call["max_tokens"], session=session, ubatch=call["ubatch"],
                           temperature=call["temperature"], seed=call["seed"], ignore_eos=True, should_stop=stop)
    except Boom:
        return ("failed", Recording.seen, list(session.tokens))
    finally:
        model.fail_at = None
    whole = model.last_prefill.tokens == len(ids) - r.cached_tokens  # the prompt ran to its end
    return ("generate", r.cached_tokens, Recording.seen, ids, r.token_ids, r.finish_reason, whole)


def fresh_difference(model, result: tuple) -> float:
    """How far a call's logits are from one fresh forward over the same tokens."""
    if result[0] == "prefill":
        _, kept, got, ids = result
        want = model.logits(ids)[kept:]
    elif result[0] == "generate" and result[2]:
        _, _, seen, ids, out, _, _ = result
        got = torch.stack(seen)  # each step's logits, after the prompt and the tokens before it
        want = model.logits((ids + out)[:len(ids) + len(seen) - 1])[len(ids) - 1:]
    else:
        return 0.0
    return (got - want).abs().max().item()


def check_state(session) -> None:
    """The state holds exactly the session's tokens; snapshots ascending, bounded, behind it."""
    kv = session.kv
    assert kv.length == len(session.tokens)
    where = [s.position for s in kv.snapshots]
    assert where == sorted(set(where)) and len(where) <= MAX_SNAPSHOTS and all(p <= kv.length for p in where)
    assert all(s.tokens == kv.length for s in getattr(kv, "recurrent", {}).values())
    for ring in getattr(kv, "rings", {}).values():
        W, held = ring.pos.shape[0], {p for p in ring.pos.tolist() if p >= 0}
        # the next position's window, and nothing at or after the end
        assert set(range(max(0, kv.length - W + 1), kv.length)) <= held <= set(range(max(0, kv.length - W), kv.length))


def equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def lowest_start(session) -> list[int]:
    """[the lowest position a forward on `session` starts from, from now on] (what it may rewrite)."""
    low = [session.kv.length]
    begin = session.kv.begin

    def spy(n):
        low[0] = min(low[0], session.kv.length)
        begin(n)

    session.kv.begin = spy
    return low


def drive(model, seed: int, calls: int, seen: Counter, fresh: bool = True) -> list[tuple]:
    """`calls` random requests on one session; each checked against a fresh forward (`fresh`)
    and, half of the time, against a copy of the session that made a detour first."""
    rng = random.Random(seed)
    window = getattr(model.cfg, "sliding_window", None)
    session = model.new_session()
    results = []
    for step in range(calls):
        held, snapshots = list(session.tokens), [s.position for s in session.kv.snapshots]
        call = make_call(rng, held, snapshots, window, model.cfg.num_layers)
        detour = make_call(rng, held, snapshots, window, model.cfg.num_layers) if rng.random() < 0.5 else None
        seen[call["kind"]] += 1
        seen["wrapped"] += bool(window) and len(held) > window
        seen["dropped"] += len(snapshots) == MAX_SNAPSHOTS
        stretch = model.stretch
        other = None
        if detour is not None:
            other = session.copy()
            low = lowest_start(other)
            run_call(model, other, detour)
            untouched = min(low[0], len(other.tokens))  # positions before it the detour left as they were
            del other.kv.begin
            model.stretch = stretch
        result = run_call(model, session, call)
        results.append(result)
        seen["failed"] += result[0] == "failed"
        stopped = result[0] == "generate" and not result[-1]
        seen["stopped"] += stopped
        where = f"seed {seed} step {step}: {call['kind']} of {len(call['ids'])} tokens after {len(held)}"
        if fresh:
            d = fresh_difference(model, result)
            assert d < ATOL, f"{where}: {d} from a fresh forward"
        if result[0] in ("prefill", "truncate", "generate") and not stopped:
            check_state(session)  # (a prompt stopped or failed part-way leaves it to the next truncate)
        reusable = min(common_prefix(held, call["ids"]), len(call["ids"]) - 1)
        if result[0] in ("prefill", "generate") and result[1] < reusable:
            seen["restored"] += 1  # kept less than the common prefix: a snapshot or position 0
        if other is not None:
            model.stretch = stretch
            again = run_call(model, other, call)
            kept = result[1] if result[0] in ("prefill", "generate") else None
            if kept is not None and again[1] == kept and kept <= untouched:
                assert equal(result, again), f"{where}: another result after a {detour['kind']} detour"
                seen["detours"] += 1
    return results


@pytest.mark.parametrize("arch", ARCHS)
def test_reused_sessions_give_a_fresh_sessions_logits(checkpoints, arch, monkeypatch):
    monkeypatch.setattr(engine, "Sampler", Recording)
    resident = load(checkpoints[arch])
    cached = load(checkpoints[arch], cache=CacheConfig(experts=3))
    seen = Counter()
    for seed in range(3):
        want = drive(resident, seed, 40, seen)
        got = drive(cached, seed, 40, Counter(), fresh=False)
        assert equal(got, want), f"seed {seed}: the expert cache changed a result"
    assert cached.telemetry()["total"]["copied_experts"] > 0
    # the sequences reached what they are meant to
    wanted = ["generate", "prefill", "prefix", "same", "stopped", "failed", "truncate", "long", "detours"]
    if arch != "qwen3_moe":  # (keys and values cut anywhere: no snapshots)
        wanted += ["dropped", "restored"]
    if arch == "gemma4":
        wanted += ["wrapped"]
    assert all(seen[what] > 0 for what in wanted), seen


@pytest.mark.parametrize("arch", ARCHS)
def test_reused_sessions_in_bf16_do_not_depend_on_what_they_held(checkpoints, arch, monkeypatch):
    """bf16, with the native decode kernels where they build (a ring's empty and stale slots
    are masked there by position): rounding is too coarse to compare with a fresh forward, but a
    detour still must not change a bit."""
    monkeypatch.setattr(engine, "Sampler", Recording)
    seen = Counter()
    drive(load(checkpoints[arch], dtype="bfloat16"), 7, 40, seen, fresh=False)
    assert seen["detours"] > 0, seen
