"""Model and cache configuration: plain dataclasses that validate themselves.

`ModelConfig.from_hf` reads a Hugging Face config.json as transformers 4.x and 5.x write it and
normalises the names that differ between families (experts, intermediate sizes, rope settings).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from .errors import ExpertCacheError

SUPPORTED_ARCHITECTURES = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(value: str | torch.dtype | None, what: str = "dtype") -> torch.dtype | None:
    """A torch dtype from its name ('bf16', 'bfloat16', 'torch.float32') or the dtype itself."""
    if value is None or isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.").lower()
    if name not in _DTYPES:
        raise ExpertCacheError(f"unknown {what} {value!r}: expected one of float32, bfloat16, float16")
    return _DTYPES[name]


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # default | linear | yarn
    factor: float = 1.0
    original_max_position: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, raw: dict, max_position: int) -> RopeConfig:
        # transformers 5.x: rope_parameters {rope_type, rope_theta, ...};
        # 4.x: rope_theta at top level and an optional rope_scaling {type|rope_type, factor, ...}.
        params = dict(raw.get("rope_parameters") or {})
        scaling = raw.get("rope_scaling") or {}
        params = {**scaling, **params}
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if kind not in ("default", "linear", "yarn"):
            raise ExpertCacheError(f"unsupported rope type {kind!r}: expected default, linear or yarn")
        factor = params.get("factor")
        original = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
        if kind == "yarn" and original is None:
            original = max_position
        if kind == "yarn" and factor is None:
            factor = max_position / original
        return cls(
            theta=float(theta), type=kind, factor=float(factor if factor is not None else 1.0),
            original_max_position=original,
            beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=params.get("attention_factor"), mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"), truncate=bool(params.get("truncate", True)),
        )

    def inv_freq(self, dim: int) -> tuple[torch.Tensor, float]:
        """Inverse frequencies [dim/2] and the cos/sin scale, as transformers computes them."""
        pos_freqs = self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        if self.type == "default":
            return 1.0 / pos_freqs, 1.0
        if self.type == "linear":
            return 1.0 / pos_freqs / self.factor, 1.0
        # YaRN: blend interpolated and extrapolated frequencies over a ramp of dimensions.
        def mscale_of(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention = self.attention_factor
        if attention is None:
            if self.mscale and self.mscale_all_dim:
                attention = mscale_of(self.factor, self.mscale) / mscale_of(self.factor, self.mscale_all_dim)
            else:
                attention = mscale_of(self.factor)

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv = (1.0 / (self.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv, float(attention)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One architecture-neutral description of a decoder-only MoE model."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    intermediate_size: int  # dense layers' MLP width (Qwen dense layers); 0 when there are none
    rms_norm_eps: float
    max_position: int
    rope: RopeConfig
    norm_topk_prob: bool
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = "none"  # none | head (Qwen3: per head) | full (OLMoE: over the projection width)
    clip_qkv: float | None = None
    sparse_layers: tuple[bool, ...] = ()
    shared_expert_intermediate_size: int = 0
    sliding_window: int | None = None
    dtype: torch.dtype = torch.float32
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_ARCHITECTURES:
            raise ExpertCacheError(
                f"unsupported model_type {self.model_type!r}: supported are {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ExpertCacheError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ExpertCacheError(f"num_experts_per_tok {self.top_k} must be between 1 and {self.num_experts}")
        if self.hidden_act != "silu":
            raise ExpertCacheError(f"unsupported hidden_act {self.hidden_act!r}: expected 'silu'")

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, sparse in enumerate(self.sparse_layers) if sparse]

    @property
    def expert_numel(self) -> int:
        """Elements in one expert: gate and up [I, H] each, down [H, I]."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @classmethod
    def from_hf(cls, raw: dict, where: str = "config.json") -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ExpertCacheError(
                f"{where}: unsupported model_type {model_type!r}: supported are {', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            return _from_hf(model_type, raw)
        except KeyError as e:
            raise ExpertCacheError(f"{where}: missing required field {e.args[0]!r} for {model_type}") from None
        except (TypeError, ValueError) as e:
            raise ExpertCacheError(f"{where}: invalid value: {e}") from None


def _from_hf(model_type: str, raw: dict) -> ModelConfig:
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    head_dim = int(raw.get("head_dim") or hidden // heads)
    layers = int(raw["num_hidden_layers"])
    max_position = int(raw.get("max_position_embeddings", 4096))
    # transformers 5.x writes num_local_experts for every family; 4.x wrote num_experts for Qwen/OLMoE.
    n_experts = raw.get("num_experts", raw.get("num_local_experts"))
    if n_experts is None:
        raise KeyError("num_experts")
    if model_type == "mixtral":
        experts, moe_inter, dense_inter = int(n_experts), int(raw["intermediate_size"]), 0
        norm_topk = True  # Mixtral always renormalises the top-k probabilities
    elif model_type == "olmoe":
        experts, moe_inter, dense_inter = int(n_experts), int(raw["intermediate_size"]), 0
        norm_topk = bool(raw.get("norm_topk_prob", False))
    else:
        experts, moe_inter = int(n_experts), int(raw["moe_intermediate_size"])
        dense_inter = int(raw.get("intermediate_size") or 0)
        norm_topk = bool(raw.get("norm_topk_prob", False))
    if model_type in ("qwen3_moe", "qwen2_moe"):
        mlp_only = set(raw.get("mlp_only_layers") or [])
        step = int(raw.get("decoder_sparse_step", 1) or 1)
        sparse = tuple(i not in mlp_only and experts > 0 and (i + 1) % step == 0 for i in range(layers))
    else:
        sparse = (True,) * layers
    eos = raw.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    dtype = parse_dtype(raw.get("dtype") or raw.get("torch_dtype") or "float32", "checkpoint dtype")
    sliding = None
    if model_type == "mixtral":
        sliding = raw.get("sliding_window")
    elif raw.get("use_sliding_window"):
        sliding = raw.get("sliding_window")
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        num_experts=experts,
        top_k=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=moe_inter,
        intermediate_size=dense_inter,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position=max_position,
        rope=RopeConfig.from_hf(raw, max_position),
        norm_topk_prob=norm_topk,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("qkv_bias", True)) if model_type == "qwen2_moe" else bool(raw.get("attention_bias", False)),
        o_bias=bool(raw.get("attention_bias", False)) if model_type in ("qwen3_moe", "olmoe") else False,
        qk_norm={"qwen3_moe": "head", "olmoe": "full"}.get(model_type, "none"),
        clip_qkv=raw.get("clip_qkv") if model_type == "olmoe" else None,
        sparse_layers=sparse,
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0)
        if model_type == "qwen2_moe" else 0,
        sliding_window=int(sliding) if sliding else None,
        dtype=dtype,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos,
        hidden_act=raw.get("hidden_act", "silu"),
    )


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "KIB": 2**10, "M": 10**6, "MB": 10**6, "MIB": 2**20,
          "G": 10**9, "GB": 10**9, "GIB": 2**30, "T": 10**12, "TB": 10**12, "TIB": 2**40}


