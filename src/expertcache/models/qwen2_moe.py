"""Qwen2-MoE: q/k/v biases and a shared expert behind a sigmoid gate, beside the routed experts."""

from .qwen3_moe import Qwen3Moe


class Qwen2Moe(Qwen3Moe):
    # Same expert tensor names as Qwen3-MoE; the shared expert is a dense part of the layer.
    model_type = "qwen2_moe"
