"""Random-weight GGUF files with a real model's layer shapes and llama.cpp's Q4_K_M recipe (or
BF16), for benchmarks where the bytes a copy moves must be real (`expertcache synth --quant
q4_k_m`).

Every block is valid: random quants, and fp16 scale fields set so that weights have about the
spread of a trained layer's (fan-in^-0.5). The file is written as llama.cpp's converter writes a
Qwen3-MoE (`qwen3moe`) or a Gemma 4 (`gemma4`), with a byte-level tokenizer, so that llama.cpp
loads it too. Rows whose length is not a multiple of 256 take the type llama.cpp's quantizer falls
back to (Q4_K -> Q5_0, Q6_K -> Q8_0): Gemma 4's expert width 704 and dense width 2112 are such rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter, TokenType
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from tqdm import tqdm

from ..checkpoint.writer import atomic_gguf, check_output_file
from ..errors import ExpertCacheError
from . import for_model_type
from .synth import QUANTS, synth_config

MARKER_KEY = "expertcache.written_by"
# Byte offsets of the fp16 scale fields in a block (ggml's block structs), and the scale that
# gives weights of unit spread from random quants and sub-scales.
_FP16 = {Q.Q4_K: (0, 2), Q.Q6_K: (208,), Q.Q5_0: (0,), Q.Q8_0: (0,)}
_UNIT = {Q.Q4_K: (1 / 170, 7.5 / 170), Q.Q6_K: (1 / 400,), Q.Q5_0: (1 / 9.2,), Q.Q8_0: (1 / 74,)}
# llama.cpp's quantizer, for rows that are not a whole number of 256-weight super-blocks.
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}


def q4_k_m_type(name: str, layer: int, layers: int) -> Q:
    """llama.cpp's Q4_K_M choice for a tensor: Q6_K for `ffn_down`/`attn_v` on the first and last
    eighth of the layers and every third layer between, and for the output; Q4_K elsewhere."""
    more = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
    if name == "output.weight" or (more and ("ffn_down" in name or "attn_v" in name)):
        return Q.Q6_K
    return Q.Q4_K


def with_fallback(qtype: Q, row: int) -> Q:
    """The type llama.cpp's quantizer writes for `qtype` on rows of `row` weights."""
    block = GGML_QUANT_SIZES[qtype][0]
    return _FALLBACK.get(qtype, qtype) if row % block else qtype


