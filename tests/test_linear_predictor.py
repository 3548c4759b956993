"""The fitted predictor (`trace fit-predictor`, `--predictor`): what it fits on is the model's own
routing, its maps are the least-squares solution of that data, it predicts the bundled model's
held-out routing better than the routers, the runtime and traces use it without changing a
logit, and a file fitted for another model or a broken one is a one-line error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import expertcache
from expertcache import CacheConfig, ExpertCacheError
from expertcache.bench.simulate import simulate
from expertcache.bench.trace import TraceRecorder
from expertcache.models import linear_predictor
from expertcache.models.linear_predictor import LinearMaps, _Collector, _train_used, fit, fit_used
from expertcache.models.predict import embedded, rank_experts, router_input
from conftest import VOCAB, assert_one_line_error, run_cli

ASSETS = Path(expertcache.__file__).parent / "assets"
BUNDLED_MAPS = ASSETS / "tiny-qwen3-moe.predictor.safetensors"
BUNDLED_USED = ASSETS / "tiny-qwen3-moe.predictor-used.safetensors"
IDS = torch.randint(4, VOCAB, (40,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A tiny Qwen2-MoE with dense layers between MoE ones (layers 1 and 3), saved as a checkpoint."""
    from conftest import build_reference, save_checkpoint, tiny_config

    ref = build_reference(tiny_config("qwen2_moe", experts=16, top_k=4, layers=4, dense=True), seed=7)
    return save_checkpoint(ref, tmp_path_factory.mktemp("lp") / "qwen2")


def test_collected_logits_are_the_routing_and_features_what_the_predictor_sees(qwen2):
    model = expertcache.load(qwen2)
    net = model.net
    collect, routed = _Collector(net), {}
    net.residual_hook, net.forward_hook = collect, collect.begin
    net.routing_hook = lambda layer, routing: routed.__setitem__(layer, routing.ids.clone())
    model.logits(IDS)
    moe = list(model.cfg.moe_layers)
    assert moe == [1, 3]
    taken = collect.take()
    for layer in moe:  # the fitted targets rank the experts exactly as the forward routed them
        got = rank_experts(taken[layer][1], model.cfg.top_k)
        assert torch.equal(got.sort(-1).values, routed[layer].sort(-1).values)
    want_first = router_input(net, 1, embedded(net, IDS)).float()
    assert torch.equal(taken[1][0], want_first)  # the first MoE layer: from the embeddings
    assert taken[3][0].shape == (len(IDS), model.cfg.hidden_size)


