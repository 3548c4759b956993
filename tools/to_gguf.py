"""Write a Qwen3-MoE checkpoint (for example one from `expertcache synth`) as a bf16/f32 GGUF
file for llama.cpp, so `expertcache bench speed --vs-llamacpp` runs both engines on the same
weights.

    python tools/to_gguf.py -m /tmp/q30 -o /tmp/q30.gguf

llama.cpp's own converter (convert_hf_to_gguf.py) refuses tokenizers it does not recognise, such
as synth's byte-level one; this writes the same tensors and model metadata with the `gguf`
package's own name table and a GPT-2 style tokenizer entry built from tokenizer.json. An existing
output file is replaced only with --force, and only when this tool wrote it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from expertcache.checkpoint.writer import atomic_gguf, check_output_file  # noqa: E402
from expertcache.errors import ExpertCacheError  # noqa: E402
from expertcache.models.loader import open_model  # noqa: E402
from expertcache.models.synth_gguf import MARKER_KEY, _is_ours  # noqa: E402

# A BPE vocabulary needs tokenizer.ggml.merges in llama.cpp (and gguf refuses an empty array): for
# a tokenizer without merges, one that can never apply. Text starts as single characters and only
# merges join them, so a part longer than one character is never a piece; expertcache drops a
# merge whose parts are not tokens. A real merge (" t" into one token) changed the ids text gets.
NO_MERGE = "\u0120\u0120\u0120 \u0120\u0120\u0120"


def pre_tokenizer(tok: dict) -> str:
    """tokenizer.ggml.pre for tokenizer.json's split: llama.cpp splits text before BPE by the
    regexes that name stands for (`gguf_tokenizer.PRE_TOKENIZERS`); with another name its ids
    differ from tokenizer.json's ("default" split the bundled tokenizer's text otherwise)."""
    from expertcache.gguf_tokenizer import PRE_TOKENIZERS

    steps = tok.get("pre_tokenizer") or {}
    steps = steps.get("pretokenizers", [steps]) if steps.get("type") == "Sequence" else [steps]
    regexes = [s["pattern"]["Regex"] for s in steps if s.get("type") == "Split" and "Regex" in s.get("pattern", {})]
    if any(s.get("type") == "ByteLevel" and s.get("use_regex", True) for s in steps):
        regexes.append(PRE_TOKENIZERS["gpt-2"][0][0])  # ByteLevel's own split is GPT-2's
    for name, (want, _, _) in PRE_TOKENIZERS.items():
        if name != "default" and want == regexes:
            return name
    raise ExpertCacheError(f"tokenizer.json splits text by {regexes!r}, which no tokenizer.ggml.pre of "
                           "llama.cpp's names; expected a byte-level (GPT-2) split")


def to_numpy(t: torch.Tensor) -> tuple[np.ndarray, object]:
    import gguf

    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.uint16).numpy(), gguf.GGMLQuantizationType.BF16
    if t.dtype == torch.float16:
        return t.contiguous().numpy(), gguf.GGMLQuantizationType.F16
    return t.float().contiguous().numpy(), gguf.GGMLQuantizationType.F32


def _add_rope_scaling(w, rope, model_dir: Path) -> None:
    """The checkpoint's RoPE scaling, as llama.cpp's converter writes it: left out, the file would
    be another model (plain RoPE). YaRN's other parameters are ones llama.cpp fixes for qwen3moe."""
    import gguf

    if rope.type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope.factor)
    elif rope.type == "yarn":
        if (rope.beta_fast, rope.beta_slow, rope.attention_factor, rope.mscale, rope.mscale_all_dim,
                rope.truncate) != (32.0, 1.0, None, None, None, True):
            raise ExpertCacheError(f"model {str(model_dir)!r} sets YaRN parameters beyond factor and "
                                   "original_max_position_embeddings, which llama.cpp does not read for qwen3moe: "
                                   "expected a rope_scaling of {rope_type: yarn, factor, original_max_position_embeddings}")
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope.factor)
        w.add_rope_scaling_orig_ctx_len(rope.original_max_position)


