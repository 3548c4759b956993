"""Tokenizers built from GGUF metadata against references written by others: the bundled model's
tokenizer.json (Hugging Face tokenizers) written into GGUF metadata the way llama.cpp's converter
writes it, Hugging Face pre-tokenizers of the model families each llama.cpp pre-tokenizer stands
for, and token ids recorded from llama.cpp itself (tests/fixtures/gguf)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, pre_tokenizers

from expertcache.checkpoint.gguf_io import GGUFCheckpoint
from expertcache.errors import ExpertCacheError
from expertcache.gguf_tokenizer import CONTROL, NORMAL, PRE_TOKENIZERS, USER_DEFINED, tokenizer_parts_from_gguf
from expertcache.tokenizer import Tokenizer as ECTokenizer

ASSETS = Path(__file__).resolve().parents[1] / "src" / "expertcache" / "assets"
# Vocabulary-only GGUF files and llama.cpp's ids for them (tools/gguf_tokenizer_fixtures.py).
RECORDED = Path(__file__).resolve().parent / "fixtures" / "gguf" / "tokenizers"
BUNDLED = ASSETS / "tiny-qwen3-moe"
HELDOUT = (ASSETS / "heldout.txt").read_text(encoding="utf-8")
TRICKY = ("Hello world! I've been 'told he's there, 'RE you sure? 3 33 333 3333 33333 3.14 "
          "\n \n\n \t\t\n   x  \n🚀 (normal) 😶‍🌫️ ✅ 🦙🦙 ?我想在apple工作1314151天～ ------======= нещо на Български "
          "''''''```````\"\"\"\"......!!!!!!?????? We'Ve a'lL ÀÉÎ café naïve nai\u0308ve\r\nend  "
          "नमस्ते दुनिया ภาษาไทย x\u0301\u0302y 12345678 ½ ٣٤ 𝟘𝟙 \u00a0\u2003\u3000 tab\there\r\r\n\n")


def converter_metadata(tok_json: Path, pre: str) -> dict:
    """GGUF tokenizer metadata as llama.cpp's convert_hf_to_gguf.py writes it for a BPE
    tokenizer: one token per id, added tokens typed CONTROL (special) or USER_DEFINED, ids with
    no token filled with [PAD{i}], merges as "a b" strings."""
    tok = Tokenizer.from_file(str(tok_json))
    data = json.loads(tok_json.read_text(encoding="utf-8"))
    vocab = tok.get_vocab(with_added_tokens=True)
    reverse = {i: t for t, i in vocab.items()}
    added = tok.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(max(reverse) + 1):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(5)
        elif i in added:
            tokens.append(reverse[i])
            types.append(CONTROL if added[i].special else USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    cfg = json.loads((tok_json.parent / "tokenizer_config.json").read_text(encoding="utf-8"))
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.eos_token_id": vocab[cfg["eos_token"]],
            "tokenizer.ggml.padding_token_id": vocab[cfg["pad_token"]],
            "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": cfg["chat_template"]}
    return meta


def with_pre_tokenizer(tok_json: Path, split_regex: str) -> Tokenizer:
    """The bundled vocabulary and merges under another family's tokenizer.json pre-tokenizer."""
    tok = Tokenizer.from_file(str(tok_json))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split_regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tok


def test_bundled_tokenizer_round_trips_through_gguf_metadata():
    ref = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    # The bundled tokenizer.json uses the GPT-2 split (ByteLevel with its regex): llama.cpp's 'gpt-2'.
    tok, cfg = tokenizer_parts_from_gguf(converter_metadata(BUNDLED / "tokenizer.json", "gpt-2"), "m.gguf")
    for text in (HELDOUT, TRICKY, "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n", ""):
        want = ref.encode(text, add_special_tokens=False).ids
        got = tok.encode(text, add_special_tokens=False).ids
        assert got == want
    ids = tok.encode(TRICKY + "<|im_end|>").ids
    assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    assert cfg["eos_token"] == "<|endoftext|>" and cfg["pad_token"] == "<|endoftext|>"
    assert cfg["bos_token"] is None and cfg["add_bos_token"] is False
    assert cfg["eot_token"] == "<|im_end|>"
    assert cfg["eog_token_ids"] == [0, 2]
    assert cfg["chat_template"].startswith("{% for message in messages %}")


