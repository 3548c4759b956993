"""Gemma 4 GGUF vocabularies ('gemma4') tokenize as llama.cpp does, token for token.

llama.cpp (src/llama-vocab.cpp, llm_tokenizer_bpe_session::tokenize) splits the text into lines
and newline runs, takes a newline run whole only when it is a token, and merges every other piece
up from its characters. Built with ignore_merges, ours took any line that spells a token whole:
the text `<0x41>` became the byte token (it decoded as "A") and, with parse_special off
(perplexity), a line `<start_of_turn>` became the control token.

The ids are llama.cpp's, recorded in tests/fixtures/gguf/tokenizers/gemma4-audit.ids.json by this
module run as a script where llama-cpp-python and gguf are installed:

    python tests/test_gemma4_tokenizer_audit.py record

It tokenizes `probes()` with llama_tokenize(add_special=True, parse_special=on and off) for each
vocabulary of VOCABS: the two committed Gemma 4 GGUF files, and the tiny one with more newline
tokens (written to a temporary GGUF with the tokens appended, as the tests append them to the
metadata). Imports of expertcache stay inside the tests so that the recorder needs neither it nor
pytest.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "gguf"
RECORDING = FIXTURES / "tokenizers" / "gemma4-audit.ids.json"
HELDOUT = (ROOT / "src" / "expertcache" / "assets" / "heldout.txt").read_text(encoding="utf-8")
NORMAL, BYTE = 1, 6

# name -> (GGUF file, lengths of newline runs appended to its vocabulary as normal tokens)
VOCABS = {
    "gemma4-tiny": ("tokenizers/gemma4-tiny.gguf", []),  # newline tokens of 1-3 newlines, no merges for them
    "gemma4-tiny+gaps": ("tokenizers/gemma4-tiny.gguf", [5, 8]),  # 4, 6, 7 and 9+ are no token
    "gemma4-tiny+31": ("tokenizers/gemma4-tiny.gguf", list(range(4, 32))),  # 1-31 as Gemma's vocabularies have
    "gemma4-converted": ("gemma4/gemma4-F32.gguf", []),  # llama.cpp's converter's: "\n" and "\n\n"
}
_BYTES = ["<0x00>", "<0x0A>", "<0x20>", "<0x41>", "<0x7F>", "<0x80>", "<0xE2>", "<0xFF>"]


def probes(tokens: list[str], types: list[int]) -> list[str]:
    """Prose, code and other scripts; newline runs of 1-40 alone, inside a line and among spaces
    and tabs; lines that spell the vocabulary's control, unknown, user-defined and some byte tokens."""
    texts = ["", " ", "\t", "Hello world! I've been there. 3.14", HELDOUT[:1200], HELDOUT[90000:90600],
             "def f(x):\n    return x + 1\n\n\nclass A:\n\tpass\n",
             "🚀 (normal) ✅ 🦙🦙 我想在apple工作1314151天～ нещо на Български नमस्ते café naïve",
             "\r\n\r\n", "\n\r\n", "a\r\n\r\n\r\nb", " \n", "\n \n", "\t\n\n\t", "\n\n \n\n\n", "  \n\n\n\n  ",
             "\n\t\n\t\n", " \n\n\n \n\n\n\n "]
    texts += ["a" + "\n" * n + "b" for n in range(1, 41)]
    for n in range(1, 11):
        texts += ["\n" * n, " " + "\n" * n + " ", "x\n" + "\n" * n + " \n" + "\n" * (n % 7) + "y"]
    spelled = [t for t, ty in zip(tokens, types) if ty not in (NORMAL, BYTE)] + _BYTES
    for t in spelled:
        texts += [t, "x\n" + t + "\ny", t + t, " " + t]
    texts += ["<0x41><0x42>", "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
              "\n<bos>\n\n\n\n<eos>\n\n"]
    return list(dict.fromkeys(texts))


def _tokenizer(name: str):
    from expertcache.checkpoint.gguf_io import GGUFCheckpoint
    from expertcache.gguf_tokenizer import tokenizer_parts_from_gguf
    from expertcache.tokenizer import Tokenizer

    path, runs = VOCABS[name]
    with GGUFCheckpoint(FIXTURES / path) as ck:
        metadata = dict(ck.metadata)
    metadata["tokenizer.ggml.tokens"] = [*metadata["tokenizer.ggml.tokens"], *("\n" * k for k in runs)]
    metadata["tokenizer.ggml.token_type"] = [*metadata["tokenizer.ggml.token_type"], *[NORMAL] * len(runs)]
    return Tokenizer.from_parts(*tokenizer_parts_from_gguf(metadata, name)), metadata


