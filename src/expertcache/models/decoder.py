"""The decoder forward every supported architecture shares: embeddings, then per layer a token
mixer (attention, gated attention or a recurrent DeltaNet, as the architecture names it for that
layer: `mixers.py`) and either a dense MLP or the routed experts (plus a shared expert where the
family has one), then the final norm and the LM head. What differs between families is data
(`arch.py`).

T = tokens, D = hidden, V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from ..config import ModelConfig
from ..kernels import Kernels
from ..errors import ExpertCacheError
from ..telemetry import StepTimer
from .gated_attention import rms_norm_fp32
from .layers import KVCache, MLPWeights, Rotary
from .mixers import Mixer
from .moe import OP_BUFFERS, ExpertProvider, Routing, Workspace, moe_experts, route
from .state import MAX_SNAPSHOTS, SNAPSHOT_EVERY, SequenceState
from ..tiers.layout import Weight
from .window_cache import WindowKVCache


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn: object                             # the mixer's weights (AttentionWeights, DeltaNetWeights, ...)
    mixer: Mixer | None = None               # what runs `attn`; set by the loader
    router: torch.Tensor | None = None       # [E, D] on MoE layers
    dense: MLPWeights | None = None          # dense (non-MoE) layers; a block's dense MLP
    shared: MLPWeights | None = None         # Qwen2-MoE shared expert
    shared_gate: torch.Tensor | None = None  # [1, D]
    # A feed-forward block that replaces the one above (Gemma 4's dense MLP beside the experts,
    # `parallel_ffn.py`): block(decoder, lw, h, x, layer) -> the new residual; `block_w` its weights.
    block: object | None = None
    block_w: object | None = None


@dataclass(slots=True)
class DenseWeights:
    """Every weight that stays in the fast tier."""

    embed: Weight          # [V, D]; a QuantTensor where the kernels multiply blocks (`load_dense`)
    norm: torch.Tensor     # [D]
    lm_head: Weight        # [V, D]
    layers: list[LayerWeights]
    # Norm weights hold 1 + w in fp32, applied in fp32 and rounded once (Qwen3.5), instead of w
    # applied in the compute dtype.
    fp32_norms: bool = False
    # The family's own RMSNorm (x, weight, eps) -> x, where it has one (Gemma 4); else as above.
    rms_norm: Callable | None = None
    embed_scale: float | None = None     # embeddings times this (Gemma: sqrt(D))
    logit_softcap: float | None = None   # logits -> cap * tanh(logits / cap)


def _no_lap(name: str) -> None:
    pass


class PrefillStopped(Exception):
    """A forward left between micro-batches because its caller's `should_stop` said so; the
    sequence state's length is unchanged, recurrent state and rings marked incomplete."""


# A hook that sees each MoE op's routing: (layer, routing). Used to record routing traces.
RoutingHook = Callable[[int, Routing], None]