def test_a_piece_longer_than_the_prefill_stretch_hands_over_all_its_tokens(qwen2):
    """`Model.logits` runs a piece longer than the prefill stretch as one forward per stretch: the
    features and logits the fit gets are still every token's, in order, as where one stretch holds
    the whole piece (they were the last stretch's alone: 4 of 100 rows here)."""
    ids = torch.randint(4, VOCAB, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    got = {}
    for stretch in (4096, 32):
        model = expertcache.load(qwen2, prefill_stretch=stretch)
        pieces = got[stretch] = []
        linear_predictor._run_over(model, ids, 100, 100, lambda fitting, layer, x, y: pieces.append((fitting, layer, x, y)),
                                   None)
        assert [(f, layer, x.shape[0], y.shape[0]) for f, layer, x, y in pieces] == [
            (True, 1, 100, 100), (True, 3, 100, 100), (False, 1, 100, 100), (False, 3, 100, 100)]
    for (_, _, x, y), (_, _, x32, y32) in zip(got[4096], got[32]):
        # Stretches of 32 group the MoE products otherwise: the same values within rounding.
        torch.testing.assert_close(x32, x, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(y32, y, rtol=1e-4, atol=1e-4)


def test_fit_is_the_least_squares_solution_and_held_out_recall_is_measured(qwen2, monkeypatch):
    monkeypatch.setattr(linear_predictor, "MIN_FIT_TOKENS", 100)  # a short text, so that the test is quick
    model = expertcache.load(qwen2)
    ids = torch.randint(4, VOCAB, (600,), generator=torch.Generator().manual_seed(9)).tolist()
    # The same data collected independently (one forward per chunk), solved with lstsq.
    net = model.net
    collect = _Collector(net)
    xs, ys = {1: [], 3: []}, {1: [], 3: []}
    net.residual_hook, net.forward_hook = collect, collect.begin
    for s in range(0, 500, 100):
        model.logits(ids[s:s + 100])
        for layer, (x, y) in collect.take().items():
            xs[layer].append(x)
            ys[layer].append(y)
    net.residual_hook = net.forward_hook = None
    maps, report = fit(model, ids, chunk=100, ridge=0.0, held_out=100 / 600)
    assert report["fit_tokens"] == 500 and report["held_out_tokens"] == 100
    for layer in xs:
        x = torch.cat(xs[layer]).double()
        x1 = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
        want = torch.linalg.lstsq(x1, torch.cat(ys[layer]).double()).solution.float()  # [D + 1, E]
        torch.testing.assert_close(maps.weight[layer], want[:-1].T, atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(maps.bias[layer], want[-1], atol=2e-3, rtol=1e-3)
        r = report["layers"][str(layer)]
        assert 0 <= r["router"] <= 1 and 0 <= r["linear"] <= 1
    assert net.residual_hook is None and net.forward_hook is None  # the fit put the hooks back


def _held_out(model, tokens: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The bundled model run over the first `tokens` of its held-out text: each MoE layer's
    predictor inputs and router logits (`_Collector.take`)."""
    net = model.net
    collect = _Collector(net)
    net.residual_hook, net.forward_hook = collect, collect.begin
    model.logits(model.tokenizer.encode((ASSETS / "heldout.txt").read_text())[:tokens])
    net.residual_hook = net.forward_hook = None
    return collect.take()


def test_bundled_predictor_beats_the_routers_on_held_out_text():
    """The committed maps (fitted on standard-library modules the model was trained on) against
    the routers, on the held-out text's actual routing: recall at width 1.0 per layer."""
    model = expertcache.load(None)
    maps = LinearMaps.load(BUNDLED_MAPS)
    maps.check(model.net)
    net, K = model.net, model.cfg.top_k
    collect = _held_out(model, 2048)
    for layer in model.cfg.moe_layers:
        x, used = collect[layer][0], rank_experts(collect[layer][1], K)
        by_router = rank_experts(x @ net.weights.layers[layer].router.float().T, K)
        by_maps = rank_experts(torch.addmm(maps.bias[layer], x, maps.weight[layer].T), K)
        recall = [float((r.unsqueeze(-1) == used.unsqueeze(1)).any(1).sum()) / used.numel()
                  for r in (by_router, by_maps)]
        assert recall[1] > recall[0] + 0.02, (layer, recall)
        if layer == model.cfg.moe_layers[0]:
            assert recall[1] > 0.8 > 0.5 > recall[0], recall  # from the embeddings alone


def test_runtime_and_traces_use_the_maps_and_logits_do_not_change():
    resident = expertcache.load(None, cache=CacheConfig(mode="resident"))
    want = resident.logits(IDS)
    model = expertcache.load(None, cache=CacheConfig(fraction=0.25, prefetch="on", predictor=str(BUNDLED_MAPS)))
    assert model.experts.predict.own.name == f"linear:{BUNDLED_MAPS.name}"
    # A trace recorded with the maps names them and holds their ranking (for the first MoE layer,
    # the maps applied to the prompt's embeddings), and the runtime prefetched exactly what the
    # simulator replays from it.
    rec = TraceRecorder.for_model(model, predict=True)
    with rec.attached(model):
        for _ in range(2):
            assert torch.equal(model.logits(IDS), want)
    rec.generate(model, IDS[:5].tolist(), max_tokens=4, ignore_eos=True)
    trace = rec.trace()
    total = model.telemetry()["total"]
    sim = simulate(trace.ops(), model.experts.capacity, "lrfu", trace.header.expert_bytes, trace.predictions(1.0))
    assert sim.prefetch_issued > 0 and sim.prefetch_used > 0
    assert (total["demand_misses"], total["prefetch_issued"], total["prefetch_used"], total["prefetch_wasted"]) == (
        sim.misses, sim.prefetch_issued, sim.prefetch_used, sim.prefetch_wasted)
    assert trace.header.predictor == f"linear:{BUNDLED_MAPS.name}"
    maps, first = model.predictor_maps, model.cfg.moe_layers[0]
    x = router_input(model.net, first, embedded(model.net, IDS)).float()
    ranked = rank_experts(torch.addmm(maps.bias[first], x, maps.weight[first].T), trace.header.pred_width)
    assert torch.equal(torch.as_tensor(trace.pred[: len(IDS)]).long(), ranked)


def test_maps_for_another_model_and_broken_files_are_one_line_errors(qwen2, tmp_path, capsys):
    with pytest.raises(ExpertCacheError, match="fitted on another model|maps for MoE layers"):
        expertcache.load(qwen2, cache=CacheConfig(fraction=0.5, predictor=str(BUNDLED_MAPS)))
    maps = LinearMaps.load(BUNDLED_MAPS)
    other = LinearMaps({k: v + 0.5 for k, v in maps.weight.items()}, maps.bias, "0" * 64, name="other")
    other.save(tmp_path / "other.safetensors")
    code, err = run_cli(capsys, "run", "-p", "hi", "-n", "1", "--cache-fraction", "0.5",
                        "--predictor", str(tmp_path / "other.safetensors"))
    assert_one_line_error(code, err, "fitted on another model", "fit-predictor")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    code, err = run_cli(capsys, "run", "-p", "hi", "-n", "1", "--predictor", str(tmp_path / "junk.safetensors"))
    assert_one_line_error(code, err, "junk.safetensors", "not a safetensors file")
    code, err = run_cli(capsys, "run", "-p", "hi", "-n", "1", "--predictor", str(tmp_path / "none.safetensors"))
    assert_one_line_error(code, err, "none.safetensors", "no such file")


def test_a_failed_save_leaves_what_was_there(tmp_path, monkeypatch):
    maps = LinearMaps.load(BUNDLED_MAPS)
    path = tmp_path / "p.safetensors"
    path.write_bytes(b"earlier")

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", broken)
    with pytest.raises(OSError):
        maps.save(path)
    assert path.read_bytes() == b"earlier" and sorted(p.name for p in tmp_path.iterdir()) == ["p.safetensors"]


def test_fit_predictor_command(tmp_path, capsys):
    text = (ASSETS / "heldout.txt").read_text()[:40_000]
    (tmp_path / "t.txt").write_text(text)
    out = tmp_path / "p.safetensors"
    code, _ = run_cli(capsys, "trace", "fit-predictor", "-f", str(tmp_path / "t.txt"), "-n", "6000",
                      "--chunk", "1000", "-o", str(out), "-t", "1")
    assert code == 0
    maps = LinearMaps.load(out)
    assert maps.meta["fit_tokens"] + maps.meta["held_out_tokens"] == 6000 and maps.meta["text"].endswith("t.txt")
    maps.check(expertcache.load(None).net)
    code, err = run_cli(capsys, "trace", "fit-predictor", "-f", str(tmp_path / "t.txt"), "-n", "100",
                        "-o", str(tmp_path / "q.safetensors"))
    assert_one_line_error(code, err, "tokens to fit on")
    assert not (tmp_path / "q.safetensors").exists()


def rewrite_router(path: Path) -> None:
    """Rewrite the checkpoint at `path` with layer 0's router changed (its rows reversed)."""
    from safetensors.torch import load_file, save_file

    f = next(path.glob("*.safetensors"))
    tensors = load_file(f)
    name = next(k for k in tensors if k.endswith("layers.0.mlp.gate.weight"))
    tensors[name] = tensors[name].flip(0).contiguous()
    f.unlink()
    save_file(tensors, f, metadata={"format": "pt"})


def test_a_reload_with_other_routers_falls_back_to_the_routers(tmp_path, capsys):
    import shutil

    path = shutil.copytree(ASSETS / "tiny-qwen3-moe", tmp_path / "m")
    model = expertcache.load(path, cache=CacheConfig(fraction=0.25, prefetch="on", predictor=str(BUNDLED_MAPS)))
    model.logits(IDS)
    assert model.experts.predict.own.name.startswith("linear:")
    # The checkpoint rewritten with one router changed: the maps no longer fit; the model reloads,
    # says so once, and predicts with the routers; the logits are the new weights' own.
    rewrite_router(path)
    capsys.readouterr()
    got = model.logits(IDS)
    err = capsys.readouterr().err
    assert err.count("fitted on another model") == 1 and "the routers predict" in err
    assert model.predictor_maps is None and model.experts.predict.own.name == "router"
    assert torch.equal(got, expertcache.load(path, cache=CacheConfig(mode="resident")).logits(IDS))


# ---- maps of use (--objective used) -------------------------------------------------------------


def _multi_hot(used: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.zeros(len(used), experts).scatter_(1, used, 1.0)


@pytest.mark.parametrize("hidden", [0, 32])
def test_maps_of_use_learn_a_known_routing_from_unstandardised_inputs(hidden):
    """Routing drawn from a known linear rule on inputs far from standardised (offsets, scales):
    the trained maps, with the standardisation folded into their first layer, rank the held-out
    tokens' experts as the rule does, and their probabilities add up to about top-k per token."""
    gen = torch.Generator().manual_seed(0)
    D, E, K, N = 12, 8, 2, 6000
    x = torch.randn(N, D, generator=gen) * torch.linspace(0.5, 3, D) + torch.linspace(-2, 2, D)
    used = rank_experts(x @ torch.randn(E, D, generator=gen).T, K)  # [N, K]
    got = _train_used(x[:5000], _multi_hot(used[:5000], E), hidden, 60, 3e-2, 250, gen, lambda: None)
    if hidden:
        maps = LinearMaps({0: got[2]}, {0: got[3]}, "", output="used", hidden_weight={0: got[0]},
                          hidden_bias={0: got[1]})
    else:
        maps = LinearMaps({0: got[0]}, {0: got[1]}, "", output="used")
    scores = maps.scores(0, x[5000:])
    recall = float((rank_experts(scores, K).unsqueeze(-1) == used[5000:].unsqueeze(1)).any(1).sum()) / (1000 * K)
    assert recall > 0.85, recall  # chance: 0.25
    total = maps.probabilities(scores).sum(-1)  # [T]: calibrated, about K
    assert abs(float(total.mean()) - K) < 0.2, float(total.mean())


def test_fit_used_maps_round_trip_and_the_runtime_records_their_probabilities(qwen2, tmp_path, monkeypatch):
    monkeypatch.setattr(linear_predictor, "MIN_FIT_TOKENS", 100)
    model = expertcache.load(qwen2)
    ids = torch.randint(4, VOCAB, (600,), generator=torch.Generator().manual_seed(9)).tolist()
    maps, report = fit_used(model, ids, chunk=100, hidden=16, epochs=3, held_out=100 / 600)
    assert report["fit_tokens"] == 500 and report["objective"] == "used" and report["hidden"] == 16
    for layer in (1, 3):
        r = report["layers"][str(layer)]
        assert all(0 <= r[k] <= 1 for k in ("router", "linear", "recall_p50", "precision_p50")), r
        assert maps.hidden_weight[layer].shape == (16, model.cfg.hidden_size)
        assert maps.weight[layer].shape == (model.cfg.num_experts, 16)
    path = tmp_path / "used.safetensors"
    maps.save(path)
    back = LinearMaps.load(path)
    assert back.output == "used" and back.meta["objective"] == "used"
    x = torch.randn(5, model.cfg.hidden_size)
    for layer in (1, 3):
        assert torch.equal(back.scores(layer, x), maps.scores(layer, x))
    # In the runtime: the trace records each guess's probability, the sigmoid of the maps' score
    # (for the first MoE layer, from the prompt's embeddings), and the replay at --prefetch-min-prob
    # counts what the runtime did; the logits are the all-resident ones.
    want = expertcache.load(qwen2, cache=CacheConfig(mode="resident")).logits(IDS)
    run = expertcache.load(qwen2, cache=CacheConfig(experts=10, prefetch="on", prefetch_width=2.0,
                                                    prefetch_min_prob=0.3, predictor=str(path)))
    rec = TraceRecorder.for_model(run, predict=True)
    with rec.attached(run):
        assert torch.equal(run.logits(IDS), want)
    rec.generate(run, IDS[:5].tolist(), max_tokens=4, ignore_eos=True)
    trace = rec.trace()
    first = run.cfg.moe_layers[0]
    scores = back.scores(first, router_input(run.net, first, embedded(run.net, IDS)).float())
    ranked = rank_experts(scores, trace.header.pred_width)
    assert torch.equal(torch.as_tensor(trace.pred[: len(IDS)]).long(), ranked)
    probs = torch.sigmoid(scores).gather(1, ranked).half()
    assert torch.equal(torch.as_tensor(trace.pred_prob[: len(IDS)]), probs)
    total = run.telemetry()["total"]
    sim = simulate(trace.ops(), run.experts.capacity, "lrfu", trace.header.expert_bytes, trace.predictions(2.0, 0.3))
    assert (total["demand_misses"], total["prefetch_issued"], total["prefetch_used"], total["prefetch_wasted"]) == (
        sim.misses, sim.prefetch_issued, sim.prefetch_used, sim.prefetch_wasted)


def test_bundled_maps_of_use_are_calibrated_on_held_out_text():
    """The committed maps of use on the held-out text's actual routing: in each band of
    probability, the share of guesses that are used is close to the probability given, and the
    guesses at 0.5 or more are right more often than the linear maps' top-k."""
    model = expertcache.load(None)
    maps = LinearMaps.load(BUNDLED_USED)
    maps.check(model.net)
    linear = LinearMaps.load(BUNDLED_MAPS)
    K = model.cfg.top_k
    collect = _held_out(model, 4096)
    for layer in model.cfg.moe_layers:
        x, used = collect[layer][0], rank_experts(collect[layer][1], K)
        hot = _multi_hot(used, model.cfg.num_experts).bool()
        p = maps.probabilities(maps.scores(layer, x))
        for lo, hi in ((0.1, 0.3), (0.3, 0.5), (0.5, 0.7), (0.7, 0.9), (0.9, 1.0)):
            band = (p >= lo) & (p < hi) if hi < 1 else p >= lo
            assert int(band.sum()) > 100, (layer, lo)
            assert abs(float(hot[band].float().mean()) - float(p[band].mean())) < 0.08, (layer, lo)
        chosen = p >= 0.5
        precision = float(hot[chosen].float().mean())
        by_linear = rank_experts(linear.scores(layer, x), K)
        linear_precision = float((by_linear.unsqueeze(-1) == used.unsqueeze(1)).any(1).sum()) / used.numel()
        assert precision > linear_precision + 0.03, (layer, precision, linear_precision)


def test_fit_predictor_command_objective_used(tmp_path, capsys):
    text = (ASSETS / "heldout.txt").read_text()[:40_000]
    (tmp_path / "t.txt").write_text(text)
    out = tmp_path / "u.safetensors"
    code, _ = run_cli(capsys, "trace", "fit-predictor", "-f", str(tmp_path / "t.txt"), "-n", "6000", "--chunk",
                      "1000", "--objective", "used", "--hidden", "8", "--epochs", "2", "-o", str(out), "-t", "1")
    assert code == 0
    maps = LinearMaps.load(out)
    assert maps.output == "used" and maps.meta["hidden"] == 8 and maps.meta["epochs"] == 2
    maps.check(expertcache.load(None).net)
    code, err = run_cli(capsys, "trace", "fit-predictor", "-f", str(tmp_path / "t.txt"), "--objective", "none",
                        "-o", str(tmp_path / "q.safetensors"))
    assert code == 2 and "invalid choice: 'none'" in err
    assert not (tmp_path / "q.safetensors").exists()


def test_fit_used_refuses_what_memory_cannot_hold(tmp_path, capsys, monkeypatch):
    # The inputs it keeps to train on (tokens x MoE layers x (hidden + top-k) x 2 bytes) against
    # what the machine has free: a one-line error before the model runs, and no file.
    monkeypatch.setattr(linear_predictor, "_free_memory", lambda: 10 * 2**20)
    (tmp_path / "t.txt").write_text((ASSETS / "heldout.txt").read_text()[:40_000])
    code, err = run_cli(capsys, "trace", "fit-predictor", "-f", str(tmp_path / "t.txt"), "-n", "8192",
                        "--objective", "used", "-o", str(tmp_path / "u.safetensors"))
    # 7,373 tokens fitted x 4 layers x (256 + 4) x 2 bytes = 14.6 MiB > 0.8 x 10 MiB
    assert_one_line_error(code, err, "7,373 tokens", "15 MiB of inputs", "10 MiB are free", "give fewer tokens (-n)")
    assert not (tmp_path / "u.safetensors").exists()


def test_training_is_seeded_and_leaves_the_callers_random_state(monkeypatch):
    x = torch.randn(200, 6, generator=torch.Generator().manual_seed(0))
    target = (x[:, :4] > 0).float()
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    # A GPU's generators are not reseeded either (fork_rng restores only the CPU's here).
    reseeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", reseeded.append)
    first = _train_used(x, target, 8, 2, 1e-2, 50, torch.Generator().manual_seed(0), lambda: None)
    assert torch.equal(torch.rand(3), want)  # the global generator did not move
    assert reseeded == []
    again = _train_used(x, target, 8, 2, 1e-2, 50, torch.Generator().manual_seed(0), lambda: None)
    other = _train_used(x, target, 8, 2, 1e-2, 50, torch.Generator().manual_seed(1), lambda: None)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0])
