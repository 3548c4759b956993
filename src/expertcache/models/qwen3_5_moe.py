"""Qwen3.5/3.6-MoE: three of every four layers Gated DeltaNet, every fourth gated full attention
(`layer_types`), every layer MoE with a shared expert behind a sigmoid gate; norms scale by 1 + w
in fp32.

The published checkpoints are multimodal (`qwen3_5_moe`): the text config sits in `text_config`
and the text weights under `model.language_model.`, beside a vision tower (`model.visual.*`) and
a multi-token-prediction head (`mtp.*`), both skipped. A text-only checkpoint (`qwen3_5_moe_text`,
transformers' Qwen3_5MoeForCausalLM) keeps the usual `model.layers.` names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import ModelConfig
from ..errors import ExpertCacheError
from .arch import HF_TENSOR_NAMES, Architecture, Key
from .deltanet import DeltaNetConfig
from .gated_attention import GatedAttentionConfig
from .mixers import DeltaNet, GatedAttention, Mixer
from .qwen3_moe import QWEN_EXPERT_LAYOUTS

# `layer_types` values, and the mixer each names.
LAYER_TYPES = {"linear_attention": "deltanet", "full_attention": "gated_attention"}

_WRAPPED_NAMES = {**HF_TENSOR_NAMES, "layer": "model.language_model.layers.{i}.",
                  "embed": "model.language_model.embed_tokens.weight",
                  "norm": "model.language_model.norm.weight"}


@dataclass(frozen=True, slots=True)
class Qwen35Config(ModelConfig):
    """`ModelConfig` plus what only this family has. `num_heads`, `num_kv_heads` and `head_dim`
    describe its full-attention layers."""

    layer_types: tuple[str, ...] = ()   # per layer: linear_attention | full_attention
    deltanet: DeltaNetConfig | None = None
    attention: GatedAttentionConfig | None = None
    wrapped: bool = False               # multimodal checkpoint: names under model.language_model.


def default_layer_types(layers: int, interval: int = 4) -> tuple[str, ...]:
    """transformers' default: full attention every `interval`-th layer, linear attention otherwise."""
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers))


class Qwen35Moe(Architecture):
    model_types = ("qwen3_5_moe", "qwen3_5_moe_text")
    gguf_architectures = ("qwen35moe",)
    expert_layouts = QWEN_EXPERT_LAYOUTS
    norm_topk_prob = True  # always renormalised; the config has no switch
    qkv_bias = Key("attention_bias", False)
    o_bias = Key("attention_bias", False)
    qk_norm = "head"
    shared_expert_width = Key("shared_expert_intermediate_size", 0)
    unit_offset_norms = True
    skipped_prefixes = ("model.visual.", "mtp.")

    @classmethod
    def _from_hf(cls, raw: dict) -> Qwen35Config:
        wrapped = "text_config" in raw
        text = raw["text_config"] if wrapped else raw
        if not isinstance(text, dict):
            raise ExpertCacheError(f"text_config: expected a JSON object, got {type(text).__name__}")
        # The wrapper's top level holds what the text config may leave out (dtype above all).
        merged = {**{k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}, **text}
        base = super()._from_hf(merged)
        layers = base.num_layers
        interval = merged.get("full_attention_interval", 4)
        types = merged.get("layer_types") or default_layer_types(layers, interval)
        if not isinstance(types, (list, tuple)) or len(types) != layers:
            raise ExpertCacheError(f"layer_types {types!r}: expected a list of {layers} layer types")
        for i, t in enumerate(types):
            if t not in LAYER_TYPES:
                raise ExpertCacheError(f"unsupported layer type {t!r} (layer {i} of layer_types): expected "
                                       f"{' or '.join(LAYER_TYPES)}")
        deltanet = DeltaNetConfig.from_hf(merged) if "linear_attention" in types else None
        attention = GatedAttentionConfig.from_hf(merged) if "full_attention" in types else None
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
        fields["model_type"] = raw.get("model_type") if raw.get("model_type") in cls.model_types else base.model_type
        return Qwen35Config(**fields, layer_types=tuple(types), deltanet=deltanet, attention=attention,
                            wrapped=wrapped)

    @classmethod
    def names(cls, cfg: ModelConfig) -> dict[str, str]:
        return _WRAPPED_NAMES if getattr(cfg, "wrapped", False) else cls.tensor_names

    @classmethod
    def mixers(cls, cfg: ModelConfig) -> tuple[Mixer, ...]:
        if not isinstance(cfg, Qwen35Config):  # a config read without the family's fields (GGUF, for now)
            raise ExpertCacheError(f"{cfg.model_type}: the layer types and DeltaNet shapes are unknown; "
                                   "expected a Hugging Face checkpoint (config.json with layer_types)")
        by_type = {}
        if cfg.deltanet is not None:
            by_type["linear_attention"] = DeltaNet(cfg.deltanet, cfg.hidden_size)
        if cfg.attention is not None:
            by_type["full_attention"] = GatedAttention(cfg.attention, cfg.hidden_size, cfg.qkv_bias)
        return tuple(by_type[t] for t in cfg.layer_types)
