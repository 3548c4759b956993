"""The decoder stack every supported architecture shares, and the weight-name tables that tell the
loader where each family keeps its tensors.

An architecture file declares data (names of its expert tensors in each checkpoint layout) and
the few switches in which it differs; the forward pass below is written once.

T = tokens, D = hidden, V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import kernels
from ..config import ModelConfig
from ..telemetry import StepTimer
from .layers import (
    AttentionWeights,
    KVCache,
    MLPWeights,
    Rotary,
    attention,
    linear,
    rms_norm,
    swiglu,
)
from .moe import ExpertProvider, Routing, moe_experts, route


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """Where one checkpoint layout keeps a MoE layer's router and experts, relative to
    `model.layers.{i}.`. Per-expert layouts name gate, up and down with `{e}`; fused layouts name
    gate_up [E, 2I, D] and down [E, D, I]; the packed layout names one [E, stride] tensor."""

    name: str
    router: str
    gate: str | None = None
    up: str | None = None
    down: str | None = None
    gate_up: str | None = None
    packed: str | None = None


PACKED_LAYOUT = ExpertLayout("packed", router="mlp.gate.weight", packed="mlp.experts.packed")


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn: AttentionWeights
    router: torch.Tensor | None = None       # [E, D] on MoE layers
    dense: MLPWeights | None = None          # dense (non-MoE) layers
    shared: MLPWeights | None = None         # Qwen2-MoE shared expert
    shared_gate: torch.Tensor | None = None  # [1, D]


class MoEArch:
    """Per-family data. Subclasses set the class attributes; nothing here holds state."""

    model_type: str = ""
    expert_layouts: tuple[ExpertLayout, ...] = ()
    router_weights_fp32: bool = False  # Mixtral keeps routing weights in fp32


def _no_lap(name: str) -> None:
    pass


# A hook that sees each MoE op's routing: (layer, routing). Used to record routing traces.
RoutingHook = Callable[[int, Routing], None]


class MoEModel:
    """Forward pass over a KV cache. The experts come from `provider`; everything else is here."""

    def __init__(self, cfg: ModelConfig, arch: type[MoEArch], embed: torch.Tensor, norm: torch.Tensor,
                 lm_head: torch.Tensor, layers: list[LayerWeights], provider: ExpertProvider,
                 device: torch.device, dtype: torch.dtype):
        self.cfg, self.arch = cfg, arch
        self.embed, self.norm, self.lm_head, self.layers = embed, norm, lm_head, layers
        self.provider = provider
        self.device, self.dtype = device, dtype
        self.rotary = Rotary(cfg, device, dtype)
        self.routing_hook: RoutingHook | None = None
        # A hook that forces routing (benchmarks replay recorded traces): (layer, routing) -> routing.
        self.routing_override: Callable[[int, Routing], Routing] | None = None
        # Set by benchmarks to split a step's time into parts; None costs nothing.
        self.timer: StepTimer | None = None
        # The native decode kernels (`kernels.select`), or None for torch's.
        self.native = None

    def new_kv(self, max_len: int) -> KVCache:
        return KVCache(self.cfg, max_len, self.device, self.dtype)

    def forward(self, tokens: torch.Tensor, kv: KVCache, all_logits: bool = True) -> torch.Tensor:
        """Run tokens [T] after what `kv` holds; return logits [T, V] (or [1, V] for the last)."""
        # This model's kernels are the active ones for the call, whatever another model uses.
        was, kernels.active = kernels.active, self.native
        try:
            return self._forward(tokens, kv, all_logits)
        finally:
            kernels.active = was

    @torch.inference_mode()
    def _forward(self, tokens: torch.Tensor, kv: KVCache, all_logits: bool) -> torch.Tensor:
        cfg = self.cfg
        lap = self.timer.lap if self.timer is not None else _no_lap
        if self.timer is not None:
            self.timer.start()
        T = tokens.shape[0]
        cos, sin = self.rotary(kv.length, T)
        h = F.embedding(tokens, self.embed)  # [T, D]
        for i, lw in enumerate(self.layers):
            h = h + attention(cfg, lw.attn, rms_norm(h, lw.input_norm, cfg.rms_norm_eps), i, kv, cos, sin)
            x = rms_norm(h, lw.post_norm, cfg.rms_norm_eps)
            lap("attention")
            if lw.router is None:
                h = h + swiglu(x, lw.dense.gate_up, lw.dense.down)
                lap("dense_mlp")
                continue
            routing = route(x, lw.router, cfg.top_k, cfg.norm_topk_prob, self.arch.router_weights_fp32)
            if self.routing_override is not None:
                routing = self.routing_override(i, routing)
            if self.routing_hook is not None:
                self.routing_hook(i, routing)
            lap("routing")
            y = moe_experts(x, routing, self.provider, i)
            if lw.shared is not None:
                shared = swiglu(x, lw.shared.gate_up, lw.shared.down)       # [T, D]
                y = y + torch.sigmoid(linear(x, lw.shared_gate)) * shared  # [T, D]
            h = h + y
            lap("experts")
        kv.advance(T)
        if not all_logits:
            h = h[-1:]
        h = rms_norm(h, self.norm, cfg.rms_norm_eps)
        logits = linear(h, self.lm_head)  # [T, V]
        lap("lm_head")
        return logits