# The regexes of these families' own tokenizer.json files, as llama.cpp quotes them beside its
# adaptations (which avoid (?i:...) for std::regex).
FAMILY_REGEX = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+",
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "olmo": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
}


@pytest.mark.parametrize("pre", sorted(FAMILY_REGEX))
def test_pre_tokenizers_match_the_families_tokenizer_json(pre):
    ref = with_pre_tokenizer(BUNDLED / "tokenizer.json", FAMILY_REGEX[pre])
    tok, cfg = tokenizer_parts_from_gguf(converter_metadata(BUNDLED / "tokenizer.json", pre), "m.gguf")
    for text in (HELDOUT[:60000], TRICKY):
        assert tok.encode(text, add_special_tokens=False).ids == ref.encode(text, add_special_tokens=False).ids
    # The small vocabulary hides most splits inside byte tokens: compare the pieces themselves.
    for line in TRICKY.split("\n") + [TRICKY]:
        assert tok.pre_tokenizer.pre_tokenize_str(line) == ref.pre_tokenizer.pre_tokenize_str(line), line


def test_llama3_family_defaults_to_adding_bos():
    meta = converter_metadata(BUNDLED / "tokenizer.json", "llama-bpe")
    del meta["tokenizer.ggml.add_bos_token"]
    meta["tokenizer.ggml.bos_token_id"] = 1
    _, cfg = tokenizer_parts_from_gguf(meta, "m.gguf")
    assert cfg["add_bos_token"] is True and cfg["bos_token"] == "<|im_start|>"


def test_user_defined_tokens_are_matched_but_not_special():
    meta = converter_metadata(BUNDLED / "tokenizer.json", "gpt-2")
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], "<think>"]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], USER_DEFINED]
    tok, _ = tokenizer_parts_from_gguf(meta, "m.gguf")
    think = len(meta["tokenizer.ggml.tokens"]) - 1
    ids = tok.encode("a<think>b<|im_end|>").ids
    assert think in ids and 2 in ids
    assert tok.decode(ids, skip_special_tokens=True) == "a<think>b"


def one_line(excinfo, *needles):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg


def test_errors_name_the_file_and_the_way_out():
    meta = converter_metadata(BUNDLED / "tokenizer.json", "kimi-k2")
    with pytest.raises(ExpertCacheError) as e:
        tokenizer_parts_from_gguf(meta, "m.gguf")
    one_line(e, "m.gguf", "'kimi-k2'", "--tokenizer DIR")
    meta["tokenizer.ggml.model"] = "t5"
    with pytest.raises(ExpertCacheError) as e:
        tokenizer_parts_from_gguf(meta, "m.gguf")
    one_line(e, "m.gguf", "'t5'", "--tokenizer DIR")
    with pytest.raises(ExpertCacheError) as e:
        tokenizer_parts_from_gguf({}, "m.gguf")
    one_line(e, "m.gguf", "tokenizer.ggml.model", "--tokenizer DIR")
    meta = converter_metadata(BUNDLED / "tokenizer.json", "qwen2")
    del meta["tokenizer.ggml.merges"]
    with pytest.raises(ExpertCacheError) as e:
        tokenizer_parts_from_gguf(meta, "m.gguf")
    one_line(e, "m.gguf", "'tokenizer.ggml.merges' is missing", "--tokenizer DIR")
    meta = converter_metadata(BUNDLED / "tokenizer.json", "qwen2")
    again = meta["tokenizer.ggml.tokens"][100]
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], again]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], NORMAL]
    with pytest.raises(ExpertCacheError) as e:
        tokenizer_parts_from_gguf(meta, "m.gguf")
    one_line(e, "m.gguf", repr(again), "twice", "ids 100 and")