class Decoder:
    """Forward pass over a sequence state (`new_kv`). The experts come from `provider`; products
    and norms run on `kernels`; everything else is here."""

    def __init__(self, cfg: ModelConfig, weights: DenseWeights, provider: ExpertProvider, kernels: Kernels,
                 device: torch.device, dtype: torch.dtype):
        self.cfg, self.weights, self.provider, self.kernels = cfg, weights, provider, kernels
        self.device, self.dtype = device, dtype
        dims = {lw.mixer.rotary_dim for lw in weights.layers if lw.mixer.rotary_dim is not None}
        if len(dims) > 1:
            raise ExpertCacheError(f"layers rotate {sorted(dims)} dims of a head; expected one rotary width")
        # None where no layer reads positions through it (Gemma 4's layers keep their own
        # tables): a table of the config's head size would grow with the context, read by nothing.
        self.rotary = Rotary(cfg, device, dtype, dims.pop()) if dims else None
        reference = weights.rms_norm or (rms_norm_fp32 if weights.fp32_norms else None)
        self.norm = kernels.rms_norm if reference is None else partial(kernels.rms_norm_scaled, reference=reference)
        # Recurrent-state snapshots of new sequences (`state.py`): how often while decoding, how many.
        self.snapshot_every, self.max_snapshots = SNAPSHOT_EVERY, MAX_SNAPSHOTS
        self.routing_hook: RoutingHook | None = None
        # A hook that forces routing (benchmarks replay recorded traces): (layer, routing) -> routing.
        self.routing_override: Callable[[int, Routing], Routing] | None = None
        # A hook that sees each layer's residual stream once its mixer has run, before its
        # feed-forward block: (layer, h [T, D]). Predictors of the next layer's experts use it.
        self.residual_hook: Callable[[int, torch.Tensor], None] | None = None
        # A hook that sees each forward's tokens [T] before its first layer runs (the first MoE
        # layer's experts are predicted from them, for prefetch).
        self.forward_hook: Callable[[torch.Tensor], None] | None = None
        # The MoE op's buffers, kept across ops (a prefill stretch needs hundreds of MB).
        self.workspace = Workspace()
        # Set by benchmarks to split a step's time into parts; None costs nothing.
        self.timer: StepTimer | None = None

    def new_kv(self, max_len: int) -> KVCache:
        """A fresh sequence state: keys and values for the attention layers (a ring with
        snapshots for sliding-window layers, `window_cache.py`), and a recurrent state (with
        snapshots, `state.py`) where some layers are recurrent."""
        layers = self.weights.layers
        recurrent = {i: lw.mixer.new_state(self.device, self.dtype) for i, lw in enumerate(layers)
                     if lw.mixer.recurrent}
        attention = [i for i, lw in enumerate(layers) if not lw.mixer.recurrent]
        shapes = {i: lw.mixer.kv_shape for i, lw in enumerate(layers) if lw.mixer.kv_shape is not None}
        windows = {i: lw.mixer.window for i, lw in enumerate(layers) if lw.mixer.window is not None}
        if windows:
            if recurrent:
                raise ExpertCacheError("a model with both recurrent and sliding-window layers is not supported")
            return WindowKVCache(self.cfg, max_len, self.device, self.dtype, attention, shapes, windows,
                                 self.snapshot_every, self.max_snapshots)
        if not recurrent:
            return KVCache(self.cfg, max_len, self.device, self.dtype, attention, shapes)
        return SequenceState(self.cfg, max_len, self.device, self.dtype, attention, recurrent,
                             self.snapshot_every, self.max_snapshots)

    @torch.inference_mode()
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The residual stream the first layer starts from: tokens [T] -> [T, D]."""
        w = self.weights
        h = self.kernels.embedding(tokens, w.embed, self.dtype)  # [T, D]
        if w.embed_scale is not None:
            h = h * torch.tensor(w.embed_scale, dtype=h.dtype)
        return h

    def forward(self, tokens: torch.Tensor, kv: KVCache, all_logits: bool = True,
                chunk: int | None = None, should_stop: Callable[[], bool] | None = None,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run tokens [T] after what `kv` holds; return logits [T, V] (or [1, V] for the last).

        With `chunk` < T the forward runs layer by layer over the whole stretch of T tokens: each
        layer's mixer runs over micro-batches of `chunk` tokens (attention's memory grows with
        the tokens of a call), and its feed-forward block over all T at once, so that each MoE
        layer is one op and each expert it uses is loaded once for the stretch. `should_stop` is
        asked before each micro-batch after the first: a yes raises `PrefillStopped`. `on_layer(i)`
        is called as each layer i is done (a long prompt's progress).
        """
        cfg, k, w, norm = self.cfg, self.kernels, self.weights, self.norm
        eps = cfg.rms_norm_eps
        lap = self.timer.lap if self.timer is not None else _no_lap
        if self.timer is not None:
            self.timer.start()
        T = tokens.shape[0]
        if self.forward_hook is not None:
            self.forward_hook(tokens)
        chunk = T if chunk is None else max(1, min(chunk, T))
        kv.begin(T)
        base = kv.length
        if chunk < T:
            kv.reserve(base + T)  # once: a reallocation would copy only the first `length` positions
        if self.rotary is not None:
            cos, sin = self.rotary(base, T, kv.max_len)
        else:
            cos = sin = torch.empty(T, 0, device=self.device, dtype=self.dtype)
        act = cfg.hidden_act
        h = self.embed(tokens)  # [T, D]
        try:
            for i, lw in enumerate(w.layers):
                if on_layer is not None and i:
                    on_layer(i - 1)
                if chunk == T:
                    h = h + lw.mixer(k, lw.attn, norm(h, lw.input_norm, eps), i, kv, cos, sin)
                else:
                    h = h + self._mixer_chunks(lw, h, i, kv, cos, sin, base, chunk, should_stop)
                if self.residual_hook is not None:
                    self.residual_hook(i, h)
                x = norm(h, lw.post_norm, eps)
                lap("attention")
                if lw.block is not None:
                    h = lw.block(self, lw, h, x, i)
                    continue
                if lw.router is None:
                    h = h + k.swiglu(x, lw.dense.gate_up, lw.dense.down, act)
                    lap("dense_mlp")
                    continue
                routing = self.hooked(i, route(k, x, lw.router, cfg.top_k, cfg.norm_topk_prob,
                                               cfg.router_weights_fp32))
                lap("routing")
                # The shared expert runs after the op, not as its `meanwhile`: in decode it is too small
                # to hide a read, and computed first it delayed the worker's reads (Qwen3.6 shapes,
                # disk store at 50%: decode 0.95-0.97x as fast, docs/benchmarks.md).
                y = moe_experts(k, x, routing, self.provider, i, act, self.workspace)
                if lw.shared is not None:
                    shared = k.swiglu(x, lw.shared.gate_up, lw.shared.down, act)  # [T, D]
                    y = y + torch.sigmoid(k.linear(x, lw.shared_gate)) * shared  # [T, D]
                h = h + y
                lap("experts")
            if on_layer is not None:
                on_layer(len(w.layers) - 1)
        finally:
            kv.seek(base)  # a failed forward leaves `length` where it was (the caches' rule)
        kv.advance(T)
        if not all_logits:
            h = h[-1:]
        h = norm(h, w.norm, eps)
        logits = k.linear(h, w.lm_head)  # [T, V]
        if w.logit_softcap is not None:
            # In place, the same arithmetic: all logits of a stretch [T, V] took three times
            # their size at once (docs/prefill.md, "All logits").
            logits = logits.div_(w.logit_softcap).tanh_().mul_(w.logit_softcap)
        lap("lm_head")
        return logits

    def _mixer_chunks(self, lw: LayerWeights, h: torch.Tensor, layer: int, kv: KVCache, cos: torch.Tensor,
                      sin: torch.Tensor, base: int, chunk: int, should_stop: Callable[[], bool] | None
                      ) -> torch.Tensor:
        """One layer's mixer over h [T, D] in micro-batches of `chunk` tokens, each after the
        ones before it: [T, D]."""
        norm, eps, T = self.norm, self.cfg.rms_norm_eps, h.shape[0]
        out = torch.empty_like(h)
        for s in range(0, T, chunk):
            if should_stop is not None and (s or layer) and should_stop():
                raise PrefillStopped()
            e = min(s + chunk, T)
            kv.seek(base + s)
            out[s:e] = lw.mixer(self.kernels, lw.attn, norm(h[s:e], lw.input_norm, eps), layer, kv,
                                cos[s:e], sin[s:e])
            if e < T:
                kv.layer_done(layer, base + e)
        return out

    def activation_bytes(self, tokens: int) -> int:
        """Memory a forward of `tokens` tokens needs beyond the weights and the KV cache: the
        residual stream and its per-layer temporaries, the RMSNorm's fp32 temporaries, the
        largest feed-forward intermediate, the MoE op's buffers (`Workspace`) and the router's
        probabilities. Attention's own buffers, bounded by the micro-batch, are not counted."""
        cfg = self.cfg
        item = torch.empty((), dtype=self.dtype).element_size()
        D, A, E = cfg.hidden_size, cfg.top_k, cfg.num_experts
        stream = 6 * D                               # h, x, mixer output, y, temporaries
        # A norm in a narrower dtype squares and scales an fp32 copy of its input: three fp32
        # [T, D] at once (measured on Qwen3.5 and Gemma 4 shapes in bf16; the two they lacked
        # put a stretch 13% over --prefill-mem).
        norm = 3 * D * 4 if item < 4 else 0
        # A gated MLP holds its gate-up product [T, 2I], the activation [T, I] and their
        # product [T, I] at once: twice the gate-up width. An expert may take every token of
        # the op (each token names it at most once), so its width counts as a whole stretch's.
        mlps = [m for lw in self.weights.layers
                for m in (lw.dense, lw.shared, getattr(lw.block_w, "dense", None)) if m is not None]
        ffn = 2 * max([m.gate_up.shape[0] for m in mlps] + [2 * cfg.moe_intermediate_size])
        moe = OP_BUFFERS * A * D * item + 3 * A * 8  # the op's buffers, its index arrays
        return tokens * ((stream + ffn) * item + norm + moe + 2 * E * 4)

    def hooked(self, layer: int, routing: Routing) -> Routing:
        """A layer's routing after the override and the hook (benchmarks, traces) saw it."""
        if self.routing_override is not None:
            routing = self.routing_override(layer, routing)
        if self.routing_hook is not None:
            self.routing_hook(layer, routing)
        return routing
