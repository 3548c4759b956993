"""Qwen2-MoE: q/k/v biases and a shared expert behind a sigmoid gate, beside the routed experts."""

from .arch import Architecture, Key
from .qwen3_moe import QWEN_EXPERT_LAYOUTS


class Qwen2Moe(Architecture):
    model_types = ("qwen2_moe",)
    gguf_architectures = ("qwen2moe",)
    expert_layouts = QWEN_EXPERT_LAYOUTS
    dense_layers = True
    qkv_bias = Key("qkv_bias", True)
    shared_expert_width = Key("shared_expert_intermediate_size", 0)
