"""Routing traces: recording is invisible to the outputs, matches the reference router, survives a
save/load round trip, rejects malformed files; and the simulator replaying a recorded trace counts
exactly what the runtime cache counted."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from expertcache import CacheConfig, load
from expertcache.bench.simulate import compare, parse_capacities, simulate
from expertcache.bench.trace import (
    Trace,
    TraceHeader,
    TraceRecorder,
    load_trace,
    parse_prompts,
    popularity,
    prediction_quality,
    reuse_distances,
    run_prompts,
    save_trace,
    top_counts,
)
from expertcache.cli import main
from expertcache.errors import ExpertCacheError
from expertcache.tiers.policy import DEFAULT_POLICY, POLICIES

PROMPT = [5, 9, 17, 33, 4, 60, 71, 12, 90, 101, 23]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """One tiny Qwen3-MoE checkpoint for the module: 3 MoE layers x 8 experts, top-2."""
    from conftest import build_reference, save_checkpoint, tiny_config

    ref = build_reference(tiny_config("qwen3_moe", experts=8, top_k=2, layers=3), seed=3)
    return ref, save_checkpoint(ref, tmp_path_factory.mktemp("trace") / "qwen3")


def test_recording_changes_nothing_and_matches_the_reference_router(ckpt):
    ref, path = ckpt
    model = load(path)
    plain = model.generate(PROMPT, max_tokens=12, ubatch=4, ignore_eos=True)
    plain_logits = model.logits(PROMPT)

    rec = TraceRecorder.for_model(model)
    traced = rec.generate(model, PROMPT, max_tokens=12, ubatch=4, ignore_eos=True)
    with rec.attached(model):
        traced_logits = model.logits(PROMPT)
    assert model.net.routing_hook is None  # detached afterwards
    assert traced.token_ids == plain.token_ids
    assert torch.equal(traced_logits, plain_logits)

    trace = rec.trace()
    # prefill 11 tokens as one stretch (attention in micro-batches of 4, each MoE layer one op),
    # then 11 decode forwards, then the logits call
    assert trace.tokens.tolist() == [11] * 3 + [1] * 33 + [11] * 3
    assert trace.layer.tolist() == [0, 1, 2] * 13
    assert trace.phase.tolist() == [0] * 3 + [1] * 33 + [0] * 3
    assert trace.prefill_tokens() == 22 and trace.decode_tokens() == 11
    h = trace.header
    assert (h.num_experts, h.num_layers, h.moe_layers, h.top_k) == (8, 3, (0, 1, 2), 2)
    assert h.expert_bytes == model.telemetry()["expert_bytes"] == 3 * 64 * 32 * 4

    # The last three ops are the logits call: the reference's router picks the same experts, in rank order.
    with torch.no_grad():
        out = ref(torch.tensor([PROMPT]), output_router_logits=True)
    rows = trace.ids[-33:].reshape(3, 11, 2)  # [layer, T, K]
    for layer, logits in enumerate(out.router_logits):
        expected = torch.topk(logits.reshape(11, 8), 2).indices
        assert rows[layer].tolist() == expected.tolist(), layer


def test_save_load_round_trip_and_format(ckpt, tmp_path):
    _, path = ckpt
    model = load(path)
    rec = TraceRecorder.for_model(model, meta={"note": "test"}, predict=True)
    rec.generate(model, PROMPT, max_tokens=5, ubatch=8, ignore_eos=True)
    trace = rec.trace()
    assert trace.has_predictions and trace.pred.shape == (len(trace.ids), 4)
    f = tmp_path / "t.npz"
    save_trace(trace, f)
    back = load_trace(f)
    assert back.header == trace.header and back.header.meta == {"note": "test"}
    for k in ("layer", "tokens", "phase", "ids", "pred", "predicted", "pred_prob"):
        assert np.array_equal(getattr(back, k), getattr(trace, k)), k
    assert back.ops() == trace.ops()
    assert all(experts == sorted(set(experts)) for _, experts in back.ops())
    assert back.predictions(1.5) == trace.predictions(1.5)
    # the router predictor ranks by its softmax: each token's probabilities fall along its ranks
    prob = back.pred_prob.astype(np.float32)
    assert ((prob >= 0) & (prob <= 1)).all() and (np.diff(prob, axis=1) <= 0).all()
    # --prefetch-min-prob: a token's guess counts only at or above it, hand-checked op by op
    cut = float(np.median(prob))
    ends = np.cumsum(back.tokens)
    expected = []
    for i in range(back.num_ops):
        rows = range(ends[i] - back.tokens[i], ends[i])
        seen = []
        for r in range(3):  # width 1.5 of top-2
            for e in sorted({int(back.pred[t, r]) for t in rows if prob[t, r] >= cut} - set(seen)):
                seen.append(e)
        expected.append(seen or None)
    assert back.predictions(1.5, cut) == expected
    assert back.predictions(1.5, cut) != back.predictions(1.5)
    # the documented on-disk layout (docs/traces.md)
    with np.load(f) as z:
        assert sorted(z.files) == ["header", "ids", "layer", "phase", "pred", "pred_prob", "predicted", "tokens"]
        header = json.loads(str(z["header"][()]))
        assert z["ids"].dtype == np.uint8 and z["layer"].dtype == np.int32
        assert z["pred"].dtype == np.uint8 and z["predicted"].dtype == np.uint8
        assert z["pred_prob"].dtype == np.float16
    assert header == {"format": "expertcache-trace", "version": 3, "num_experts": 8, "num_layers": 3,
                      "moe_layers": [0, 1, 2], "top_k": 2, "expert_bytes": 3 * 64 * 32 * 4,
                      "model": str(path), "meta": {"note": "test"}, "pred_width": 4, "predictor": "router"}
    # without predictions: the same entries, `pred` 0 wide and no op predicted
    plain = TraceRecorder.for_model(model)
    plain.generate(model, PROMPT, max_tokens=3, ignore_eos=True)
    save_trace(plain.trace(), f)
    back = load_trace(f)
    assert not back.has_predictions and back.pred.shape == (len(back.ids), 0)
    assert back.predictions(1.0) == [None] * back.num_ops


def _write(path, header=None, **arrays):
    h = {"format": "expertcache-trace", "version": 1, "num_experts": 4, "num_layers": 2, "moe_layers": [0, 1],
         "top_k": 2, "expert_bytes": 10, "model": "", "meta": {}} | (header or {})
    a = {"layer": np.array([0, 1]), "tokens": np.array([1, 2]), "phase": np.array([0, 0]),
         "ids": np.array([[0, 1], [2, 3], [1, 0]])} | arrays
    np.savez(path, header=np.array(json.dumps(h)), **{k: v for k, v in a.items() if v is not None})
    return path


def _write2(path, header=None, **arrays):
    """A version 2 trace: `_write`'s ops with predictions of width 3 (op 1 not predicted)."""
    a = {"pred": np.array([[1, 2, 0], [3, 1, 2], [0, 0, 0]]), "predicted": np.array([1, 0])} | arrays
    return _write(path, {"version": 2, "pred_width": 3, "predictor": "router"} | (header or {}), **a)


