"""Two tokenizer edges: /tokenize's pieces as llama-server gives them, and streaming a long run of
invalid byte tokens in time linear in its length.

llama-server's /tokenize with `with_pieces` (tools/server/server.cpp, handle_tokenize) gives each
token's `common_token_to_piece(ctx, id)`, which is llama_vocab::token_to_piece with special=true
and no lstrip: a control, unknown or user-defined token's text; a SentencePiece token's text with
'▁' as a space; a byte token's one byte; a byte-level BPE token's bytes. The piece is a string where
those bytes are valid UTF-8 and a list of the byte values otherwise. `llama_piece` below follows
that from the GGUF's own token types, without our tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import expertcache
from expertcache.checkpoint.gguf_io import GGUFCheckpoint
from expertcache.gguf_tokenizer import tokenizer_parts_from_gguf
from expertcache.server.app import create_app
from expertcache.tokenizer import StreamDecoder, Tokenizer
from test_tokenizer_audit import CountingTokenizer

ROOT = Path(__file__).resolve().parent
FIXTURES = ROOT / "fixtures" / "gguf"
BUNDLED = ROOT.parent / "src" / "expertcache" / "assets" / "tiny-qwen3-moe"  # byte-level BPE
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
TEXT = "Hi 0 x€ naïve 🦙 <start_of_turn>user\n<0x41>\n\n a"


def _byte_level_table() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, character to byte: what llama.cpp's llama_decode_text reads."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, n = {chr(b): b for b in bs}, 0
    for b in range(256):
        if b not in bs:
            table[chr(256 + n)] = b
            n += 1
    return table


def llama_piece(metadata: dict, token_id: int):
    """llama-server's piece of `token_id`, from the GGUF's tokens and token types."""
    text = metadata["tokenizer.ggml.tokens"][token_id]
    kind = metadata["tokenizer.ggml.token_type"][token_id]
    if kind in (CONTROL, UNKNOWN, USER_DEFINED):
        raw = text.encode()
    elif kind == BYTE:
        raw = bytes([int(text[3:5], 16)])
    elif kind == NORMAL and metadata["tokenizer.ggml.model"] == "gpt2":
        raw = bytes(_byte_level_table()[c] for c in text)
    elif kind == NORMAL:
        raw = text.replace("▁", " ").encode()
    else:
        raw = b""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _gguf(name: str) -> tuple[Tokenizer, dict]:
    with GGUFCheckpoint(FIXTURES / name) as ck:
        metadata = dict(ck.metadata)
    return Tokenizer.from_parts(*tokenizer_parts_from_gguf(metadata, name)), metadata


@pytest.fixture(scope="module")
def model():
    return expertcache.load(None, ctx_size=256)


def _tokenize(model, tokenizer: Tokenizer, content: str, add_special: bool = True) -> list[dict]:
    saved, model.tokenizer = model.tokenizer, tokenizer
    try:
        with TestClient(create_app(model)) as c:
            r = c.post("/tokenize", json={"content": content, "add_special": add_special, "with_pieces": True})
    finally:
        model.tokenizer = saved
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# ---- /tokenize's pieces ----
@pytest.mark.parametrize("name", ["tokenizers/spm-tiny.gguf", "tokenizers/gemma4-tiny.gguf",
                                  "tokenizers/bpe-tiny.gguf", "gemma4/gemma4-F32.gguf"])
def test_tokenize_pieces_are_llama_servers(model, name):
    """Each id decoded alone gave 'Hi' for SentencePiece's '▁Hi' (llama-server: ' Hi') and U+FFFD
    for a byte token or a byte-level part of a character (llama-server: the byte values)."""
    tok, metadata = _gguf(name)
    got = _tokenize(model, tok, TEXT)
    ids = tok.encode(TEXT)
    assert [t["id"] for t in got] == ids
    assert [t["piece"] for t in got] == [llama_piece(metadata, i) for i in ids]
    assert not any(isinstance(p, str) and "\ufffd" in p for p in (t["piece"] for t in got))


def test_sentencepiece_pieces_keep_the_space_and_give_bytes_as_lists(model):
    tok, _ = _gguf("tokenizers/spm-tiny.gguf")
    got = _tokenize(model, tok, "0 €", add_special=False)
    # '▁0', '▁', then the three byte tokens of '€'
    assert [t["piece"] for t in got] == [" 0", " ", [0xE2], [0x82], [0xAC]]


def test_tokenizer_json_pieces_match_the_same_models_gguf(model):
    """A model directory's tokenizer.json gives the pieces its GGUF conversion gives (same ids)."""
    hf, (gguf, metadata) = Tokenizer(FIXTURES / "gemma4" / "tokenizer"), _gguf("gemma4/gemma4-F32.gguf")
    text = "Hi 0 x€ naïve 🦙 a"
    ids = hf.encode(text)
    assert ids == gguf.encode(text)
    assert [t["piece"] for t in _tokenize(model, hf, text)] == [llama_piece(metadata, i) for i in ids]
    # A byte-level tokenizer.json (the bundled model's): '€' is three tokens of one byte each.
    got = _tokenize(model, model.tokenizer, "<|im_start|>€ 0")
    assert [t["piece"] for t in got] == ["<|im_start|>", [0xE2], [0x82], [0xAC], " 0"]


