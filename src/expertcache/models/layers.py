"""Dense building blocks shared by every architecture: rotary embeddings, a KV cache, and
grouped-query attention over it. Products and norms go through the model's `Kernels`.

T = tokens in this call, P = tokens already in the KV cache, D = hidden size,
H = query heads, G = key/value heads, Dh = head dim, I = MLP width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..errors import ExpertCacheError
from ..kernels import Kernels

_NO_NORM = torch.empty(0, dtype=torch.bfloat16)


class Rotary:
    """cos/sin tables by position, computed in fp32 and cast to the compute dtype once; a call
    slices them. The sign of rotate-half is folded into the sin table: (-x) * s == x * (-s)
    exactly, and a decode step saves the negation."""

    # Rows computed at once when a table grows: the fp32 temporaries of a whole table (Gemma 4's
    # full layers, 512 dims at 262,144 positions) took 2 GiB for a table of 512 MiB.
    GROW_ROWS = 4096

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, dim: int | None = None):
        # `dim`: the rotated dims of a head where only a part of it rotates (partial rotary).
        dim = dim or cfg.head_dim
        if dim % 2:
            # Rotate-half pairs dim i with dim i + dim/2: an odd count was a shape error at the
            # first forward, after `info` had passed the config.
            raise ExpertCacheError(f"head_dim {dim}: rotary position embeddings rotate pairs of dims; "
                                   "expected an even head size")
        inv_freq, self.scale = cfg.rope.inv_freq(dim)
        self.inv_freq, self.dtype = inv_freq.to(device), dtype
        self.cos = self.sin = torch.empty(0, dim, device=device, dtype=dtype)

    def _grow(self, n: int) -> None:
        dim = 2 * self.inv_freq.shape[0]
        half = dim // 2
        cos = torch.empty(n, dim, device=self.inv_freq.device, dtype=self.dtype)
        sin = torch.empty_like(cos)
        # Block by block the same elementwise arithmetic as over the whole table: the same bits.
        for s in range(0, n, self.GROW_ROWS):
            e = min(s + self.GROW_ROWS, n)
            positions = torch.arange(s, e, device=self.inv_freq.device)
            freqs = positions[:, None].float() * self.inv_freq[None, :]  # [rows, Dh/2]
            emb = torch.cat((freqs, freqs), dim=-1)                      # [rows, Dh]
            cos[s:e] = emb.cos() * self.scale
            signed = emb.sin() * self.scale
            sin[s:e, :half] = -signed[:, :half]
            sin[s:e, half:] = signed[:, half:]
        self.cos, self.sin = cos, sin

    def __call__(self, start: int, n: int, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [n, Dh] for positions start .. start+n-1. `limit`: the positions
        the sequence can reach (its context); the table grows in doublings but never past it."""
        if start + n > self.cos.shape[0]:
            size = max(start + n, 2 * self.cos.shape[0], 256)
            if limit is not None:
                size = min(size, max(limit, start + n))
            self._grow(size)
        return self.cos[start: start + n], self.sin[start: start + n]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [heads, T, Dh]; cos, sin: [T, Dh], sin signed as `Rotary` makes it
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


