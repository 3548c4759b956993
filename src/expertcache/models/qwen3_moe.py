"""Qwen3-MoE: per-head QK-norm, optional dense layers (`mlp_only_layers`, `decoder_sparse_step`)."""

from .base import ExpertLayout, MoEArch


class Qwen3Moe(MoEArch):
    model_type = "qwen3_moe"
    expert_layouts = (
        ExpertLayout("per-expert", router="mlp.gate.weight", gate="mlp.experts.{e}.gate_proj.weight",
                     up="mlp.experts.{e}.up_proj.weight", down="mlp.experts.{e}.down_proj.weight"),
        ExpertLayout("fused", router="mlp.gate.weight", gate_up="mlp.experts.gate_up_proj",
                     down="mlp.experts.down_proj"),
    )