def _spm_metadata() -> dict:
    with GGUFCheckpoint(RECORDED / "spm-tiny.gguf") as ck:
        return dict(ck.metadata)


@pytest.mark.parametrize("kind,key,value,needle", [
    # Each was a raw IndexError, TypeError or AttributeError from inside the tokenizer's build.
    ("llama", "tokenizer.ggml.scores", [0.0] * 10, "holds 10 entries, expected one number per token (1162)"),
    ("llama", "tokenizer.ggml.scores", ["a"] * 1162, "holds 'a', expected numbers"),
    ("llama", "tokenizer.ggml.tokens", list(range(1162)), "holds 0, expected an array of strings"),
    ("llama", "tokenizer.ggml.bos_token_id", "1", "'tokenizer.ggml.bos_token_id' is '1', expected a token id"),
    ("gpt2", "tokenizer.ggml.merges", [1, 2], "holds 1, expected an array of strings"),
    # Silently misread: string types were taken as given, a template of another type as none.
    ("gpt2", "tokenizer.ggml.token_type", ["1"] * 4096, "holds '1', expected numbers"),
    ("gpt2", "tokenizer.chat_template", 5, "'tokenizer.chat_template' is 5, expected a string"),
    # A string 'false' was true: BOS or EOS added to every prompt (llama.cpp refuses the key's type).
    ("gpt2", "tokenizer.ggml.add_eos_token", "false", "'tokenizer.ggml.add_eos_token' is 'false', expected a bool"),
    ("gpt2", "tokenizer.ggml.add_bos_token", 0, "'tokenizer.ggml.add_bos_token' is 0, expected a bool"),
    ("llama", "tokenizer.ggml.add_space_prefix", "no", "'tokenizer.ggml.add_space_prefix' is 'no', expected a bool"),
])
def test_metadata_of_the_wrong_kind_is_one_line(kind, key, value, needle):
    meta = _spm_metadata() if kind == "llama" else converter_metadata(BUNDLED / "tokenizer.json", "gpt-2")
    with pytest.raises(ExpertCacheError) as e:
        tokenizer_parts_from_gguf({**meta, key: value}, "m.gguf")
    one_line(e, "m.gguf", needle)


def test_a_flag_stored_as_a_string_is_refused_by_the_cli(tmp_path, capsys):
    from gguf import GGUFValueType as VT

    from conftest import assert_one_line_error, run_cli
    from gguf_blocks import rewrite_gguf

    src = Path(__file__).resolve().parent / "fixtures" / "gguf" / "qwen3_moe-mix.gguf"
    path = rewrite_gguf(src, tmp_path / "m.gguf", {"tokenizer.ggml.add_eos_token": ("false", VT.STRING, None)})
    code, err = run_cli(capsys, "run", "-m", str(path), "-p", "def f(x):", "-n", "1")
    assert_one_line_error(code, err, "m.gguf", "'tokenizer.ggml.add_eos_token' is 'false', expected a bool")


def test_tokenizer_from_parts_matches_the_directory_tokenizer():
    ref = ECTokenizer(BUNDLED)
    got = ECTokenizer.from_parts(*tokenizer_parts_from_gguf(
        converter_metadata(BUNDLED / "tokenizer.json", "gpt-2"), "m.gguf"))
    messages = [{"role": "user", "content": "What is 12 * 34?"}, {"role": "assistant", "content": "408."},
                {"role": "user", "content": TRICKY}]
    assert got.render_chat(messages) == ref.render_chat(messages)
    assert got.encode_chat(messages) == ref.encode_chat(messages)
    assert got.encode(HELDOUT[:5000]) == ref.encode(HELDOUT[:5000])
    assert (got.eos_id, got.bos_id, got.add_bos, got.vocab_size) == (ref.eos_id, ref.bos_id, ref.add_bos, ref.vocab_size)