class KVCache:
    """Keys and values of the attention layers for one sequence; it grows on demand up to `max_len`.

    `layers` names the layers that hold keys and values (every layer by default; a hybrid model's
    recurrent layers hold none). `shapes` gives (key/value heads, head dim) of layers whose
    attention differs from the config's (Gemma 4's full layers). It can be extended, truncated to a
    prefix and copied, so that a prompt cache or several conversations can reuse it.
    """

    def __init__(self, cfg: ModelConfig, max_len: int, device: torch.device, dtype: torch.dtype,
                 layers: Sequence[int] | None = None, shapes: dict[int, tuple[int, int]] | None = None):
        self.cfg, self.max_len, self.device, self.dtype = cfg, max_len, device, dtype
        self.layers = tuple(range(cfg.num_layers)) if layers is None else tuple(layers)
        self.shapes = dict(shapes or {})
        self.length = 0
        self.capacity = 0
        self.k: dict[int, torch.Tensor] = {}  # layer -> [G, capacity, Dh]
        self.v: dict[int, torch.Tensor] = {}
        self.snapshots: list = []  # of recurrent state (`state.SequenceState`); none here

    def reserve(self, n: int) -> None:
        """Room for n tokens in every layer (kept: the first `length`)."""
        if n <= self.capacity:
            return
        # Grown by a quarter: a long prompt reserves its length exactly, and doubling at its
        # first decoded token held twice the keys and values the context needed. Any factor
        # above 1 keeps the copies amortised (here at most 4 per position), small beside the
        # attention that reads every position at every step.
        cap = min(self.max_len, max(n, self.capacity + self.capacity // 4, 256))
        default = (self.cfg.num_kv_heads, self.cfg.head_dim)
        # One buffer at a time, the old one dropped once copied: the peak is the new buffers plus
        # one old one, where allocating all the new ones first held old + new (3x the old size
        # when doubling). Stopped half-way (out of memory), every buffer still holds at least
        # `capacity` rows and the first `length`, so the cache stays usable.
        for buffers in (self.k, self.v):
            for i in self.layers:
                G, Dh = self.shapes.get(i, default)
                new = torch.empty((G, cap, Dh), device=self.device, dtype=self.dtype)
                old = buffers.pop(i, None)
                if old is not None:
                    new[:, : self.length].copy_(old[:, : self.length])
                buffers[i] = new
                del old, new
        self.capacity = cap

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [G, T, Dh] after the cached tokens; return all keys and values [G, P+T, Dh]."""
        T = k.shape[1]
        end = self.length + T
        self.reserve(end)
        self.k[layer][:, self.length:end].copy_(k)
        self.v[layer][:, self.length:end].copy_(v)
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def append_window(self, layer: int, k: torch.Tensor, v: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As `append`, plus the keys' positions [P+T] (a ring's keys are not in order:
        `window_cache.WindowKVCache`)."""
        keys, values = self.append(layer, k, v)
        return keys, values, torch.arange(keys.shape[1], device=k.device)

    def decode_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int, int, torch.Tensor | None]:
        """For a native decode step: the layer's key and value buffers [G, capacity, Dh], the row
        this token's key and value go to, how many rows from the first it attends over, and the
        rows' positions (None: rows 0 .. n-1 hold positions 0 .. n-1)."""
        self.reserve(self.length + 1)
        return self.k[layer], self.v[layer], self.length, self.length + 1, None

    def begin(self, n: int) -> None:
        """A forward of n tokens starts (a hook for state that is not truncatable)."""

    def seek(self, position: int) -> None:
        """Within a forward, make the next append start at `position` (a forward over a long
        stretch runs each layer's mixer micro-batch by micro-batch, `Decoder.forward`); the
        forward seeks back to where it began before `advance`."""
        self.length = position

    def layer_done(self, layer: int, position: int) -> None:
        """Within a forward over a stretch, `layer` has run every token before `position` (a
        micro-batch end): a cache that keeps snapshots of state it cannot truncate copies that
        layer's state here, and makes whole snapshots of the copies at `advance`."""

    def advance(self, n: int) -> None:
        self.length += n

    def truncate(self, n: int) -> int:
        """Keep only the first n tokens; returns the length kept (here always min(length, n))."""
        self.length = min(self.length, n)
        return self.length

    def snapshot_bytes(self) -> int:
        """Memory held by snapshots of recurrent state: none here (keys and values truncate)."""
        return 0

    def copy(self) -> KVCache:
        other = KVCache(self.cfg, self.max_len, self.device, self.dtype, self.layers, self.shapes)
        self._copy_into(other)
        return other

    def _copy_into(self, other: KVCache) -> None:
        other.shapes = self.shapes
        if self.length:
            other.reserve(self.length)
            for src, dst in ((self.k, other.k), (self.v, other.v)):
                for i, s in src.items():
                    dst[i][:, : self.length].copy_(s[:, : self.length])
        other.length = self.length


@dataclass(slots=True)
class AttentionWeights:
    qkv: torch.Tensor          # [(H+2G)*Dh, D]: q, k and v rows in one matrix, one product per step
    o: torch.Tensor            # [D, H*Dh]
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [Dh] (per head) or [H*Dh] (whole projection)
    k_norm: torch.Tensor | None = None
    qk_norm: torch.Tensor | None = None  # per head: q_norm for H rows, then k_norm for G, [H+G, Dh]

    def stack_head_norms(self, heads: int, kv_heads: int) -> None:
        if self.q_norm is not None:
            self.qk_norm = torch.cat((self.q_norm.expand(heads, -1), self.k_norm.expand(kv_heads, -1)))


def attention(k: Kernels, cfg: ModelConfig, w: AttentionWeights, x: torch.Tensor, layer: int, kv: KVCache,
              cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    T = x.shape[0]
    H, G, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    eps = cfg.rms_norm_eps
    window = cfg.window_of(layer)
    native = k.native
    linear, rms_norm = k.linear, k.rms_norm
    if (native is not None and T == 1 and window is None
            and cfg.qk_norm in ("none", "head") and cfg.clip_qkv is None):
        # Everything between the two projections in one call: q/k norm, rotary, the cache append
        # and attention over the cache (see native/decode.cpp).
        qkv = linear(x, w.qkv, w.qkv_bias)                                         # [1, (H+2G)*Dh]
        keys, values, slot, _, _ = kv.decode_rows(layer)
        norm = w.qk_norm if w.qk_norm is not None else _NO_NORM
        out = native.attend(qkv, norm, eps, cos, sin, keys, values, slot, Dh ** -0.5, H, G)  # [1, H*Dh]
        return linear(out, w.o, w.o_bias)                                          # [1, D]
    # Queries and keys stay side by side, [T, H+G, Dh], and are normalised and rotated as one
    # tensor: per element the same arithmetic as doing each alone, in half the calls.
    qk, v = linear(x, w.qkv, w.qkv_bias).split([(H + G) * Dh, G * Dh], dim=-1)  # [T, (H+G)*Dh], [T, G*Dh]
    if cfg.qk_norm == "full":
        q, k = qk.split([H * Dh, G * Dh], dim=-1)
        qk = torch.cat((rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)), dim=-1)
    if cfg.clip_qkv is not None:
        qk, v = qk.clamp(-cfg.clip_qkv, cfg.clip_qkv), v.clamp(-cfg.clip_qkv, cfg.clip_qkv)
    qk = qk.view(T, H + G, Dh)
    if cfg.qk_norm == "head":
        qk = rms_norm(qk, w.qk_norm, eps)                # one weight row per head: [H+G, Dh]
    qk = apply_rotary(qk.transpose(0, 1), cos, sin)      # [H+G, T, Dh]
    q, k = qk[:H], qk[H:]                               # [H, T, Dh], [G, T, Dh]
    v = v.view(T, G, Dh).transpose(0, 1)                # [G, T, Dh]
    P = kv.length
    keys, values = kv.append(layer, k, v)           # [G, P+T, Dh]
    R = H // G
    if T == 1 and window is None:
        # Decode: the R query heads sharing a key/value head are stacked along the query axis of
        # their group, so the cache is read once per group and never copied per head. 4-D inputs
        # select the fused CPU kernel, 2-3x faster here than the 3-D math path.
        out = F.scaled_dot_product_attention(q.reshape(1, G, R, Dh), keys[None], values[None],
                                             scale=Dh ** -0.5)                      # [1, G, R, Dh]
        return linear(out.reshape(1, H * Dh), w.o, w.o_bias)                       # [1, D]
    # enable_gqa: the kernel maps each query head to its group's keys and values, where repeating
    # them per head allocated 2 x H x context x Dh per call (98 MB at 6,000 tokens of
    # Qwen3-30B-A3B's shapes), bit for bit the same result.
    if P == 0 and window is None:
        # A fresh prompt: the fused causal kernel, no mask tensor.
        # (4-D inputs select the fused CPU kernel.)
        out = F.scaled_dot_product_attention(q[None], keys[None], values[None], is_causal=True,
                                             scale=Dh ** -0.5, enable_gqa=R > 1)[0]  # [H, T, Dh]
    else:
        qpos = torch.arange(P, P + T, device=x.device)[:, None]  # [T, 1]
        kpos = torch.arange(P + T, device=x.device)[None, :]     # [1, P+T]
        allowed = kpos <= qpos
        if window is not None:
            allowed &= kpos > qpos - window
        out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=allowed,
                                             scale=Dh ** -0.5, enable_gqa=R > 1)[0]  # [H, T, Dh]
    out = out.transpose(0, 1).reshape(T, H * Dh)                 # [T, H*Dh]
    return linear(out, w.o, w.o_bias)                          # [T, D]


@dataclass(slots=True)
class MLPWeights:
    gate_up: torch.Tensor  # [2I, D]: gate rows, then up rows
    down: torch.Tensor     # [D, I]
