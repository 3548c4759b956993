"""OLMoE: QK-norm over the whole projection width (not per head), optional clip_qkv; the expert
width is `intermediate_size`, every layer is MoE, and attention never slides (transformers builds
OLMoE's mask causal whatever `sliding_window` a config holds)."""

from .arch import Architecture, Key
from .qwen3_moe import QWEN_EXPERT_LAYOUTS


class Olmoe(Architecture):
    model_types = ("olmoe",)
    gguf_architectures = ("olmoe",)
    expert_layouts = QWEN_EXPERT_LAYOUTS
    expert_width = Key("intermediate_size")
    o_bias = Key("attention_bias", False)
    qk_norm = "full"
    clip_qkv = Key("clip_qkv")
    slides = False
    default_rms_norm_eps = 1e-5
