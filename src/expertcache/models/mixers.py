"""A layer's token mixer, as the architecture names it: which tensors it reads, how they are
loaded, what per-sequence state it needs, and its forward. The decoder runs whatever mixer each
layer has; nothing in the shared forward asks which family a model is.

- `attention`: grouped-query attention over the KV cache (`layers.attention`), every family so far.
- `gated_attention`: Qwen3.5's attention with an output gate and partial rotary (`gated_attention`).
- `deltanet`: Gated DeltaNet, a recurrent linear-attention layer (`deltanet`).

T = tokens, D = hidden size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from ..config import ModelConfig
from ..kernels import Kernels
from .deltanet import DeltaNetConfig, DeltaNetPaths, DeltaNetState, DeltaNetWeights, deltanet
from .gated_attention import GatedAttentionConfig, GatedAttentionWeights, gated_attention, unit_offset
from .layers import AttentionWeights, KVCache, attention


class Reader:
    """What a mixer loads its weights through: `read` gives a tensor in the compute dtype on the
    device, `keep` one that every step reads (huge-page memory), `has` whether a name exists,
    `matrices` matrices multiplied as one (rows joined), which may stay quantized blocks
    (`QuantTensor`) that only `Kernels.linear` takes."""

    def __init__(self, read: Callable[[str], torch.Tensor], keep: Callable[[torch.Tensor], torch.Tensor],
                 has: Callable[[str], bool], matrices: Callable[[list[str]], object] | None = None):
        self.read, self.keep, self.has = read, keep, has
        self.matrices = matrices or (lambda names: keep(torch.cat([read(n) for n in names])))

    def get(self, name: str) -> torch.Tensor:
        return self.keep(self.read(name))

    def opt(self, name: str) -> torch.Tensor | None:
        return self.get(name) if self.has(name) else None


class Mixer:
    """One layer's token mixer. Instances hold only configuration (shared by layers alike)."""

    kind: ClassVar[str] = ""
    recurrent: ClassVar[bool] = False  # holds a DeltaNetState per sequence instead of keys and values
    rotary_dim: int | None = None      # the rotated dims of a head, for mixers that use positions
    # (key/value heads, head dim) of its KV cache where they differ from the config's; None: the config's
    kv_shape: tuple[int, int] | None = None
    # Attends only to the last `window` positions: its keys and values kept in a ring
    # (`window_cache.py`); None: all positions
    window: int | None = None

    def shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """Every tensor this mixer reads from a checkpoint, by full name, with its shape."""
        raise NotImplementedError

    def load(self, prefix: str, r: Reader):
        raise NotImplementedError

    def __call__(self, kern: Kernels, w, x: torch.Tensor, layer: int, kv: KVCache, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D] after what `kv` holds (the caller advances it)."""
        raise NotImplementedError

    def weight_bytes(self, w) -> int:
        """Bytes of its projections a decode step reads (norms and vectors left out)."""
        return sum(t.nbytes for t in (w.qkv, w.o))


class Attention(Mixer):
    """Attention as most families have it; names from the architecture's tensor table."""

    kind = "attention"

    def __init__(self, cfg: ModelConfig, names: dict[str, str]):
        self.cfg, self.names = cfg, names
        self.rotary_dim = cfg.head_dim

    def shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        cfg, N, D = self.cfg, self.names, self.cfg.hidden_size
        qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        out = {prefix + N[n]: shape for n, shape in (("q", (qd, D)), ("k", (kd, D)), ("v", (kd, D)), ("o", (D, qd)))}
        if cfg.qkv_bias:
            out.update({prefix + N[n + "_bias"]: (d,) for n, d in (("q", qd), ("k", kd), ("v", kd))})
        if cfg.o_bias:
            out[prefix + N["o_bias"]] = (D,)
        if cfg.qk_norm != "none":
            head = cfg.qk_norm == "head"
            out[prefix + N["q_norm"]] = (cfg.head_dim,) if head else (qd,)
            out[prefix + N["k_norm"]] = (cfg.head_dim,) if head else (kd,)
        return out

    def load(self, prefix: str, r: Reader) -> AttentionWeights:
        cfg, N, p = self.cfg, self.names, prefix
        qkv_bias = [r.opt(p + N[f"{n}_bias"]) for n in "qkv"]
        w = AttentionWeights(
            qkv=r.matrices([p + N[n] for n in "qkv"]),
            o=r.matrices([p + N["o"]]), qkv_bias=torch.cat(qkv_bias) if qkv_bias[0] is not None else None,
            o_bias=r.opt(p + N["o_bias"]), q_norm=r.opt(p + N["q_norm"]), k_norm=r.opt(p + N["k_norm"]))
        if cfg.qk_norm == "head":
            w.stack_head_norms(cfg.num_heads, cfg.num_kv_heads)
        return w

    def __call__(self, kern, w, x, layer, kv, cos, sin):
        return attention(kern, self.cfg, w, x, layer, kv, cos, sin)


