"""Mixtral: experts named w1 (gate), w3 (up), w2 (down) under `block_sparse_moe`; the top-k
routing weights are always renormalised and kept in fp32; a sliding window whenever one is set; no
attention biases (transformers' Mixtral has none, whatever `attention_bias` says).
llama.cpp writes Mixtral as `llama` with an expert count, which tells it apart from a dense Llama."""

from .arch import Architecture, ExpertLayout, Key


class Mixtral(Architecture):
    model_types = ("mixtral",)
    gguf_architectures = ("llama",)
    expert_layouts = (
        ExpertLayout("per-expert", router="block_sparse_moe.gate.weight",
                     gate="block_sparse_moe.experts.{e}.w1.weight", up="block_sparse_moe.experts.{e}.w3.weight",
                     down="block_sparse_moe.experts.{e}.w2.weight"),
        ExpertLayout("fused", router="mlp.gate.weight", gate_up="mlp.experts.gate_up_proj",
                     down="mlp.experts.down_proj"),
    )
    expert_width = Key("intermediate_size")
    qkv_bias = False
    norm_topk_prob = True
    sliding_window_switch = None
    router_weights_fp32 = True
    # transformers' MixtralConfig defaults, for a config.json that leaves these out.
    default_rope_theta = 1e6
    default_rms_norm_eps = 1e-5
    default_max_position = 4096 * 32

    gguf_norm_topk_prob = True

    @classmethod
    def from_gguf(cls, hf_name: str, t, cfg):
        # llama.cpp's converter interleaves the two rotary halves of each q/k head (`permute`);
        # put each head's rows back in rotate-half order.
        heads = cfg.num_heads if hf_name.endswith("q_proj.weight") else \
            cfg.num_kv_heads if hf_name.endswith("k_proj.weight") else None
        if heads is None:
            return t
        return t.reshape(heads, t.shape[0] // heads // 2, 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    @classmethod
    def matches_gguf(cls, metadata: dict) -> bool:
        return (metadata.get("llama.expert_count") or 0) > 0
