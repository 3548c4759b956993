"""Vocabulary-only GGUF files for the SentencePiece ('llama') and 'gemma4' tokenizer kinds, with
the token ids llama.cpp gives for a set of texts, for tests/test_gguf_tokenizer.py.

    python tools/gguf_tokenizer_fixtures.py build OUT_DIR     # the .gguf files (tokenizers, gguf)
    python tools/gguf_tokenizer_fixtures.py record OUT_DIR    # the ids, with llama-cpp-python

The vocabularies are trained here with the `tokenizers` library on the bundled held-out text, so
nothing is downloaded. 'build' writes OUT_DIR/spm-tiny.gguf, OUT_DIR/gemma4-tiny.gguf and
OUT_DIR/bpe-tiny.gguf (byte-level BPE); 'record' writes OUT_DIR/<name>.ids.json: {"texts": [...],
"add_special": true, "parse_special": true, "ids": [[...], ...]} as llama_tokenize returns them
(for bpe-tiny, "ids" maps each tokenizer.ggml.pre to its entry of "id_sets").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = (ROOT / "src" / "expertcache" / "assets" / "heldout.txt").read_text(encoding="utf-8")
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

TEXTS = [
    "Hello world! I've been 'told he's there, 'RE you sure? 3 33 333 3333 3.14",
    " leading space,  two spaces,   three.\n\n\nnewlines\n \n\t\ttabs\r\nend ",
    "🚀 (normal) ✅ 🦙🦙 我想在apple工作1314151天～ нещо на Български नमस्ते café naïve",
    "<s>start</s> then <start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n <tool> x<tool>y",
    "",
    " ",
    "\n\n",
    HELDOUT[:12000],
    HELDOUT[200000:206000],
]

BPE_TEXTS = TEXTS[:3] + [
    "<|im_start|>user\nWhat's 2+2? I'LL ask: don't, won't, it's.<|im_end|>\n<|im_start|>assistant\n<think>\n",
    "ñandú Ελληνικά عربي ٣٤٥ 한국어 日本語のテキスト ＡＢＣ１２３ x\u0301\u0302y e\u0301 ภาษาไทย\u0e31",
    "    indented\n\tcode(x) {\r\n  return a+b; }\n\n\n   \n",
    "1234567890 12,345.67 $100 #1 @user https://example.com/a?b=c&d=e",
    HELDOUT[:4000],
]


def _train(lines, vocab_size: int, prefix_space: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always" if prefix_space else "never")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, limit_alphabet=200)
    tok.train_from_iterator(lines, trainer)
    data = json.loads(tok.to_str())
    vocab = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return [t for t, _ in vocab], merges


def _writer(path: Path):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    # llama.cpp reads these hyperparameters even when it loads only the vocabulary.
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(16)
    return w


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


def build_spm(path: Path) -> None:
    """A Llama-2-style vocabulary: <unk> <s> </s>, 256 byte tokens, then pieces whose scores rank
    them in the order they were learned (as a SentencePiece BPE model stores them)."""
    pieces, _ = _train(HELDOUT.splitlines()[::2], 900, prefix_space=True)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    for i, p in enumerate(pieces):
        tokens.append(p)
        types.append(NORMAL)
        scores.append(-float(i))
    for t, ty in (("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL), ("<tool>", USER_DEFINED)):
        tokens.append(t)
        types.append(ty)
        scores.append(0.0)
    w = _writer(path)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    _finish(w)


def build_gemma4(path: Path) -> None:
    """A Gemma-4-style vocabulary: BPE on raw UTF-8 pieces with '▁' for spaces, <0xXX> bytes,
    newline-run tokens without merges for them."""
    pieces, merges = _train(HELDOUT.splitlines()[1::2], 900, prefix_space=False)
    head = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", UNKNOWN),
            ("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL), ("<tool>", USER_DEFINED)]
    tokens = [t for t, _ in head] + [f"<0x{b:02X}>" for b in range(256)] + ["\n", "\n\n", "\n\n\n"]
    types = [ty for _, ty in head] + [BYTE] * 256 + [NORMAL] * 3
    tokens += [p for p in pieces if p not in tokens]
    types += [NORMAL] * (len(tokens) - len(types))
    w = _writer(path)
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    _finish(w)


def build_bpe(path: Path) -> None:
    """A byte-level BPE vocabulary trained with no pre-tokenizer split on the texts themselves, so
    that most pieces a pre-tokenizer cuts are single tokens: the ids show where each cut falls."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=6000, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = [line for t in BPE_TEXTS for line in t.splitlines(keepends=True)]
    tok.train_from_iterator(lines, trainer)
    data = json.loads(tok.to_str())
    tokens = [t for t, _ in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    types = [NORMAL] * len(tokens)
    for t, ty in (("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL),
                  ("<think>", USER_DEFINED)):
        if t in tokens:  # learned from the texts that hold it
            types[tokens.index(t)] = ty
        else:
            tokens.append(t)
            types.append(ty)
    w = _writer(path)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    _finish(w)


def record_bpe(path: Path) -> None:
    """The ids of BPE_TEXTS under each pre-tokenizer llama.cpp knows of those expertcache supports."""
    import gguf
    import llama_cpp

    sys.path.insert(0, str(ROOT / "src"))
    from expertcache.gguf_tokenizer import PRE_TOKENIZERS

    reader = gguf.GGUFReader(path)
    out, unknown = {}, []
    for pre in sorted(PRE_TOKENIZERS):
        tmp = path.with_name(f"_{pre}.gguf")
        w = gguf.GGUFWriter(str(tmp), "llama")
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            value = pre if key == "tokenizer.ggml.pre" else field.contents()
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, value, field.types[0], sub_type=sub)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        try:
            llm = llama_cpp.Llama(model_path=str(tmp), vocab_only=True, verbose=False)
        except ValueError:  # this llama.cpp does not know the pre-tokenizer
            unknown.append(pre)
            continue
        finally:
            tmp.unlink()
        out[pre] = [llm.tokenize(t.encode("utf-8"), add_bos=True, special=True) for t in BPE_TEXTS]
    # Many names share one split: each distinct list of ids is stored once.
    id_sets = []
    for ids in out.values():
        if ids not in id_sets:
            id_sets.append(ids)
    rec = path.with_suffix(".ids.json")
    rec.write_text(json.dumps({"llama_cpp_python": llama_cpp.__version__, "texts": BPE_TEXTS,
                               "add_special": True, "parse_special": True, "ids": {pre: id_sets.index(ids) for pre, ids in out.items()}, "id_sets": id_sets,
                               "unknown_to_llama_cpp": unknown}, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{rec}: {len(out)} pre-tokenizers, {len(id_sets)} distinct; unknown to this llama.cpp: {unknown}")


def record(path: Path) -> None:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    ids = [llm.tokenize(t.encode("utf-8"), add_bos=True, special=True) for t in TEXTS]
    out = path.with_suffix(".ids.json")
    out.write_text(json.dumps({"llama_cpp_python": llama_cpp.__version__, "texts": TEXTS, "add_special": True,
                               "parse_special": True, "ids": ids},
                              ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{out}: {sum(map(len, ids))} ids for {len(TEXTS)} texts")


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] not in ("build", "record"):
        print(__doc__, file=sys.stderr)
        raise SystemExit(2)
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    names = [out / "spm-tiny.gguf", out / "gemma4-tiny.gguf"]
    if argv[0] == "build":
        build_spm(names[0])
        build_gemma4(names[1])
        build_bpe(out / "bpe-tiny.gguf")
    else:
        for p in names:
            record(p)
        record_bpe(out / "bpe-tiny.gguf")


if __name__ == "__main__":
    main(sys.argv[1:])
