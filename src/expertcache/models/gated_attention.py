"""Gated full attention of Qwen3.5/3.6-MoE, and the RMSNorm of that family.

The query projection yields, per head, a query and an output gate; the attention output is
multiplied by sigmoid(gate) before the output projection. Queries and keys are normalised per
head and rotated over their first R dims only (partial rotary); the rest pass through.

T = tokens in this call, P = tokens already in the KV cache, D = hidden size,
H = query heads, G = key/value heads, Dh = head dim, R = rotary dims (a fraction of Dh).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ExpertCacheError
from ..kernels import Kernels
from .layers import KVCache, apply_rotary


def unit_offset(w: torch.Tensor) -> torch.Tensor:
    """A Qwen3.5 norm weight as `rms_norm_fp32` takes it: 1 + w, in fp32 as transformers adds it
    (so that the product is bitwise its product). GGUF files store it already added."""
    return 1.0 + w.float()


def rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's RMSNorm: normalised and scaled in fp32 by `weight` (1 + w, see `unit_offset`),
    then rounded once to x's dtype. Every norm of the family but the DeltaNet's gated one."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


@dataclass(frozen=True, slots=True)
class GatedAttentionConfig:
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    eps: float = 1e-6

    def __post_init__(self):
        if self.heads < 1 or self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ExpertCacheError(f"attention heads ({self.heads}) are not a positive multiple of its key/value "
                                   f"heads ({self.kv_heads})")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ExpertCacheError(f"rotary dims are {self.rotary_dim}; expected an even number in "
                                   f"2..{self.head_dim} (the head dim)")

    @classmethod
    def from_hf(cls, text_config: dict) -> GatedAttentionConfig:
        """From a Hugging Face text config. partial_rotary_factor sits in rope_parameters
        (transformers 5) or at the top (older configs); 0.25 when absent, as transformers does."""
        c = text_config
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        rope = c.get("rope_parameters") or {}
        factor = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))
        return cls(heads, c.get("num_key_value_heads", heads), head_dim, int(head_dim * factor),
                   c.get("rms_norm_eps", 1e-6))


@dataclass(slots=True)
class GatedAttentionWeights:
    # [2H*Dh + 2G*Dh, D]: q_proj's rows as stored (per head Dh query rows, then Dh gate rows),
    # then k_proj's, then v_proj's: one product per step. GGUF's attn_q keeps the same layout.
    qkv: torch.Tensor
    o: torch.Tensor        # [D, H*Dh]
    q_norm: torch.Tensor   # [Dh] fp32, 1 + w
    k_norm: torch.Tensor   # [Dh] fp32, 1 + w
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None


def gated_attention(kern: Kernels, cfg: GatedAttentionConfig, w: GatedAttentionWeights, x: torch.Tensor,
                    layer: int, kv: KVCache, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, D] -> [T, D]. Appends this layer's keys and values to `kv` after its `length`
    tokens (the caller advances it once all layers ran); cos, sin [T, R] as `layers.Rotary`
    makes them for a head dim of R, at positions P .. P+T-1."""
    T = x.shape[0]
    linear = kern.linear
    H, G, Dh, R = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.rotary_dim
    proj = linear(x, w.qkv, w.qkv_bias)
    if kern.native is not None and T == 1:
        # Everything between the two projections in one call (native/decode.cpp): the norms, the
        # partial rotary, the key and value into the cache, attention over it and the gate.
        keys, values, slot, n, _ = kv.decode_rows(layer)
        out = kern.native.attend_gated(proj, w.q_norm, w.k_norm, cfg.eps, cos, sin, keys, values, slot, n,
                                       Dh ** -0.5, H, G)                      # [1, H*Dh]
        return linear(out, w.o, w.o_bias)                                     # [1, D]
    qg, k, v = proj.split([2 * H * Dh, G * Dh, G * Dh], dim=-1)
    qg = qg.view(T, H, 2, Dh)
    gate = qg[:, :, 1].reshape(T, H * Dh)                             # [T, H*Dh]
    q = kern.rms_norm_scaled(qg[:, :, 0], w.q_norm, cfg.eps, rms_norm_fp32).transpose(0, 1)  # [H, T, Dh]
    k = kern.rms_norm_scaled(k.view(T, G, Dh), w.k_norm, cfg.eps, rms_norm_fp32).transpose(0, 1)  # [G, T, Dh]
    q = torch.cat((apply_rotary(q[..., :R], cos, sin), q[..., R:]), dim=-1)  # [H, T, Dh]
    k = torch.cat((apply_rotary(k[..., :R], cos, sin), k[..., R:]), dim=-1)  # [G, T, Dh]
    v = v.view(T, G, Dh).transpose(0, 1)                              # [G, T, Dh]
    P = kv.length
    keys, values = kv.append(layer, k, v)                             # [G, P+T, Dh]
    rep = H // G
    if T == 1:
        # The rep query heads of a group stacked along its query axis: the cache is read once per
        # group and never copied per head.
        out = F.scaled_dot_product_attention(q.reshape(1, G, rep, Dh), keys[None], values[None],
                                             scale=Dh ** -0.5)         # [1, G, rep, Dh]
        out = out.reshape(1, H * Dh)
    else:
        # enable_gqa maps each query head to its group's keys and values without copying them.
        if P == 0:
            out = F.scaled_dot_product_attention(q[None], keys[None], values[None], is_causal=True,
                                                 scale=Dh ** -0.5, enable_gqa=rep > 1)[0]  # [H, T, Dh]
        else:
            allowed = (torch.arange(P + T, device=x.device)[None, :]
                       <= torch.arange(P, P + T, device=x.device)[:, None])  # [T, P+T]
            out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=allowed,
                                                 scale=Dh ** -0.5, enable_gqa=rep > 1)[0]  # [H, T, Dh]
        out = out.transpose(0, 1).reshape(T, H * Dh)                  # [T, H*Dh]
    return linear(out * torch.sigmoid(gate), w.o, w.o_bias)           # [T, D]
