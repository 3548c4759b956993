"""The next-layer predictor: each architecture's router input is reproduced exactly (the
prediction of a layer from its own input is its routing), predictions match a hand computation,
and predicting changes no output."""

import pytest
import torch

from expertcache import load
from expertcache.bench.trace import TraceRecorder
from expertcache.errors import ExpertCacheError
from expertcache.models.predict import RouterPredictor, op_prediction, rank_experts, router_probs, width_experts

PROMPT = [5, 9, 17, 33, 4, 60, 71, 12, 90, 101, 23]


def test_op_prediction_and_width_by_hand():
    ranked = [[3, 1, 7, 0], [1, 5, 3, 2]]  # two tokens, best first
    assert op_prediction(ranked, 1) == [1, 3]  # rank 1 of each, by id
    assert op_prediction(ranked, 2) == [1, 3, 5]  # then rank 2's new ones: 1 is there already
    assert op_prediction(ranked, 4) == [1, 3, 5, 7, 0, 2]
    assert op_prediction(ranked, 0) == []
    assert [width_experts(w, 4, 8) for w in (0, 1.0, 1.5, 1.3, 2.0, 3.0)] == [0, 4, 6, 6, 8, 8]
    assert width_experts(1.5, 3, 6) == 5  # ceil(4.5)
    with pytest.raises(ExpertCacheError, match="prefetch width"):
        width_experts(-1, 4, 8)


def _capture(model, prompt):
    """Each layer's residual after its mixer, and each MoE op's routing, for one forward."""
    hs, ids = {}, {}
    model.net.residual_hook = lambda layer, h: hs.__setitem__(layer, h.clone())
    model.net.routing_hook = lambda layer, r: ids.__setitem__(layer, r.ids.clone())
    try:
        model.logits(prompt)
    finally:
        model.net.residual_hook = model.net.routing_hook = None
    return hs, ids


def _qwen(arch, tmp_path, layers=3, **kw):
    from conftest import build_reference, save_checkpoint, tiny_config

    ref = build_reference(tiny_config(arch, experts=8, top_k=2, layers=layers, **kw), seed=5)
    return save_checkpoint(ref, tmp_path / arch)


def _gemma(tmp_path):
    from conftest import save_checkpoint
    from test_gemma4 import build

    return save_checkpoint(build(seed=1), tmp_path / "gemma4", fused=True)


@pytest.mark.parametrize("make", [lambda p: _qwen("qwen3_moe", p), lambda p: _qwen("qwen2_moe", p, 4, dense=True),
                                  _gemma], ids=["qwen3_moe", "qwen2_moe-dense-layer", "gemma4"])
def test_router_probs_of_a_layers_own_input_is_its_routing(make, tmp_path):
    model = load(make(tmp_path))
    hs, ids = _capture(model, PROMPT)
    moe = list(model.cfg.moe_layers)
    assert sorted(ids) == moe and len(moe) >= 2
    for layer in moe:
        got = rank_experts(router_probs(model.net, layer, hs[layer]), model.cfg.top_k)
        assert torch.equal(got, ids[layer]), layer
    dense = [i for i in range(model.cfg.num_layers) if i not in moe]
    for layer in dense:
        with pytest.raises(ExpertCacheError, match="no router"):
            router_probs(model.net, layer, hs[layer])


def test_recorded_predictions_match_a_hand_computation(tmp_path):
    model = load(_qwen("qwen3_moe", tmp_path))  # fp32
    hs, ids = _capture(model, PROMPT)
    rec = TraceRecorder.for_model(model, predict=True)
    with rec.attached(model):
        model.logits(PROMPT)
    trace = rec.trace()
    w, eps, P = model.net.weights, model.cfg.rms_norm_eps, trace.header.pred_width
    assert P == 4 and trace.header.predictor == "router" and trace.predicted.tolist() == [1, 1, 1]

    def by_hand(layer, h):
        x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.layers[layer].post_norm
        return torch.topk(x @ w.layers[layer].router.T, P).indices

    T = len(PROMPT)
    pred = torch.from_numpy(trace.pred.astype("int64")).view(3, T, P)
    # layer 0 from the embeddings; layers 1 and 2 from the residual after the previous layer's mixer
    assert torch.equal(pred[0], by_hand(0, w.embed[torch.tensor(PROMPT)]))
    assert torch.equal(pred[1], by_hand(1, hs[0]))
    assert torch.equal(pred[2], by_hand(2, hs[1]))
    # the prediction of layer 0 from its embeddings alone is not its routing, but close
    assert not torch.equal(pred[0, :, :2], ids[0])


@pytest.mark.parametrize("path", ["bundled", "gemma4"])
def test_predicting_changes_no_output(path, tmp_path):
    model = load(None if path == "bundled" else _gemma(tmp_path))
    plain = model.generate(PROMPT, max_tokens=8, ubatch=4, ignore_eos=True)
    plain_logits = model.logits(PROMPT)
    rec = TraceRecorder.for_model(model, predict=True)
    traced = rec.generate(model, PROMPT, max_tokens=8, ubatch=4, ignore_eos=True)
    with rec.attached(model):
        traced_logits = model.logits(PROMPT)
    assert traced.token_ids == plain.token_ids
    assert torch.equal(traced_logits, plain_logits)
    # everything is put back: hooks and the decoder's own forward
    assert model.net.residual_hook is None and model.net.routing_hook is None
    assert "forward" not in vars(model.net)
    t = rec.trace()
    assert t.predicted.all() and t.pred.shape == (len(t.ids), min(model.cfg.num_experts, 2 * model.cfg.top_k))


def test_predictor_rejects_a_bad_width():
    model = load(None)
    for width in (0, 33, 1.5):
        with pytest.raises(ExpertCacheError, match="prediction width"):
            RouterPredictor(model.net, width)
