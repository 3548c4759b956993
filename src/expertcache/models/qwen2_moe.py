"""Qwen2-MoE: q/k/v biases and a shared expert behind a sigmoid gate, beside the routed experts;
with `use_sliding_window`, the window applies only to the layers `layer_types` names."""

from ..errors import ExpertCacheError
from .arch import Architecture, Key
from .qwen3_moe import QWEN_EXPERT_LAYOUTS


class Qwen2Moe(Architecture):
    model_types = ("qwen2_moe",)
    gguf_architectures = ("qwen2moe",)
    expert_layouts = QWEN_EXPERT_LAYOUTS
    dense_layers = True
    qkv_bias = Key("qkv_bias", True)
    # transformers' Qwen2MoeConfig defaults, for a config.json that leaves the keys out.
    dense_width = Key("intermediate_size", 5632)
    shared_expert_width = Key("shared_expert_intermediate_size", 5632)
    default_max_position = 32768

    @classmethod
    def _from_hf(cls, raw: dict):
        # Qwen2MoeConfig's window where `use_sliding_window` asks for one and gives no size.
        return super()._from_hf({"sliding_window": 4096, **raw})

    @classmethod
    def sliding_layers(cls, raw: dict, layers: int) -> tuple[bool, ...]:
        # transformers' Qwen2MoeConfig: without `layer_types`, every other layer from the first
        # slides, up to `max_window_layers`; the rest attend to every position.
        types = raw.get("layer_types")
        if types is None:
            limit = raw.get("max_window_layers")
            limit = 28 if limit is None else limit
            if isinstance(limit, bool) or not isinstance(limit, int):
                raise ExpertCacheError(f"max_window_layers {limit!r}: expected an integer")
            return tuple(i % 2 == 0 and i < limit for i in range(layers))
        kinds = ("sliding_attention", "full_attention")
        if not isinstance(types, list) or len(types) != layers or any(t not in kinds for t in types):
            raise ExpertCacheError(f"layer_types {types!r}: expected a list of {layers} of {' or '.join(kinds)}")
        return tuple(t == "sliding_attention" for t in types)
