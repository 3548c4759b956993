"""Tokenizer (tokenizer.json through `tokenizers`) and chat templates rendered with jinja2 the
way transformers renders them. The engine never sees text; this module is the only place that does.
"""

from __future__ import annotations

import codecs
import json
import operator
import re
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from .errors import ExpertCacheError


# Decoding more ids than this goes through decode_batch, which releases the GIL.
_LONG = 4096
# tokenizer_config.json's special tokens that transformers hands a chat template by name.
_TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# The names a message's reasoning may come under, the one chat templates read first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# A token ByteFallback decodes as one byte.
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_chars() -> dict[str, int]:
    """The byte-level alphabet (GPT-2's bytes_to_unicode), character to byte, as the ByteLevel decoder reads it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(rest)}}


_BYTE_LEVEL = _byte_level_chars()


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, directory: str | Path):
        d = Path(directory)
        if not d.is_dir():  # a file (its config.json, say) or a typo: not "<path>/tokenizer.json: missing"
            raise ExpertCacheError(f"tokenizer {str(directory)!r} is not an existing directory: expected a "
                                   "directory with tokenizer.json")
        path = d / "tokenizer.json"
        if not path.exists():
            raise ExpertCacheError(f"{path}: missing (a model directory needs tokenizer.json)")
        try:
            self.tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception subclass
            raise ExpertCacheError(f"{path}: cannot load tokenizer: {e}") from None
        cfg = {}
        cfg_path = d / "tokenizer_config.json"
        if cfg_path.exists():
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ExpertCacheError(f"{cfg_path}: not valid JSON: {e}") from None
            _check_config(cfg, cfg_path)
        jinja_path = d / "chat_template.jinja"
        if jinja_path.exists():
            try:
                cfg = {**cfg, "chat_template": jinja_path.read_text(encoding="utf-8")}
            except UnicodeDecodeError as e:
                raise ExpertCacheError(f"{jinja_path}: not UTF-8 text: {e}") from None
        self.template_home = "tokenizer_config.json's chat_template or chat_template.jinja"
        self._configure(cfg)

    @classmethod
    def from_parts(cls, tok: HFTokenizer, cfg: dict) -> Tokenizer:
        """A tokenizer from a built `tokenizers.Tokenizer` and tokenizer_config.json's fields
        (bos_token, eos_token, add_bos_token, chat_template), as a GGUF file provides them."""
        self = cls.__new__(cls)
        self.tok = tok
        self.template_home = "the GGUF metadata key tokenizer.chat_template"
        self._configure(cfg)
        return self

    def _configure(self, cfg: dict) -> None:
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_id = self.tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self.tok.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos = bool(cfg.get("add_bos_token", False)) and self.bos_id is not None
        # Some tokenizer.json files leave BOS to tokenizer_config's add_bos_token (a GGUF's always
        # does): then encode() prepends it, even before a BOS the text spells, as llama.cpp and a
        # post-processor that adds it both do.
        self._prepend_bos = self.add_bos and self.tok.encode("", add_special_tokens=True).ids[:1] != [self.bos_id]
        # What a template may read beside bos_token and eos_token, as transformers passes its special tokens.
        self._template_tokens = {k: _token_text(cfg.get(k)) for k in _TEMPLATE_TOKENS if _token_text(cfg.get(k))}
        # Every id generation ends at (a GGUF names them all: eos, eot, ...); eos alone otherwise.
        self.end_ids = set(cfg.get("eog_token_ids") or ()) | ({self.eos_id} if self.eos_id is not None else set())
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        self.chat_template = template
        self._compiled = None
        self._plain: HFTokenizer | None = None  # `encode(parse_special=False)`'s copy, made on first use
        # What decode(skip_special_tokens=True) leaves out.
        added = self.tok.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self._added_ids = frozenset(added)
        self._decoder_steps = _decoder_steps(self.tok)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. Text that is not valid Unicode (a lone surrogate) is an ExpertCacheError.
        `parse_special=False` reads text that spells a special token (`<|endoftext|>`) as plain
        characters, as llama.cpp's tokenizer does with parse_special off (llama-perplexity's way)."""
        tok = self.tok if parse_special else self._plain_text()
        try:
            # encode_batch releases the GIL while it works (encode holds it): a server's other
            # threads keep running while a large prompt is tokenized.
            ids = tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except (TypeError, UnicodeError) as e:
            raise ExpertCacheError(f"cannot tokenize the text: {_unicode_problem(text) or e}") from None
        if add_special_tokens and self._prepend_bos:
            ids = [self.bos_id, *ids]
        return ids

    def _plain_text(self) -> HFTokenizer:
        # A copy, so that the shared tokenizer (a server's threads use it) never changes mode.
        if self._plain is None:
            plain = HFTokenizer.from_str(self.tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`. An id past the vocabulary adds nothing, as in transformers (a model may
        have more embedding rows than tokens); one that is no id at all is an ExpertCacheError."""
        try:
            ids = list(ids)
            if len(ids) > _LONG:  # as in encode: without the GIL; a short call stays on the cheaper path
                return self.tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
            return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
        except (TypeError, OverflowError):
            # tokenizers says only "number too small to fit in target type", naming no value.
            if not isinstance(ids, list):
                raise ExpertCacheError(f"token ids {_one_line(repr(ids))[:80]} must be a list of integers") from None
            bad = next((i for i in ids if not _is_id(i)), None)
            raise ExpertCacheError(f"token id {bad!r} is not a token id (expected an integer from 0; this "
                                   f"tokenizer has {self.vocab_size} tokens)") from None

    def piece(self, token_id: int) -> str | list[int]:
        """llama-server's /tokenize piece of a token: its own bytes as a string where they are valid
        UTF-8, else as a list of byte values (a byte token, or part of a character)."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return list(raw)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes llama.cpp's token_to_piece(special=true) gives a token: an added (control or
        user-defined) token's text, and any other token as the decoder makes it when alone, less what
        the decoder does by position only: a SentencePiece word keeps its leading space (decode([id])
        strips it), a byte token or a byte-level token that is part of a character stays bytes
        (decode turns them into U+FFFD). Nothing for an id past the vocabulary."""
        token = self.tok.id_to_token(token_id)
        if token is None:
            return b""
        if token_id in self._added_ids:
            return token.encode()
        own = _own_bytes(self._decoder_steps, token)
        if own is None:  # a decoder step not known here: its decode, as before
            return self.decode([token_id], skip_special_tokens=False).encode()
        return own

    def check_chat_template(self) -> None:
        """Raises, naming where a template would be, when this tokenizer has none."""
        if not self.chat_template:
            raise ExpertCacheError(f"this model has no chat template ({self.template_home}); a tokenizer "
                                   "directory with one can stand in (--tokenizer DIR)")

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The chat template applied as transformers' apply_chat_template(tokenize=False) applies it:
        keys whose value is None dropped from each message, reasoning under `thinking` or `reasoning`
        also given as `reasoning_content`, `tools` and `documents` None, the special tokens by name;
        `extra` (enable_thinking, tools, ...) passed to the template as well."""
        self.check_chat_template()
        if self._compiled is None:
            self._compiled = _compile(self.chat_template)
        values = {"tools": None, "documents": None, **self._template_tokens,
                  "bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **extra}
        try:
            return self._compiled.render(messages=[_plain_message(m) for m in messages],
                                         add_generation_prompt=add_generation_prompt, **values)
        except ExpertCacheError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError,
                RuntimeError) as e:
            # The template met messages it cannot render (a missing key, a value of another type).
            raise ExpertCacheError(f"chat template failed to render these messages: {type(e).__name__}: "
                                   f"{_one_line(e)}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> list[int]:
        # The rendered template already holds any special tokens it wants, as in transformers.
        return self.encode(self.render_chat(messages, add_generation_prompt, **extra), add_special_tokens=False)


def _decoder_steps(tok: HFTokenizer) -> list[dict] | None:
    """The decoder's steps as tokenizer.json spells them ([] for none); None where one is nested."""
    if tok.decoder is None:
        return []
    spec = json.loads(tok.decoder.__getstate__())
    steps = spec.get("decoders", []) if spec.get("type") == "Sequence" else [spec]
    return None if any(s.get("type") == "Sequence" for s in steps) else steps


def _own_bytes(steps: list[dict] | None, token: str) -> bytes | None:
    """What the decoder `steps` make of `token` alone, leaving out the steps that act by position
    (Strip of the text's first space, Metaspace's of the first token's); None for an unknown step."""
    if steps is None:
        return None
    piece: str | bytes = token
    for step in steps:
        kind = step.get("type")
        if kind in ("Replace", "Metaspace"):
            if kind == "Replace":
                if "String" not in step.get("pattern", {}):
                    return None
                old, new = step["pattern"]["String"], step.get("content", "")
            else:
                old, new = step.get("replacement", "▁"), " "
            piece = piece.replace(old, new) if isinstance(piece, str) else piece.replace(old.encode(), new.encode())
        elif kind == "ByteFallback":
            byte = _BYTE_TOKEN.fullmatch(piece) if isinstance(piece, str) else None
            if byte:
                piece = bytes([int(byte[1], 16)])
        elif kind == "ByteLevel":
            if isinstance(piece, str):  # a token with a character outside the alphabet is its own UTF-8
                piece = bytes(_BYTE_LEVEL[c] for c in piece) if all(c in _BYTE_LEVEL for c in piece) else piece.encode()
        elif kind not in ("Fuse", "Strip"):
            return None
    return piece if isinstance(piece, bytes) else piece.encode()


def _byte_runs(steps: list[dict] | None) -> str | None:
    """How a decoder turns bytes into text where StreamDecoder can follow it: "level" (ByteLevel:
    all the bytes together, each invalid sequence one U+FFFD), "fallback" (SentencePiece's
    Replace('▁', ' '), ByteFallback, Fuse, Strip: a run of byte tokens at a time, one U+FFFD per
    byte where the run is not valid UTF-8), None for any other."""
    kinds = [s.get("type") for s in steps or ()]
    if kinds == ["ByteLevel"]:
        return "level"
    spm = all(s.get("type") in ("ByteFallback", "Fuse") or s == {"type": "Strip", "content": " ", "start": 1, "stop": 0}
              or (s.get("type") == "Replace" and s.get("pattern") == {"String": "▁"} and s.get("content") == " ")
              for s in steps or ())
    return "fallback" if spm and "ByteFallback" in kinds else None


def _invalid_utf8(data: bytes) -> bool:
    """Whether `data` holds a byte that no bytes after it make valid UTF-8 (more than an unfinished
    character at its end)."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
    except UnicodeDecodeError:
        return True
    return False


def _is_id(value) -> bool:
    try:
        return 0 <= operator.index(value) < 2**32  # tokenizers' ids are u32
    except TypeError:
        return False


def _check_config(cfg, path: Path) -> None:
    """The tokenizer_config.json fields read here have the types transformers writes: a value of
    another type failed later, inside a render or an encode, as a bare TypeError or AttributeError."""
    if not isinstance(cfg, dict):
        raise ExpertCacheError(f"{path}: holds a JSON {type(cfg).__name__}, expected an object")
    for key in _TEMPLATE_TOKENS:
        value = cfg.get(key)
        if not (value is None or isinstance(_token_text(value), str)):
            raise ExpertCacheError(f"{path}: {key} is {value!r}, expected a token's text (a string)")
    template = cfg.get("chat_template")
    named = isinstance(template, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in template)
    if not (template is None or isinstance(template, str) or named):
        raise ExpertCacheError(f"{path}: chat_template is {_one_line(repr(template))[:80]}, expected a string or a "
                               "list of {\"name\": ..., \"template\": ...} objects")


def _plain_message(message):
    """A message as a template sees it in transformers: a key whose value is None is absent (a
    template testing `'tool_calls' in message` sees no calls), and reasoning sent under any of its
    names is under `reasoning_content` too (what the Qwen templates read) and, unless the message
    has its own, under `thinking`."""
    if not isinstance(message, dict):
        return message
    m = {k: v for k, v in message.items() if v is not None}
    for name in _REASONING_FIELDS:
        if name in m:
            m["reasoning_content"] = m[name]
            m.setdefault("thinking", m[name])
            break
    return m


def _one_line(message) -> str:
    return " ".join(str(message).split())


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which transformers' templates may use to mark the
    assistant's text (for its training masks): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _compile(template: str) -> jinja2.Template:
    """A template in the environment transformers renders chat templates in."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])

    def raise_exception(message):
        raise ExpertCacheError(f"chat template: {_one_line(message)}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; transformers' does not.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ExpertCacheError(f"chat template does not compile: {_one_line(e)}") from None


def _unicode_problem(text: str) -> str | None:
    """Where `text` stops being encodable as UTF-8 (a lone surrogate), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"a lone surrogate U+{ord(text[e.start]):04X} at character {e.start} (not valid Unicode)"
    return None


def _stand_in(tokenizer: Tokenizer) -> list[int]:
    """Ids of a short ASCII text that decode to just that text and end in a token no byte token
    continues (not a byte token itself, nor special, which decoding drops); [] where none does."""
    for text in (".", "x", "a"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        last = tokenizer.tok.id_to_token(ids[-1]) if ids else None
        if (last is not None and _BYTE_TOKEN.fullmatch(last) is None
                and not set(ids) & tokenizer.special_ids and tokenizer.decode(ids) == text):
            return ids
    return []


class StreamDecoder:
    """Turns generated token ids into text pieces, holding back incomplete UTF-8 sequences.

    The pieces are the text the ids add after `context` (the prompt's ids): a SentencePiece
    word keeps its leading space where it continues a prompt, as llama.cpp's pieces and
    transformers' decode of prompt and continuation together have it (decoding the new ids alone
    strips it). After a prompt that ends in bytes that are no whole character, the ids' bytes start
    afresh, as llama.cpp's pieces do, and never change the prompt's text. Each step decodes only a
    short window (the tokens since the last emitted piece, plus the ones before them for context
    such as a leading space), so streaming costs the same per token however long the generation gets.
    """

    CONTEXT = 4  # prompt ids kept as context

    def __init__(self, tokenizer: Tokenizer, context: list[int] | tuple[int, ...] = ()):
        # Decoding drops special ids and ids past the vocabulary: the text the completion continues
        # ends before any at the end of the prompt (a window of them alone read as no text at all).
        # A value that is no id stays, for decode to name.
        end = len(context)
        while end and _is_id(i := context[end - 1]) and (
                i in tokenizer.special_ids or tokenizer.tok.id_to_token(i) is None):
            end -= 1
        tail = list(context[max(0, end - self.CONTEXT):end])
        # The longest tail of the prompt that decodes to whole characters: one that ends inside a
        # character, or starts inside one where byte tokens decode as a run, would blur the first piece.
        ids = next((tail[-n:] for n in range(len(tail), 0, -1) if not tokenizer.decode(tail[-n:]).endswith("\ufffd")),
                   None if tail else [])
        if ids is None:
            # The prompt ends in bytes that are no whole character (a byte token the completion may
            # continue, an invalid run: possible when the prompt comes as ids). The completion's
            # bytes start afresh there, as llama.cpp's pieces do: the text the prompt's bytes already
            # gave stays, and a character they began cannot change. So all the prompt gives the
            # completion's text is that text comes before it, which keeps a SentencePiece word's
            # leading space: a stand-in says so where the prompt's tail would join the next bytes.
            ids = _stand_in(tokenizer)
        self.tokenizer, self.ids = tokenizer, ids
        self.prefix = 0         # window start: one piece back, for context
        self.read = len(ids)    # tokens already emitted as text
        self.emitted: list[str] = []
        self._bytes = _byte_runs(tokenizer._decoder_steps)
        self._tail, self._held = b"", 0  # byte-level: the last 4 bytes of the ids since `read`, and their count
        self._stuck = False     # byte fallback: held text that more byte tokens keep held
        self._changed = False   # whether the last _unread found the window's text changed what was emitted

    def push(self, token_id: int) -> str:
        if token_id in self.tokenizer.special_ids:
            # Decoding leaves it out; kept, it would stay in every later window (a run of them made
            # each push decode the whole run again).
            return ""
        self.ids.append(token_id)
        if self._still_held(token_id):
            return ""
        new = self._unread()
        if not new or new.endswith("\ufffd"):
            self._stuck = self._bytes == "fallback" and self._poisoned()
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        self._tail, self._held, self._stuck = b"", 0, False
        self.emitted.append(new)
        return new

    def _still_held(self, token_id: int) -> bool:
        """Whether the text pushed since the last piece still ends in U+FFFD (so `push` gives
        nothing), where that is known without decoding the window: decoding it at each push made a
        long run of invalid bytes cost the square of its length. Only what `_unread` would find."""
        token = self.tokenizer.tok.id_to_token(token_id)
        if token is None:
            return True  # past the vocabulary: decoding drops it, so nothing changes
        if self._bytes == "level":
            own = _own_bytes(self.tokenizer._decoder_steps, token)
            self._tail, self._held = (self._tail + own)[-4:], self._held + len(own)
            # The ByteLevel decoder decodes the ids' bytes together, invalid ones as U+FFFD, and
            # UTF-8 starts afresh at each byte that is no continuation byte: the last four bytes
            # say how the text ends. With four or more since the last piece, the window's text and
            # that of the new ids alone (both of which `_unread` may use) end alike.
            return self._held >= 4 and self._tail.decode("utf-8", "replace").endswith("\ufffd")
        # ByteFallback decodes a run of byte tokens that holds an invalid byte as one U+FFFD per
        # byte: one more byte token adds one more.
        return self._stuck and _BYTE_TOKEN.fullmatch(token) is not None

    def _poisoned(self) -> bool:
        """Whether the held text ends in a run of byte tokens with a byte that no later byte makes
        valid UTF-8: that of the window and, where `_unread` went by the new ids alone, theirs."""
        return all(_invalid_utf8(self._run_bytes(start)) for start in (self.prefix, self.read)[:1 + self._changed])

    def _run_bytes(self, start: int) -> bytes:
        """The bytes of the byte tokens that end the ids from `start`, as the decoder sees them."""
        run = []
        for i in reversed(self.ids[start:]):
            token = None if i in self.tokenizer.special_ids else self.tokenizer.tok.id_to_token(i)
            if token is None:  # decoding drops it: the run goes on across it
                continue
            byte = _BYTE_TOKEN.fullmatch(token)
            if byte is None:
                break
            run.append(int(byte[1], 16))
        return bytes(reversed(run))

    def _unread(self) -> str:
        """The text the ids not yet emitted add to what was."""
        before = self.tokenizer.decode(self.ids[self.prefix: self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        self._changed = not text.startswith(before)
        if self._changed:
            # Decoding the window again changed text already emitted: byte-fallback tokens decode
            # as one run, and a run that turns invalid UTF-8 becomes one U+FFFD per byte, a
            # character completed earlier in it included. The new ids' own bytes continue it
            # instead, as llama.cpp joins the pieces' bytes.
            return self.tokenizer.decode(self.ids[self.read:])
        return text[len(before):]

    def text(self) -> str:
        """All the text of the ids pushed so far, what is held back included: the pieces `push`
        returned and then the rest, so that a stream and the whole answer never differ."""
        return "".join(self.emitted) + self._unread()
