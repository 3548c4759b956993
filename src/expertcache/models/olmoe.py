"""OLMoE: QK-norm over the whole projection width (not per head), optional clip_qkv."""

from .qwen3_moe import Qwen3Moe


class Olmoe(Qwen3Moe):
    # Same expert tensor names as Qwen3-MoE; the QK-norm difference lives in the config.
    model_type = "olmoe"
