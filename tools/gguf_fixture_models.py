"""Tiny random Hugging Face MoE checkpoints for the GGUF test fixtures, built with transformers.

`build_checkpoint(spec, tokenizer_dir, out_dir)` writes a real checkpoint (config.json,
model.safetensors in bf16, tokenizer.json, tokenizer_config.json) that llama.cpp's
convert_hf_to_gguf.py accepts. Every weight is a bf16 value held in fp32 before saving, so the
bf16 checkpoint, its F32 GGUF and the fp32 model built here are the same numbers.

Weights start from transformers' own initialisation (normal, std `init_std`); then norm weights
become 1 + 0.2 N(0, 1) and biases 0.02 N(0, 1) so that a loader which drops either changes the
output, and lm_head is scaled so that the logits of a fixed text have a standard deviation of
`logit_std`: the next-token distributions are far from uniform and a small error shows.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

# The text whose logits set lm_head's scale (any fixed text does).
SCALE_TEXT = "def __repr__(self):\n        return 'Use %s() or %s to exit' % (self.name, self.eof)"


@dataclass(frozen=True)
class FamilySpec:
    """One tiny checkpoint: a transformers model_type and the config values that differ from its
    defaults. `vocab_size` is filled from the tokenizer."""

    name: str
    model_type: str
    config: dict = field(default_factory=dict)
    seed: int = 0
    init_std: float = 0.05
    logit_std: float = 3.0
    save_dtype: str = "bfloat16"  # of model.safetensors
    # The tokenizer directory (relative to the repository) when it is not the bundled model's, and
    # its end-of-text and beginning-of-text tokens.
    tokenizer: str | None = None
    eos: str = "<|endoftext|>"
    bos: str | None = None


_S, _F = "sliding_attention", "full_attention"
GEMMA4_TOKENIZER = "tests/fixtures/gguf/gemma4/tokenizer"
# Rows of 32 (Q8_0's block) or more; saved in bf16 (Gemma 4's norms are stored as w, unchanged).
GEMMA4_BASE = dict(
    hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    sliding_window=16, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
    hidden_size_per_layer_input=0, num_kv_shared_layers=0, final_logit_softcapping=30.0,
    tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=4096)

# Row lengths (hidden, moe_intermediate_size, heads x head_dim) of qwen3_moe are multiples of 256
# so that K-quants are used as such; the other families are smaller (rows of 64 or 128) to keep the
# files small, so llama.cpp falls back from K-quants to 32-element blocks there. OLMoE has as many
# KV heads as heads: llama.cpp's olmoe wants its k-norm over n_embd values, so it refuses GQA.
FAMILIES = {
    "qwen3_moe": FamilySpec("qwen3_moe", "qwen3_moe", dict(
        hidden_size=256, intermediate_size=768, moe_intermediate_size=256, num_experts=8,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=1e-6,
        max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        seed=1),
    "qwen2_moe": FamilySpec("qwen2_moe", "qwen2_moe", dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=128,
        num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, norm_topk_prob=False, tie_word_embeddings=False, rms_norm_eps=1e-6,
        max_position_embeddings=4096, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), seed=2),
    "olmoe": FamilySpec("olmoe", "olmoe", dict(
        hidden_size=64, intermediate_size=64, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, norm_topk_prob=False, tie_word_embeddings=False,
        rms_norm_eps=1e-5, max_position_embeddings=4096, clip_qkv=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), seed=3),
    "mixtral": FamilySpec("mixtral", "mixtral", dict(
        hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rms_norm_eps=1e-5, max_position_embeddings=4096, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), seed=4),
    # Qwen3.5/3.6-MoE, text only: three DeltaNet layers and one gated attention layer, 2 key heads
    # for 4 value heads (so that the converter reorders value heads), a shared expert. Rows of 32
    # (Q8_0's block) and a tied embedding keep the F32 file under 1 MB. Saved in fp32: the
    # converter adds 1 to the norms and takes -exp(A_log) in the source dtype, which in bf16 would
    # round them away from what transformers computes.
    "qwen3_5_moe": FamilySpec("qwen3_5_moe", "qwen3_5_moe_text", dict(
        hidden_size=32, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
        seed=5, init_std=0.09, save_dtype="float32"),
    # Gemma 4 with the MoE block, text only: sliding layers (window 16, head dim 32, 2 KV heads)
    # and full layers (head dim 64, one KV head, k-eq-v: no v_proj), proportional RoPE on the full
    # layers, a dense GeGLU MLP beside 4 experts, a soft-capped tied LM head. Its converter needs
    # a Llama-style BPE tokenizer (byte fallback), so it has its own small Gemma-4-style one.
    "gemma4": FamilySpec("gemma4", "gemma4_text", dict(GEMMA4_BASE, layer_types=[_S, _F, _S, _F], num_hidden_layers=4,
                                                       global_head_dim=64, num_global_key_value_heads=1,
                                                       attention_k_eq_v=True),
                         seed=6, init_std=0.09, logit_std=1.0, tokenizer=GEMMA4_TOKENIZER, eos="<eos>",
                         bos="<bos>"),
    # The same without k-eq-v: every layer has v_proj and the full layers 2 KV heads. (With one
    # head dim for every layer transformers 5.24 saves no full-layer head dim, which the
    # converter refuses: an AssertionError in Gemma4Model.set_gguf_parameters.)
    "gemma4_v": FamilySpec("gemma4_v", "gemma4_text", dict(GEMMA4_BASE, layer_types=[_S, _F], num_hidden_layers=2,
                                                           global_head_dim=64, attention_k_eq_v=False),
                           seed=7, init_std=0.09, logit_std=1.0, tokenizer=GEMMA4_TOKENIZER, eos="<eos>",
                           bos="<bos>"),
}


def _config(spec: FamilySpec, vocab_size: int, eos_id: int, bos_id: int | None = None):
    import transformers as tf

    return tf.AutoConfig.for_model(spec.model_type, vocab_size=vocab_size, initializer_range=spec.init_std,
                                   bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id,
                                   **spec.config)


@torch.no_grad()
def build_model(spec: FamilySpec, tokenizer_dir: Path):
    """The fp32 transformers model of `spec`, every weight a bf16 value (see the module doc)."""
    import transformers as tf
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    cfg = _config(spec, tok.get_vocab_size(), tok.token_to_id(spec.eos),
                  tok.token_to_id(spec.bos) if spec.bos else None)
    torch.manual_seed(spec.seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(spec.seed + 1000)
    unit_offset = spec.model_type == "qwen3_5_moe_text"  # norms scale by 1 + w, but the gated one
    for name, p in model.named_parameters():
        if unit_offset and name.endswith("A_log"):
            p.copy_(torch.linspace(-4.0, 2.5, p.numel()))  # long and short memories
        elif unit_offset and name.endswith(("conv1d.weight", "dt_bias")):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        elif unit_offset and "norm" in name and not name.endswith("linear_attn.norm.weight"):
            # w with 1 + w a bf16 value, so that the converter's 1 + w is exact
            p.copy_((1.0 + 0.2 * torch.randn(p.shape, generator=gen)).to(torch.bfloat16).float() - 1.0)
        elif p.ndim == 1 and ("norm" in name or name.endswith("scale")):  # Gemma 4's router scales too
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        elif p.ndim == 1:
            p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):  # Gemma 4: 1 by default, which a loader could drop
            b.copy_(torch.empty(b.shape).uniform_(0.7, 1.3, generator=gen))
    ids = torch.tensor([tok.encode(SCALE_TEXT).ids])  # [1, T]
    std = model(ids).logits.float().std().item()
    model.get_output_embeddings().weight.mul_(spec.logit_std / std)
    for p in model.parameters():
        p.copy_(p.to(torch.bfloat16).float())
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):  # saved with the weights, so a bf16 value too
            b.copy_(b.to(torch.bfloat16).float())
    return model


def tokenizer_dir(spec: FamilySpec, root: Path, default: Path) -> Path:
    """The tokenizer directory `spec` is built with: its own, else `default` (the bundled model)."""
    return root / spec.tokenizer if spec.tokenizer else default


def build_checkpoint(spec: FamilySpec, tokenizer_dir: Path, out_dir: Path) -> Path:
    """Write the checkpoint of `spec` to `out_dir` (safetensors in `spec.save_dtype` + the
    tokenizer files)."""
    model = build_model(spec, tokenizer_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(getattr(torch, spec.save_dtype)).save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, out_dir / name)
    (out_dir / "generation_config.json").unlink(missing_ok=True)
    cfg = json.loads((out_dir / "config.json").read_text())
    assert cfg["model_type"] == spec.model_type, cfg["model_type"]
    return out_dir


def build_gemma4_tokenizer(out_dir: Path, heldout: Path, pieces: int = 512) -> Path:
    """A small Gemma-4-style tokenizer.json (what llama.cpp's Gemma 4 converter accepts: BPE with
    byte fallback, spaces as '▁', split only at newline runs): <pad> <eos> <bos> <unk>, the 256
    <0xXX> byte tokens, two newline runs, then BPE pieces trained on the held-out text."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    def shell(tok):
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
        return tok

    text = heldout.read_text(encoding="utf-8")
    trained = shell(Tokenizer(models.BPE()))
    trained.train_from_iterator(text[:200000].splitlines()[1::2],
                                trainers.BpeTrainer(vocab_size=pieces, show_progress=False, limit_alphabet=120))
    data = json.loads(trained.to_str())
    head = ["<pad>", "<eos>", "<bos>", "<unk>"]
    tokens = head + [f"<0x{b:02X}>" for b in range(256)] + ["\n", "\n\n"]
    tokens += [t for t, _ in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1]) if t not in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in data["model"]["merges"]]
    tok = shell(Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>")))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in head])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
              "pad_token": "<pad>", "unk_token": "<unk>", "add_bos_token": True, "model_max_length": 4096}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out_dir
