"""Gemma 4 with the MoE block (`enable_moe_block`): sliding-window and full attention layers
(`layer_types`; full layers with their own head dim and, with `attention_k_eq_v`, their own
key/value heads and no v_proj), proportional RoPE on full layers, and per layer a dense GeGLU MLP
beside the routed experts (`parallel_ffn.py`). Norms scale by w, in fp32; embeddings are scaled
by sqrt(D), the LM head is tied and the logits soft-capped.

The published checkpoints are multimodal (`gemma4`): the text config sits in `text_config` and
the text weights under `model.language_model.`, beside vision and audio towers, skipped. A
text-only checkpoint (`gemma4_text`, Gemma4ForCausalLM) keeps the usual `model.layers.` names.

GGUF files (`gemma4`, llama.cpp's converter) are read under the text-only names through gguf-py's
name map; the converter keeps every weight as it is (norms as w, the experts fused as
`ffn_gate_up_exps`, the router's `scale` as `ffn_gate_inp.scale`, `per_expert_scale` as
`ffn_down_exps.scale`). The layer kinds come from `attention.sliding_window_pattern`, the head
dims from `key_length` (full) and `key_length_swa`, the KV heads from the per-layer
`head_count_kv`, k-eq-v from the full layers having no `attn_v`, and the full layers'
proportional RoPE from the `rope_freqs` tensor (1 for the frequencies that rotate, 1e30 for the
rest).

Per-layer-input embeddings and key/value sharing between layers are not implemented: a config
that asks for them is refused, naming the key. A key the config leaves out is not such a request
(transformers' class defaults `hidden_size_per_layer_input` to 256, which a MoE checkpoint never
uses). `use_double_wide_mlp` widens only the MLPs of layers that share keys and values, which
are refused, so it changes nothing in a model that loads and is not checked.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..config import HIDDEN_ACTS, ModelConfig
from ..errors import ExpertCacheError
from .arch import HF_TENSOR_NAMES, Architecture, ExpertLayout, gguf_required
from .mixers import Mixer
from .parallel_ffn import ParallelFFN
from .sliding_attention import SlidingAttention, SlidingAttentionConfig, gemma_rms_norm

SLIDING, FULL = "sliding_attention", "full_attention"

_NAMES = {**HF_TENSOR_NAMES, "post_norm": "pre_feedforward_layernorm.weight"}
_WRAPPED_NAMES = {**_NAMES, "layer": "model.language_model.layers.{i}.",
                  "embed": "model.language_model.embed_tokens.weight",
                  "norm": "model.language_model.norm.weight"}

GEMMA4_LAYOUTS = (ExpertLayout("fused", router="router.proj.weight", gate_up="experts.gate_up_proj",
                               down="experts.down_proj"),)

# Options this engine does not run, with the value that means "off".
_UNSUPPORTED = (("hidden_size_per_layer_input", 0), ("num_kv_shared_layers", 0))


@dataclass(frozen=True, slots=True)
class Gemma4Config(ModelConfig):
    """`ModelConfig` plus what only this family has. `num_kv_heads`, `head_dim` describe the
    sliding layers; `full` the full layers' attention, `sliding` the sliding layers'."""

    layer_types: tuple[str, ...] = ()
    sliding: SlidingAttentionConfig | None = None
    full: SlidingAttentionConfig | None = None
    final_logit_softcapping: float | None = None
    wrapped: bool = False


def default_layer_types(layers: int) -> tuple[str, ...]:
    """transformers' default: five sliding layers to one full, the last layer always full."""
    types = [SLIDING if (i + 1) % 6 else FULL for i in range(layers)]
    return tuple(types[:-1] + [FULL]) if types else ()


