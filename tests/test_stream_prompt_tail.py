"""Streaming a completion after a prompt that ends in bytes that are no whole character.

A prompt given as token ids (/v1/completions with an array of ids, `expertcache run` with ids) may
end in a byte-fallback token that starts a multi-byte character (<0xE2>, the first byte of '€'),
or in an invalid run (<0xFF>). StreamDecoder keeps the prompt's last ids as context so that a
SentencePiece word keeps its leading space where it continues a text (the Strip decoder drops the
space only at the very start of a text). It dropped that context whenever the prompt's ids
ended in such bytes: " foo" then streamed as "foo", in the stream and in the whole answer alike.

What the completion's text must be there. llama-server streams each generated token's piece (its
bytes, a SentencePiece word with its space) and joins the pieces' bytes, holding back an
unfinished character; the prompt's bytes are never part of it. So the completion's bytes start
afresh after the prompt: bytes that would finish a character the prompt began are invalid on their
own (one U+FFFD each), and a whole character stays whole even after an invalid prompt byte. That is
also the only choice that never changes text already given: the prompt's unfinished bytes were
given as U+FFFD, and turning them into '€' afterwards cannot be streamed. Decoding prompt and
completion together (transformers) joins the bytes across the boundary instead: its
`decode(prompt + completion)[len(decode(prompt)):]` either does not begin where the prompt's text
ends ('\ufffd' became '€') or turns a valid '€' of the completion into U+FFFD x3 behind an invalid
prompt byte; it is the reference only where the prompt ends in whole characters, and there it
agrees with llama.cpp's. After any prompt with text, then, the completion's text is the same
however the prompt ends; `llama_text` below computes it from the vocabulary, as llama.cpp does,
without StreamDecoder. The completions here avoid a lead byte cut short, where Python's
errors="replace" (one U+FFFD per cut sequence) and the tokenizers ByteFallback decoder (one per
byte) count differently.

The non-streamed answer (GenerationResult.text, the server's non-streaming `text`) is
StreamDecoder.text(): the pieces given and then what was held back, so it must equal the stream.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, normalizers

import expertcache
import expertcache.engine
from expertcache.server.app import create_app
from expertcache.tokenizer import StreamDecoder, Tokenizer
from test_tokenizer_leftovers import _byte_level_table

BUNDLED = Path(__file__).resolve().parent.parent / "src" / "expertcache" / "assets" / "tiny-qwen3-moe"
WORDS = [" Hello", " foo", " bar"]
BYTES = [0x80, 0x82, 0xAC, 0xE2, 0xFF]


def write_spm(directory: Path, dummy_prefix: bool) -> Path:
    """A SentencePiece vocabulary with byte fallback in tokenizer.json, under 128 ids (the test
    model's). dummy_prefix: Llama's and Mixtral's (a Prepend('▁') normalizer and a Strip decoder
    that drops the space it gives the text's first word); without, Gemma's."""
    vocab = {"<unk>": 0, "</s>": 1, "<s>": 2, "<eot>": 3}
    vocab.update({f"<0x{b:02X}>": len(vocab) + i for i, b in enumerate(BYTES)})
    for piece in ["▁", ".", "x", "a", *(w.replace(" ", "▁") for w in WORDS)]:
        vocab[piece] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    prefix = [normalizers.Prepend("▁")] if dummy_prefix else []
    tok.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if dummy_prefix else []))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "</s>", "<s>", "<eot>")])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return directory


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("spm")
    return {"llama": Tokenizer(write_spm(root / "llama", dummy_prefix=True)),
            "gemma": Tokenizer(write_spm(root / "gemma", dummy_prefix=False)),
            "bundled": Tokenizer(BUNDLED)}  # byte-level BPE


def ids_of(tok: Tokenizer, items: list) -> list[int]:
    """Token ids of words (str), single bytes (int) and "<special>" (the vocabulary's special token)."""
    level = {b: c for c, b in _byte_level_table().items()}
    special = "<eot>" if tok.tok.token_to_id("<eot>") is not None else "<|im_end|>"
    out = []
    for item in items:
        if item == "<special>":
            out.append(tok.tok.token_to_id(special))
        elif isinstance(item, int):
            byte = tok.tok.token_to_id(f"<0x{item:02X}>")
            out.append(byte if byte is not None else tok.tok.token_to_id(level[item]))
        elif tok.tok.token_to_id(item.replace(" ", "▁")) is not None:
            out.append(tok.tok.token_to_id(item.replace(" ", "▁")))
        else:
            out.extend(tok.encode(item, add_special_tokens=False))
    assert None not in out
    return out


def llama_text(tok: Tokenizer, ids: list[int]) -> str:
    """llama-server's text of generated ids: each token's piece (a byte token's byte, a
    SentencePiece token with '▁' as a space, a byte-level token's bytes), the bytes joined and an
    invalid sequence one U+FFFD (its JSON writer replaces them)."""
    table, byte_level = _byte_level_table(), type(tok.tok.decoder).__name__ == "ByteLevel"
    raw = b""
    for i in ids:
        token = tok.tok.id_to_token(i)
        if byte_level:
            raw += bytes(table[c] for c in token)
        elif token.startswith("<0x") and token.endswith(">"):
            raw += bytes([int(token[3:5], 16)])
        else:
            raw += token.replace("▁", " ").encode()
    return raw.decode("utf-8", errors="replace")


PROMPTS = {
    "whole": [" Hello"],
    "whole via bytes": [" Hello", 0xE2, 0x82, 0xAC],   # '€' spelled in byte tokens
    "lead byte": [" Hello", 0xE2],                     # the first byte of '€'
    "two of three": [" Hello", 0xE2, 0x82],
    "invalid byte": [" Hello", 0xFF],
    "invalid run": [" Hello", 0x80, 0x80],
    "lead byte, special": [" Hello", 0xE2, "<special>"],  # decoding drops the special token
    "only a lead byte": [0xE2],
    "specials after a word": [" Hello", *["<special>"] * 5],  # more than the 4 ids of context
}
COMPLETIONS = {
    "words": [" foo", " bar"],
    "the rest of a '€'": [0x82, 0xAC, " foo"],
    "a '€'": [0xE2, 0x82, 0xAC, " foo"],
    "a continuation byte": [0xAC, " bar"],
    "an invalid byte": [0xFF, " foo"],
}


@pytest.mark.parametrize("name", ["llama", "gemma", "bundled"])
@pytest.mark.parametrize("prompt_name", sorted(PROMPTS))
def test_the_stream_after_any_prompt_tail_is_llama_servers_text(tokenizers, name, prompt_name):
    tok = tokenizers[name]
    prompt = ids_of(tok, PROMPTS[prompt_name])
    assert tok.decode(prompt), "every prompt here has text: the completion continues it"
    for completion_name, items in COMPLETIONS.items():
        out = ids_of(tok, items)
        want = llama_text(tok, out)
        assert want.startswith(" ") or completion_name != "words"
        whole, before = tok.decode(prompt + out), tok.decode(prompt)
        if prompt_name in ("whole", "whole via bytes", "specials after a word") and whole.startswith(before):
            # Where the prompt ends in whole characters, transformers' decode agrees.
            assert whole[len(before):] == want, (completion_name, whole, before)
        dec = StreamDecoder(tok, context=prompt)
        streamed = "".join(dec.push(i) for i in out)
        # Every completion ends in a word: nothing is held back at the end.
        assert (streamed, dec.text()) == (want, want), (completion_name, streamed, dec.text())


def test_a_word_after_a_lead_byte_keeps_its_space_piece_by_piece(tokenizers):
    """The reported case: each piece as it streams, not only the pieces joined."""
    tok = tokenizers["llama"]
    dec = StreamDecoder(tok, context=ids_of(tok, [" Hello", 0xE2]))
    assert [dec.push(i) for i in ids_of(tok, [" foo", " bar"])] == [" foo", " bar"]
    # Bytes owed to the prompt's '€' are held while a later byte could still finish a character,
    # then given as what they are on their own.
    dec = StreamDecoder(tok, context=ids_of(tok, [" Hello", 0xE2]))
    assert [dec.push(i) for i in ids_of(tok, [0x82, 0xAC, " foo"])] == ["", "", "\ufffd\ufffd foo"]


def test_a_text_that_starts_the_text_still_loses_its_leading_space(tokenizers):
    """Unchanged: with no text before it (a prompt of BOS alone), a SentencePiece word is the
    text's first and the Strip decoder drops its space, as decoding prompt and completion does."""
    tok = tokenizers["llama"]
    bos = [tok.tok.token_to_id("<s>")]
    out = ids_of(tok, [" foo", " bar"])
    dec = StreamDecoder(tok, context=bos)
    assert "".join(dec.push(i) for i in out) == tok.decode(bos + out) == "foo bar" == dec.text()


class Script:
    """A sampler that gives set ids in turn, whatever the logits."""

    def __init__(self, ids: list[int]):
        self.ids = iter(ids)

    def __call__(self, logits) -> int:
        return next(self.ids)


CASES = [("lead byte", "words"), ("lead byte", "the rest of a '€'"), ("invalid byte", "a '€'"),
         ("two of three", "a continuation byte")]


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory, tokenizers):
    from conftest import build_reference, save_checkpoint, tiny_config

    root = tmp_path_factory.mktemp("model")
    d = save_checkpoint(build_reference(tiny_config("qwen3_moe", layers=1)), root / "ckpt")
    return expertcache.load(d, ctx_size=64, tokenizer=write_spm(root / "tok", dummy_prefix=True))


@pytest.mark.parametrize("prompt_name,completion_name", CASES)
def test_generate_streams_what_it_answers(spm_model, monkeypatch, prompt_name, completion_name):
    """Model.generate, streamed through on_text and not: one text, llama-server's."""
    tok = spm_model.tokenizer
    prompt, out = ids_of(tok, PROMPTS[prompt_name]), ids_of(tok, COMPLETIONS[completion_name])
    texts = []
    for stream in (True, False):
        monkeypatch.setattr(expertcache.engine, "Sampler", lambda params: Script(out))
        pieces = []
        res = spm_model.generate(prompt, max_tokens=len(out), ignore_eos=True,
                                 on_text=pieces.append if stream else None)
        assert res.token_ids == out
        if stream:
            assert "".join(pieces) == res.text
        texts.append(res.text)
    assert texts == [llama_text(tok, out)] * 2


def test_completions_endpoint_streams_what_it_answers(spm_model, monkeypatch):
    """/v1/completions with the prompt as token ids: the streamed chunks joined and the
    non-streamed `text` are one text, with the word's leading space."""
    tok = spm_model.tokenizer
    prompt, out = ids_of(tok, [" Hello", 0xE2]), ids_of(tok, [" foo", 0x82, 0xAC, " bar"])
    body = {"prompt": prompt, "max_tokens": len(out), "ignore_eos": True, "temperature": 0}
    with TestClient(create_app(spm_model, n_slots=1, cache_prompt=False)) as c:
        monkeypatch.setattr(expertcache.engine, "Sampler", lambda params: Script(out))
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["text"]
        monkeypatch.setattr(expertcache.engine, "Sampler", lambda params: Script(out))
        r = c.post("/v1/completions", json={**body, "stream": True})
        assert r.status_code == 200, r.text
    chunks = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    streamed = "".join(ch["choices"][0]["text"] for ch in chunks if ch.get("choices"))
    assert streamed == answer == llama_text(tok, out) == " foo\ufffd\ufffd bar"
