"""Tokenizer (tokenizer.json through `tokenizers`) and chat templates rendered with jinja2 the
way transformers renders them. The engine never sees text; this module is the only place that does.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from .errors import ExpertCacheError


# Decoding more ids than this goes through decode_batch, which releases the GIL.
_LONG = 4096


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
        jinja_path = d / "chat_template.jinja"
        if jinja_path.exists():
            cfg = {**cfg, "chat_template": jinja_path.read_text(encoding="utf-8")}
        self._configure(cfg)

    @classmethod
    def from_parts(cls, tok: HFTokenizer, cfg: dict) -> Tokenizer:
        """A tokenizer from a built `tokenizers.Tokenizer` and tokenizer_config.json's fields
        (bos_token, eos_token, add_bos_token, chat_template), as a GGUF file provides them."""
        self = cls.__new__(cls)
        self.tok = tok
        self._configure(cfg)
        return self

    def _configure(self, cfg: dict) -> None:
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_id = self.tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self.tok.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos = bool(cfg.get("add_bos_token", False)) and self.bos_id is not None
        # Every id generation ends at (a GGUF names them all: eos, eot, ...); eos alone otherwise.
        self.end_ids = set(cfg.get("eog_token_ids") or ()) | ({self.eos_id} if self.eos_id is not None else set())
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        self.chat_template = template
        self._compiled = None
        self._plain: HFTokenizer | None = None  # `encode(parse_special=False)`'s copy, made on first use

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
        # Some tokenizer.json files leave BOS to tokenizer_config's add_bos_token.
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_id):
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
        ids = list(ids)
        if len(ids) > _LONG:  # as in encode: without the GIL; a short call stays on the cheaper path
            return self.tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        if not self.chat_template:
            raise ExpertCacheError("this model has no chat template (tokenizer_config.json chat_template "
                                   "or chat_template.jinja)")
        if self._compiled is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])

            def raise_exception(message):
                raise ExpertCacheError(f"chat template: {message}")

            def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys)

            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._compiled = env.from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise ExpertCacheError(f"chat template does not compile: {e}") from None
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
        except ExpertCacheError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError,
                RecursionError) as e:
            # The template met messages it cannot render (a missing key, a value of another type).
            raise ExpertCacheError(f"chat template failed to render these messages: {type(e).__name__}: {e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # The rendered template already holds any special tokens it wants, as in transformers.
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


def _unicode_problem(text: str) -> str | None:
    """Where `text` stops being encodable as UTF-8 (a lone surrogate), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"a lone surrogate U+{ord(text[e.start]):04X} at character {e.start} (not valid Unicode)"
    return None


class StreamDecoder:
    """Turns generated token ids into text pieces, holding back incomplete UTF-8 sequences.

    Each step decodes only a short window (the tokens since the last emitted piece, plus the one
    before them for context such as a leading space), so streaming costs the same per token
    however long the generation gets.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids = tokenizer, []
        self.prefix = 0  # window start: one piece back, for context
        self.read = 0    # tokens already emitted as text

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix: self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]