def test_a_hand_written_trace_loads(tmp_path):
    t = load_trace(_write(tmp_path / "ok.npz"))  # version 1: no predictions
    assert t.ops() == [(0, [0, 1]), (1, [0, 1, 2, 3])]
    assert t.header.total_experts == 8
    assert not t.has_predictions and t.header.pred_width == 0 and t.predictions(2.0) == [None, None]
    t = load_trace(_write2(tmp_path / "ok2.npz"))
    assert t.ops() == [(0, [0, 1]), (1, [0, 1, 2, 3])] and t.header.predictor == "router"
    # width 1.0 = top-2: experts 1 and 2 of op 0's token; 1.5 = 3 (all stored); op 1 has none
    assert t.predictions(1.0) == [[1, 2], None] and t.predictions(1.5) == t.predictions(5.0) == [[1, 2, 0], None]
    with pytest.raises(ExpertCacheError, match="needs a trace with the predictions' probabilities"):
        t.predictions(1.0, 0.5)
    # version 3: each guess's probability; --prefetch-min-prob keeps those at or above it
    prob = np.array([[0.9, 0.5, 0.25], [0.8, 0.1, 0.1], [0, 0, 0]], np.float16)
    t = load_trace(_write2(tmp_path / "ok3.npz", {"version": 3}, pred_prob=prob))
    assert t.predictions(1.5, 0.5) == [[1, 2], None] and t.predictions(1.5, 0.6) == [[1], None]
    assert t.predictions(1.5, 0.95) == [None, None] and t.predictions(1.5) == [[1, 2, 0], None]
    assert t.predictions(0) == [None, None]