def parse_size(text: str) -> int:
    """Bytes from '2GiB', '300MB', '1.5G' or a plain number of bytes."""
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).upper() if m else None
    if not m or unit not in _UNITS:
        raise ExpertCacheError(f"cannot parse size {text!r}: expected a number with an optional unit, "
                               "such as 300MB, 2GiB or 512KiB")
    return int(float(m.group(1)) * _UNITS[unit])


CACHE_MODES = ("cache", "resident", "staging")
STORES = ("ram", "mmap", "disk")


def _default_policy() -> str:
    # Imported when a config is made: importing the tiers package here would be circular.
    from .tiers.policy import DEFAULT_POLICY

    return DEFAULT_POLICY


@dataclass(slots=True)
class CacheConfig:
    """How experts are held: every expert resident, a slot cache over a slow tier, or staging.

    At most one of `experts` (slots in total), `mem` (bytes or a size string) and `fraction` (of all
    experts) sizes the cache; with none of them the cache holds every expert.
    """

    mode: str = "cache"
    experts: int | None = None
    mem: int | str | None = None
    fraction: float | None = None
    policy: str = field(default_factory=_default_policy)
    store: str = "ram"
    verify: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in CACHE_MODES:
            raise ExpertCacheError(f"unknown cache mode {self.mode!r}: expected one of {', '.join(CACHE_MODES)}")
        if self.store not in STORES:
            raise ExpertCacheError(f"unknown store {self.store!r}: expected one of {', '.join(STORES)}")
        given = [n for n in ("experts", "mem", "fraction") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ExpertCacheError(f"cache size given twice ({' and '.join(given)}): give one of experts, mem, fraction")
        if isinstance(self.mem, str):
            self.mem = parse_size(self.mem)
        if self.experts is not None and self.experts < 1:
            raise ExpertCacheError(f"cache experts {self.experts} must be at least 1")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ExpertCacheError(f"cache fraction {self.fraction} must be in (0, 1]")

    def slots_for(self, total_experts: int, expert_bytes: int) -> int:
        """Slots in the pool for a model with `total_experts` experts of `expert_bytes` each."""
        if self.mode == "resident":
            return total_experts
        if self.experts is not None:
            return min(self.experts, total_experts)
        if self.mem is not None:
            return min(int(self.mem) // expert_bytes, total_experts)
        if self.fraction is not None:
            return max(1, min(total_experts, math.floor(self.fraction * total_experts + 1e-9)))
        return total_experts
