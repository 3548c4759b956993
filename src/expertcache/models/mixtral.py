"""Mixtral: experts named w1 (gate), w3 (up), w2 (down) under `block_sparse_moe`; the top-k
routing weights are always renormalised and kept in fp32."""

from .base import ExpertLayout, MoEArch


class Mixtral(MoEArch):
    model_type = "mixtral"
    router_weights_fp32 = True
    expert_layouts = (
        ExpertLayout("per-expert", router="block_sparse_moe.gate.weight",
                     gate="block_sparse_moe.experts.{e}.w1.weight", up="block_sparse_moe.experts.{e}.w3.weight",
                     down="block_sparse_moe.experts.{e}.w2.weight"),
        ExpertLayout("fused", router="mlp.gate.weight", gate_up="mlp.experts.gate_up_proj",
                     down="mlp.experts.down_proj"),
    )
