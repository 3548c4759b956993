"""Gemma 4's attention, one mixer for its sliding-window and its full layers: per-head RMSNorm
of queries and keys (weight w) and of values (no weight), attention scaling 1.0, its own rotary
table per layer kind, an optional sliding window and the k-eq-v option; the layer's
post-attention norm is applied here, to the attention output, before the residual add.

- Sliding window W: the query at position q attends keys at q-W < k <= q.
- k-eq-v (`attention_k_eq_v`, full layers): no v_proj; V is k_proj's output before k_norm, then
  the weightless v_norm.
- Proportional RoPE (full layers): frequencies over the whole head with only the first
  `rotary_factor * Dh / 2` non-zero, rotate-half over the whole head.

A sliding layer keeps only the last W positions' keys and values (`window_cache.py`).

T = tokens in this call, P = tokens already in the KV cache, D = hidden size,
H = query heads, G = key/value heads, Dh = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from ..errors import ExpertCacheError
from ..kernels import Kernels
from .layers import KVCache, Rotary, apply_rotary
from .mixers import Mixer, Reader


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma 4's RMSNorm as transformers computes it: in fp32, x * (mean(x^2) + eps)^-0.5, times
    w (not 1 + w) when there is a weight, rounded once to x's dtype."""
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.to(x.dtype)