def test_tokenize_parse_special_false_reads_a_special_tokens_text_as_characters(model):
    """llama-server's `parse_special` (default true): off, "<|im_start|>" is its characters'
    tokens, as `encode(parse_special=False)` gives them, not the special token."""
    special = model.tokenizer.encode("<|im_start|>", add_special_tokens=False)
    plain = model.tokenizer.encode("<|im_start|>", add_special_tokens=False, parse_special=False)
    assert len(special) == 1 and len(plain) > 1
    with TestClient(create_app(model)) as c:
        for body, want in (({}, special), ({"parse_special": True}, special), ({"parse_special": False}, plain)):
            r = c.post("/tokenize", json={"content": "<|im_start|>", **body})
            assert r.status_code == 200 and r.json()["tokens"] == want, (body, r.text)
        r = c.post("/tokenize", json={"content": "x", "parse_special": "no"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "parse_special"


# ---- streaming runs of invalid bytes ----
def _tokenizers():
    out = {name: _gguf(f"tokenizers/{name}.gguf")[0] for name in ("spm-tiny", "gemma4-tiny", "bpe-tiny")}
    out["bundled"] = Tokenizer(BUNDLED)
    return out


TOKENIZERS = _tokenizers()


def _byte_ids(tok: Tokenizer, values: list[int]) -> list[int]:
    """The ids of single bytes: <0xXX> tokens, or byte-level tokens of one byte."""
    table = {b: c for c, b in _byte_level_table().items()}
    out = []
    for v in values:
        i = tok.tok.token_to_id(f"<0x{v:02X}>")
        out.append(i if i is not None else tok.tok.token_to_id(table[v]))
    assert None not in out
    return out


def _stream(tok, prompt: list[int], pushed: list[int]) -> tuple[list[str], StreamDecoder]:
    dec = StreamDecoder(tok, context=prompt)
    return [dec.push(i) for i in pushed], dec


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_runs_of_invalid_and_partial_bytes_stream_as_the_whole_decode(name):
    tok = TOKENIZERS[name]
    prompt = tok.encode("Hello there", add_special_tokens=False)
    word = tok.encode(" world", add_special_tokens=False)
    runs = [
        [0x80] * 300,                                  # continuation bytes with no lead
        [0xFF, 0xC0, 0xF5] * 50,                       # bytes UTF-8 never has
        [0x80] + [0xE2, 0x82, 0xAC] * 40,              # a run made invalid by its first byte, valid after
        [0xE2, 0x82] * 30,                             # leads cut short again and again
        [0xF0, 0x9F, 0xA6],                            # a character cut short at the end of the run
        [0xED, 0xA0, 0x80] * 20,                       # encoded surrogates
    ]
    for run in runs:
        for pushed in (_byte_ids(tok, run) + word, word + _byte_ids(tok, run), _byte_ids(tok, run)):
            pieces, dec = _stream(tok, prompt, pushed)
            whole = tok.decode(prompt + pushed)
            assert whole.startswith(tok.decode(prompt))
            assert "".join(pieces) + dec._unread() == whole[len(tok.decode(prompt)):] == dec.text()


def test_an_invalid_run_is_held_until_a_word_ends_it():
    tok = TOKENIZERS["spm-tiny"]
    world = tok.encode("world", add_special_tokens=False)  # '▁w', 'or', 'l', 'd'
    pieces, dec = _stream(tok, tok.encode("Hi", add_special_tokens=False), _byte_ids(tok, [0x80] * 3) + world)
    assert pieces == ["", "", "", "\ufffd" * 3 + " w", "or", "l", "d"]
    assert dec.text() == "\ufffd" * 3 + " world"


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_a_long_invalid_run_costs_linear_decoding(name):
    """Each push of a held run decoded the whole run again: 2000 invalid bytes decoded two million
    ids (and 4000 four times as many). Now a bounded window per push."""
    tok = TOKENIZERS[name]
    prompt = tok.encode("Hello there", add_special_tokens=False)
    word = tok.encode(" world again", add_special_tokens=False)
    for run in ([0x80] * 2000, [0x80] + [0xE2, 0x82, 0xAC] * 700, [0xFF, 0xE2, 0x82] * 700):
        pushed = _byte_ids(tok, run) + word + _byte_ids(tok, run[:500]) + word
        counting = CountingTokenizer(tok)
        dec = StreamDecoder(counting, context=prompt)
        counting.decoded = 0
        pieces = [dec.push(i) for i in pushed]
        assert "".join(pieces) + dec._unread() == tok.decode(prompt + pushed)[len(tok.decode(prompt)):]
        assert counting.decoded < 10 * len(pushed)


def test_ids_past_the_vocabulary_keep_streaming_linear():
    """An id past the vocabulary decodes to nothing (a model may have more rows than tokens); a run
    of them stayed in the window and every push decoded the whole run again."""
    tok = TOKENIZERS["bundled"]
    prompt = tok.encode("Hello", add_special_tokens=False)
    word = tok.encode(" world", add_special_tokens=False)
    pushed = word + [tok.vocab_size + 5] * 2000 + word
    counting = CountingTokenizer(tok)
    dec = StreamDecoder(counting, context=prompt)
    counting.decoded = 0
    assert "".join(dec.push(i) for i in pushed) == " world world" == dec.text()
    assert counting.decoded < 10 * len(pushed)