def test_prediction_quality_by_hand():
    h = TraceHeader(num_experts=8, num_layers=2, moe_layers=(0, 1), top_k=2, expert_bytes=1, pred_width=4)
    # op 0 (layer 0, prefill, 2 tokens) uses {0, 1, 2}; op 1 (layer 1, decode) uses {4, 5};
    # op 2 (layer 1, decode) uses {4, 6}; op 3 (layer 0, decode) has no prediction
    ids = np.array([[0, 1], [2, 1], [4, 5], [6, 4], [0, 1]])
    pred = np.array([[1, 3, 0, 7], [1, 2, 3, 4], [5, 6, 4, 0], [7, 1, 2, 3], [0, 0, 0, 0]])
    trace = Trace(h, np.array([0, 1, 1, 0]), np.array([2, 1, 1, 1]), np.array([0, 1, 1, 1], dtype=np.uint8),
                  ids, pred, np.array([1, 1, 1, 0], dtype=np.uint8))
    pre = prediction_quality(trace, "prefill")
    # width 1.0: tokens' top-2 {1,3} | {1,2} = {1,2,3}: 2 of 3 used were predicted, 2 of 3 predicted used
    # width 2.0: {0,1,2,3,4,7}: 3 of 3 used, 3 of 6 predicted
    assert set(pre) == {0} and pre[0]["ops"] == 1 and pre[0]["used"] == 3
    assert pre[0]["widths"]["1.0"] == {"predicted": 3, "correct": 2, "recall": 2 / 3, "precision": 2 / 3}
    assert pre[0]["widths"]["2.0"] == {"predicted": 6, "correct": 3, "recall": 1.0, "precision": 0.5}
    dec = prediction_quality(trace, "decode")
    # layer 1, width 1.0: op 1 {5,6} vs {4,5}: 1; op 2 {7,1} vs {4,6}: 0 -> recall 1/4, precision 1/4
    # width 1.5 (3): {5,6,4}: 2; {7,1,2}: 0 -> 2/4, 2/6. The unpredicted op 3 of layer 0 is left out.
    assert set(dec) == {1} and dec[1]["ops"] == 2
    assert dec[1]["widths"]["1.0"]["recall"] == 0.25 and dec[1]["widths"]["1.0"]["precision"] == 0.25
    assert dec[1]["widths"]["1.5"]["recall"] == 0.5 and dec[1]["widths"]["1.5"]["precision"] == pytest.approx(1 / 3)
    assert prediction_quality(Trace(h, trace.layer, trace.tokens, trace.phase, ids), None) == {}
    # with probabilities, a floor: width 2.0 (4 per token) keeping guesses at 0.5 or more
    prob = np.array([[0.9, 0.2, 0.6, 0.1], [0.8, 0.5, 0.4, 0.3], [0.7, 0.6, 0.5, 0.1], [0.9, 0.1, 0.1, 0.1],
                     [0, 0, 0, 0]], np.float16)
    floored = Trace(h, trace.layer, trace.tokens, trace.phase, ids, pred, trace.predicted, prob)
    got = prediction_quality(floored, None, widths=(), floors=[(2.0, 0.5)])
    # op 0 keeps {1, 0} | {1, 2} = {0, 1, 2}: 3 of 3 used, 3 of 3 predicted; op 1 keeps {5, 6, 4} vs
    # {4, 5}: 2 of 2, 2 of 3; op 2 keeps {7} vs {4, 6}: 0 of 2, 0 of 1
    assert got[0]["widths"]["2.0,p>=0.5"] == {"predicted": 3, "correct": 3, "recall": 1.0, "precision": 1.0}
    assert got[1]["widths"]["2.0,p>=0.5"] == {"predicted": 4, "correct": 2, "recall": 0.5, "precision": 0.5}


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing.npz", "no such file"),
    (lambda d: d, "is a directory"),
    (lambda d: (d / "text.npz").write_text("hello") and d / "text.npz", "not an expertcache trace"),
    (lambda d: _write(d / "a.npz", ids=None), "missing ids"),
    (lambda d: _write(d / "b.npz", {"format": "other"}), "header format"),
    (lambda d: _write(d / "c.npz", {"version": 4}), "version 4 is not supported"),
    (lambda d: _write2(d / "c8.npz", {"version": 3}, pred_prob=np.full((3, 2), 0.5, np.float16)),
     "'pred_prob' has shape"),
    (lambda d: _write2(d / "c9.npz", {"version": 3}, pred_prob=np.full((3, 3), 0.5)), "must hold float16"),
    (lambda d: _write2(d / "c10.npz", {"version": 3}, pred_prob=np.full((3, 3), 1.5, np.float16)),
     "probabilities in"),
    (lambda d: _write(d / "c2.npz", {"version": 2}), "version 2: missing pred, predicted"),
    (lambda d: _write2(d / "c3.npz", pred=np.array([[1, 2], [3, 1], [0, 0]])), "array 'pred' has shape"),
    (lambda d: _write2(d / "c4.npz", pred=np.array([[1, 9, 0], [3, 1, 2], [0, 0, 0]])), "predicted expert id 9"),
    (lambda d: _write2(d / "c5.npz", pred=np.array([[1, 2, 1], [3, 1, 2], [0, 0, 0]])), "repeat an id"),
    (lambda d: _write2(d / "c6.npz", predicted=np.array([1, 2])), "'predicted' must be 2 flags"),
    (lambda d: _write2(d / "c7.npz", {"pred_width": 9}), "'pred_width' must be an integer in"),
    (lambda d: _write(d / "d.npz", {"top_k": 0}), "'top_k' must be a positive integer"),
    (lambda d: _write(d / "e.npz", {"moe_layers": [1, 0]}), "moe_layers"),
    (lambda d: _write(d / "f.npz", ids=np.array([[0, 1], [2, 4], [1, 0]])), "expert id 4 out of range"),
    (lambda d: _write(d / "g.npz", layer=np.array([0, 2])), "layer 2, which is not a MoE layer"),
    (lambda d: _write(d / "h.npz", tokens=np.array([1, 3])), "route 4 tokens in all but 'ids' has 3 rows"),
    (lambda d: _write(d / "i.npz", tokens=np.array([0, 3])), "routes 0 tokens"),
    (lambda d: _write(d / "j.npz", phase=np.array([0, 2])), "'phase' must be 0"),
    (lambda d: _write(d / "k.npz", ids=np.array([[0.0, 1], [2, 3], [1, 0]])), "must hold integers"),
])
def test_malformed_traces_are_one_line_errors(tmp_path, capsys, make, message):
    path = make(tmp_path)
    with pytest.raises(ExpertCacheError, match=message):
        load_trace(path)
    assert main(["trace", "simulate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("expertcache: error:") and err.count("\n") == 1 and message in err


def test_capacities_parse():
    assert parse_capacities("10%,25%,50%,75%", 128) == [("10%", 12), ("25%", 32), ("50%", 64), ("75%", 96)]
    assert parse_capacities(" 3 , 200,100%", 24) == [("3", 3), ("200", 24)]  # 100% is 24 again: dropped
    assert parse_capacities("0.1%", 24) == [("0.1%", 1)]
    for bad in ("", "abc", "0", "-3", "0%", "150%", "10%%", "5,x"):
        with pytest.raises(ValueError, match="expected a percentage"):
            parse_capacities(bad, 24)


def test_bad_command_line_input_is_one_line(tmp_path, capsys):
    path = str(_write(tmp_path / "ok.npz"))
    for argv, message in [
        (["trace", "simulate", path, "--capacity", "ten"], "capacity 'ten'"),
        (["trace", "simulate", path, "--policy", "lru,mru"], "unknown policy 'mru'"),
        (["trace", "simulate", path, "--plot", str(tmp_path / "x.svg")], "expected a .png"),
        (["trace", "record", "-f", str(tmp_path / "nope.txt"), "-o", str(tmp_path / "o.npz")], "cannot read"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (argv, err)


def test_prompt_files_parse_and_reject_bad_lines():
    items = parse_prompts('{"prompt": "w1 w2"}\n\n{"user": "w3", "max_tokens": 4}\n'
                          '{"messages": [{"role": "user", "content": "w5"}]}\n', "p.jsonl")
    assert [(i["kind"], i["max_tokens"]) for i in items] == [("prompt", None), ("user", 4), ("messages", None)]
    for text, message in [("", "no prompts"), ("{", "p.jsonl:1: not valid JSON"),
                          ('{"prompt": "a", "user": "b"}', "exactly one of"), ('[1]', "exactly one of"),
                          ('{"user": ""}', "non-empty string"), ('{"messages": [{"role": "user"}]}', "list of"),
                          ('{"user": "a", "max_tokens": -1}', "'max_tokens' must be")]:
        with pytest.raises(ExpertCacheError, match=message):
            parse_prompts(text, "p.jsonl")


CONVERSATION = [
    {"kind": "user", "value": "w10 w11 w12 w13 w14 w15 w16", "max_tokens": 6},
    {"kind": "user", "value": "w20 w21 w22", "max_tokens": None},
    {"kind": "prompt", "value": "w30 w31 w32 w33 w34 w35 w36 w37 w38", "max_tokens": 3},
    {"kind": "messages", "value": [{"role": "system", "content": "w40"}, {"role": "user", "content": "w41"}],
     "max_tokens": None},
]


def test_runtime_and_simulator_agree_for_every_policy(ckpt):
    _, path = ckpt
    trace = None
    # 24 experts in all; ops use up to 8 experts of a layer: at 3 and 5 slots prefill ops run in waves
    for policy in POLICIES:
        for capacity in (3, 5, 9, 16):
            model = load(path, cache=CacheConfig(mode="cache", experts=capacity, policy=policy))
            rec = TraceRecorder.for_model(model)
            run_prompts(model, rec, CONVERSATION, max_tokens=8, ubatch=5, ignore_eos=True)
            rec.generate(model, PROMPT * 2, max_tokens=10, ubatch=16, ignore_eos=True)
            t = rec.trace()
            if trace is None:
                trace = t
                assert max(len(e) for _, e in t.ops()) > 5 and t.decode_tokens() == 5 + 7 + 2 + 7 + 9
            # the routing does not depend on the cache
            assert np.array_equal(t.ids, trace.ids) and np.array_equal(t.tokens, trace.tokens)
            total = model.telemetry()["total"]
            sim = simulate(t.ops(), capacity, policy, t.header.expert_bytes)
            got = (sim.hits, sim.misses, sim.evictions, sim.bytes_moved, sim.copy_ranges, sim.ops)
            want = (total["resident_hits"], total["resident_misses"], total["evictions"],
                    total["copied_bytes"], total["copy_ranges"], total["ops_seen"])
            assert got == want, (policy, capacity)


def test_compare_puts_each_policy_next_to_min():
    # capacity 2, ops {0,1,2} {0,1,2} {0,2}: Belady's docstring example, where MIN (5 misses) loses to LRU (4)
    ops = [(0, [0, 1, 2]), (0, [0, 1, 2]), (0, [0, 2])]
    rows = compare(ops, [2, 3], ["lru"], expert_bytes=7)
    assert [(r.result.policy, r.result.capacity, r.result.misses, r.waved_ops) for r in rows] == [
        ("belady", 2, 5, 2), ("lru", 2, 4, 2), ("belady", 3, 3, 0), ("lru", 3, 3, 0)]
    assert rows[1].misses_vs_belady == pytest.approx(4 / 5)
    assert rows[1].noncompulsory_vs_belady == pytest.approx(1 / 2)  # 3 first uses
    assert rows[3].noncompulsory_vs_belady == 1.0  # 0 / 0: both avoid everything avoidable
    d = rows[1].as_dict()
    assert d["bytes_moved"] == 28 and d["belady_misses"] == 5 and d["waved_ops"] == 2


def test_popularity_and_reuse_distances_by_hand():
    h = TraceHeader(num_experts=4, num_layers=2, moe_layers=(0, 1), top_k=1, expert_bytes=1)
    # layer 0 ops use experts 0, 0, 1, 0 ; layer 1 ops use 3, 3 (interleaved)
    layer = np.array([0, 1, 0, 1, 0, 0])
    trace = Trace(h, layer, np.ones(6, dtype=np.int32), np.array([0, 0, 1, 1, 1, 1], dtype=np.uint8),
                  np.array([[0], [3], [0], [3], [1], [0]]))
    pop = popularity(trace)
    assert pop[0]["uses"] == 4 and pop[0]["top10_share"] == 0.75 and pop[0]["top25_share"] == 0.75
    # the top 10% / 25% of a layer, rounded up: 1 / 1 of 4 experts, 4 / 8 of 32, 13 / 32 of 128
    assert top_counts(4) == (1, 1) and top_counts(32) == (4, 8) and top_counts(128) == (13, 32)
    assert pop[0]["entropy_bits"] == pytest.approx(-(0.75 * np.log2(0.75) + 0.25 * np.log2(0.25)))
    assert pop[1]["entropy_bits"] == 0.0 and pop[1]["unused_experts"] == 3
    d = reuse_distances(trace)
    assert sorted(d[0].tolist()) == [1, 2] and d[1].tolist() == [1]  # expert 0: ops 0 -> 1 -> 3 of layer 0
    assert reuse_distances(trace, "decode")[0].tolist() == [2]  # within decode: ops 0, 2 of layer 0


def test_command_line_record_simulate_stats(ckpt, tmp_path, capsys):
    _, path = ckpt
    prompts = tmp_path / "conv.jsonl"
    prompts.write_text('{"user": "w10 w11 w12"}\n{"user": "w13 w14", "max_tokens": 3}\n')
    out = tmp_path / "conv.npz"
    assert main(["trace", "record", "-m", str(path), "--prompts", str(prompts), "-n", "5", "--ignore-eos",
                 "--ubatch", "4", "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    t = load_trace(out)
    assert t.decode_tokens() == 4 + 2 and t.header.meta["kind"] == "prompts"

    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i}" for i in range(40)))
    out2 = tmp_path / "text.npz"
    assert main(["trace", "record", "-m", str(path), "-f", str(text), "--max-prompt-tokens", "30", "-n", "4",
                 "--ignore-eos", "-o", str(out2)]) == 0
    capsys.readouterr()
    assert load_trace(out2).prefill_tokens() == 30

    png = tmp_path / "p.png"
    assert main(["trace", "simulate", str(out), "--capacity", "25%,12", "--plot", str(png)]) == 0
    lines = capsys.readouterr().out.splitlines()
    result = json.loads(lines[-1])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    got = [(r["policy"], r["capacity"], r["default"]) for r in result["results"]]
    assert got[:2] == [("belady", 6, False), ("lru", 6, DEFAULT_POLICY == "lru")]
    assert len(got) == 2 * (1 + len(POLICIES)) and sum(r["default"] for r in result["results"]) == 2
    assert any(f"{DEFAULT_POLICY}*" in line for line in lines)

    assert main(["trace", "stats", str(out), "--phase", "decode"]) == 0
    stats = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert set(stats["layers"]) == {"0", "1", "2"} and stats["layers"]["0"]["uses"] > 0
    # predictions are recorded by default: quality per phase, prefetch replayed beside each policy
    assert t.has_predictions and t.header.pred_width == 4
    assert set(stats["prediction"]) == {"decode"}
    q = stats["prediction"]["decode"]["1"]["widths"]
    assert set(q) == {"1.0", "1.5", "2.0"} and 0 <= q["1.0"]["recall"] <= q["2.0"]["recall"] <= 1
    assert main(["trace", "stats", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert set(json.loads(lines[-1])["prediction"]) == {"prefill", "decode"}
    assert any(line.startswith("prediction (router predictor)") for line in lines)

    assert main(["trace", "simulate", str(out), "--capacity", "25%", "--policy", "lru,lrfu", "--prefetch",
                 "--prefetch-width", "1.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    result = json.loads(lines[-1])
    assert result["prefetch_width"] == 1.5
    rows = [(r["policy"], r["prefetch"]) for r in result["results"]]
    assert rows == [("belady", False), ("lru", False), ("lru", True), ("lrfu", False), ("lrfu", True)]
    pf = result["results"][2]
    want = simulate(t.ops(), 6, "lru", t.header.expert_bytes, t.predictions(1.5))
    assert (pf["misses"], pf["prefetch_issued"], pf["prefetch_used"], pf["prefetch_wasted"]) == (
        want.misses, want.prefetch_issued, want.prefetch_used, want.prefetch_wasted) and want.prefetch_issued > 0
    assert any("lru+pf" in line for line in lines)
    # with a probability floor: the replay drops the guesses below it, and stats reports that setting
    assert main(["trace", "simulate", str(out), "--capacity", "25%", "--policy", "lrfu", "--prefetch",
                 "--prefetch-width", "2", "--prefetch-min-prob", "0.2"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    pf = result["results"][2]
    want = simulate(t.ops(), 6, "lrfu", t.header.expert_bytes, t.predictions(2.0, 0.2))
    assert result["prefetch_min_prob"] == 0.2 and t.predictions(2.0, 0.2) != t.predictions(2.0)
    assert (pf["misses"], pf["prefetch_issued"]) == (want.misses, want.prefetch_issued)
    assert main(["trace", "stats", str(out), "--prefetch-width", "2", "--prefetch-min-prob", "0.2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    q = json.loads(lines[-1])["prediction"]["decode"]["1"]["widths"]
    assert set(q) == {"1.0", "1.5", "2.0", "2.0,p>=0.2"} and q["2.0,p>=0.2"]["predicted"] < q["2.0"]["predicted"]
    assert any("R@2,p0.2" in line for line in lines)

    out3 = tmp_path / "plain.npz"
    assert main(["trace", "record", "-m", str(path), "-f", str(text), "-n", "2", "--no-predictions",
                 "-o", str(out3)]) == 0
    capsys.readouterr()
    assert not load_trace(out3).has_predictions
    assert main(["trace", "simulate", str(out3), "--prefetch"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--prefetch needs a trace with predictions" in err
    with pytest.raises(SystemExit) as e:
        main(["trace", "simulate", str(out), "--prefetch-width", "-1"])
    assert e.value.code == 2 and "must be in [0, 64]" in capsys.readouterr().err


def test_a_floor_on_a_trace_without_probabilities_is_one_line_before_anything_runs(tmp_path, capsys):
    # A version 2 trace (predictions without probabilities) cannot be replayed at a floor: `trace
    # simulate`, `trace stats` and `bench cache` say so in one line, bench cache before its first run.
    import expertcache

    model = str(Path(expertcache.__file__).parent / "assets" / "tiny-qwen3-moe")
    v2 = _write2(tmp_path / "v2.npz")
    for argv in (["trace", "simulate", str(v2), "--prefetch", "--prefetch-min-prob", "0.5"],
                 ["trace", "stats", str(v2), "--prefetch-min-prob", "0.5"],
                 ["bench", "cache", "-m", model, "--stores", "ram", "--route-trace", str(v2), "--prefetch", "on",
                  "--prefetch-min-prob", "0.5"]):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "needs a trace with the predictions' probabilities" in err, (argv, err)


def test_settings_that_would_be_ignored_are_one_line_errors(tmp_path, capsys, monkeypatch):
    # A setting nothing reads was taken without a word: the prefetch width or floor of `simulate`
    # without --prefetch, the width of `stats` without a floor (its columns are always 1, 1.5, 2),
    # a floor on a trace without predictions, an infinite ridge (maps that predict nothing).
    v1, v2 = str(_write(tmp_path / "v1.npz")), str(_write2(tmp_path / "v2.npz"))
    for argv, message in [
        (["trace", "simulate", v2, "--prefetch-width", "2"], "add --prefetch"),
        (["trace", "simulate", v2, "--prefetch-min-prob", "0.5"], "add --prefetch"),
        (["trace", "stats", v2, "--prefetch-width", "2"], "add --prefetch-min-prob"),
        (["trace", "stats", v1, "--prefetch-min-prob", "0.5"], "needs a trace with predictions"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (argv, err)
    assert main(["trace", "simulate", v2, "--prefetch", "--prefetch-width", "2", "--capacity", "2"]) == 0
    capsys.readouterr()
    text = tmp_path / "t.txt"
    text.write_text("w1 w2")
    with pytest.raises(SystemExit) as e:
        main(["trace", "fit-predictor", "-f", str(text), "--ridge", "inf", "-o", str(tmp_path / "p.safetensors")])
    assert e.value.code == 2 and "'inf' is not a finite number" in capsys.readouterr().err

    # --held-out 0: no recall to report, said in words rather than as a table with no rows
    import expertcache.models.linear_predictor as lp

    class Maps:
        meta: dict = {}

        def save(self, path):
            Path(path).write_bytes(b"maps")

    monkeypatch.setattr(lp, "split_tokens", lambda *a, **k: (1, 0))
    monkeypatch.setattr(lp, "fit", lambda model, ids, **k: (Maps(), {"fit_tokens": len(ids), "held_out_tokens": 0,
                                                                       "layers": {}}))
    assert main(["trace", "fit-predictor", "-f", str(text), "--held-out", "0",
                 "-o", str(tmp_path / "p.safetensors")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "no tokens held out (--held-out 0): recall not measured" in lines[0] and lines[1].startswith("wrote")
    assert json.loads(lines[-1])["held_out_tokens"] == 0
