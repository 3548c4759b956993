"""Random-weight checkpoints with a real model's layer shapes, for benchmarks where copy costs
must be real. Written as an ordinary Hugging Face checkpoint (per-expert keys, as
`save_pretrained` writes them), with a byte-level tokenizer so every command can run on it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from ..checkpoint.writer import PlannedTensor, atomic_output_dir, write_safetensors
from ..config import parse_dtype
from ..errors import ExpertCacheError
from . import for_model_type
from .loader import expected_shapes, optional_shapes
from .gemma4 import default_layer_types as gemma4_layer_types
from .qwen3_5_moe import default_layer_types

# What `synth --quant` writes as a GGUF file (`synth_gguf`): llama.cpp's Q4_K_M recipe, or BF16.
QUANTS = ("q4_k_m", "bf16")

PRESETS = {
    # Qwen3-30B-A3B: 48 layers of 128 experts of 3 x 2048 x 768, top-8.
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          intermediate_size=6144, num_hidden_layers=48, vocab_size=151936,
                          max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, norm_topk_prob=True),
    # Qwen3.6-35B-A3B: 40 layers, three of every four Gated DeltaNet (16 key / 32 value heads of
    # 128), every fourth gated full attention (16 query / 2 kv heads of 256, a quarter rotated);
    # every layer 256 experts of 3 x 2048 x 512, top-8, and a shared expert of width 512.
    "qwen3.6-35b-a3b": dict(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"],
                            hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                            linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512, num_hidden_layers=40, vocab_size=248320,
                            max_position_embeddings=262144, rms_norm_eps=1e-6,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                             "partial_rotary_factor": 0.25}),
    # Gemma 4 26B-A4B (google/gemma-4-26B-A4B, its config.json's text_config): 30 layers, five
    # sliding-window layers (window 1024, 16 query / 8 kv heads of 256) to one full layer (16
    # query / 2 kv heads of 512, k-eq-v, proportional RoPE over a quarter); every layer a dense
    # GeGLU MLP of width 2112 beside 128 experts of GeGLU width 704, top-8; a tied LM head
    # soft-capped at 30. `--layers 2` gives one sliding and one full layer.
    "gemma-4-26b-a4b": dict(model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], hidden_size=2816,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
                            num_global_key_value_heads=2, attention_k_eq_v=True, sliding_window=1024,
                            enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
                            intermediate_size=2112, num_hidden_layers=30, vocab_size=262144,
                            max_position_embeddings=262144, rms_norm_eps=1e-6, final_logit_softcapping=30.0,
                            hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                             "full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                                                "partial_rotary_factor": 0.25}}),
    # Qwen3-235B-A22B's expert shape at a smaller width is not useful here; a small preset for tests.
    "tiny": dict(model_type="qwen3_moe", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, intermediate_size=96,
                 num_hidden_layers=2, vocab_size=512, max_position_embeddings=4096, rope_theta=1e6,
                 rms_norm_eps=1e-6, norm_topk_prob=True),
}


def synth_config(like: str, layers: int | None = None, experts: int | None = None, top_k: int | None = None,
                 vocab: int | None = None, dtype: str = "bfloat16", overrides: dict | None = None) -> dict:
    """The config.json of a `like` checkpoint. `overrides`: config keys set last, over the
    preset's and the arguments' (smaller shapes for a quick check; the caller keeps them
    consistent, e.g. `layer_types` with the layer count)."""
    if like not in PRESETS:
        raise ExpertCacheError(f"unknown --like {like!r}: expected one of {', '.join(PRESETS)}")
    raw = dict(PRESETS[like])
    if layers is not None:
        raw["num_hidden_layers"] = layers
    gemma = raw["model_type"] == "gemma4_text"
    if experts is not None:
        raw["num_experts"] = experts
    if top_k is not None:
        raw["top_k_experts" if gemma else "num_experts_per_tok"] = top_k
    k = raw["top_k_experts" if gemma else "num_experts_per_tok"]
    if experts is not None and top_k is None and k > experts:  # the preset's top-k does not fit
        raise ExpertCacheError(f"--experts {experts} is fewer than {like}'s top-k of {k}: "
                               f"give --top-k {experts} or less too")
    if vocab is not None:
        if vocab < 260:
            raise ExpertCacheError(f"vocab {vocab} must be at least 260 (256 bytes and the special tokens)")
        raw["vocab_size"] = vocab
    if raw["model_type"] == "qwen3_5_moe_text":
        raw["layer_types"] = list(default_layer_types(raw["num_hidden_layers"], raw["full_attention_interval"]))
    elif gemma:
        raw["layer_types"] = list(gemma4_layer_types(raw["num_hidden_layers"]))
    else:
        raw.update(architectures=["Qwen3MoeForCausalLM"], mlp_only_layers=[], decoder_sparse_step=1)
    if gemma:  # GeGLU, tied embeddings
        raw.update(hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
    else:
        raw.update(hidden_act="silu", tie_word_embeddings=False)
    raw.update(attention_bias=False, eos_token_id=257, bos_token_id=None,
               dtype=str(parse_dtype(dtype, "dtype")).removeprefix("torch."))
    raw.update(overrides or {})
    return raw


def synth(out: str | Path, like: str = "qwen3-30b-a3b", layers: int | None = 2, experts: int | None = None,
          top_k: int | None = None, vocab: int | None = 4096, dtype: str = "bfloat16", seed: int = 0,
          force: bool = False, progress: bool = True, overrides: dict | None = None) -> Path:
    raw = synth_config(like, layers, experts, top_k, vocab, dtype, overrides)
    arch = for_model_type(raw["model_type"], f"--like {like}")
    cfg = arch.config_from_hf(raw)
    torch_dtype = parse_dtype(dtype)
    layout = arch.expert_layouts[0]
    gen = torch.Generator().manual_seed(seed)

    def random(shape, name):
        def produce():
            if name.endswith(("norm.weight", "scale", "layer_scalar")):  # Gemma 4's scales too
                # A unit scale: w, or 1 + w where the family adds the 1 to a norm's weight (but its
                # gated DeltaNet norm's); scales and the layer scalar multiply as they are.
                zero = (arch.unit_offset_norms and name.endswith("norm.weight")
                        and not name.endswith("linear_attn.norm.weight"))
                yield (torch.zeros if zero else torch.ones)(shape, dtype=torch_dtype)
                return
            # Scaled so that activations keep unit size through the layers.
            fan_in = shape[-1]
            yield (torch.randn(shape, generator=gen) * fan_in ** -0.5).to(torch_dtype)
        return produce

    # The tensors a checkpoint may leave out too (Gemma 4's layer_scalar): the published checkpoints
    # hold them, and transformers reported them missing from ours.
    shapes = {**expected_shapes(cfg, arch, layout), **optional_shapes(cfg, arch)}
    planned = [PlannedTensor(n, torch_dtype, s, random(s, n)) for n, s in shapes.items()]
    total = sum(t.nbytes for t in planned)
    with atomic_output_dir(Path(out), force) as tmp:
        with tqdm(total=total, unit="B", unit_scale=True, desc="synth",
                  disable=None if progress else True) as bar:  # None: a bar only on a terminal
            write_safetensors(tmp / "model.safetensors", planned, bar.update)
        (tmp / "config.json").write_text(json.dumps(raw, indent=2))
        write_byte_tokenizer(tmp, raw["vocab_size"])
    return Path(out)


def write_byte_tokenizer(directory: Path, vocab: int) -> None:
    """A byte-level tokenizer: 256 byte tokens and the special tokens, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    table = {ch: i for i, ch in enumerate(sorted(alphabet))}
    specials = ["<|im_start|>", "<|endoftext|>", "<|im_end|>"]
    for s in specials:
        table[s] = len(table)
    tok = Tokenizer(models.BPE(vocab=table, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(directory / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "bos_token": None, "chat_template": template}))