class GatedAttention(Mixer):
    """Qwen3.5's gated full attention, `self_attn.*` tensors."""

    kind = "gated_attention"

    def __init__(self, cfg: GatedAttentionConfig, hidden: int, bias: bool = False):
        self.cfg, self.hidden, self.bias = cfg, hidden, bias
        self.rotary_dim = cfg.rotary_dim

    def shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c, D = self.cfg, self.hidden
        qd, kd = c.heads * c.head_dim, c.kv_heads * c.head_dim
        p = prefix + "self_attn."
        out = {p + "q_proj.weight": (2 * qd, D), p + "k_proj.weight": (kd, D), p + "v_proj.weight": (kd, D),
               p + "o_proj.weight": (D, qd), p + "q_norm.weight": (c.head_dim,), p + "k_norm.weight": (c.head_dim,)}
        if self.bias:
            out.update({p + "q_proj.bias": (2 * qd,), p + "k_proj.bias": (kd,), p + "v_proj.bias": (kd,),
                        p + "o_proj.bias": (D,)})
        return out

    def load(self, prefix: str, r: Reader) -> GatedAttentionWeights:
        p = prefix + "self_attn."
        bias = None
        if self.bias:
            bias = torch.cat([r.read(f"{p}{n}_proj.bias") for n in "qkv"])
        return GatedAttentionWeights(
            r.matrices([f"{p}{n}_proj.weight" for n in "qkv"]), r.matrices([p + "o_proj.weight"]),
            unit_offset(r.read(p + "q_norm.weight")), unit_offset(r.read(p + "k_norm.weight")),
            bias, r.opt(p + "o_proj.bias") if self.bias else None)

    def __call__(self, kern, w, x, layer, kv, cos, sin):
        return gated_attention(kern, self.cfg, w, x, layer, kv, cos, sin)


# The tensors of one DeltaNet layer after `linear_attn.`, in DeltaNetWeights.from_hf's names.
DELTANET_TENSORS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                    "conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")


class DeltaNet(Mixer):
    """Gated DeltaNet, `linear_attn.*` tensors. `paths` counts which form each call ran."""

    kind = "deltanet"
    recurrent = True

    def __init__(self, cfg: DeltaNetConfig, hidden: int):
        self.cfg, self.hidden = cfg, hidden
        self.paths = DeltaNetPaths()

    def shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        c, D = self.cfg, self.hidden
        shapes = ((c.conv_dim, D), (c.value_dim, D), (c.v_heads, D), (c.v_heads, D), (c.conv_dim, 1, c.conv_kernel),
                  (c.v_heads,), (c.v_heads,), (c.v_head_dim,), (D, c.value_dim))
        return {prefix + "linear_attn." + n: s for n, s in zip(DELTANET_TENSORS, shapes)}

    def load(self, prefix: str, r: Reader) -> DeltaNetWeights:
        w = DeltaNetWeights.from_hf({n: r.read(prefix + "linear_attn." + n) for n in DELTANET_TENSORS})
        for f in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
            setattr(w, f, r.keep(getattr(w, f)))
        w.conv = w.conv.contiguous()
        return w

    def weight_bytes(self, w: DeltaNetWeights) -> int:
        return sum(t.nbytes for t in (w.in_proj_qkv, w.in_proj_z, w.in_proj_b, w.in_proj_a, w.conv, w.out_proj))

    def new_state(self, device: torch.device, dtype: torch.dtype) -> DeltaNetState:
        return DeltaNetState.zeros(self.cfg, device, dtype)

    def __call__(self, kern, w, x, layer, kv, cos, sin):
        return deltanet(kern, self.cfg, w, x, kv.recurrent[layer], self.paths)


def describe_layers(mixers: tuple[Mixer, ...]) -> str:
    """The layer-type pattern in a few words, e.g. '(deltanet x3, gated_attention) x10'."""
    kinds = [m.kind for m in mixers]
    n = len(kinds)
    period = next(p for p in range(1, n + 1) if n % p == 0 and kinds == kinds[:p] * (n // p))
    runs: list[list] = []
    for k in kinds[:period]:
        if runs and runs[-1][0] == k:
            runs[-1][1] += 1
        else:
            runs.append([k, 1])
    body = ", ".join(k if c == 1 else f"{k} x{c}" for k, c in runs)
    return body if n == period else f"({body}) x{n // period}" if len(runs) > 1 else f"{runs[0][0]} x{n}"
