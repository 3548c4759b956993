"""Qwen3-MoE: per-head QK-norm, optional dense layers (`mlp_only_layers`, `decoder_sparse_step`)."""

from .arch import Architecture, ExpertLayout, Key

# The expert names every Qwen-style family shares, in both layouts transformers writes.
QWEN_EXPERT_LAYOUTS = (
    ExpertLayout("per-expert", router="mlp.gate.weight", gate="mlp.experts.{e}.gate_proj.weight",
                 up="mlp.experts.{e}.up_proj.weight", down="mlp.experts.{e}.down_proj.weight"),
    ExpertLayout("fused", router="mlp.gate.weight", gate_up="mlp.experts.gate_up_proj",
                 down="mlp.experts.down_proj"),
)


class Qwen3Moe(Architecture):
    model_types = ("qwen3_moe",)
    gguf_architectures = ("qwen3moe",)
    expert_layouts = QWEN_EXPERT_LAYOUTS
    dense_layers = True
    o_bias = Key("attention_bias", False)
    qk_norm = "head"
    gguf_norm_topk_prob = True
    default_max_position = 32768