def convert(model_dir: Path, out: Path, force: bool = False) -> None:
    import gguf

    # Before any work: never the source's weights, another GGUF (llama.cpp's own conversion of the
    # model, a quantized file) or any other file of the user's, in a directory that exists.
    out = check_output_file(out, force, "to_gguf's output", _is_ours)
    model_dir = Path(model_dir)
    m = open_model(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        raise ExpertCacheError(f"model {str(model_dir)!r} has no tokenizer.json: expected a Hugging Face "
                               "checkpoint directory with one")
    cfg, ckpt = m.cfg, m.ckpt
    if cfg.model_type != "qwen3_moe" or any(not s for s in cfg.sparse_layers):
        raise ExpertCacheError(f"model {str(model_dir)!r} is {cfg.model_type}"
                               f"{'' if cfg.model_type != 'qwen3_moe' else ' with dense layers'}: expected a "
                               "Qwen3-MoE checkpoint with every layer sparse")
    arch = gguf.MODEL_ARCH.QWEN3MOE
    names = gguf.get_tensor_name_map(arch, cfg.num_layers)
    # Written beside `out` and renamed in once complete: a failure leaves no partial file.
    with atomic_gguf(out, gguf.MODEL_ARCH_NAMES[arch]) as w:
        w.add_block_count(cfg.num_layers)
        w.add_context_length(cfg.max_position)
        w.add_embedding_length(cfg.hidden_size)
        w.add_feed_forward_length(cfg.intermediate_size or cfg.moe_intermediate_size)
        w.add_head_count(cfg.num_heads)
        w.add_head_count_kv(cfg.num_kv_heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_freq_base(cfg.rope.theta)
        _add_rope_scaling(w, cfg.rope, model_dir)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.top_k)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        w.add_string(MARKER_KEY, "tools/to_gguf.py")

        tok = json.loads((model_dir / "tokenizer.json").read_text())
        vocab = {**tok["model"]["vocab"], **{a["content"]: a["id"] for a in tok.get("added_tokens", [])}}
        tokens = [f"[PAD{i}]" for i in range(cfg.vocab_size)]
        types = [gguf.TokenType.UNUSED] * cfg.vocab_size
        special = {a["content"] for a in tok.get("added_tokens", [])}
        for text, i in vocab.items():
            if i < cfg.vocab_size:
                tokens[i] = text
                types[i] = gguf.TokenType.CONTROL if text in special else gguf.TokenType.NORMAL
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre_tokenizer(tok))
        w.add_token_list(tokens)
        w.add_token_types(types)
        merges = tok["model"].get("merges") or [NO_MERGE]
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
        if cfg.eos_token_id:
            w.add_eos_token_id(cfg.eos_token_id[0])

        for name in ckpt.tensors:
            if ".experts." in name:
                continue
            gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if gname is None:
                raise SystemExit(f"to_gguf: no GGUF name for {name}")
            t = ckpt.read(name)
            # llama.cpp adds norm weights to f32 activations: vectors are stored in f32.
            arr, kind = to_numpy(t.float() if t.ndim == 1 else t)
            w.add_tensor(gname, arr, raw_dtype=kind)
        src = m.experts
        D, I = cfg.hidden_size, cfg.moe_intermediate_size
        for layer in cfg.moe_layers:
            rows = torch.stack([src.read(layer, e).view(src.dtype) for e in range(cfg.num_experts)])  # [E, 3*I*D]
            parts = {"gate_proj": rows[:, : I * D].reshape(-1, I, D), "up_proj": rows[:, I * D: 2 * I * D].reshape(-1, I, D),
                     "down_proj": rows[:, 2 * I * D:].reshape(-1, D, I)}
            for part, t in parts.items():
                gname = names.get_name(f"model.layers.{layer}.mlp.experts.{part}.weight", try_suffixes=(".weight",))
                arr, kind = to_numpy(t)
                w.add_tensor(gname, arr, raw_dtype=kind)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file(progress=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True, type=Path)
    ap.add_argument("-o", "--output", required=True, type=Path)
    ap.add_argument("--force", action="store_true", help="replace an earlier output of this tool")
    args = ap.parse_args(argv)
    try:
        convert(args.model, args.output, args.force)
    except ExpertCacheError as e:
        print(f"to_gguf: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
