"""Model and cache configuration: frozen dataclasses that validate themselves.

`ModelConfig` describes a model in one architecture-neutral vocabulary; each architecture maps
its own config keys onto it (`models/`). `CacheConfig` says how experts are held. Both are checked
completely when built, before any weight is read.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, replace
from decimal import Decimal

import torch

from .errors import ExpertCacheError

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(value: str | torch.dtype | None, what: str = "dtype") -> torch.dtype | None:
    """A torch dtype from its name ('bf16', 'bfloat16', 'torch.float32') or the dtype itself."""
    if value is None:
        return value
    if isinstance(value, torch.dtype):
        # The engine computes in these three; torch.int32 passed the load and failed in the
        # first forward with "expected scalar type Float but found Int".
        if value not in _DTYPES.values():
            raise ExpertCacheError(f"unsupported {what} {value}: expected one of float32, bfloat16, float16")
        return value
    name = str(value).removeprefix("torch.").lower()
    if name not in _DTYPES:
        raise ExpertCacheError(f"unknown {what} {value!r}: expected one of float32, bfloat16, float16")
    return _DTYPES[name]


def check_min_prob(min_prob: float) -> float:
    """`prefetch_min_prob`: a probability in [0, 1) (0 keeps every guess the width allows)."""
    if isinstance(min_prob, bool) or not isinstance(min_prob, (int, float)) or not 0 <= min_prob < 1:
        raise ExpertCacheError(f"prefetch min-prob must be a probability in [0, 1), got {min_prob!r}")
    return float(min_prob)


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # default | linear | yarn
    factor: float = 1.0
    # YaRN's context before scaling; a GGUF's rope.scaling.original_context_length whatever the
    # type, as llama.cpp reads it (n_ctx_orig_yarn: what `--yarn-orig-ctx 0` falls back to)
    original_max_position: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # The scaling type a GGUF names where it scales by nothing (`none`, or YaRN at factor 1):
    # llama.cpp keeps it as the model's (rope_scaling_type_train) for flags that name no type,
    # so `--rope-scale` alone must not scale such a file linearly (`RopeOverride.apply`).
    train_type: str | None = None

    def __post_init__(self) -> None:
        # What `inv_freq` takes the logarithm of or divides by: a zero or negative value there was a
        # raw "math domain error" at the first run, after `info` had passed the config.
        for name in ("theta", "factor", "beta_fast", "beta_slow"):
            _check_positive(name, getattr(self, name))
        if self.type == "yarn":
            _check_int("original_max_position", self.original_max_position, 1)

    @classmethod
    def from_hf(cls, raw: dict, max_position: int, default_theta: float = 10000.0) -> RopeConfig:
        # transformers 5.x: rope_parameters {rope_type, rope_theta, ...};
        # 4.x: rope_theta at top level and an optional rope_scaling {type|rope_type, factor, ...}.
        # Each value is checked here, under the key the config gives it, before `inv_freq` uses it.
        # `default_theta`: the family's theta where the config gives none (transformers' `default_theta`).
        given = {}
        for section in ("rope_scaling", "rope_parameters"):
            value = raw.get(section)
            if value is not None and not isinstance(value, dict):
                raise ExpertCacheError(f"{section} {value!r}: expected a JSON object of RoPE parameters "
                                       "(rope_type, factor, ...)")
            given.update({k: (f"{section}.{k}", v) for k, v in (value or {}).items()})
        both = [raw.get(s) for s in ("rope_scaling", "rope_parameters")]
        if all(both) and _rope_keys(both[0]) != _rope_keys(both[1]):
            # A 5.x config with a 4.x rope_scaling added by hand (as model cards say to enable YaRN):
            # transformers then reads rope_scaling alone, dropping rope_parameters' rope_theta too.
            raise ExpertCacheError(f"rope_scaling {both[0]!r} and rope_parameters {both[1]!r} disagree "
                                   "(transformers reads rope_scaling alone): give the RoPE parameters in one of them")

        def key(name: str, *fallbacks: str, top: bool = False) -> tuple[str, object]:
            """(the key as the config spells it, its value): the first of `name` and `fallbacks`
            given in rope_parameters, then rope_scaling, then (`top`) at the top level."""
            for k in (name, *fallbacks):
                if given.get(k, (None, None))[1] is not None:
                    return given[k]
            return name, raw.get(name) if top else None

        def number(name: str, default: float | None = None, *, top: bool = False,
                   zero_is_default: bool = False) -> float | None:
            where, value = key(name, top=top)
            if value is None or (zero_is_default and value == 0 and not isinstance(value, bool)):
                return default
            return _check_positive(where, value)

        kind = key("rope_type", "type")[1] or "default"
        if kind not in ("default", "linear", "yarn"):
            raise ExpertCacheError(f"unsupported rope type {kind!r}: expected default, linear or yarn")
        theta = number("rope_theta", default_theta, top=True)
        factor = number("factor")
        original = None
        if kind == "yarn":
            # A top-level value wins over the RoPE section's, as in transformers (Phi-3 style
            # configs keep the pretraining length there).
            where, original = "original_max_position_embeddings", raw.get("original_max_position_embeddings")
            if original is None:
                where, original = key("original_max_position_embeddings")
            if original is None:
                original = max_position
            elif isinstance(original, bool) or not isinstance(original, int) or original < 1:
                raise ExpertCacheError(f"{where} {original!r}: expected an integer >= 1 (the context the "
                                       "model was trained on before YaRN)")
            if factor is None:
                factor = max_position / original
        truncate_key, truncate = key("truncate")
        if truncate is not None and not isinstance(truncate, bool):
            raise ExpertCacheError(f"{truncate_key} {truncate!r}: expected true or false")
        return cls(
            theta=theta, type=kind, factor=factor if factor is not None else 1.0,
            original_max_position=original,
            # 0 takes the default, as transformers reads them (`get("beta_fast") or 32`); a zero
            # mscale is no mscale (`inv_freq`).
            beta_fast=number("beta_fast", 32.0, zero_is_default=True),
            beta_slow=number("beta_slow", 1.0, zero_is_default=True),
            attention_factor=number("attention_factor"), mscale=number("mscale", zero_is_default=True),
            mscale_all_dim=number("mscale_all_dim", zero_is_default=True),
            truncate=truncate if truncate is not None else True,
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


ROPE_SCALING_TYPES = ("none", "linear", "yarn")


@dataclass(frozen=True, slots=True)
class RopeOverride:
    """A RoPE scaling asked for at load time over the checkpoint's own, with llama.cpp's semantics
    for `--rope-scaling`, `--rope-scale` and `--yarn-orig-ctx` (llama-context.cpp): what is not
    given (None, or 0 for the context) is the model's; a model without a scaling type scales
    linearly; `none` never scales. `names`: how the three values are spelled in messages (the
    flags, or `load(rope_scaling=...)`'s keys)."""

    type: str | None = None
    factor: float | None = None
    original_max_position: int = 0
    names: tuple[str, str, str] = ("rope_scaling rope_type", "rope_scaling factor",
                                   "rope_scaling original_max_position_embeddings")

    def __post_init__(self) -> None:
        kind, scale, orig = self.names
        if self.type is not None and self.type not in ROPE_SCALING_TYPES:
            raise ExpertCacheError(f"{kind} {self.type!r}: expected one of {', '.join(ROPE_SCALING_TYPES)}")
        if self.factor is not None:
            object.__setattr__(self, "factor", _check_positive(scale, self.factor))
        if isinstance(self.original_max_position, bool) or not isinstance(self.original_max_position, int) \
                or self.original_max_position < 0:
            raise ExpertCacheError(f"{orig} {self.original_max_position!r}: expected an integer >= 0 (the context "
                                   "the model was trained on before YaRN; 0: the model's own)")
        # What would be ignored without a word, whatever the model: llama.cpp drops a factor under
        # `none` and reads the original context for YaRN alone.
        if self.type == "none" and self.factor is not None:
            raise ExpertCacheError(f"{scale} {self.factor:g}: {kind} none never scales (leave one of them out)")
        if self.type in ("none", "linear") and self.original_max_position:
            raise ExpertCacheError(f"{orig} {self.original_max_position} applies to YaRN only, not to {kind} "
                                   f"{self.type}")
        if self.type == "yarn":
            self._check_yarn_factor()

    def _check_yarn_factor(self) -> None:
        if self.factor is not None and self.factor <= 1:
            raise ExpertCacheError(f"{self.names[1]} {self.factor:g}: YaRN extends the context by a factor > 1 "
                                   "(e.g. 4 for 4x the original context)")

    @classmethod
    def from_dict(cls, value: dict) -> RopeOverride:
        """From a rope_scaling object as config.json spells it (and Qwen's model cards give it):
        rope_type (or 4.x's type), factor, original_max_position_embeddings."""
        if not isinstance(value, dict):
            raise ExpertCacheError(f"rope_scaling {value!r}: expected a dict of rope_type, factor and "
                                   "original_max_position_embeddings, or None")
        known = ("rope_type", "type", "factor", "original_max_position_embeddings")
        extra = [k for k in value if k not in known]
        if extra:
            raise ExpertCacheError(f"rope_scaling key {extra[0]!r} is not supported: expected "
                                   f"{', '.join(k for k in known if k != 'type')}")
        if "rope_type" in value and "type" in value and value["rope_type"] != value["type"]:
            raise ExpertCacheError(f"rope_scaling rope_type {value['rope_type']!r} and type {value['type']!r} "
                                   "disagree: give one of them")
        kind = value.get("rope_type", value.get("type"))
        if kind == "default":  # transformers' name for no scaling
            kind = "none"
        original = value.get("original_max_position_embeddings")
        return cls(kind, value.get("factor"), 0 if original is None else original)

    def given(self) -> str:
        """The values given, as `names` spell them: "--rope-scaling yarn --rope-scale 4", or
        "rope_scaling {'rope_type': 'yarn', 'factor': 4.0}"."""
        values = (self.type, self.factor, self.original_max_position or None)
        if not self.names[0].startswith("--"):
            keys = ("rope_type", "factor", "original_max_position_embeddings")
            return f"rope_scaling {({k: v for k, v in zip(keys, values) if v is not None})!r}"
        return " ".join(f"{n} {v:g}" if isinstance(v, float) else f"{n} {v}"
                        for n, v in zip(self.names, values) if v is not None)

    @property
    def empty(self) -> bool:
        """Whether it asks for nothing (each value the model's own)."""
        return self.type is None and self.factor is None and not self.original_max_position

    def apply(self, rope: RopeConfig, max_position: int) -> RopeConfig:
        """The RoPE of a model whose own is `rope` (trained on `max_position` tokens) with this
        override. Where it would scale by nothing, a one-line error says what is missing."""
        if self.empty:
            return rope
        kind_name, scale, orig = self.names
        trained = rope.train_type or rope.type
        kind = self.type or ("linear" if trained == "default" else trained)
        if kind == "none":
            if self.type is None:  # the model's none: llama.cpp drops the factor and the context
                given, add = ((f"{scale} {self.factor:g}", "linear or yarn") if self.factor is not None
                              else (f"{orig} {self.original_max_position}", "yarn"))
                raise ExpertCacheError(f"{given}: the model's RoPE scaling type is none, which never scales "
                                       f"(add {kind_name} {add})")
            return RopeConfig(theta=rope.theta)
        factor = self.factor if self.factor is not None else rope.factor
        if kind == "yarn":
            self._check_yarn_factor()
            if factor <= 1:
                own = "no factor" if factor == 1 else f"a factor of {factor:g}"
                raise ExpertCacheError(f"{kind_name} yarn needs {scale} > 1: the model gives {own}")
            original = self.original_max_position or rope.original_max_position or max_position
            if rope.type == "yarn":  # a config's own beta, mscale, ... stay
                return replace(rope, factor=factor, original_max_position=original)
            return RopeConfig(theta=rope.theta, type="yarn", factor=factor, original_max_position=original)
        if self.original_max_position:  # no type given: the model's scaling is linear, or none
            raise ExpertCacheError(f"{orig} {self.original_max_position} applies to YaRN only, and the scaling "
                                   f"is {kind} (add {kind_name} yarn)")
        if self.factor is None and factor == 1:
            raise ExpertCacheError(f"{kind_name} linear needs {scale}: the model gives no factor")
        return RopeConfig(theta=rope.theta) if factor == 1 else RopeConfig(theta=rope.theta, type="linear",
                                                                           factor=factor)


def _rope_keys(section: dict) -> dict:
    """A RoPE section with 4.x's `type` read as `rope_type`, as transformers reads it."""
    out = {("rope_type" if k == "type" else k): v for k, v in section.items()}
    return out | {"rope_type": section.get("rope_type", section.get("type", "default"))}


# The gated MLP activations the decoder implements (`kernels.ACTIVATIONS`).
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One architecture-neutral description of a decoder-only MoE model.

    Each architecture maps its own config keys onto these fields (`models/`); nothing here knows
    a family. Values are checked when the config is built, so a checkpoint with nonsense in it
    fails before any weight is read.
    """

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
    # Per layer, whether `sliding_window` applies to it (Qwen2-MoE's layer_types); () every layer.
    sliding_layers: tuple[bool, ...] = ()
    dtype: torch.dtype = torch.float32
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    hidden_act: str = "silu"
    router_weights_fp32: bool = False  # Mixtral keeps the top-k routing weights in fp32

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "num_experts", "top_k", "moe_intermediate_size", "max_position"):
            _check_int(name, getattr(self, name), 1)
        for name in ("intermediate_size", "shared_expert_intermediate_size"):
            _check_int(name, getattr(self, name), 0)
        if not (isinstance(self.rms_norm_eps, float) and 0 < self.rms_norm_eps < 1):
            raise ExpertCacheError(f"rms_norm_eps {self.rms_norm_eps!r} must be a number in (0, 1)")
        if self.num_heads % self.num_kv_heads:
            raise ExpertCacheError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ExpertCacheError(f"num_experts_per_tok {self.top_k} must be between 1 and {self.num_experts}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ExpertCacheError(f"unsupported hidden_act {self.hidden_act!r}: expected "
                                   f"{' or '.join(repr(a) for a in HIDDEN_ACTS)}")
        if self.qk_norm not in ("none", "head", "full"):
            raise ExpertCacheError(f"qk_norm {self.qk_norm!r}: expected none, head or full")
        if len(self.sparse_layers) != self.num_layers:
            raise ExpertCacheError(f"{len(self.sparse_layers)} layer kinds for {self.num_layers} layers")
        if not any(self.sparse_layers):
            raise ExpertCacheError("no MoE layer: every layer is dense (mlp_only_layers, decoder_sparse_step)")
        if any(not s for s in self.sparse_layers) and self.intermediate_size < 1:
            raise ExpertCacheError("intermediate_size must be at least 1 when some layers are dense")
        if self.sliding_window is not None:
            _check_int("sliding_window", self.sliding_window, 1)
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ExpertCacheError(f"{len(self.sliding_layers)} sliding-window flags for {self.num_layers} layers")
        if self.clip_qkv is not None and not (isinstance(self.clip_qkv, float) and self.clip_qkv > 0):
            raise ExpertCacheError(f"clip_qkv {self.clip_qkv!r} must be a positive number")
        for t in self.eos_token_id:
            if not (isinstance(t, int) and 0 <= t < self.vocab_size):
                raise ExpertCacheError(f"eos_token_id {t!r} is not a token id of the vocabulary of {self.vocab_size}")
        if self.bos_token_id is not None and not (isinstance(self.bos_token_id, int)
                                                  and 0 <= self.bos_token_id < self.vocab_size):
            raise ExpertCacheError(
                f"bos_token_id {self.bos_token_id!r} is not a token id of the vocabulary of {self.vocab_size}")

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer`'s attention, or None where it attends to every position."""
        if self.sliding_window is None or (self.sliding_layers and not self.sliding_layers[layer]):
            return None
        return self.sliding_window

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, sparse in enumerate(self.sparse_layers) if sparse]