def test_end_of_generation_ids_follow_llama_cpp():
    meta = converter_metadata(BUNDLED / "tokenizer.json", "gpt-2")
    extra = ["<|return|>", "<|call|>", "<|end|>", "<|channel|>", "<|file_sep|>"]
    n = len(meta["tokenizer.ggml.tokens"])
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], *extra]
    # Stored as normal tokens: llama.cpp makes the end-of-generation ones control tokens by their text.
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], *[NORMAL] * len(extra)]
    tok, cfg = tokenizer_parts_from_gguf(meta, "m.gguf")
    ret, call, end, channel, file_sep = range(n, n + len(extra))
    # gpt-oss: <|end|> ends nothing when <|return|> and <|call|> exist, and is rendered like text.
    assert cfg["eog_token_ids"] == [0, 2, ret, call, file_sep]
    ids = tok.encode("a<|end|>b<|channel|>c<|return|>").ids
    assert end in ids and channel in ids and ret in ids
    assert tok.decode(ids, skip_special_tokens=True) == "a<|end|>b<|channel|>c"


def llama_cpp_ids(tok: ECTokenizer, text: str) -> list[int]:
    """What llama_tokenize(add_special=True, parse_special=True) gives: BOS where the vocabulary
    adds it (even before a BOS in the text), then the text with special tokens parsed."""
    ids = tok.encode(text, add_special_tokens=False)
    return [tok.bos_id, *ids] if tok.add_bos else ids


@pytest.mark.parametrize("name", ["spm-tiny", "gemma4-tiny"])
def test_sentencepiece_and_gemma4_kinds_match_llama_cpp(name):
    rec = json.loads((RECORDED / f"{name}.ids.json").read_text(encoding="utf-8"))
    with GGUFCheckpoint(RECORDED / f"{name}.gguf") as ck:
        tok = ECTokenizer.from_parts(*tokenizer_parts_from_gguf(ck.metadata, str(ck.files[0])))
    assert tok.add_bos
    for text, want in zip(rec["texts"], rec["ids"], strict=True):
        assert llama_cpp_ids(tok, text) == want, text[:60]


@pytest.mark.parametrize("name", ["spm-tiny", "gemma4-tiny", "bpe-tiny"])
def test_decoding_gives_back_the_text(name):
    rec = json.loads((RECORDED / f"{name}.ids.json").read_text(encoding="utf-8"))
    with GGUFCheckpoint(RECORDED / f"{name}.gguf") as ck:
        tok = ECTokenizer.from_parts(*tokenizer_parts_from_gguf(ck.metadata, str(ck.files[0])))
    added = [t.content for t in tok.tok.get_added_tokens_decoder().values()]
    plain = [t for t in rec["texts"] if not any(a in t for a in added)]  # added tokens decode apart
    assert len(plain) >= 6
    for text in plain:
        assert tok.decode(tok.encode(text)) == text


@pytest.fixture(scope="module")
def bpe_recording():
    rec = json.loads((RECORDED / "bpe-tiny.ids.json").read_text(encoding="utf-8"))
    with GGUFCheckpoint(RECORDED / "bpe-tiny.gguf") as ck:
        return ck.metadata, rec


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_supported_pre_tokenizer_matches_llama_cpp(pre, bpe_recording):
    """The vocabulary learned its merges across every boundary, so the ids show each cut."""
    metadata, rec = bpe_recording
    want_all = rec["id_sets"][rec["ids"][pre]]
    tok = ECTokenizer.from_parts(*tokenizer_parts_from_gguf({**metadata, "tokenizer.ggml.pre": pre}, "bpe-tiny.gguf"))
    for text, want in zip(rec["texts"], want_all, strict=True):
        assert llama_cpp_ids(tok, text) == want, text[:60]


# Models converted and quantized by llama.cpp (tools/make_gguf_fixtures.py), with the ids its
# llama-perplexity tokenization gave: special tokens added, special text not parsed.
CONVERTED = sorted((Path(__file__).resolve().parent / "fixtures" / "gguf").glob("*.json"))


