"""Random-weight GGUF files with a real model's layer shapes and llama.cpp's Q4_K_M recipe, for
benchmarks where the bytes a copy moves must be real (`expertcache synth --quant q4_k_m`).

Every block is valid: random quants, and fp16 scale fields set so that weights have about the
spread of a trained layer's (fan-in^-0.5). The file is written as llama.cpp's converter writes a
Qwen3-MoE (`qwen3moe`), with a byte-level tokenizer, so that llama.cpp loads it too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter, TokenType
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from tqdm import tqdm

from ..checkpoint.writer import atomic_gguf, check_output_file
from ..errors import ExpertCacheError
from .synth import synth_config

QUANTS = ("q4_k_m",)
MARKER_KEY = "expertcache.written_by"
# Byte offsets of the fp16 scale fields in a block (ggml's block structs), and the scale that
# gives weights of unit spread from random quants and sub-scales.
_FP16 = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}
_UNIT = {Q.Q4_K: (1 / 170, 7.5 / 170), Q.Q6_K: (1 / 400,)}


def q4_k_m_type(name: str, layer: int, layers: int) -> Q:
    """llama.cpp's Q4_K_M choice for a tensor: Q6_K for `ffn_down`/`attn_v` on the first and last
    eighth of the layers and every third layer between, and for the output; Q4_K elsewhere."""
    more = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
    if name == "output.weight" or (more and ("ffn_down" in name or "attn_v" in name)):
        return Q.Q6_K
    return Q.Q4_K


def _blocks(rng: np.random.Generator, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[:-1]))
    n = rows * shape[-1] // block
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    spread = shape[-1] ** -0.5
    for at, unit in zip(_FP16[qtype], _UNIT[qtype]):
        raw[:, at:at + 2] = np.full(n, unit * spread, dtype=np.float16).view(np.uint8).reshape(n, 2)
    return raw.reshape(*shape[:-1], -1)


def add_byte_tokenizer(w: GGUFWriter, vocab: int, eos: int | None) -> None:
    """A byte-level BPE tokenizer as llama.cpp reads one: 256 byte tokens, the special tokens,
    unused fillers, and one merge (llama.cpp refuses a BPE vocabulary without merges)."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<|im_start|>", "<|endoftext|>", "<|im_end|>"]
    tokens = alphabet + specials + [f"[PAD{i}]" for i in range(vocab - len(alphabet) - len(specials))]
    types = [TokenType.NORMAL] * len(alphabet) + [TokenType.CONTROL] * len(specials) + \
        [TokenType.UNUSED] * (vocab - len(alphabet) - len(specials))
    free = len(alphabet) + len(specials)
    tokens[free], types[free] = "\u0120t", TokenType.NORMAL
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens[:vocab])
    w.add_token_types(types[:vocab])
    w.add_token_merges(["\u0120 t"])
    if eos is not None:
        w.add_eos_token_id(eos)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def synth_gguf(out: str | Path, like: str = "qwen3-30b-a3b", layers: int | None = 2, experts: int | None = None,
               top_k: int | None = None, vocab: int | None = 4096, quant: str = "q4_k_m", seed: int = 0,
               force: bool = False, progress: bool = True) -> Path:
    if quant not in QUANTS:
        raise ExpertCacheError(f"unknown --quant {quant!r}: expected one of {', '.join(QUANTS)}")
    raw = synth_config(like, layers, experts, top_k, vocab)
    if raw["model_type"] != "qwen3_moe":
        raise ExpertCacheError(f"--quant writes Qwen3-MoE shapes; --like {like!r} is {raw['model_type']}")
    out = check_output_file(Path(out), force, MARKER_KEY, _is_ours)
    L, D, E = raw["num_hidden_layers"], raw["hidden_size"], raw["num_experts"]
    I, H, G, Dh, V = (raw["moe_intermediate_size"], raw["num_attention_heads"], raw["num_key_value_heads"],
                      raw["head_dim"], raw["vocab_size"])
    with atomic_gguf(out, "qwen3moe") as w:
        w.add_string(MARKER_KEY, "expertcache synth")
        w.add_block_count(L)
        w.add_context_length(raw["max_position_embeddings"])
        w.add_embedding_length(D)
        w.add_feed_forward_length(raw["intermediate_size"])
        w.add_head_count(H)
        w.add_head_count_kv(G)
        w.add_key_length(Dh)
        w.add_value_length(Dh)
        w.add_rope_freq_base(raw["rope_theta"])
        w.add_layer_norm_rms_eps(raw["rms_norm_eps"])
        w.add_expert_count(E)
        w.add_expert_used_count(raw["num_experts_per_tok"])
        w.add_expert_feed_forward_length(I)
        w.add_file_type(15)  # MOSTLY_Q4_K_M
        add_byte_tokenizer(w, V, raw["eos_token_id"])
        rng = np.random.default_rng(seed)
        tensors = [("token_embd.weight", (V, D)), ("output_norm.weight", (D,)), ("output.weight", (V, D))]
        for i in range(L):
            p = f"blk.{i}."
            tensors += [(p + "attn_norm.weight", (D,)), (p + "ffn_norm.weight", (D,)),
                        (p + "attn_q.weight", (H * Dh, D)), (p + "attn_k.weight", (G * Dh, D)),
                        (p + "attn_v.weight", (G * Dh, D)), (p + "attn_output.weight", (D, H * Dh)),
                        (p + "attn_q_norm.weight", (Dh,)), (p + "attn_k_norm.weight", (Dh,)),
                        (p + "ffn_gate_inp.weight", (E, D)), (p + "ffn_gate_exps.weight", (E, I, D)),
                        (p + "ffn_up_exps.weight", (E, I, D)), (p + "ffn_down_exps.weight", (E, D, I))]
        for name, shape in tqdm(tensors, desc="synth", unit="tensor", disable=not progress):
            if len(shape) == 1:
                w.add_tensor(name, np.ones(shape, dtype=np.float32))
            elif name.endswith("ffn_gate_inp.weight"):  # llama.cpp keeps the router in F32
                w.add_tensor(name, (rng.standard_normal(shape) * shape[-1] ** -0.5).astype(np.float32))
            else:
                layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
                qtype = q4_k_m_type(name, layer, L)
                w.add_tensor(name, _blocks(rng, qtype, shape), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file(progress=False)
    return out


def _is_ours(path: Path) -> bool:
    try:
        return MARKER_KEY in {f.name for f in GGUFReader(path).fields.values()}
    except Exception:  # not a GGUF at all: certainly not ours
        return False
