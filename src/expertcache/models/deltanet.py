"""Gated DeltaNet, the linear-attention layer of Qwen3.5/3.6-MoE, as transformers computes it.

A call continues from the layer's `DeltaNetState`: a prompt prefilled in micro-batches and then
decoded one token at a time gives what one forward over all of its tokens gives. More than one
token runs the chunked form (chunks of 64, a few matrix products per chunk); one token runs the
recurrent form, a constant amount of work per step however long the sequence.

T = tokens in this call, D = hidden size, Hk = key heads, Hv = value heads (a multiple of Hk),
dk = key head dim, dv = value head dim, C = conv channels (2*Hk*dk + Hv*dv), K = conv kernel,
N = chunks, L = chunk length.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from ..errors import ExpertCacheError
from ..kernels import Kernels


@dataclass(frozen=True, slots=True)
class DeltaNetConfig:
    """Shapes of one DeltaNet layer.

    `tiled_v_heads`: the order of the value heads in every per-value-head weight. Hugging Face
    checkpoints group them by key head (value head j reads key head j // (Hv/Hk)); llama.cpp's
    converter writes them tiled (value head j reads key head j % Hk). Running in the file's own
    order spares the loader a permutation, which a quantized out projection could not take
    without dequantizing (its blocks run along the value-head axis).
    """

    k_heads: int
    v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int = 4
    eps: float = 1e-6
    chunk: int = 64
    tiled_v_heads: bool = False

    def __post_init__(self):
        for name in ("k_heads", "v_heads", "k_head_dim", "v_head_dim", "conv_kernel", "chunk"):
            if getattr(self, name) < 1:
                raise ExpertCacheError(f"DeltaNet {name} is {getattr(self, name)}; expected a positive integer")
        if self.v_heads % self.k_heads:
            raise ExpertCacheError(f"DeltaNet value heads ({self.v_heads}) are not a multiple of its key heads "
                                   f"({self.k_heads})")

    @property
    def key_dim(self) -> int:
        return self.k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @classmethod
    def from_hf(cls, text_config: dict, tiled_v_heads: bool = False) -> DeltaNetConfig:
        """From a Hugging Face text config (`text_config` of the multimodal wrapper)."""
        keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim")
        missing = [k for k in keys if k not in text_config]
        if missing:
            raise ExpertCacheError(f"config has no {missing[0]}; a Gated DeltaNet model needs {', '.join(keys)}")
        return cls(text_config["linear_num_key_heads"], text_config["linear_num_value_heads"],
                   text_config["linear_key_head_dim"], text_config["linear_value_head_dim"],
                   conv_kernel=text_config.get("linear_conv_kernel_dim", 4),
                   eps=text_config.get("rms_norm_eps", 1e-6), tiled_v_heads=tiled_v_heads)


@dataclass(slots=True)
class DeltaNetWeights:
    in_proj_qkv: torch.Tensor  # [C, D]: q rows (Hk*dk), k rows (Hk*dk), v rows (Hv*dv)
    in_proj_z: torch.Tensor    # [Hv*dv, D]: the output gate
    in_proj_b: torch.Tensor    # [Hv, D]: beta before its sigmoid
    in_proj_a: torch.Tensor    # [Hv, D]: the decay's input
    conv: torch.Tensor         # [C, K]: depthwise causal conv, no bias (HF's [C, 1, K] squeezed)
    dt_bias: torch.Tensor      # [Hv]
    A: torch.Tensor            # [Hv] fp32: -exp(A_log), which GGUF stores as ssm_a
    norm: torch.Tensor         # [dv]: gated RMSNorm weight, used as is (no 1 + w)
    out_proj: torch.Tensor     # [D, Hv*dv]

    @classmethod
    def from_hf(cls, t: dict[str, torch.Tensor]) -> DeltaNetWeights:
        """From one layer's `linear_attn.*` tensors, keyed by the name after `linear_attn.`."""
        return cls(t["in_proj_qkv.weight"], t["in_proj_z.weight"], t["in_proj_b.weight"],
                   t["in_proj_a.weight"], t["conv1d.weight"].squeeze(1), t["dt_bias"],
                   -t["A_log"].float().exp(), t["norm.weight"], t["out_proj.weight"])


@dataclass(slots=True)
class DeltaNetState:
    """What a DeltaNet layer carries from one call to the next, for one sequence.

    `conv` keeps the last K-1 conv inputs (the projections before the conv), all a causal conv of
    width K reads from the past; transformers keeps K, one of which it never reads, and llama.cpp
    K-1. Zeros stand for the positions before the first token. `tokens` counts the tokens
    consumed, so that a snapshot knows the prefix it stands for. It is not truncatable: a prefix
    is restored from a copy taken there.
    """

    recurrent: torch.Tensor  # [Hv, dk, dv] fp32
    conv: torch.Tensor       # [C, K-1] compute dtype
    tokens: int = 0

    @classmethod
    def zeros(cls, cfg: DeltaNetConfig, device: torch.device | str, dtype: torch.dtype) -> DeltaNetState:
        return cls(torch.zeros(cfg.v_heads, cfg.k_head_dim, cfg.v_head_dim, device=device, dtype=torch.float32),
                   torch.zeros(cfg.conv_dim, cfg.conv_kernel - 1, device=device, dtype=dtype))

    def copy(self) -> DeltaNetState:
        return DeltaNetState(self.recurrent.clone(), self.conv.clone(), self.tokens)

    @property
    def nbytes(self) -> int:
        return self.recurrent.nbytes + self.conv.nbytes


@dataclass(slots=True)
class DeltaNetPaths:
    """How many calls ran each form; a decode step must never run the chunked one."""

    chunked: int = 0
    recurrent: int = 0


def deltanet(kern: Kernels, cfg: DeltaNetConfig, w: DeltaNetWeights, x: torch.Tensor, state: DeltaNetState,
             paths: DeltaNetPaths | None = None) -> torch.Tensor:
    """x [T, D] -> [T, D], continuing from `state` and leaving it after the last token. The
    projections go through `kern`; the recurrence itself runs in fp32 torch."""
    linear = kern.linear
    T = x.shape[0]
    Hk, Hv, dk, dv = cfg.k_heads, cfg.v_heads, cfg.k_head_dim, cfg.v_head_dim
    if kern.native is not None and T == 1:
        # The decode step between the projections in one native call (native/decode.cpp), which
        # rounds where the torch path below does: about forty torch calls fewer per layer.
        o = kern.native.deltanet_step(linear(x, w.in_proj_qkv), linear(x, w.in_proj_z),
                                      linear(x, w.in_proj_b), linear(x, w.in_proj_a), w.conv, state.conv,
                                      w.A, w.dt_bias, w.norm, state.recurrent, Hk, cfg.tiled_v_heads, cfg.eps)
        state.tokens += 1
        if paths is not None:
            paths.recurrent += 1
        return linear(o, w.out_proj)                                  # [1, D]
    mixed = causal_conv(linear(x, w.in_proj_qkv), w.conv, state)      # [T, C]
    z = linear(x, w.in_proj_z)                                        # [T, Hv*dv]
    beta = linear(x, w.in_proj_b).sigmoid().float()                   # [T, Hv]
    # -exp(A_log) * softplus(...) in fp32: the log-decay, always <= 0
    g = w.A * F.softplus(linear(x, w.in_proj_a).float() + w.dt_bias)  # [T, Hv]
    q, k, v = mixed.float().split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
    q = _l2norm(q.reshape(T, Hk, dk)) * dk ** -0.5                    # [T, Hk, dk]
    k = _l2norm(k.reshape(T, Hk, dk))                                 # [T, Hk, dk]
    v = v.reshape(T, Hv, dv)                                          # [T, Hv, dv]
    if Hv != Hk:
        R = Hv // Hk
        if cfg.tiled_v_heads:
            q, k = q.repeat(1, R, 1), k.repeat(1, R, 1)               # [T, Hv, dk]
        else:
            q, k = q.repeat_interleave(R, dim=1), k.repeat_interleave(R, dim=1)  # [T, Hv, dk]
    if T == 1:
        o = _recurrent_step(q[0], k[0], v[0], g[0], beta[0], state.recurrent)[None]  # [1, Hv, dv]
        if paths is not None:
            paths.recurrent += 1
    else:
        o = _chunked(q, k, v, g, beta, state.recurrent, cfg.chunk)   # [T, Hv, dv]
        if paths is not None:
            paths.chunked += 1
    state.tokens += T
    o = gated_rms_norm(o.to(x.dtype), z.view(T, Hv, dv), w.norm, cfg.eps)  # [T, Hv, dv]
    return linear(o.reshape(T, Hv * dv), w.out_proj)                  # [T, D]


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: DeltaNetState) -> torch.Tensor:
    """SiLU(depthwise causal conv) of x [T, C] after the K-1 inputs kept in `state`, which it
    then replaces with the last K-1 inputs.

    K multiply-adds over [T, C] slices, summed in fp32 and rounded once, as a conv rounds: torch's
    depthwise conv1d in bf16 on a CPU loops over the channels one at a time, thousands of calls."""
    T, K = x.shape[0], weight.shape[1]
    seq = torch.cat((state.conv.t(), x))                               # [K-1+T, C]
    state.conv.copy_(seq[T:].t())
    seq = seq.float()
    wf = weight.float().t()                                            # [K, C]
    y = seq[:T] * wf[0]                                                # [T, C]
    # Each product into one temporary, then added: the same roundings as y += a * b, without a
    # fresh [T, C] fp32 tensor per tap (a prompt's are megabytes, mapped a page at a time).
    term = torch.empty_like(y)
    for j in range(1, K):
        y += torch.mul(seq[j:j + T], wf[j], out=term)
    return F.silu(y.to(x.dtype))                                       # [T, C]


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., dv] scaled by plain `weight`, times SiLU(z), rounded as transformers
    rounds it: the scale in the compute dtype, the gate in fp32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype) * F.silu(z.float())).to(x.dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # eps inside the root, as the fla kernels and transformers compute it
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    S: torch.Tensor) -> torch.Tensor:
    """One token, S [Hv, dk, dv] updated in place: decay, then write the part of v that S does
    not already predict from k (the delta rule); read with q. Returns [Hv, dv]."""
    S.mul_(g.exp()[:, None, None])
    predicted = torch.bmm(k[:, None, :], S)[:, 0]                      # [Hv, dv]
    delta = (v - predicted) * beta[:, None]                            # [Hv, dv]
    S.baddbmm_(k[:, :, None], delta[:, None, :])
    return torch.bmm(q[:, None, :], S)[:, 0]                           # [Hv, dv]


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             S: torch.Tensor, chunk: int) -> torch.Tensor:
    """The same recurrence over T tokens, S [Hv, dk, dv] updated in place; returns [T, Hv, dv].

    Within a chunk with cumulative log-decay G and start state S0, the delta-rule writes U solve
    (I + L) U = beta*V - beta*exp(G)*K S0, with L strictly lower triangular,
    L[i, j] = beta_i exp(G_i - G_j) k_i.k_j; outputs are exp(G) Q S0 plus the causal,
    decay-weighted Q K^T times U. Only the state passes from chunk to chunk, so the triangular
    solves of every chunk run at once and the loop over chunks is a few small products each.
    """
    T, Hv = g.shape
    L = min(chunk, T)
    N = -(-T // L)
    pad = N * L - T
    # Padding tokens have k = 0 and no decay: they change neither the state nor earlier outputs.
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(0, 1).reshape(Hv, N, L, -1) for t in (q, k, v))
    g, beta = (F.pad(t, (0, 0, 0, pad)).t().reshape(Hv, N, L) for t in (g, beta))
    G = g.cumsum(-1)                                                   # [Hv, N, L]
    causal = torch.ones(L, L, dtype=torch.bool, device=g.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [Hv, N, L, L]
    kb = k * beta[..., None]                                           # [Hv, N, L, dk]
    system = (kb @ k.transpose(-1, -2)) * decay                        # [Hv, N, L, L], diagonal unused
    solve = partial(torch.linalg.solve_triangular, system, upper=False, unitriangular=True)
    u = solve(v * beta[..., None])                                     # [Hv, N, L, dv]
    ks = solve(kb * G.exp()[..., None])                                # [Hv, N, L, dk]: reads of S0
    attn = (q @ k.transpose(-1, -2)) * decay                           # [Hv, N, L, L]
    q = q * G.exp()[..., None]                                         # reads S0 decayed to each position
    k = k * (G[..., -1:] - G).exp()[..., None]                         # writes decayed to the chunk's end
    end = G[..., -1].exp()                                             # [Hv, N]
    out = torch.empty_like(u)                                          # [Hv, N, L, dv]
    s = S
    for n in range(N):
        un = u[:, n] - ks[:, n] @ s                                    # [Hv, L, dv]
        out[:, n] = q[:, n] @ s + attn[:, n] @ un
        s = s * end[:, n, None, None] + k[:, n].transpose(-1, -2) @ un  # [Hv, dk, dv]
    S.copy_(s)
    return out.reshape(Hv, N * L, -1)[:, :T].transpose(0, 1)           # [T, Hv, dv]
