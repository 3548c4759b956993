"""Tokenizer and chat templates against transformers' tokenizer and apply_chat_template."""

from __future__ import annotations

import json

import pytest

from expertcache.tokenizer import StreamDecoder, Tokenizer
from conftest import write_tokenizer

MESSAGES = [{"role": "system", "content": "w1"}, {"role": "user", "content": "w2 w3"},
            {"role": "assistant", "content": "w4"}, {"role": "user", "content": "w5"}]

TEMPLATES = {
    "chatml": None,  # the one write_tokenizer puts in tokenizer_config.json
    "bos-and-loopcontrols": (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
        "{{ m['role'] | upper }} {{ m['content'] | trim }}{% if not loop.last %} {% endif %}{% endfor %}"
        "{% if add_generation_prompt %} ASSISTANT{% endif %}{{ eos_token if not add_generation_prompt }}"),
    "tojson": "{% for m in messages %}{{ m | tojson }}\n{% endfor %}",
}


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(tmp_path, name, gen):
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path)
    if TEMPLATES[name]:
        cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
        cfg["chat_template"] = TEMPLATES[name]
        cfg["bos_token"] = "<|im_start|>"
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours = Tokenizer(tmp_path)
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    expected = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
    assert ours.render_chat(MESSAGES, add_generation_prompt=gen) == expected
    ids = theirs.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=gen)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ours.encode_chat(MESSAGES, add_generation_prompt=gen) == list(ids)


def test_chat_template_jinja_file_wins(tmp_path):
    write_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert Tokenizer(tmp_path).render_chat(MESSAGES[:2]) == "[w1][w2 w3]"


def test_encode_decode_roundtrip(tmp_path):
    write_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    ids = tok.encode("w1 w2 w10")
    assert ids == [tok.tok.token_to_id(w) for w in ("w1", "w2", "w10")]
    assert tok.decode(ids) == "w1 w2 w10"
    assert tok.eos_id == 1


def test_stream_decoder_holds_back_partial_utf8(tmp_path):
    from tokenizers import Tokenizer as HF, models, decoders, pre_tokenizers

    vocab = {"<unk>": 0, "a": 1}
    # A byte-level BPE vocab in which an emoji is split over two tokens.
    bl = pre_tokenizers.ByteLevel(add_prefix_space=False)
    emoji_bytes = "é€".encode()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    hf = HF(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    hf.pre_tokenizer = bl
    hf.decoder = decoders.ByteLevel()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path)
    ids = tok.encode("é€", add_special_tokens=False)
    assert len(ids) == len(emoji_bytes)
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    assert "".join(pieces) == "é€"
    assert all("\ufffd" not in p for p in pieces)
