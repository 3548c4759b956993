"""Tokenizer edges found in review: bad tokenizer_config.json / chat_template.jinja files and bad ids
are one-line errors, and a stream of special tokens costs the same per token however long it gets."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from expertcache.checkpoint.gguf_io import GGUFCheckpoint
from expertcache.errors import ExpertCacheError
from expertcache.gguf_tokenizer import tokenizer_parts_from_gguf
from expertcache.tokenizer import StreamDecoder, Tokenizer

ROOT = Path(__file__).resolve().parent
BUNDLED = ROOT.parent / "src" / "expertcache" / "assets" / "tiny-qwen3-moe"
RECORDED = ROOT / "fixtures" / "gguf" / "tokenizers"


def one_line(excinfo, *needles):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg


def tokenizer_dir(tmp_path: Path, config: bytes | None = None, jinja: bytes | None = None) -> Path:
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(BUNDLED / "tokenizer.json", d)
    if config is not None:
        (d / "tokenizer_config.json").write_bytes(config)
    if jinja is not None:
        (d / "chat_template.jinja").write_bytes(jinja)
    return d


@pytest.mark.parametrize("config,jinja,needles", [
    # Each was a bare AttributeError, TypeError or UnicodeDecodeError, at load or at the first chat.
    (b"[1, 2]", None, ["tokenizer_config.json", "holds a JSON list, expected an object"]),
    (b"[1, 2]", b"{{ messages }}", ["tokenizer_config.json", "holds a JSON list, expected an object"]),
    (b'{"chat_template": 5}', None, ["tokenizer_config.json", "chat_template is 5, expected a string"]),
    (b'{"chat_template": [1]}', None, ["tokenizer_config.json", "chat_template is [1], expected a string"]),
    (b'{"bos_token": 5, "add_bos_token": true}', None, ["tokenizer_config.json", "bos_token is 5, expected"]),
    (b'{"eos_token": ["a"]}', None, ["tokenizer_config.json", "eos_token is ['a'], expected"]),
    (b"{}", b"\xff\xfe{{ x }}", ["chat_template.jinja", "not UTF-8"]),
])
def test_a_malformed_tokenizer_directory_is_one_line(tmp_path, config, jinja, needles):
    d = tokenizer_dir(tmp_path, config, jinja)
    with pytest.raises(ExpertCacheError) as e:
        Tokenizer(d).render_chat([{"role": "user", "content": "hi"}])
    one_line(e, *needles)


def test_well_formed_configs_still_load(tmp_path):
    """transformers writes special tokens as strings or as AddedToken objects, and named templates as a list."""
    cfg = {"bos_token": {"content": "<|im_start|>", "__type": "AddedToken"}, "eos_token": "<|im_end|>",
           "add_bos_token": False, "chat_template": [{"name": "default", "template": "[{{ messages[0].content }}]"},
                                                     {"name": "tool_use", "template": "t"}]}
    tok = Tokenizer(tokenizer_dir(tmp_path, json.dumps(cfg).encode()))
    assert tok.bos_token == "<|im_start|>" and tok.eos_id == tok.tok.token_to_id("<|im_end|>")
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "[hi]"


@pytest.mark.parametrize("ids,needle", [
    ([5, -1], "token id -1 is not a token id"),       # was OverflowError: number too small to fit in target type
    ([2**32], "token id 4294967296 is not a token id"),
    ([1, "a"], "token id 'a' is not a token id"),     # was TypeError
    ([2.0], "token id 2.0 is not a token id"),
    (None, "token ids None must be a list of integers"),
    (7, "token ids 7 must be a list of integers"),
])
def test_decoding_what_is_no_token_id_is_one_line(ids, needle):
    tok = Tokenizer(BUNDLED)
    with pytest.raises(ExpertCacheError) as e:
        tok.decode(ids)
    one_line(e, needle)


def test_decoding_ids_past_the_vocabulary_adds_nothing_as_transformers_does():
    """A model may have more embedding rows than tokens: such an id stays text-less, not an error."""
    from transformers import AutoTokenizer

    tok, ref = Tokenizer(BUNDLED), AutoTokenizer.from_pretrained(BUNDLED)
    ids = tok.encode("a b") + [tok.vocab_size + 10] + tok.encode(" c")
    assert tok.decode(ids) == ref.decode(ids) == "a b c"


def _gguf_tokenizer(name: str) -> Tokenizer:
    with GGUFCheckpoint(RECORDED / f"{name}.gguf") as ck:
        return Tokenizer.from_parts(*tokenizer_parts_from_gguf(ck.metadata, str(ck.files[0])))


class CountingTokenizer:
    """A Tokenizer that counts the ids it is asked to decode."""

    def __init__(self, tok: Tokenizer):
        self.inner, self.decoded = tok, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens)


@pytest.mark.parametrize("name,special", [("spm-tiny", "<start_of_turn>"), ("bpe-tiny", "<|im_start|>"),
                                          ("gemma4-tiny", "<start_of_turn>")])
def test_a_run_of_special_tokens_keeps_streaming_linear(name, special):
    """Special tokens decode to nothing. Kept in the decode window, each one pushed made every later
    push decode the whole run again: 4000 of them took seconds, and 8000 four times as long."""
    tok = _gguf_tokenizer(name)
    sid = tok.tok.token_to_id(special)
    assert tok.tok.get_added_tokens_decoder()[sid].special and tok.decode([sid]) == ""
    prompt = tok.encode("Hello there", add_special_tokens=False)
    word = tok.encode(" world again", add_special_tokens=False)
    pushed = [sid] * 500 + word + [sid] * 500 + word
    counting = CountingTokenizer(tok)
    dec = StreamDecoder(counting, context=prompt)
    counting.decoded = 0
    pieces = [dec.push(i) for i in pushed]
    # The text is what decoding prompt and continuation together gives, as before.
    whole = tok.decode(prompt + pushed)
    assert whole.startswith(tok.decode(prompt))
    assert "".join(pieces) + dec._unread() == whole[len(tok.decode(prompt)):] == dec.text()
    assert dec.text().count("world again") == 2 and dec.text().endswith(" world again")
    # A bounded window per push: at most a few dozen ids decoded each time, not hundreds.
    assert counting.decoded < 40 * len(pushed) // 10