def _check_positive(name: str, value) -> float:
    """`value` as a float if it is a finite number > 0; else an ExpertCacheError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ExpertCacheError(f"{name} {value!r}: expected a positive number")
    return float(value)


def _check_int(name: str, value, minimum: int) -> None:
    # bool is an int to Python, and 256.0 or "256" in a config is a writer's bug worth naming.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ExpertCacheError(f"{name} {value!r} must be an integer >= {minimum}")


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
    # Exact decimal arithmetic: float('2.01') * 10**9 is 2009999999.9999998, which int() cut to
    # one byte short of what was written.
    return int(Decimal(m.group(1)) * _UNITS[unit])


CACHE_MODES = ("cache", "resident", "staging")
STORES = ("ram", "mmap", "disk")
# The eviction policies by name; `tiers.policy` implements each (a test checks the two agree).
POLICY_NAMES = ("lru", "lfu", "s3fifo", "arc", "lrfu")
DEFAULT_POLICY = "lrfu"
PREFETCH_MODES = ("auto", "on", "off")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """How experts are held: every expert resident, a slot cache over a slow tier, or staging.

    At most one of `experts` (slots in total), `mem` (bytes, or a size string such as '2GiB') and
    `fraction` (of all experts) sizes the cache; with none of them the cache holds every expert.
    `resident` mode holds every expert and takes none of them.
    The config is complete and checked when built, before any weight is read. `mode=None` picks
    the mode from the other fields: `cache` when a size, another store or `verify` is given,
    `resident` otherwise. `trace_every` > 0 prints a counter line on stderr every that many ops.
    `prefetch` (`cache` mode only): load the experts predicted for the next MoE op while the
    current one computes; `auto` turns it on where it was measured to pay (a GPU's copy engine;
    on a CPU, direct disk reads steered by a fitted predictor), see `prefetch_active`.
    `prefetch_width`: experts predicted per token, as a multiple of top-k (0 predicts nothing);
    `prefetch_min_prob`: of those, only the experts the predictor gives at least this
    probability. `predictor`: a file of fitted maps for this model
    (`expertcache trace fit-predictor`) that predicts in place of the next layer's router.
    """

    mode: str | None = None
    experts: int | None = None
    mem: int | str | None = None
    fraction: float | None = None
    policy: str = DEFAULT_POLICY
    store: str = "ram"
    verify: bool = False
    trace_every: int = 0
    prefetch: str = "auto"
    prefetch_width: float = 1.0
    predictor: str | None = None
    prefetch_min_prob: float = 0.0

    def __post_init__(self) -> None:
        given = [n for n in ("experts", "mem", "fraction") if getattr(self, n) is not None]
        if self.mode is None:
            implied = "cache" if given or self.store != "ram" or self.verify else "resident"
            object.__setattr__(self, "mode", implied)
        if self.mode not in CACHE_MODES:
            raise ExpertCacheError(f"unknown cache mode {self.mode!r}: expected one of {', '.join(CACHE_MODES)}")
        if self.store not in STORES:
            raise ExpertCacheError(f"unknown store {self.store!r}: expected one of {', '.join(STORES)}")
        if self.policy not in POLICY_NAMES:
            raise ExpertCacheError(f"unknown cache policy {self.policy!r}: expected one of {', '.join(POLICY_NAMES)}")
        if len(given) > 1:
            raise ExpertCacheError(f"cache size given twice ({' and '.join(given)}): give one of experts, mem, fraction")
        if self.mode == "resident" and given:
            # Resident holds every expert: a size would be ignored without a word.
            raise ExpertCacheError(f"cache mode 'resident' holds every expert and takes no cache size "
                                   f"({given[0]}={getattr(self, given[0])!r}): give a size with mode 'cache' or "
                                   "'staging', or none")
        if isinstance(self.mem, str):
            size = parse_size(self.mem)
            if size < 1:  # '0.5' is 0 bytes: name the size as given, not what it rounded to
                raise ExpertCacheError(f"cache mem {self.mem!r} must be at least 1 byte")
            object.__setattr__(self, "mem", size)
        if self.mem is not None and (isinstance(self.mem, bool) or not isinstance(self.mem, int) or self.mem < 1):
            raise ExpertCacheError(f"cache mem {self.mem!r} must be a positive number of bytes")
        if self.experts is not None and (isinstance(self.experts, bool) or not isinstance(self.experts, int)
                                         or self.experts < 1):
            raise ExpertCacheError(f"cache experts {self.experts!r} must be an integer >= 1")
        # bool is an int to Python: fraction=True would be a whole cache without a word.
        if self.fraction is not None and (isinstance(self.fraction, bool) or not (
                isinstance(self.fraction, (int, float)) and 0 < self.fraction <= 1)):
            raise ExpertCacheError(f"cache fraction {self.fraction!r} must be in (0, 1]")
        if not isinstance(self.verify, bool):  # verify="no" is truthy: it turned verify mode on
            raise ExpertCacheError(f"cache verify {self.verify!r} must be True or False")
        _check_int("trace_every", self.trace_every, 0)
        if self.prefetch not in PREFETCH_MODES:
            raise ExpertCacheError(f"unknown prefetch setting {self.prefetch!r}: expected one of "
                                   f"{', '.join(PREFETCH_MODES)}")
        w = self.prefetch_width
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= 64:
            raise ExpertCacheError(f"prefetch width {w!r} must be a number in [0, 64] (a multiple of top-k)")
        check_min_prob(self.prefetch_min_prob)
        if self.predictor is not None and not isinstance(self.predictor, (str, os.PathLike)):
            raise ExpertCacheError(f"predictor {self.predictor!r} must be the path of a fitted predictor file")

    def prefetch_active(self, device_type: str, direct_and_fitted: bool = False) -> bool:
        """Whether an op's copies for the next op's prediction are made early: only in `cache` mode,
        at a width > 0; `auto` on a GPU, whose copy engine does not take compute's cores, and on a
        CPU only where `direct_and_fitted`: the slow tier is read with O_DIRECT (the disk's DMA
        writes the slots, no core copies the bytes) and a fitted predictor names the experts.
        Elsewhere on a CPU a copy goes through the cores that compute (RAM to RAM, or out of the
        page cache) and the router predictor's wrong guesses add reads: on 2 cores its prefetch
        paid only where decode left a core free, while with fitted maps and direct reads it paid
        at one thread and two (docs/benchmarks.md, "Prefetch in the runtime"). `on` turns it on
        anywhere."""
        if self.mode != "cache" or self.prefetch == "off" or self.prefetch_width == 0:
            return False
        return self.prefetch == "on" or device_type == "cuda" or direct_and_fitted

    @property
    def sized(self) -> bool:
        return any(v is not None for v in (self.experts, self.mem, self.fraction))

    def slots_for(self, total_experts: int, slot_bytes: int) -> int:
        """Slots in the pool for a model with `total_experts` experts in slots of `slot_bytes`."""
        if self.mode == "resident":
            return total_experts
        if self.experts is not None:
            return min(self.experts, total_experts)
        if self.mem is not None:
            return min(int(self.mem) // slot_bytes, total_experts)
        if self.fraction is not None:
            return max(1, min(total_experts, math.floor(self.fraction * total_experts + 1e-9)))
        return total_experts