class Gemma4(Architecture):
    model_types = ("gemma4", "gemma4_text")
    gguf_architectures = ("gemma4",)
    gguf_norm_topk_prob = True
    gguf_config_reads_file = True  # rope_freqs and which layers have attn_v
    gguf_extra_tensors = ("rope_freqs.weight",)  # read by `_rotary_factor`
    expert_layouts = GEMMA4_LAYOUTS
    norm_topk_prob = True
    qkv_bias = False
    tensor_names = _NAMES
    sliding_window_switch = None
    skipped_prefixes = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")

    @classmethod
    def _from_hf(cls, raw: dict) -> Gemma4Config:
        wrapped = "text_config" in raw
        text = raw["text_config"] if wrapped else raw
        if not isinstance(text, dict):
            raise ExpertCacheError(f"text_config: expected a JSON object, got {type(text).__name__}")
        merged = {**{k: v for k, v in raw.items() if k not in ("text_config", "vision_config", "audio_config")},
                  **text}
        for key, off in _UNSUPPORTED:
            if merged.get(key) not in (None, off):
                raise ExpertCacheError(f"{key} {merged[key]!r} is not supported (expected {off}: per-layer "
                                       "input embeddings and key/value sharing between layers are not implemented)")
        if not merged.get("enable_moe_block"):
            raise ExpertCacheError(f"enable_moe_block {merged.get('enable_moe_block')!r}: expected true "
                                   "(only Gemma 4 models with the MoE block are supported)")
        if merged.get("attention_bias"):
            raise ExpertCacheError(f"attention_bias {merged['attention_bias']!r} is not supported (expected false)")
        if merged.get("use_bidirectional_attention") == "all":
            raise ExpertCacheError("use_bidirectional_attention 'all' is not supported (expected null or 'vision')")
        for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            if merged.get(key) is None:
                raise KeyError(key)
        act = merged.get("hidden_activation", merged.get("hidden_act", "gelu_pytorch_tanh"))
        if act not in HIDDEN_ACTS:
            raise ExpertCacheError(f"hidden_activation {act!r} is not supported: expected "
                                   f"{' or '.join(repr(a) for a in HIDDEN_ACTS)}")
        layers = merged.get("num_hidden_layers", 30)
        types = merged.get("layer_types") or default_layer_types(layers if isinstance(layers, int) else 0)
        if not isinstance(types, (list, tuple)) or len(types) != layers:
            raise ExpertCacheError(f"layer_types {types!r}: expected a list of {layers} layer types")
        # transformers makes the last layer full whatever the config says (with a warning).
        types = tuple(types[:-1]) + (FULL,) if types else ()
        for i, t in enumerate(types):
            if t not in (SLIDING, FULL):
                raise ExpertCacheError(f"unsupported layer type {t!r} (layer {i} of layer_types): expected "
                                       f"{SLIDING} or {FULL}")
        rope = merged.get("rope_parameters") or {}
        sliding_rope = rope.get(SLIDING) or {"rope_type": "default", "rope_theta": 10_000.0}
        full_rope = rope.get(FULL) or {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                       "rope_theta": 1_000_000.0}
        # transformers' class defaults for what a saved config may leave out.
        base_raw = {"max_position_embeddings": 131_072, "head_dim": 256, "num_attention_heads": 8,
                    "num_key_value_heads": 4, "sliding_window": 512, "tie_word_embeddings": True,
                    "intermediate_size": 9216, "eos_token_id": 1, "bos_token_id": 2, **merged,
                    "num_experts_per_tok": merged["top_k_experts"], "hidden_act": act,
                    "rope_parameters": None, "rope_scaling": None, "rope_theta": 10_000.0}
        base = super()._from_hf(base_raw)
        heads, eps = base.num_heads, base.rms_norm_eps
        full_head, full_kv = _full_attention_shape(merged, types, base)
        sliding = SlidingAttentionConfig(heads, base.num_kv_heads, base.head_dim,
                                         float(_rope(sliding_rope, SLIDING)), 1.0, base.sliding_window,
                                         False, eps)
        full = SlidingAttentionConfig(heads, full_kv, full_head, float(_rope(full_rope, FULL)),
                                      _rotated_share(full_rope), None,
                                      bool(merged.get("attention_k_eq_v", False)), eps)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
        fields["intermediate_size"] = base_raw["intermediate_size"]
        fields["model_type"] = raw.get("model_type") if raw.get("model_type") in cls.model_types else base.model_type
        cap = merged.get("final_logit_softcapping")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap == 0
                                or not math.isfinite(cap)):
            # transformers caps whenever the value is not null: by 0 it divides every logit by zero
            # (all logits 0 or NaN), so 0 is no way to turn the cap off.
            raise ExpertCacheError(f"final_logit_softcapping {cap!r}: expected a finite nonzero number, or null "
                                   "for no soft-capping")
        return Gemma4Config(**fields, layer_types=tuple(types), sliding=sliding, full=full,
                            final_logit_softcapping=None if cap is None else float(cap), wrapped=wrapped)

    @classmethod
    def gguf_config(cls, base: ModelConfig, metadata: dict, gg) -> Gemma4Config:
        """The family's config from a `gemma4` GGUF file (`gg`: its metadata and tensor table),
        over what `config_from_gguf` read (`base`); a missing key raises KeyError naming it."""
        a = metadata["general.architecture"]

        def need(key: str):
            return gguf_required(metadata, f"{a}.{key}")

        layers = base.num_layers
        for key, off in (("embedding_length_per_layer_input", 0), ("attention.shared_kv_layers", 0)):
            if metadata.get(f"{a}.{key}") not in (None, off):
                raise ExpertCacheError(f"{a}.{key} {metadata[f'{a}.{key}']!r} is not supported (expected {off}: "
                                       "per-layer input embeddings and key/value sharing are not implemented)")
        pattern = need("attention.sliding_window_pattern")
        if not isinstance(pattern, list) or len(pattern) != layers:
            raise ExpertCacheError(f"{a}.attention.sliding_window_pattern {pattern!r}: expected {layers} booleans")
        types = tuple(SLIDING if p else FULL for p in pattern)
        if not all(base.sparse_layers):
            dense = base.sparse_layers.index(False)
            raise ExpertCacheError(f"tensor 'blk.{dense}.ffn_gate_inp.weight' is missing: expected the MoE block "
                                   "in every layer")
        kv = metadata.get(f"{a}.attention.head_count_kv", base.num_heads)
        kv = kv if isinstance(kv, list) else [kv] * layers
        if len(kv) != layers:
            raise ExpertCacheError(f"{a}.attention.head_count_kv {kv!r}: expected {layers} values")
        head = {SLIDING: need("attention.key_length_swa"), FULL: need("attention.key_length")}
        value = {SLIDING: metadata.get(f"{a}.attention.value_length_swa", head[SLIDING]),
                 FULL: metadata.get(f"{a}.attention.value_length", head[FULL])}
        rot = {SLIDING: metadata.get(f"{a}.rope.dimension_count_swa", head[SLIDING]),
               FULL: metadata.get(f"{a}.rope.dimension_count", head[FULL])}
        suffix = {SLIDING: "_swa", FULL: ""}
        heads_kv = {}
        for kind in (SLIDING, FULL):
            if value[kind] != head[kind]:
                raise ExpertCacheError(f"{a}.attention.value_length{suffix[kind]} {value[kind]}: expected the key "
                                       f"length {head[kind]}")
            if rot[kind] != head[kind]:
                raise ExpertCacheError(f"{a}.rope.dimension_count{suffix[kind]} {rot[kind]}: expected the head dim "
                                       f"{head[kind]} (RoPE over the whole head)")
            counts = {kv[i] for i, t in enumerate(types) if t == kind}
            if len(counts) > 1:
                raise ExpertCacheError(f"{a}.attention.head_count_kv {kv!r}: {kind} layers with different counts")
            heads_kv[kind] = counts.pop() if counts else kv[0]
        ff = need("feed_forward_length")
        if isinstance(ff, list):
            if len(set(ff)) != 1:
                raise ExpertCacheError(f"{a}.feed_forward_length {ff!r}: layers of different widths (double-wide "
                                       "MLPs of shared-KV layers) are not supported")
            ff = ff[0]
        full_layers = [i for i, t in enumerate(types) if t == FULL]
        with_v = {f"blk.{i}.attn_v.weight" in gg for i in full_layers}
        if len(with_v) > 1:
            raise ExpertCacheError("full-attention layers with and without 'attn_v': expected one or the other")
        k_eq_v = with_v == {False}
        theta = base.rope.theta
        theta_swa = float(metadata.get(f"{a}.rope.freq_base_swa", theta))
        factor = _rotary_factor(gg, head[FULL]) if full_layers else 1.0
        eps = base.rms_norm_eps
        sliding = SlidingAttentionConfig(base.num_heads, heads_kv[SLIDING], head[SLIDING], theta_swa, 1.0,
                                         need("attention.sliding_window"), False, eps)
        full = SlidingAttentionConfig(base.num_heads, heads_kv[FULL], head[FULL], theta, factor, None, k_eq_v, eps)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
        fields.update(num_kv_heads=heads_kv[SLIDING], head_dim=head[SLIDING], intermediate_size=ff,
                      norm_topk_prob=True, hidden_act="gelu_pytorch_tanh", sliding_window=sliding.window)
        # As llama.cpp: 30 where the key is absent (its default), no cap where it is 0.
        cap = metadata.get(f"{a}.final_logit_softcapping", 30.0)
        return Gemma4Config(**fields, layer_types=types, sliding=sliding, full=full,
                            final_logit_softcapping=float(cap) if cap else None)

    @classmethod
    def names(cls, cfg: ModelConfig) -> dict[str, str]:
        return _WRAPPED_NAMES if getattr(cfg, "wrapped", False) else cls.tensor_names

    @classmethod
    def mixers(cls, cfg: ModelConfig) -> tuple[Mixer, ...]:
        if not isinstance(cfg, Gemma4Config):
            raise ExpertCacheError(f"{cfg.model_type}: the layer types and attention shapes are unknown; "
                                   "expected a Hugging Face checkpoint (config.json)")
        by_type = {SLIDING: SlidingAttention(cfg.sliding, cfg.hidden_size),
                   FULL: SlidingAttention(cfg.full, cfg.hidden_size)}
        return tuple(by_type[t] for t in cfg.layer_types)

    @classmethod
    def block(cls, cfg: ModelConfig) -> ParallelFFN:
        return ParallelFFN(cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.top_k, cfg.hidden_act,
                           cfg.rms_norm_eps)

    @classmethod
    def dense_options(cls, cfg: ModelConfig) -> dict:
        return {"rms_norm": gemma_rms_norm, "embed_scale": math.sqrt(cfg.hidden_size),
                "logit_softcap": getattr(cfg, "final_logit_softcapping", None)}


