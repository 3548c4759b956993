"""OLMoE: QK-norm over the whole projection width (not per head), optional clip_qkv; the expert
width is `intermediate_size` and every layer is MoE."""

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
