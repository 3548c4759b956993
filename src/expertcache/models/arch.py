"""What an architecture declares: its names, its config keys and its tensor names, as data.

One `Architecture` subclass per family sets the class attributes below; `config_from_hf` turns a
Hugging Face config into the architecture-neutral `ModelConfig` by reading them, and the loader
finds every tensor through `tensor_names` and `expert_layouts`. A family that reuses the shared
layers is one small file of such data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..config import ModelConfig, RopeConfig, parse_dtype
from ..errors import ExpertCacheError
from .mixers import Attention, Mixer


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """Where one checkpoint layout keeps a MoE layer's router and experts, relative to the layer
    prefix. Per-expert layouts name gate, up and down with `{e}`; fused layouts name gate_up
    [E, 2I, D] and down [E, D, I]; the packed layout names one [E, bytes] tensor."""

    name: str
    router: str
    gate: str | None = None
    up: str | None = None
    down: str | None = None
    gate_up: str | None = None
    packed: str | None = None


# Written by `expertcache pack` for every family: each expert one contiguous range.
PACKED_LAYOUT = ExpertLayout("packed", router="mlp.gate.weight", packed="mlp.experts.packed")

# Hugging Face tensor names of the dense weights; `{i}` is the layer. Keys are the roles the loader
# knows; an architecture overrides the names that differ.
HF_TENSOR_NAMES = {
    "layer": "model.layers.{i}.",
    "embed": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "input_norm": "input_layernorm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias",
    "o_bias": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "mlp": "mlp.",                       # a dense layer's MLP: {mlp}gate_proj.weight, ...
    "shared": "mlp.shared_expert.",      # the shared expert's MLP
    "shared_gate": "mlp.shared_expert_gate.weight",
}
# Tensors a checkpoint may hold that no forward reads.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True, slots=True)
class Key:
    """A config value read from `name` (the first present of several), else `default`."""

    name: str | tuple[str, ...]
    default: object = None

    def read(self, raw: dict):
        for n in (self.name,) if isinstance(self.name, str) else self.name:
            if raw.get(n) is not None:
                return raw[n]
        return self.default


class Architecture:
    """Per-family data. Subclasses set the class attributes; nothing here holds state."""

    model_types: ClassVar[tuple[str, ...]] = ()       # Hugging Face `model_type` names
    gguf_architectures: ClassVar[tuple[str, ...]] = ()  # llama.cpp `general.architecture` names
    expert_layouts: ClassVar[tuple[ExpertLayout, ...]] = ()
    tensor_names: ClassVar[dict[str, str]] = HF_TENSOR_NAMES

    # How config keys map onto `ModelConfig`.
    expert_width: ClassVar[Key] = Key("moe_intermediate_size")
    dense_width: ClassVar[Key] = Key("intermediate_size", 0)
    norm_topk_prob: ClassVar[Key | bool] = Key("norm_topk_prob", False)
    dense_layers: ClassVar[bool] = False  # honours mlp_only_layers and decoder_sparse_step
    qkv_bias: ClassVar[Key | bool] = Key("attention_bias", False)
    o_bias: ClassVar[Key | bool] = False
    qk_norm: ClassVar[str] = "none"       # none | head | full
    clip_qkv: ClassVar[Key | None] = None
    shared_expert_width: ClassVar[Key | None] = None
    sliding_window_switch: ClassVar[str | None] = "use_sliding_window"  # None: a window always applies
    # False: the family's attention never slides, whatever `sliding_window` says (OLMoE's mask is
    # always the causal one).
    slides: ClassVar[bool] = True
    # What transformers' config class takes where a config.json leaves the key out.
    default_rope_theta: ClassVar[float] = 10000.0
    default_rms_norm_eps: ClassVar[float] = 1e-6
    default_max_position: ClassVar[int] = 4096
    router_weights_fp32: ClassVar[bool] = False
    # Norms scale by 1 + w, computed and applied in fp32 (Qwen3.5); the loader adds the 1.
    unit_offset_norms: ClassVar[bool] = False
    # Name prefixes of tensors a checkpoint may hold that this engine does not run (a vision
    # tower, a multi-token-prediction head): skipped with one notice instead of an error.
    skipped_prefixes: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def names(cls, cfg: ModelConfig) -> dict[str, str]:
        """The tensor-name table of a checkpoint with this config (`tensor_names` unless a family
        names its tensors differently by checkpoint kind)."""
        return cls.tensor_names

    @classmethod
    def mixers(cls, cfg: ModelConfig) -> tuple[Mixer, ...]:
        """Each layer's token mixer (`mixers.py`); attention in every layer unless a family says
        otherwise."""
        attention = Attention(cfg, cls.names(cfg))
        return (attention,) * cfg.num_layers

    @classmethod
    def sliding_layers(cls, raw: dict, layers: int) -> tuple[bool, ...]:
        """Which layers the sliding window applies to, where it does not apply to all: () (all)
        unless a family says otherwise (Qwen2-MoE's `layer_types`)."""
        return ()

    @classmethod
    def block(cls, cfg: ModelConfig):
        """A feed-forward block that replaces the shared MLP/MoE step of every layer (Gemma 4's
        `parallel_ffn.ParallelFFN`), or None."""
        return None

    @classmethod
    def dense_options(cls, cfg: ModelConfig) -> dict:
        """Extra `decoder.DenseWeights` fields (the family's norm, embedding scale, logit cap)."""
        return {}

    # GGUF tensors the family reads itself, besides those under Hugging Face names and the experts
    # (any other tensor in a file is refused).
    gguf_extra_tensors: ClassVar[tuple[str, ...]] = ()

    # Whether a GGUF without `expert_weights_norm` renormalises the top-k weights (llama.cpp's
    # default for the architecture).
    gguf_norm_topk_prob: ClassVar[bool] = False

    @classmethod
    def from_gguf(cls, hf_name: str, t, cfg: ModelConfig):
        """A dense tensor read from a GGUF file (fp32, Hugging Face shape), with what llama.cpp's
        converter changed undone; most families store them as they are."""
        return t

    @classmethod
    def matches_gguf(cls, metadata: dict) -> bool:
        """Whether a GGUF whose `general.architecture` is one of ours is this family (a name
        llama.cpp shares between families is told apart by the metadata)."""
        return True

    @classmethod
    def config_from_hf(cls, raw: dict, where: str = "config.json") -> ModelConfig:
        """The model's config from a Hugging Face config.json as transformers 4.x and 5.x write it."""
        try:
            return cls._from_hf(raw)
        except KeyError as e:
            raise ExpertCacheError(f"{where}: missing required field {e.args[0]!r} for {cls.model_types[0]}") from None
        except ExpertCacheError as e:
            raise ExpertCacheError(f"{where}: {e}") from None
        except (TypeError, ValueError) as e:
            raise ExpertCacheError(f"{where}: invalid value: {e}") from None

    @classmethod
    def _from_hf(cls, raw: dict) -> ModelConfig:
        def get(v):
            return v.read(raw) if isinstance(v, Key) else v

        def need(name: str):
            if raw.get(name) is None:
                raise KeyError(name)
            return raw[name]

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        layers = need("num_hidden_layers")
        max_position = raw.get("max_position_embeddings", cls.default_max_position)
        # transformers 5.x writes num_local_experts for every family; 4.x wrote num_experts for Qwen/OLMoE.
        experts = Key(("num_experts", "num_local_experts")).read(raw)
        if experts is None:
            raise KeyError("num_experts")
        width = get(cls.expert_width)
        if width is None:
            raise KeyError(cls.expert_width.name)
        if cls.dense_layers:
            # Checked here, not left to `ModelConfig`: a string would be read as a set of characters
            # and a step that is not a positive integer as no layer kinds at all.
            mlp_only = raw.get("mlp_only_layers") or []
            if not isinstance(mlp_only, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                         for i in mlp_only):
                raise ExpertCacheError(f"mlp_only_layers {mlp_only!r}: expected a list of layer indices")
            mlp_only = set(mlp_only)
            step = raw.get("decoder_sparse_step")
            step = 1 if step is None else step
            if isinstance(step, bool) or not isinstance(step, int) or step < 1:
                raise ExpertCacheError(f"decoder_sparse_step {step!r} must be an integer >= 1")
            sparse = tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(layers)) \
                if isinstance(layers, int) else ()
        else:
            sparse = (True,) * layers if isinstance(layers, int) and layers > 0 else ()
        eos = raw.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        sliding = raw.get("sliding_window")
        if not cls.slides or (cls.sliding_window_switch is not None and not raw.get(cls.sliding_window_switch)):
            sliding = None
        clip = get(cls.clip_qkv) if cls.clip_qkv is not None else None
        heads_ok = isinstance(hidden, int) and isinstance(heads, int) and heads > 0
        return ModelConfig(
            model_type=cls.model_types[0],
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or (hidden // heads if heads_ok else 0),
            num_experts=experts,
            top_k=need("num_experts_per_tok"),
            moe_intermediate_size=width,
            intermediate_size=get(cls.dense_width) if cls.dense_layers else 0,
            rms_norm_eps=_as_float(raw.get("rms_norm_eps", cls.default_rms_norm_eps)),
            max_position=max_position,
            rope=RopeConfig.from_hf(raw, max_position, cls.default_rope_theta),
            norm_topk_prob=bool(get(cls.norm_topk_prob)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bool(get(cls.qkv_bias)),
            o_bias=bool(get(cls.o_bias)),
            qk_norm=cls.qk_norm,
            clip_qkv=_as_float(clip) if clip is not None else None,
            sparse_layers=sparse,
            shared_expert_intermediate_size=get(cls.shared_expert_width) or 0 if cls.shared_expert_width else 0,
            sliding_window=sliding or None,
            sliding_layers=cls.sliding_layers(raw, layers) if sliding else (),
            dtype=parse_dtype(raw.get("dtype") or raw.get("torch_dtype") or "float32", "checkpoint dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos,
            hidden_act=raw.get("hidden_act", "silu"),
            router_weights_fp32=cls.router_weights_fp32,
        )


def gguf_required(metadata: dict, key: str):
    """A GGUF metadata value that must be there; KeyError naming the key (the loader turns it
    into one line) where it is absent."""
    if metadata.get(key) is None:
        raise KeyError(key)
    return metadata[key]


def _as_float(v) -> float:
    # Integers are fine where a float is expected (rms_norm_eps: 1 would still be caught by its range).
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ExpertCacheError(f"expected a number, got {v!r}")
    return float(v)