def _rotary_factor(gg, head_dim: int) -> float:
    """The share of the full layers' frequencies that rotate, from the GGUF's `rope_freqs`
    (ggml divides each frequency by its factor: 1 keeps it, 1e30 stops it)."""
    name = "rope_freqs.weight"
    if name not in gg:
        return 1.0
    info = gg.info(name)
    f = gg.read(name).view(info.storage).view(-1).float()                     # [Dh/2]
    n = int((f == 1.0).long().cumprod(0).sum())
    if f.numel() != head_dim // 2 or not bool((f[n:] >= 1e29).all()):
        raise ExpertCacheError(f"{info.file}: tensor {name!r} holds {f.tolist()[:8]}...: expected {head_dim // 2} "
                               "values, 1 for the frequencies that rotate and then 1e30 (proportional RoPE)")
    factor = 2 * n / head_dim
    if int(factor * head_dim // 2) != n:  # what `SlidingAttentionConfig.inv_freq` will take
        raise ExpertCacheError(f"{info.file}: tensor {name!r}: {n} rotating frequencies of {head_dim // 2} "
                               "cannot be expressed as a rotary factor")
    return factor


def _rope(params: dict, kind: str) -> float:
    allowed = ("default",) if kind == SLIDING else ("default", "proportional")
    t = params.get("rope_type", "default")
    if t not in allowed:
        raise ExpertCacheError(f"rope_parameters.{kind}.rope_type {t!r}: expected {' or '.join(allowed)}")
    if params.get("factor", 1.0) != 1.0:
        raise ExpertCacheError(f"rope_parameters.{kind}.factor {params['factor']!r}: expected 1.0")
    return params.get("rope_theta", 10_000.0 if kind == SLIDING else 1_000_000.0)


def _rotated_share(params: dict) -> float:
    """The share of a full layer's head that rotates. Only proportional RoPE reads
    `partial_rotary_factor`: transformers' default RoPE for Gemma 4 rotates the whole head
    whatever the factor says, so a factor beside `rope_type: default` changes nothing."""
    if params.get("rope_type", "default") != "proportional":
        return 1.0
    return float(params.get("partial_rotary_factor", 1.0))


def _full_attention_shape(raw: dict, types, base: ModelConfig) -> tuple[int, int]:
    """(head dim, key/value heads) of the full layers: from `per_layer_config` (transformers 5.24
    writes it, leaving out layers of the shared shape), else `global_head_dim` (512 when absent, as transformers) and, with
    `attention_k_eq_v` only, `num_global_key_value_heads`."""
    per_layer = raw.get("per_layer_config")
    if per_layer is not None and not isinstance(per_layer, dict):
        raise ExpertCacheError(f"per_layer_config {per_layer!r}: expected a JSON object")
    if per_layer is not None:  # present, even empty: layers it leaves out keep the shared shape
        shapes = set()
        for i, t in enumerate(types):
            o = per_layer.get(str(i), per_layer.get(i)) or {}
            if not isinstance(o, dict):
                raise ExpertCacheError(f"per_layer_config[{i}] {o!r}: expected a JSON object")
            unknown = set(o) - {"head_dim", "num_key_value_heads"}
            if unknown:
                raise ExpertCacheError(f"per_layer_config[{i}].{sorted(unknown)[0]} is not supported "
                                       "(expected head_dim and num_key_value_heads only)")
            shape = (o.get("head_dim", base.head_dim), o.get("num_key_value_heads", base.num_kv_heads))
            if t == SLIDING and shape != (base.head_dim, base.num_kv_heads):
                raise ExpertCacheError(f"per_layer_config[{i}] {o!r}: a sliding layer with its own shape is "
                                       "not supported")
            if t == FULL:
                shapes.add(shape)
        if len(shapes) > 1:
            raise ExpertCacheError(f"per_layer_config: full layers of different shapes {sorted(shapes)}; "
                                   "expected one")
        if shapes:
            return shapes.pop()
    head = raw.get("global_head_dim") or 512
    kv = raw.get("num_global_key_value_heads") if raw.get("attention_k_eq_v") else None
    return head, kv or base.num_kv_heads