def _recording() -> dict:
    return json.loads(RECORDING.read_text(encoding="utf-8"))


def test_every_probe_matches_llama_cpp_with_special_text_parsed_and_not():
    rec = _recording()
    assert set(rec["vocabs"]) == set(VOCABS)
    for name, want in rec["vocabs"].items():
        tok, metadata = _tokenizer(name)
        assert want["texts"] == probes(metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"])
        for mode, parse_special in (("special", True), ("plain", False)):
            got = [tok.encode(t, parse_special=parse_special) for t in want["texts"]]
            wrong = [(t[:40], g, w) for t, g, w in zip(want["texts"], got, want[mode], strict=True) if g != w]
            assert not wrong, (name, mode, len(wrong), wrong[:3])


def test_a_line_that_spells_a_byte_token_stays_text():
    """llama.cpp gives the characters' tokens; it was the byte token, decoding as "A"."""
    tok, _ = _tokenizer("gemma4-tiny")
    want = _recording()["vocabs"]["gemma4-tiny"]
    for text in ("<0x41>", "x\n<0x41>\ny", "<0x0A>"):
        ids = tok.encode(text)
        assert ids == want["special"][want["texts"].index(text)]
        assert tok.decode(ids) == text


def test_a_control_token_line_is_text_when_special_text_is_not_parsed():
    tok, _ = _tokenizer("gemma4-tiny")
    want = _recording()["vocabs"]["gemma4-tiny"]
    control = tok.tok.token_to_id("<start_of_turn>")
    for text in ("<start_of_turn>", "x\n<start_of_turn>\ny"):
        plain = tok.encode(text, parse_special=False)
        assert plain == want["plain"][want["texts"].index(text)]
        assert control not in plain and tok.decode(plain) == text
        assert control in tok.encode(text)  # parsed, it is the control token, as in llama.cpp


def test_newline_runs_are_one_token_only_at_a_token_length():
    """llama.cpp: a run that is a token is that token; any other run is single newlines (no merge
    joins newlines), longer runs than the longest newline token included."""
    for name in VOCABS:
        tok, _ = _tokenizer(name)
        want = _recording()["vocabs"][name]
        one = tok.tok.token_to_id("\n")
        for n in range(1, 41):
            text = "a" + "\n" * n + "b"
            ids = tok.encode(text)
            assert ids == want["special"][want["texts"].index(text)], (name, n)
            whole = tok.tok.token_to_id("\n" * n)
            assert ids[2:-1] == ([whole] if whole is not None else [one] * n), (name, n)


def _record() -> None:
    import tempfile

    import gguf
    import llama_cpp

    out = {"llama_cpp_python": llama_cpp.__version__, "add_special": True, "vocabs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (path, runs) in VOCABS.items():
            reader = gguf.GGUFReader(FIXTURES / path)
            tokens = [*reader.fields["tokenizer.ggml.tokens"].contents(), *("\n" * k for k in runs)]
            types = [*reader.fields["tokenizer.ggml.token_type"].contents(), *[NORMAL] * len(runs)]
            target = Path(tmp) / f"{name}.gguf"
            w = gguf.GGUFWriter(str(target), "llama")
            for key, field in reader.fields.items():
                if key.startswith("GGUF.") or key == "general.architecture":
                    continue
                changed = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}
                value = changed.get(key, field.contents())
                sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
                w.add_key_value(key, value, field.types[0], sub_type=sub)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.close()
            llm = llama_cpp.Llama(model_path=str(target), vocab_only=True, verbose=False)
            texts = probes(tokens, types)
            out["vocabs"][name] = {
                "texts": texts,
                "special": [llm.tokenize(t.encode("utf-8"), add_bos=True, special=True) for t in texts],
                "plain": [llm.tokenize(t.encode("utf-8"), add_bos=True, special=False) for t in texts],
            }
    RECORDING.write_text(json.dumps(out, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"{RECORDING}: {sum(len(v['texts']) for v in out['vocabs'].values())} texts")


if __name__ == "__main__":
    if sys.argv[1:] != ["record"]:
        raise SystemExit(__doc__)
    _record()