@pytest.mark.parametrize("fixture", CONVERTED, ids=lambda p: p.stem)
def test_converted_models_tokenize_like_llama_cpp(fixture):
    rec = json.loads(fixture.read_text(encoding="utf-8"))
    with GGUFCheckpoint(fixture.with_name(rec["gguf"])) as ck:
        tok = ECTokenizer.from_parts(*tokenizer_parts_from_gguf(ck.metadata, str(ck.files[0])))
    tok.tok.encode_special_tokens = True  # llama.cpp's parse_special=False: control text is text
    start, stop = rec["heldout"]["chars"]
    assert llama_cpp_ids(tok, HELDOUT[start:stop]) == rec["heldout"]["tokens"]
    assert llama_cpp_ids(tok, rec["prompt"]["text"]) == rec["prompt"]["tokens"]


def test_llama_cpp_recordings_are_present():
    assert len(CONVERTED) >= 4, "tests/fixtures/gguf holds the llama.cpp recordings the test above compares with"


def test_to_gguf_names_the_split_llama_cpp_applies_to_the_bundled_tokenizer(tmp_path):
    """tools/to_gguf.py writes tokenizer.ggml.pre from tokenizer.json's split: the bundled
    tokenizer's is byte-level (GPT-2's), and written as "default" (another split) the converted
    file tokenized text differently (heldout.txt's first ids [201, 351, 201, 201, 5] against
    [201, 351, 585, 5, 366]). Ids and logits now equal the checkpoint's."""
    import sys

    import torch

    import expertcache
    from expertcache.checkpoint.gguf_io import GGUFCheckpoint

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from to_gguf import convert

    out = tmp_path / "tiny.gguf"
    convert(expertcache.engine.default_model_path(), out)
    with GGUFCheckpoint(out) as gg:
        assert gg.metadata["tokenizer.ggml.pre"] == "gpt-2"
    ref, conv = expertcache.load(), expertcache.load(out)
    text = (Path(expertcache.__file__).parent / "assets" / "heldout.txt").read_text()[:4000]
    ids = ref.tokenizer.encode(text)
    assert conv.tokenizer.encode(text) == ids
    assert torch.equal(conv.logits(ids[:48]), ref.logits(ids[:48]))


def test_a_gguf_without_a_chat_template_names_its_metadata_key(capsys):
    """A chat on a GGUF without `tokenizer.chat_template`: one line naming that key (it named
    tokenizer_config.json, a file a GGUF model does not have) and the way out, --tokenizer."""
    from conftest import assert_one_line_error, run_cli

    gg = Path(__file__).parent / "fixtures" / "gguf" / "gemma4" / "gemma4-Q8_0.gguf"
    code, err = run_cli(capsys, "run", "-m", str(gg), "--chat", "-n", "2")
    assert_one_line_error(code, err, "tokenizer.chat_template", "--tokenizer DIR")
    assert "tokenizer_config.json" not in err


def test_a_bad_tokenizer_fails_before_the_kernels_are_chosen(tmp_path, monkeypatch):
    # The kernels' first build takes a minute and prints a notice: a tokenizer that cannot be read
    # is refused before it, alone on its line.
    from gguf import GGUFValueType as VT

    import expertcache
    import expertcache.engine as engine
    from gguf_blocks import rewrite_gguf

    def chosen(*args, **kwargs):
        raise AssertionError("the kernels were chosen before the tokenizer was read")

    monkeypatch.setattr(engine, "select_kernels", chosen)
    src = Path(__file__).resolve().parent / "fixtures" / "gguf" / "qwen3_moe-mix.gguf"
    path = rewrite_gguf(src, tmp_path / "m.gguf", {"tokenizer.ggml.add_eos_token": ("false", VT.STRING, None)})
    with pytest.raises(ExpertCacheError, match="'tokenizer.ggml.add_eos_token' is 'false', expected a bool"):
        expertcache.load(path)
