"""Gemma 4's feed-forward block: a dense gated MLP and the routed experts side by side, each
with its own norms, summed, normed once more and added to the residual, the layer then scaled.

    dense  = post_ffw_norm_1(mlp(pre_ffw_norm(h)))          (x, the decoder's post-norm output)
    router = softmax(proj(rms(h) * scale * D^-0.5)), top-k, renormalised, * per_expert_scale[id]
    moe    = post_ffw_norm_2(experts(pre_ffw_norm_2(h)))
    h      = (h + post_ffw_norm(dense + moe)) * layer_scalar

The router reads the residual itself, so its input is ready before the dense MLP runs. The
dense MLP stays in the fast tier; only the experts go through the provider.

T = tokens, D = hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from .layers import MLPWeights
from .mixers import Reader
from .moe import Routing, moe_experts
from .sliding_attention import gemma_rms_norm

# Tensor names after the layer prefix; the router's projection is the expert layout's `router`.
NAMES = {
    "mlp": "mlp.", "post_1": "post_feedforward_layernorm_1.weight",
    "pre_2": "pre_feedforward_layernorm_2.weight", "post_2": "post_feedforward_layernorm_2.weight",
    "post": "post_feedforward_layernorm.weight", "scale": "router.scale",
    "expert_scale": "router.per_expert_scale", "layer_scalar": "layer_scalar",
}


@dataclass(slots=True)
class ParallelFFNWeights:
    dense: MLPWeights
    post_1: torch.Tensor        # [D]
    pre_2: torch.Tensor         # [D]
    post_2: torch.Tensor        # [D]
    post: torch.Tensor          # [D]
    scale: torch.Tensor         # [D] the router's input scale
    expert_scale: torch.Tensor  # [E]
    layer_scalar: torch.Tensor | None = None  # [1]


class ParallelFFN:
    """The block (`decoder.LayerWeights.block`); holds configuration only."""

    def __init__(self, hidden: int, dense_width: int, experts: int, top_k: int, act: str, eps: float):
        self.hidden, self.width, self.experts, self.top_k, self.act, self.eps = \
            hidden, dense_width, experts, top_k, act, eps

    def shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        D, I, E, N = self.hidden, self.width, self.experts, NAMES
        m = prefix + N["mlp"]
        out = {m + "gate_proj.weight": (I, D), m + "up_proj.weight": (I, D), m + "down_proj.weight": (D, I),
               prefix + N["scale"]: (D,), prefix + N["expert_scale"]: (E,)}
        out.update({prefix + N[n]: (D,) for n in ("post_1", "pre_2", "post_2", "post")})
        return out

    def optional(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """Tensors a checkpoint may leave out (then their defaults apply)."""
        return {prefix + NAMES["layer_scalar"]: (1,)}

    def load(self, prefix: str, r: Reader) -> ParallelFFNWeights:
        N, m = NAMES, prefix + NAMES["mlp"]
        dense = MLPWeights(r.matrices([m + "gate_proj.weight", m + "up_proj.weight"]),
                           r.matrices([m + "down_proj.weight"]))
        return ParallelFFNWeights(dense, *(r.read(prefix + N[n]) for n in ("post_1", "pre_2", "post_2", "post",
                                                                           "scale", "expert_scale")),
                                  r.opt(prefix + N["layer_scalar"]))

    def router_input(self, k, h: torch.Tensor, w: ParallelFFNWeights) -> torch.Tensor:
        """What the router projects: rms(h) * scale * D^-0.5, [T, D]."""
        return k.rms_norm_scaled(h, None, self.eps, gemma_rms_norm) * w.scale * self.hidden ** -0.5

    def route(self, k, h: torch.Tensor, router: torch.Tensor, w: ParallelFFNWeights) -> Routing:
        x = self.router_input(k, h, w)                                               # [T, D]
        # softmax in fp32, top-k, renormalised, left in fp32 (`Kernels.route`)
        weights, ids = k.route(x, router, self.top_k, True, weights_fp32=True)       # [T, A]
        return Routing(weights * w.expert_scale[ids], ids)

    def __call__(self, dec, lw, h: torch.Tensor, x: torch.Tensor, layer: int) -> torch.Tensor:
        """h [T, D] the residual after attention, x [T, D] = pre_ffw_norm(h) -> the new residual."""
        k, w, eps = dec.kernels, lw.block_w, self.eps
        lap = dec.timer.lap if dec.timer is not None else _no_lap
        routing = dec.hooked(layer, self.route(k, h, lw.router, w))
        lap("routing")
        norm = partial(k.rms_norm_scaled, eps=eps, reference=gemma_rms_norm)
        dense = []

        def dense_mlp() -> None:  # while the op's first expert copies are in flight
            dense.append(norm(k.swiglu(x, w.dense.gate_up, w.dense.down, self.act), w.post_1))  # [T, D]
            lap("dense_mlp")

        moe = moe_experts(k, norm(h, w.pre_2), routing, dec.provider, layer, self.act, dec.workspace,
                          meanwhile=dense_mlp)  # [T, D]
        h = h + norm(dense[0] + norm(moe, w.post_2), w.post)
        lap("experts")
        return h if w.layer_scalar is None else h * w.layer_scalar


def _no_lap(name: str) -> None:
    pass
