"""Text in and out against references: transformers' apply_chat_template on the families' chat
templates, llama.cpp's recorded token ids (tests/fixtures/gguf/tokenizers), and the text that
decoding a prompt and its continuation together gives."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

import expertcache
from conftest import assert_one_line_error, run_cli
from expertcache.checkpoint.gguf_io import GGUFCheckpoint
from expertcache.errors import ExpertCacheError
from expertcache.gguf_tokenizer import tokenizer_parts_from_gguf
from expertcache.tokenizer import StreamDecoder, Tokenizer

ROOT = Path(__file__).resolve().parent
BUNDLED = ROOT.parent / "src" / "expertcache" / "assets" / "tiny-qwen3-moe"  # ChatML, byte-level BPE
GEMMA_DIR = ROOT / "fixtures" / "gguf" / "gemma4" / "tokenizer"             # <bos>, <pad>, <unk>
RECORDED = ROOT / "fixtures" / "gguf" / "tokenizers"
TEMPLATES = ROOT / "fixtures" / "chat_templates"

# The families' published chat templates (tests/fixtures/chat_templates): Qwen3's as its
# tokenizer_config.json has it; the text path of Qwen3.5's and Gemma 4's (their image, video and
# tool-declaration branches left out).
QWEN3, QWEN35, GEMMA4 = ((TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
                         for name in ("qwen3", "qwen3_5", "gemma4"))


def template_dir(tmp_path: Path, source: Path, template: str) -> Path:
    """`source`'s tokenizer with `template` as its chat template."""
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(source / "tokenizer.json", d)
    cfg = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}), encoding="utf-8")
    return d


def transformers_tokenizer(d: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(d)


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "  Be brief. "}, {"role": "user", "content": "naïve 日本語 🦙 x\r\ny\n"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "<think>\nr\n</think>\n\nb"}, {"role": "user", "content": "c"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<|channel>thought\nx<channel|>b"},
     {"role": "user", "content": "c"}],
    # What OpenAI clients send: null fields, and the reasoning under another name.
    [{"role": "user", "content": "a", "name": None},
     {"role": "assistant", "content": "b", "reasoning": "r", "tool_calls": None}, {"role": "user", "content": "c"}],
]
FAMILIES = {"qwen3": (BUNDLED, QWEN3), "qwen3_5": (BUNDLED, QWEN35), "gemma4": (GEMMA_DIR, GEMMA4)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_chat_templates_render_as_transformers_renders_them(tmp_path, family):
    d = template_dir(tmp_path, *FAMILIES[family])
    ours, theirs = Tokenizer(d), transformers_tokenizer(d)
    for conv in CONVERSATIONS:
        for gen in (True, False):
            for extra in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
                want = theirs.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen, **extra)
                assert ours.render_chat(conv, add_generation_prompt=gen, **extra) == want, (conv, gen, extra)
                ids = theirs.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen, return_dict=False,
                                                 **extra)
                assert ours.encode_chat(conv, add_generation_prompt=gen, **extra) == list(ids)


# Constructs of published templates beyond the families' own: Llama 3.1's `'tool_calls' in message`,
# Mistral's `tools is not none`, the special tokens by name, transformers' `{% generation %}` tag.
CONSTRUCTS = (
    "{%- for m in messages %}{% generation %}{{ m.role }}: {{ m.content }}{% endgeneration %}"
    "{%- if 'tool_calls' in m %} [{{ m.tool_calls | length }} calls]{% endif %}"
    "{%- if m.reasoning_content is defined %} ({{ m.reasoning_content }}){% endif %}\n{% endfor %}"
    "{{- tools is none }} {{ documents is none }} {{ tools is not none and tools | length }}"
    " [{{ pad_token }}] [{{ unk_token }}] [{{ bos_token }}] [{{ eos_token }}] {{ 'x' | tojson }}")


@pytest.mark.parametrize("source", [BUNDLED, GEMMA_DIR], ids=["bundled", "gemma4"])
def test_template_constructs_match_transformers(tmp_path, source):
    d = template_dir(tmp_path, source, CONSTRUCTS)
    ours, theirs = Tokenizer(d), transformers_tokenizer(d)
    conv = [{"role": "user", "content": "<b>&'</b>", "tool_calls": None},
            {"role": "assistant", "content": "ok", "thinking": "t", "tool_calls": [{"name": "f"}]}]
    for extra in ({}, {"tools": [{"name": "f"}]}):
        want = theirs.apply_chat_template(conv, tokenize=False, add_generation_prompt=True, **extra)
        assert ours.render_chat(conv, **extra) == want


def test_template_errors_are_one_line(tmp_path):
    d = template_dir(tmp_path, BUNDLED, "{{ raise_exception('Roles must alternate\\nuser/assistant/user') }}")
    with pytest.raises(ExpertCacheError) as e:
        Tokenizer(d).render_chat([{"role": "user", "content": "hi"}])
    assert str(e.value) == "chat template: Roles must alternate user/assistant/user"
    # A function transformers does not provide either.
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ format_tools(tools) }}"}))
    with pytest.raises(ExpertCacheError) as e:
        Tokenizer(d).render_chat([{"role": "user", "content": "hi"}])
    assert "\n" not in str(e.value) and "'format_tools' is undefined" in str(e.value)


