"""OpenAI's request and response shapes: parsing and validating request bodies (every error names
the field and what was expected, as an `ApiError` with OpenAI's error shape) and building the
JSON of responses and stream chunks."""

from __future__ import annotations

import json
import math
import re
import time
import uuid

from ..engine import GenerationResult

ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status` (and
    `headers`, such as a 503's `Retry-After`)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        message, param = _printable(message), None if param is None else _printable(param)
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.headers = message, status, param, code, headers
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def _printable(text: str) -> str:
    """`text` with what UTF-8 cannot encode (lone surrogates quoted from a request) escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# JSON nested deeper than this is refused (a request needs about 5 levels; the parser itself
# would give up near Python's recursion limit).
MAX_DEPTH = 64
# Integers with more digits than this are kept as `LongInt` instead of being converted (Python
# refuses to convert more than 4300 digits, and no field takes a value that long).
MAX_INT_DIGITS = 40
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what the sampler's generator accepts
MAX_STOPS, MAX_STOP_CHARS = 16, 1024  # OpenAI takes 4 stop strings; llama-server, any number


class LongInt:
    """An integer literal too long to be any field's value; every field check refuses it."""

    __slots__ = ("digits",)

    def __init__(self, text: str):
        self.digits = len(text.lstrip("-"))

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"

    __str__ = __repr__


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_LONG_DIGITS = re.compile(rb"[0-9]{%d}" % (MAX_INT_DIGITS + 1))


def _parse_int(text: str):
    return int(text) if len(text) <= MAX_INT_DIGITS else LongInt(text)


def parse_json(raw: bytes) -> dict:
    """A request body: a JSON object, at most MAX_DEPTH deep, whose strings are valid Unicode."""
    try:
        # Decoded here, strictly: json.loads(bytes) would also take UTF-16 and UTF-32, and UTF-8
        # bytes of a surrogate (it decodes with 'surrogatepass'), past the check below. A byte
        # order mark may be ignored (RFC 8259), as json.loads did.
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ApiError(f"the request body is not valid UTF-8: {e}", code="invalid_json") from None
    try:
        # The hook costs a call per integer: only a body with a long run of digits needs it.
        body = json.loads(text, parse_int=_parse_int) if _LONG_DIGITS.search(raw) else json.loads(text)
    except ValueError as e:  # JSONDecodeError is a ValueError
        raise ApiError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(f"the request body is nested deeper than {MAX_DEPTH} levels", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, not {_type_name(body)}", code="invalid_json")
    # A lone surrogate can only come from a \\uD8xx-\\uDFxx escape (raw bytes were checked as UTF-8).
    _check_tree(body, strings=_SURROGATE_ESCAPE.search(raw) is not None)
    return body


def _check_tree(body: dict, strings: bool = True) -> None:
    """Refuse nesting beyond MAX_DEPTH and, when `strings`, strings that are not valid Unicode
    (lone surrogates, which JSON's \\uD800 escapes can produce), naming where they are. Paths
    are built only for an error: a body may hold millions of values."""
    stack = [(body, (), 1)]
    while stack:
        node, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ApiError(f"the request body is nested deeper than {MAX_DEPTH} levels (at '{_path(where)}')",
                           param=_param(where), code="invalid_json")
        items = node.items() if type(node) is dict else enumerate(node)
        for key, v in items:
            if strings and type(key) is str and not _is_unicode(key):
                _unicode_error(key, (*where, key), "a key")
            t = type(v)
            if t is str:
                if strings and not _is_unicode(v):
                    _unicode_error(v, (*where, key), "a string")
            elif t is dict or t is list:
                stack.append((v, (*where, key), depth + 1))


def _path(where: tuple) -> str:
    out = ""
    for k in where:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else k)
    return out


def _param(where: tuple) -> str | None:
    return where[0] if where and isinstance(where[0], str) else None


def _is_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _unicode_error(text: str, where: tuple, what: str):
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(f"'{_path(where)}' holds {what} that is not valid Unicode: a lone surrogate "
                       f"U+{ord(text[e.start]):04X} at character {e.start}", param=_param(where)) from None


# ---- fields ----
def _type_name(v) -> str:
    return "null" if v is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                     list: "array", dict: "object", LongInt: "integer"}.get(type(v), type(v).__name__)


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def get_int(body: dict, name: str, default=None, lo: int | None = INT64_MIN, hi: int | None = INT64_MAX):
    """An integer field in [lo, hi] (by default, one that fits 64 bits)."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, LongInt):
        raise ApiError(f"'{name}' is {v!r}; it must be in [{lo}, {hi}]", param=name)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(f"'{name}' must be an integer, got {_type_name(v)} {_short(v)}", param=name)
    if lo is not None and v < lo:
        raise ApiError(f"'{name}' is {v}; it must be >= {lo}", param=name)
    if hi is not None and v > hi:
        raise ApiError(f"'{name}' is {v}; it must be <= {hi}", param=name)
    return v


def get_number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    interval = f"[{lo}, {hi}]"
    if isinstance(v, LongInt):
        raise ApiError(f"'{name}' is {v!r}; it must be in {interval}", param=name)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ApiError(f"'{name}' must be a number, got {_type_name(v)} {_short(v)}", param=name)
    # Compared before any float(): an int beyond a float's range must not overflow here.
    if (isinstance(v, float) and math.isnan(v)) or v < lo or v > hi:
        raise ApiError(f"'{name}' is {v}; it must be in {interval}", param=name)
    return float(v)


def get_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"'{name}' must be a boolean, got {_type_name(v)} {_short(v)}", param=name)
    return v


def get_stop(body: dict) -> list[str]:
    """At most MAX_STOPS strings of at most MAX_STOP_CHARS each: every generated token is checked
    against all of them."""
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
        raise ApiError(f"'stop' must be a string or an array of strings, got {_type_name(v)}", param="stop")
    if len(v) > MAX_STOPS:
        raise ApiError(f"'stop' holds {len(v)} strings; at most {MAX_STOPS} are accepted", param="stop")
    longest = max((len(s) for s in v), default=0)
    if longest > MAX_STOP_CHARS:
        raise ApiError(f"'stop' holds a string of {longest} characters; at most {MAX_STOP_CHARS} are accepted",
                       param="stop")
    return v


def check_model(body: dict, served: str) -> None:
    name = body.get("model")
    if name is None:
        return
    if not isinstance(name, str):
        raise ApiError(f"'model' must be a string, got {_type_name(name)}", param="model")
    if name != served:
        raise ApiError(f"the model '{name}' does not exist; this server serves '{served}'", status=404,
                       param="model", code="model_not_found")


def _reject(body: dict, name: str, allowed) -> None:
    v = body.get(name)
    # A boolean matches only a boolean: in Python `True == 1` and `0 == False`, which would let
    # `"n": true` or `"echo": 0` pass as the supported value.
    if v is not None and not any(v == a and isinstance(v, bool) == isinstance(a, bool) for a in allowed):
        only = " or ".join(["null", *(json.dumps(a) for a in allowed)])
        raise ApiError(f"'{name}' = {_short(v)} is not supported by this server (only {only})", param=name,
                       code="unsupported_parameter")


# The fields the generation routes read; any other is refused (400 `unsupported_parameter`), as
# OpenAI's API refuses an unrecognized argument. Ignoring it would change the answer without a
# word: a sampler of another server (`repeat_penalty`, `grammar`), a newer
# OpenAI feature (`reasoning_effort`, `audio`), a misspelt name, a `prompt` sent to the chat route.
_FIELDS = frozenset({
    "model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "n_predict", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos", "cache_prompt",
    # Honoured only at their neutral value (sampling() refuses any other).
    "n", "logprobs", "top_logprobs", "echo", "best_of", "suffix", "presence_penalty", "frequency_penalty",
    "logit_bias", "tools", "tool_choice", "functions", "function_call", "response_format", "modalities",
    # Accepted and ignored: they label the request (who sent it, what to keep, billing) and change
    # nothing in its answer.
    "user", "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier", "parallel_tool_calls",
})
CHAT_FIELDS = _FIELDS | {"messages", "chat_template_kwargs"}
COMPLETION_FIELDS = _FIELDS | {"prompt"}


def check_fields(body: dict, chat: bool) -> None:
    """Refuse a field the route does not read (`CHAT_FIELDS`, `COMPLETION_FIELDS`)."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name in body:
        if name not in known:
            route = "/v1/chat/completions" if chat else "/v1/completions"
            shown = name if len(name) <= 60 else name[:57] + "..."
            raise ApiError(f"unrecognized request argument '{shown}': {route} on this server does not "
                           "support it, and refuses it rather than ignore it", param=shown,
                           code="unsupported_parameter")


def _no_tools(body: dict, name: str) -> None:
    """`tools` / `functions`: absent or empty (the model is never offered a function to call)."""
    v = body.get(name)
    if v is None:
        return
    if not isinstance(v, list):
        raise ApiError(f"'{name}' must be an array, got {_type_name(v)}", param=name)
    if v:
        raise ApiError(f"'{name}' are not supported by this server", param=name, code="unsupported_parameter")


def _no_forced_call(body: dict, name: str) -> None:
    """`tool_choice` / `function_call`: "none" or "auto" (with no tools, the answer is text either
    way); "required" or a named function asks for a call this server cannot make."""
    v = body.get(name)
    if v is None or v in ("none", "auto"):
        return
    if not isinstance(v, str | dict):
        raise ApiError(f"'{name}' must be a string or an object, got {_type_name(v)}", param=name)
    raise ApiError(f"'{name}' = {_short(v)} is not supported by this server (only \"none\" or \"auto\": it "
                   "calls no tools)", param=name, code="unsupported_parameter")


def _no_logit_bias(body: dict) -> None:
    v = body.get("logit_bias")
    if v is None:
        return
    if not isinstance(v, dict):
        raise ApiError(f"'logit_bias' must be an object of token ids to numbers, got {_type_name(v)}",
                       param="logit_bias")
    if v:
        raise ApiError(f"'logit_bias' = {_short(v)} is not supported by this server (only {{}} or null: its "
                       "sampler takes no biases)", param="logit_bias", code="unsupported_parameter")


def sampling(body: dict, ctx: int, chat: bool) -> dict:
    """generate() keyword arguments from a request, all checked. max_tokens is None when the
    request leaves it out (`limit_tokens` settles it once the prompt is known); it may not exceed
    the context, and a completion that would run past it is cut there (finish_reason "length"),
    as llama-server does. A field this server does not honour is refused, never ignored: only its
    neutral value passes (`check_fields` refuses the fields it does not know)."""
    _reject(body, "n", (1,))
    # Chat's `logprobs` is a boolean; the legacy route's is a count, and 0 still asks for the
    # chosen tokens' log probabilities, so only null passes there.
    _reject(body, "logprobs", (False,) if chat else ())
    _reject(body, "top_logprobs", (0,))
    _reject(body, "echo", (False,))
    _reject(body, "best_of", (1,))
    _reject(body, "suffix", ("",))
    _no_tools(body, "tools")
    _no_tools(body, "functions")
    _no_forced_call(body, "tool_choice")
    _no_forced_call(body, "function_call")
    fmt = body.get("response_format")
    if fmt is not None and not isinstance(fmt, dict):
        raise ApiError(f"'response_format' must be an object such as {{\"type\": \"text\"}}, got {_type_name(fmt)}",
                       param="response_format")
    if fmt is not None and fmt.get("type", "text") != "text":
        raise ApiError(f"'response_format' = {_short(fmt)} is not supported by this server (only "
                       "{\"type\": \"text\"})", param="response_format", code="unsupported_parameter")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise ApiError(f"'modalities' = {_short(modalities)} is not supported by this server (only [\"text\"])",
                       param="modalities", code="unsupported_parameter")
    # No repetition penalty in the sampler: 0 (OpenAI's default) is the only value it honours.
    for name in ("presence_penalty", "frequency_penalty"):
        if get_number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise ApiError(f"'{name}' = {body[name]} is not supported by this server (only 0)", param=name,
                           code="unsupported_parameter")
    _no_logit_bias(body)
    # Every alias given is checked (a wrong one is not let pass because another came first); the
    # first given is the limit. n_predict -1 is llama-server's "no limit" (its default).
    limits = [get_int(body, n, None, lo=-1 if n == "n_predict" else 0, hi=ctx)
              for n in ("max_completion_tokens", "max_tokens", "n_predict")]
    max_tokens = next((v for v in limits if v is not None), None)
    return {
        "max_tokens": None if max_tokens == -1 else max_tokens,
        "temperature": get_number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": get_number(body, "top_p", 1.0, 0.0, 1.0),
        # -1 is "off" in vLLM (its old default) and llama-server, as 0 is.
        "top_k": max(0, get_int(body, "top_k", 0, lo=-1)),
        "min_p": get_number(body, "min_p", 0.0, 0.0, 1.0),
        "seed": get_int(body, "seed", None, lo=SEED_MIN, hi=SEED_MAX),
        "stop": get_stop(body),
        "ignore_eos": get_bool(body, "ignore_eos", False),
    }


def stream_options(body: dict, stream: bool) -> bool:
    """`stream_options`, checked: whether a usage chunk ends the stream (`include_usage`)."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise ApiError(f"'stream_options' must be an object, got {_type_name(opts)}", param="stream_options")
    if not stream:  # as OpenAI and vLLM: it would be silently ignored
        raise ApiError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    # `include_obfuscation` only pads chunks against a network observer, and changes no content;
    # another option (vLLM's `continuous_usage_stats`) would change the stream: refused, not ignored.
    for name, v in opts.items():
        if name not in ("include_usage", "include_obfuscation"):
            shown = name if len(name) <= 60 else name[:57] + "..."
            raise ApiError(f"'stream_options.{shown}' is not supported by this server (only "
                           "include_usage and include_obfuscation)", param="stream_options",
                           code="unsupported_parameter")
        if v is not None and not isinstance(v, bool):
            raise ApiError(f"'stream_options.{name}' must be a boolean, got {_type_name(v)} {_short(v)}",
                           param="stream_options")
    return bool(opts.get("include_usage"))


def limit_tokens(gen: dict, ctx: int, prompt_tokens: int, param: str) -> None:
    """Settle max_tokens for a prompt: by default up to the end of the context, and never past
    it. The prompt and the completion together fit the slot's context (`usage.total_tokens` <=
    n_ctx), as llama-server (n_predict -1, no context shift) and vLLM count, whether max_tokens
    is left out or larger: the engine could sample one more token (the last one needs no KV
    slot), but the conversation sent back with it would no longer fit. A prompt that fills the
    context leaves no room for a token: refused as they refuse it, unless max_tokens is 0 (the
    prompt is only processed)."""
    room = ctx - prompt_tokens
    if room <= 0 and gen["max_tokens"] != 0:
        raise ApiError(f"the prompt has {prompt_tokens} tokens and fills the context of a slot ({ctx} tokens): "
                       "no room for a completion", param=param, code="context_length_exceeded")
    gen["max_tokens"] = room if gen["max_tokens"] is None else min(gen["max_tokens"], room)


# ---- prompts ----
def template_kwargs(body: dict) -> dict:
    """`chat_template_kwargs` (llama-server's and vLLM's extension): more variables for the chat
    template, such as Qwen3's `enable_thinking`. The template's own inputs are not among them."""
    v = body.get("chat_template_kwargs")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ApiError(f"'chat_template_kwargs' must be an object, got {_type_name(v)}", param="chat_template_kwargs")
    for name in ("messages", "add_generation_prompt"):
        if name in v:
            raise ApiError(f"'chat_template_kwargs' may not set '{name}' (the request's own)",
                           param="chat_template_kwargs")
    bad = next((k for k in v if not k.isidentifier()), None)
    if bad is not None:
        raise ApiError(f"'chat_template_kwargs' key {_short(bad)} is not a template variable name",
                       param="chat_template_kwargs")
    return v


# A template that handles the `developer` role names it as a string (Gemma 4's, gpt-oss's).
_NAMES_DEVELOPER = re.compile(r"""['"]developer['"]""")


def knows_developer(template: str | None) -> bool:
    return bool(template) and _NAMES_DEVELOPER.search(template) is not None


def chat_messages(body: dict, developer: bool = True) -> list[dict]:
    """The request's messages for the chat template. Unless `developer` (the template knows that
    role), a `developer` message is given as `system`, as llama-server does: OpenAI's newer name
    for the same instructions, which a template that does not know it drops without a word
    (Qwen3's) or refuses (Qwen3.5's)."""
    msgs = body.get("messages")
    if msgs is None:
        raise ApiError("'messages' is required", param="messages")
    if not isinstance(msgs, list):
        raise ApiError(f"'messages' must be an array, got {_type_name(msgs)}", param="messages")
    if not msgs:
        raise ApiError("'messages' must hold at least one message", param="messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"'{where}' must be an object, got {_type_name(m)}", param=where)
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ApiError(f"'{where}.role' is {_short(role)}; expected one of {', '.join(ROLES)}",
                           param=f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(f"'{where}.content[{j}]' must be a text part {{\"type\": \"text\", \"text\": ...}}",
                                   param=f"{where}.content")
                texts.append(part["text"])
            content = "\n".join(texts)  # as vLLM and llama-server join them
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise ApiError(f"'{where}.content' must be a string or an array of text parts, got {_type_name(content)}",
                           param=f"{where}.content")
        if role == "developer" and not developer:
            role = "system"
        out.append({**{k: v for k, v in m.items() if k != "content"}, "role": role, "content": content})
    return out


def completion_prompt(body: dict, tokenizer, vocab_size: int) -> list[int]:
    """Prompt ids of a completion request: a string, an array of token ids, or an array of one of either."""
    p = body.get("prompt")
    if p is None:
        raise ApiError("'prompt' is required", param="prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]
    if isinstance(p, str):
        return tokenizer.encode(p)
    if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return check_token_ids(p, vocab_size, "prompt")
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, str | list) for x in p):
        raise ApiError(f"'prompt' holds {len(p)} prompts; this server takes one prompt per request", param="prompt")
    if isinstance(p, list):  # name what is not a token id: "got array" would not say what is wrong
        bad = next(t for t in p if isinstance(t, bool) or not isinstance(t, int))
        raise ApiError(f"'prompt' must be a string or an array of token ids; it holds {_type_name(bad)} {_short(bad)}",
                       param="prompt")
    raise ApiError(f"'prompt' must be a string or an array of token ids, got {_type_name(p)}", param="prompt")


def check_token_ids(ids, vocab_size: int, param: str) -> list[int]:
    if not isinstance(ids, list):
        raise ApiError(f"'{param}' must be an array of token ids, got {_type_name(ids)}", param=param)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ApiError(f"'{param}' holds {_short(t)}; token ids are integers in [0, {vocab_size})", param=param)
    return ids


def check_prompt_fits(ids: list[int], ctx: int, param: str) -> None:
    if not ids:
        raise ApiError("the prompt is empty (no tokens)", param=param)
    if len(ids) > ctx:
        raise ApiError(f"the prompt has {len(ids)} tokens; the context of a slot is {ctx} tokens",
                       param=param, code="context_length_exceeded")


# ---- responses ----
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(res: GenerationResult) -> dict:
    n = len(res.token_ids)
    return {"prompt_tokens": res.prompt_tokens, "completion_tokens": n, "total_tokens": res.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": res.cached_tokens}}


def finish_reason(res: GenerationResult) -> str:
    return "length" if res.finish_reason == "length" else "stop"


def chat_response(rid: str, model: str, res: GenerationResult) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": res.text},
                         "logprobs": None, "finish_reason": finish_reason(res)}],
            "usage": usage(res), "timings": res.timings()}


def completion_response(rid: str, model: str, res: GenerationResult) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": res.text, "logprobs": None, "finish_reason": finish_reason(res)}],
            "usage": usage(res), "timings": res.timings()}


def _chunk(obj: str, rid: str, model: str, created: int, choice: dict | None, usage_: dict | None,
           timings: dict | None) -> dict:
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [] if choice is None else [choice]}
    if usage_ is not None:
        out["usage"] = usage_
    if timings is not None:
        out["timings"] = timings
    return out


def chat_chunk(rid: str, model: str, created: int, delta: dict | None, finish: str | None = None,
               usage_: dict | None = None, timings: dict | None = None) -> dict:
    choice = None if delta is None else {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return _chunk("chat.completion.chunk", rid, model, created, choice, usage_, timings)


def completion_chunk(rid: str, model: str, created: int, text: str | None, finish: str | None = None,
                     usage_: dict | None = None, timings: dict | None = None) -> dict:
    choice = None if text is None else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return _chunk("text_completion", rid, model, created, choice, usage_, timings)


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n".encode()
