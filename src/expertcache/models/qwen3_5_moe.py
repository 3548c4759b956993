"""Qwen3.5/3.6-MoE: three of every four layers Gated DeltaNet, every fourth gated full attention
(`layer_types`), every layer MoE with a shared expert behind a sigmoid gate; norms scale by 1 + w
in fp32.

The published checkpoints are multimodal (`qwen3_5_moe`): the text config sits in `text_config`
and the text weights under `model.language_model.`, beside a vision tower (`model.visual.*`) and
a multi-token-prediction head (`mtp.*`), both skipped. A text-only checkpoint (`qwen3_5_moe_text`,
transformers' Qwen3_5MoeForCausalLM) keeps the usual `model.layers.` names.

GGUF files (`qwen35moe`, llama.cpp's converter) are read under the text-only names through
gguf-py's name map. The converter changed three things, taken as they are rather than undone:
the value heads are tiled (`DeltaNetConfig.tiled_v_heads`), `A_log` is stored as A = -exp(A_log)
(`ssm_a`, read by `GGUFDeltaNet`), and every norm but the DeltaNet's gated one holds 1 + w.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..errors import ExpertCacheError
from .arch import HF_TENSOR_NAMES, Architecture, Key, gguf_required
from .deltanet import DeltaNetConfig, DeltaNetWeights
from .gated_attention import GatedAttentionConfig
from .mixers import DeltaNet, GatedAttention, Mixer, Reader
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
    gguf: bool = False                  # read from a GGUF file (see the module doc)


class GGUFDeltaNet(DeltaNet):
    """DeltaNet on a GGUF file's tensors: the name `A_log` stands for the file's `ssm_a`, which
    holds A = -exp(A_log) itself, taken as is."""

    def load(self, prefix: str, r: Reader) -> DeltaNetWeights:
        p = prefix + "linear_attn."
        t = {n: r.read(p + n) for n in ("conv1d.weight", "dt_bias", "A_log", "norm.weight")}
        proj = {n: r.matrices([p + n + ".weight"]) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                                               "out_proj")}
        return DeltaNetWeights(proj["in_proj_qkv"], proj["in_proj_z"], proj["in_proj_b"], proj["in_proj_a"],
                               t["conv1d.weight"].squeeze(1).contiguous(), t["dt_bias"], t["A_log"].float(),
                               t["norm.weight"], proj["out_proj"])


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
    # transformers' Qwen3_5MoeTextConfig defaults, for a config.json that leaves the key out.
    shared_expert_width = Key("shared_expert_intermediate_size", 512)
    default_max_position = 32768
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
        # transformers' class default: a config.json without head_dim has heads 256 wide, whatever
        # hidden_size // heads is (the fallback the shared code takes).
        merged.setdefault("head_dim", 256)
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
    def gguf_config(cls, base: ModelConfig, metadata: dict) -> Qwen35Config:
        """The family's config from a `qwen35moe` GGUF's metadata, over what `config_from_gguf`
        read (`base`); a missing key raises KeyError naming it."""
        a = metadata["general.architecture"]

        def need(key: str):
            return gguf_required(metadata, f"{a}.{key}")

        layers = base.num_layers
        recurrent = metadata.get(f"{a}.attention.recurrent_layers")
        if recurrent is not None:
            # Where the file holds multi-token-prediction layers after the model's (skipped by the
            # loader), the list may cover them too.
            if isinstance(recurrent, list) and len(recurrent) > layers and \
                    len(recurrent) == metadata.get(f"{a}.block_count"):
                recurrent = recurrent[:layers]
            if not isinstance(recurrent, list) or len(recurrent) != layers:
                raise ExpertCacheError(f"{a}.attention.recurrent_layers {recurrent!r}: expected {layers} booleans")
            types = tuple("linear_attention" if r else "full_attention" for r in recurrent)
        else:
            types = default_layer_types(layers, need("full_attention_interval"))
        deltanet = attention = None
        if "linear_attention" in types:
            v_heads = need("ssm.time_step_rank")
            inner = need("ssm.inner_size")
            if inner % v_heads:
                raise ExpertCacheError(f"{a}.ssm.inner_size {inner} is not a multiple of {a}.ssm.time_step_rank "
                                       f"{v_heads}")
            deltanet = DeltaNetConfig(need("ssm.group_count"), v_heads, need("ssm.state_size"), inner // v_heads,
                                      conv_kernel=need("ssm.conv_kernel"), eps=base.rms_norm_eps,
                                      tiled_v_heads=True)
        if "full_attention" in types:
            rotary = metadata.get(f"{a}.rope.dimension_count", base.head_dim // 4)
            attention = GatedAttentionConfig(base.num_heads, base.num_kv_heads, base.head_dim, rotary,
                                             base.rms_norm_eps)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
        fields["norm_topk_prob"] = True  # as llama.cpp's qwen35moe graph, whatever the metadata says
        return Qwen35Config(**fields, layer_types=types, deltanet=deltanet, attention=attention, gguf=True)

    @classmethod
    def from_gguf(cls, hf_name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        # The converter stored g = 1 + w; the loader adds the 1 in fp32 (`unit_offset`), so w is
        # handed back: 1 + (g - 1) is g exactly for every fp32 g >= 0.5 (Sterbenz), all a norm
        # scale near 1 takes.
        if hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
            return t - 1.0
        return t

    @classmethod
    def names(cls, cfg: ModelConfig) -> dict[str, str]:
        return _WRAPPED_NAMES if getattr(cfg, "wrapped", False) else cls.tensor_names

    @classmethod
    def mixers(cls, cfg: ModelConfig) -> tuple[Mixer, ...]:
        if not isinstance(cfg, Qwen35Config):  # a config read without the family's fields
            raise ExpertCacheError(f"{cfg.model_type}: the layer types and DeltaNet shapes are unknown; "
                                   "expected a Hugging Face checkpoint (config.json with layer_types)")
        by_type = {}
        if cfg.deltanet is not None:
            by_type["linear_attention"] = (GGUFDeltaNet if cfg.gguf else DeltaNet)(cfg.deltanet, cfg.hidden_size)
        if cfg.attention is not None:
            by_type["full_attention"] = GatedAttention(cfg.attention, cfg.hidden_size, cfg.qkv_bias)
        return tuple(by_type[t] for t in cfg.layer_types)