@pytest.fixture
def chat_checkpoint(tiny_checkpoint):
    _, d = tiny_checkpoint("qwen3_moe", layers=2)
    return d


def test_cli_chat_reads_crlf_lines_and_the_system_message(chat_checkpoint, capsys, monkeypatch):
    (chat_checkpoint / "chat_template.jinja").write_text(
        "{% if messages[0].role != 'system' or messages[0].content != 'w7' %}{{ raise_exception('no system') }}"
        "{% endif %}{% for m in messages %}{% if '\\r' in m.content %}{{ raise_exception('a CR in ' + m.role) }}"
        "{% endif %}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endfor %}<|im_start|> assistant ")
    monkeypatch.setattr("sys.stdin", io.StringIO("w1 w2\r\nw3\r\n"))
    code, err = run_cli(capsys, "run", "-m", str(chat_checkpoint), "--chat", "--system", "w7", "-n", "2")
    assert code == 0, err
    monkeypatch.setattr("sys.stdin", io.StringIO("w1\n"))
    assert_one_line_error(*run_cli(capsys, "run", "-m", str(chat_checkpoint), "--chat", "-n", "2"), "no system")


# ---- token ids: llama.cpp's ----

@pytest.mark.parametrize("name", ["spm-tiny", "gemma4-tiny", "bpe-tiny"])
def test_gguf_encode_gives_llama_cpp_ids(name):
    """llama_tokenize(add_special=True, parse_special=True) adds BOS where the vocabulary asks for
    it, also before a BOS that the text spells ("<s>start..." is BOS, BOS, ...)."""
    rec = json.loads((RECORDED / f"{name}.ids.json").read_text(encoding="utf-8"))
    with GGUFCheckpoint(RECORDED / f"{name}.gguf") as ck:
        tok = Tokenizer.from_parts(*tokenizer_parts_from_gguf(ck.metadata, str(ck.files[0])))
    want_all = rec["id_sets"][rec["ids"]["gpt-2"]] if name == "bpe-tiny" else rec["ids"]
    for text, want in zip(rec["texts"], want_all, strict=True):
        assert tok.encode(text) == want, text[:60]


# ---- decoding and streaming ----

def gguf_tokenizer(name: str) -> Tokenizer:
    with GGUFCheckpoint(RECORDED / f"{name}.gguf") as ck:
        return Tokenizer.from_parts(*tokenizer_parts_from_gguf(ck.metadata, str(ck.files[0])))


STREAM_TEXTS = [
    "The capital of France is Paris.", " two  spaces\tand a tab\r\nend ", "1234567 3.14 ٣٤٥",
    "我想在apple工作 日本語のテキスト 한국어", "नमस्ते दुनिया ภาษาไทย", "🚀 😶\u200d🌫️ 👩🏽\u200d💻 🦙🦙 e\u0301 naïve",
    "<s>a</s> <start_of_turn>user\nhi<end_of_turn>", "<|im_start|>user\nhi<|im_end|>",
]


@pytest.mark.parametrize("name", ["spm-tiny", "gemma4-tiny", "bpe-tiny", "bundled"])
def test_streamed_pieces_are_the_text_that_continues_the_prompt(name):
    """At every cut of every text, the pieces add up to what decoding prompt and continuation
    together adds to the prompt's own text (a SentencePiece word keeps its leading space), and no
    piece holds a replacement character that a later byte would have completed."""
    tok = Tokenizer(BUNDLED) if name == "bundled" else gguf_tokenizer(name)
    checked = 0
    for text in STREAM_TEXTS:
        ids = tok.encode(text)
        for cut in range(1, len(ids)):
            prompt, out = ids[:cut], ids[cut:]
            whole, before = tok.decode(prompt + out), tok.decode(prompt)
            if not whole.startswith(before):
                continue  # the prompt ends inside a character
            want = whole[len(before):]
            dec = StreamDecoder(tok, context=prompt)
            pieces = [dec.push(i) for i in out]
            assert dec.text() == want, (text, cut)
            assert want.startswith("".join(pieces)), (text, cut)
            assert all("\ufffd" not in p for p in pieces) or "\ufffd" in want
            checked += 1
    assert checked > 100


def test_generated_text_continues_the_prompt(tiny_checkpoint):
    """prompt text + generated text = the text of prompt and generated ids decoded together, and
    the streamed pieces add up to it (the test tokenizer joins words with spaces)."""
    _, d = tiny_checkpoint("qwen3_moe", layers=2)
    model = expertcache.load(d, ctx_size=128)
    prompt = [5, 9, 17, 33]
    streamed = []
    res = model.generate(prompt, max_tokens=6, ignore_eos=True, on_text=streamed.append)
    tok = model.tokenizer
    assert tok.decode(prompt) + res.text == tok.decode(prompt + res.token_ids)
    assert res.text.startswith(" ") and "".join(streamed) == res.text
    # Held back at a stop string, then flushed: the same text.
    stop = res.text.split()[2]
    streamed = []
    cut = model.generate(prompt, max_tokens=6, ignore_eos=True, stop=[stop], on_text=streamed.append)
    assert cut.text == res.text[: res.text.index(stop)] == "".join(streamed)