@dataclass(frozen=True, slots=True)
class SlidingAttentionConfig:
    heads: int
    kv_heads: int
    head_dim: int
    theta: float
    rotary_factor: float = 1.0       # the share of the head's frequencies that rotate (proportional RoPE)
    window: int | None = None        # sliding layers: keys within this many positions
    k_eq_v: bool = False
    eps: float = 1e-6

    def __post_init__(self):
        if self.heads < 1 or self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ExpertCacheError(f"attention heads ({self.heads}) are not a positive multiple of its key/value "
                                   f"heads ({self.kv_heads})")
        if self.head_dim < 2 or self.head_dim % 2:
            raise ExpertCacheError(f"head_dim {self.head_dim} must be an even number >= 2")
        if not 0 <= self.rotary_factor <= 1:
            raise ExpertCacheError(f"partial_rotary_factor {self.rotary_factor} must be in [0, 1]")

    def inv_freq(self) -> torch.Tensor:
        """[Dh/2] as transformers' default (factor 1) and proportional RoPE compute them."""
        Dh = self.head_dim
        rotated = int(self.rotary_factor * Dh // 2)
        inv = 1.0 / (self.theta ** (torch.arange(0, 2 * rotated, 2, dtype=torch.int64).float() / Dh))
        return torch.cat((inv, torch.zeros(Dh // 2 - rotated)))


class _Table(Rotary):
    """`Rotary` over given inverse frequencies (the shared one reads the model config's)."""

    def __init__(self, inv_freq: torch.Tensor, device: torch.device, dtype: torch.dtype):
        self.inv_freq, self.scale, self.dtype = inv_freq.to(device), 1.0, dtype
        self.cos = self.sin = torch.empty(0, 2 * inv_freq.shape[0], device=device, dtype=dtype)


@dataclass(slots=True)
class SlidingAttentionWeights:
    qkv: torch.Tensor        # [(H+2G)*Dh, D], or [(H+G)*Dh, D] with k-eq-v
    o: torch.Tensor          # [D, H*Dh]
    q_norm: torch.Tensor     # [Dh]
    k_norm: torch.Tensor     # [Dh]
    post_norm: torch.Tensor  # [D], applied to the output


class SlidingAttention(Mixer):
    """Gemma 4's attention, `self_attn.*` tensors plus `post_attention_layernorm.weight`."""

    def __init__(self, cfg: SlidingAttentionConfig, hidden: int):
        self.cfg, self.hidden = cfg, hidden
        self.kind = "sliding_attention" if cfg.window is not None else "full_attention"
        self.kv_shape = (cfg.kv_heads, cfg.head_dim)
        self.window = cfg.window
        self._tables: dict[tuple, _Table] = {}

    def shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c, D = self.cfg, self.hidden
        qd, kd = c.heads * c.head_dim, c.kv_heads * c.head_dim
        p = prefix + "self_attn."
        out = {p + "q_proj.weight": (qd, D), p + "k_proj.weight": (kd, D), p + "o_proj.weight": (D, qd),
               p + "q_norm.weight": (c.head_dim,), p + "k_norm.weight": (c.head_dim,),
               prefix + "post_attention_layernorm.weight": (D,)}
        if not c.k_eq_v:
            out[p + "v_proj.weight"] = (kd, D)
        return out

    def load(self, prefix: str, r: Reader) -> SlidingAttentionWeights:
        p = prefix + "self_attn."
        parts = "qk" if self.cfg.k_eq_v else "qkv"
        return SlidingAttentionWeights(
            r.matrices([f"{p}{n}_proj.weight" for n in parts]), r.matrices([p + "o_proj.weight"]),
            r.read(p + "q_norm.weight"), r.read(p + "k_norm.weight"),
            r.read(prefix + "post_attention_layernorm.weight"))

    def weight_bytes(self, w: SlidingAttentionWeights) -> int:
        return w.qkv.nbytes + w.o.nbytes

    def rotary(self, start: int, n: int, device: torch.device, dtype: torch.dtype, limit: int | None = None):
        key = (device, dtype)
        if key not in self._tables:
            self._tables[key] = _Table(self.cfg.inv_freq(), device, dtype)
        return self._tables[key](start, n, limit)

    def __call__(self, kern, w, x, layer, kv, cos, sin):
        return sliding_attention(kern, self, w, x, layer, kv)


def sliding_attention(kern: Kernels, mixer: SlidingAttention, w: SlidingAttentionWeights, x: torch.Tensor,
                      layer: int, kv: KVCache) -> torch.Tensor:
    """x [T, D] (the input-normed residual) -> post_attention_norm(attention) [T, D]. Appends
    this layer's keys and values to `kv` after its `length` tokens (the caller advances it)."""
    cfg = mixer.cfg
    T = x.shape[0]
    H, G, Dh, eps = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.eps
    P = kv.length
    cos, sin = mixer.rotary(P, T, x.device, x.dtype, kv.max_len)              # [T, Dh]
    proj = kern.linear(x, w.qkv)
    if kern.native is not None and T == 1:
        # Everything between the two projections in one call (native/decode.cpp): the norms, the
        # rotary, the key and value into the cache (a sliding layer's ring) and attention over it,
        # masked by position as below.
        keys, values, slot, n, kpos = kv.decode_rows(layer)
        lo = P - cfg.window if cfg.window is not None else -1
        out = kern.native.attend_scaled(proj, w.q_norm, w.k_norm, eps, cos, sin, keys, values, slot, n,
                                        kpos, lo, 1.0, H, G, cfg.k_eq_v)    # [1, H*Dh]
        return kern.rms_norm_scaled(kern.linear(out, w.o), w.post_norm, eps, reference=gemma_rms_norm)
    if cfg.k_eq_v:
        q, k = proj.split([H * Dh, G * Dh], dim=-1)
        v = k
    else:
        q, k, v = proj.split([H * Dh, G * Dh, G * Dh], dim=-1)
    norm = partial(kern.rms_norm_scaled, eps=eps, reference=gemma_rms_norm)
    q = apply_rotary(norm(q.view(T, H, Dh), w.q_norm).transpose(0, 1), cos, sin)  # [H, T, Dh]
    k = apply_rotary(norm(k.view(T, G, Dh), w.k_norm).transpose(0, 1), cos, sin)  # [G, T, Dh]
    v = norm(v.view(T, G, Dh), None).transpose(0, 1)                              # [G, T, Dh]
    keys, values, kpos = kv.append_window(layer, k, v)                       # [G, N, Dh] x2, [N]
    R = H // G
    if T == 1:
        # Decode: the R query heads of a group stacked along its query axis, so the cache is read
        # once per group and never copied per head. Every key is at or before P; a ring may hold
        # empty slots (-1) and, in a sliding layer, nothing older than its window.
        mask = None
        if cfg.window is not None:
            mask = ((kpos >= 0) & (kpos > P - cfg.window))[None, None, None, :]  # [1, 1, 1, N]
        out = F.scaled_dot_product_attention(q.reshape(1, G, R, Dh), keys[None], values[None],
                                             attn_mask=mask, scale=1.0)    # [1, G, R, Dh]
        return norm(kern.linear(out.reshape(1, H * Dh), w.o), w.post_norm)  # [1, D]
    qpos = torch.arange(P, P + T, device=x.device)[:, None]                   # [T, 1]
    kpos = kpos[None, :]                                                      # [1, N]
    allowed = (kpos <= qpos) & (kpos >= 0)                                    # [T, N]
    if cfg.window is not None:
        allowed &= kpos > qpos - cfg.window
    # enable_gqa maps each query head to its group's keys and values without copying them.
    out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=allowed,
                                         scale=1.0, enable_gqa=R > 1)[0]      # [H, T, Dh]
    out = kern.linear(out.transpose(0, 1).reshape(T, H * Dh), w.o)           # [T, D]
    return norm(out, w.post_norm)
