"""The routed MoE op alone, in the spirit of llama.cpp's MUL_MAT_ID tests: our op over the cache
in each mode against a plain per-token computation, over token counts, expert counts and top-k."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import expertcache
from expertcache import CacheConfig
from expertcache.models.synth import synth
from expertcache.models.moe import moe_experts, route

MODES = [CacheConfig(mode="resident"), CacheConfig(mode="staging"), CacheConfig(mode="staging", experts=2),
         CacheConfig(mode="cache", experts=1), CacheConfig(mode="cache", fraction=0.5, policy="lfu")]


def plain_moe(x, router, weights, top_k, normalize):
    """Token by token: softmax, top-k, weighted sum of SwiGLU experts, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    probs = torch.softmax(F.linear(x, router).double(), dim=-1)
    for t in range(x.shape[0]):
        w, ids = torch.topk(probs[t], top_k)
        if normalize:
            w = w / w.sum()
        for wk, e in zip(w, ids.tolist()):
            gate, up, down = (weights[f"model.layers.0.mlp.experts.{e}.{p}_proj.weight"].double()
                              for p in ("gate", "up", "down"))
            xt = x[t].double()
            out[t] += wk * (down @ (F.silu(gate @ xt) * (up @ xt)))
    return out


@pytest.mark.parametrize("experts,top_k", [(4, 1), (8, 2), (16, 4), (32, 8)])
def test_moe_op_matches_plain_reference(tmp_path, experts, top_k):
    d = synth(tmp_path / "m", like="tiny", layers=1, experts=experts, top_k=top_k, vocab=300, dtype="float32",
              progress=False)
    weights = load_file(d / "model.safetensors")
    router = weights["model.layers.0.mlp.gate.weight"]
    gen = torch.Generator().manual_seed(experts)
    for T in (1, 3, 64, 512):
        x = torch.randn(T, 64, generator=gen)
        expected = plain_moe(x, router, weights, top_k, True)
        results = []
        for cache in MODES:
            model = expertcache.load(d, cache=cache)
            r = route(model.kernels, x, router, top_k, True)
            results.append(moe_experts(model.kernels, x, r, model.experts, 0))
        for cache, y in zip(MODES, results):
            torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5, msg=f"{cache} T={T}")
            assert torch.equal(y, results[0]), f"{cache} T={T} differs bitwise from resident"