def _bf16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Normal weights of spread fan-in^-0.5 as BF16 bytes [..., 2 * cols] (rounded to nearest)."""
    x = (rng.standard_normal(shape, dtype=np.float32) * np.float32(shape[-1] ** -0.5)).view(np.uint32)
    x = ((x + 0x7FFF + ((x >> 16) & 1)) >> 16).astype(np.uint16)
    return x.view(np.uint8).reshape(*shape[:-1], -1)


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
               force: bool = False, progress: bool = True, overrides: dict | None = None) -> Path:
    if quant not in QUANTS:
        raise ExpertCacheError(f"unknown --quant {quant!r}: expected one of {', '.join(QUANTS)}")
    raw = synth_config(like, layers, experts, top_k, vocab, overrides=overrides)
    if raw["model_type"] not in ("qwen3_moe", "gemma4_text"):
        raise ExpertCacheError(f"--quant writes Qwen3-MoE or Gemma 4 shapes; --like {like!r} is {raw['model_type']}")
    # The config checked as `synth` checks it (top-k against the experts, ...), before anything is
    # written: a file the loader then refuses is no output.
    for_model_type(raw["model_type"], f"--like {like}").config_from_hf(raw)
    out = check_output_file(Path(out), force, "a file written by expertcache", _is_ours)
    # numpy's generator takes only a non-negative seed, and --seed takes a signed 64-bit one too
    # (-1 ended in numpy's ValueError): read it as torch reads one, as 64 unsigned bits.
    seed %= 1 << 64
    if raw["model_type"] == "gemma4_text":
        return _gemma4(out, raw, quant, seed, progress)
    if quant != "q4_k_m":
        raise ExpertCacheError(f"--quant {quant} is written for Gemma 4 shapes only; --like {like!r} takes q4_k_m")
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
        for name, shape in tqdm(tensors, desc="synth", unit="tensor",
                                disable=None if progress else True):  # None: a bar only on a terminal
            if len(shape) == 1:
                w.add_tensor(name, np.ones(shape, dtype=np.float32))
            elif name.endswith("ffn_gate_inp.weight"):  # llama.cpp keeps the router in F32
                w.add_tensor(name, (rng.standard_normal(shape) * shape[-1] ** -0.5).astype(np.float32))
            else:
                layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
                # Rows narrower than a K-quant super-block (--like tiny's 64 and 32) take llama.cpp's
                # fallback type, as for Gemma 4 below: gguf-py refused them with a raw ValueError.
                qtype = with_fallback(q4_k_m_type(name, layer, L), shape[-1])
                w.add_tensor(name, _blocks(rng, qtype, shape), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file(progress=False)
    return out


def _gemma4(out: Path, raw: dict, quant: str, seed: int, progress: bool) -> Path:
    """A `gemma4` file as llama.cpp's converter writes one (see gemma4.py for what it reads)."""
    L, D, E, I = raw["num_hidden_layers"], raw["hidden_size"], raw["num_experts"], raw["moe_intermediate_size"]
    H, V, FF = raw["num_attention_heads"], raw["vocab_size"], raw["intermediate_size"]
    swa = [t == "sliding_attention" for t in raw["layer_types"]]
    head = {True: raw["head_dim"], False: raw["global_head_dim"]}
    kv = {True: raw["num_key_value_heads"], False: raw["num_global_key_value_heads"]}
    rope = raw["rope_parameters"]
    rotating = int(head[False] * rope["full_attention"]["partial_rotary_factor"] / 2)
    with atomic_gguf(out, "gemma4") as w:
        w.add_string(MARKER_KEY, "expertcache synth")
        w.add_block_count(L)
        w.add_context_length(raw["max_position_embeddings"])
        w.add_embedding_length(D)
        w.add_feed_forward_length(FF)
        w.add_head_count(H)
        w.add_head_count_kv([kv[s] for s in swa])
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        w.add_layer_norm_rms_eps(raw["rms_norm_eps"])
        w.add_expert_count(E)
        w.add_expert_used_count(raw["top_k_experts"])
        w.add_key_length(head[False])
        w.add_value_length(head[False])
        w.add_key_length_swa(head[True])
        w.add_value_length_swa(head[True])
        w.add_final_logit_softcapping(raw["final_logit_softcapping"])
        w.add_sliding_window(raw["sliding_window"])
        w.add_shared_kv_layers(0)
        w.add_embedding_length_per_layer_input(0)
        w.add_sliding_window_pattern(swa)
        w.add_expert_feed_forward_length(I)
        w.add_rope_dimension_count(head[False])
        w.add_rope_dimension_count_swa(head[True])
        w.add_file_type(15 if quant == "q4_k_m" else 32)  # MOSTLY_Q4_K_M, MOSTLY_BF16
        add_byte_tokenizer(w, V, raw["eos_token_id"])
        rng = np.random.default_rng(seed)
        # The full layers' proportional RoPE: frequencies past the rotating quarter divided by 1e30.
        w.add_tensor("rope_freqs.weight", np.array([1.0] * rotating + [1e30] * (head[False] // 2 - rotating),
                                                   dtype=np.float32))
        tensors = [("token_embd.weight", (V, D)), ("output_norm.weight", (D,))]
        for i in range(L):
            p, Dh, G = f"blk.{i}.", head[swa[i]], kv[swa[i]]
            tensors += [(p + n, (D,)) for n in ("attn_norm.weight", "post_attention_norm.weight", "ffn_norm.weight",
                                                 "post_ffw_norm_1.weight", "pre_ffw_norm_2.weight",
                                                 "post_ffw_norm_2.weight", "post_ffw_norm.weight",
                                                 "ffn_gate_inp.scale")]
            tensors += [(p + "layer_output_scale.weight", (1,)), (p + "ffn_down_exps.scale", (E,)),
                        (p + "attn_q_norm.weight", (Dh,)), (p + "attn_k_norm.weight", (Dh,)),
                        (p + "attn_q.weight", (H * Dh, D)), (p + "attn_k.weight", (G * Dh, D))]
            if swa[i]:  # full layers are k-eq-v: no attn_v
                tensors.append((p + "attn_v.weight", (G * Dh, D)))
            tensors += [(p + "attn_output.weight", (D, H * Dh)), (p + "ffn_gate.weight", (FF, D)),
                        (p + "ffn_up.weight", (FF, D)), (p + "ffn_down.weight", (D, FF)),
                        (p + "ffn_gate_inp.weight", (E, D)), (p + "ffn_gate_up_exps.weight", (E, 2 * I, D)),
                        (p + "ffn_down_exps.weight", (E, D, I))]
        for name, shape in tqdm(tensors, desc="synth", unit="tensor",
                                disable=None if progress else True):  # None: a bar only on a terminal
            if len(shape) == 1:
                w.add_tensor(name, np.ones(shape, dtype=np.float32))
            elif name.endswith("ffn_gate_inp.weight"):  # llama.cpp keeps the router in F32
                w.add_tensor(name, (rng.standard_normal(shape) * shape[-1] ** -0.5).astype(np.float32))
            elif quant == "bf16":
                w.add_tensor(name, _bf16(rng, shape), raw_dtype=Q.BF16)
            else:
                layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
                # Tied: the embedding is also the output, which the recipe gives Q6_K.
                qtype = Q.Q6_K if name == "token_embd.weight" else q4_k_m_type(name, layer, L)
                qtype = with_fallback(qtype, shape[-1])
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
