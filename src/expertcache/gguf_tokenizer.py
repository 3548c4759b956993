"""A `tokenizers.Tokenizer` built from a GGUF file's `tokenizer.ggml.*` metadata that gives the
token ids llama.cpp gives (src/llama-vocab.cpp is the reference this follows):

- 'gpt2': byte-level BPE. The text is split by the regexes llama.cpp uses for the file's
  `tokenizer.ggml.pre`, applied one after another, then merged by `tokenizer.ggml.merges`.
- 'llama': SentencePiece-style. llama.cpp merges adjacent pieces by the score of the merged
  token (whatever algorithm trained the vocabulary), prefixes a space and writes spaces as '▁',
  and falls back to <0xXX> byte tokens; that is BPE with merges ranked by score.
- 'gemma4': BPE on raw UTF-8 with '▁' for spaces, split only at newlines, <0xXX> byte fallback; a
  newline run is one token only where it is a token.

Control, unknown and user-defined tokens become added tokens, matched in the text before
anything else as llama.cpp does; control and unknown ones are special (skipped when decoding).
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from .errors import ExpertCacheError

# tokenizer.ggml.token_type values (llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + (r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                           r"|\s+(?!\S)|\s+")
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = _CONTRACTIONS + (r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
                           r"|\s+(?!\S)|\s+")
# llama.cpp's GPT-4o split stands in for the case classes of tokenizer.json's regex with lookaheads
# over \p{L}, so combining marks (\p{M}) do not join a word there; followed here as llama.cpp has it.
_GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
          r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3 = [r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"]

# tokenizer.ggml.pre -> (regexes applied in turn, ignore_merges, add_bos default), as in llama.cpp.
PRE_TOKENIZERS: dict[str, tuple[list[str], bool, bool]] = {
    "default": ([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"], False, False),
    **{k: ([_GPT2], False, False) for k in ("gpt-2", "phi-2", "olmo", "mpt", "jais", "trillion", "exaone4",
                                            "granite-docling", "gigachat", "mellum", "a.x-4.0")},
    **{k: ([_LLAMA3], True, True) for k in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                                            "pixtral", "midm-2.0", "lfm2")},
    **{k: ([_LLAMA3], False, False) for k in ("dbrx", "smaug-bpe")},
    **{k: ([_QWEN2], False, False) for k in ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan",
                                             "solar-open")},
    "qwen35": ([_QWEN35], False, False),
    **{k: ([r"\p{N}", _GPT2], False, False) for k in ("starcoder", "refact", "command-r", "smollm",
                                                      "codeshell", "exaone", "minerva-7b")},
    **{k: ([_GPT4O], False, False) for k in ("gpt-4o", "llama4", "minimax-m2")},
    **{k: ([_LLAMA3], False, False) for k in ("glm4", "chatglm-bpe")},  # CHATGLM4 has llama3's regex
    **{k: (_DEEPSEEK3, False, False) for k in ("deepseek-v3", "hunyuan-dense")},
}

# llama.cpp recognises some tokens by their text (llama_vocab::impl::load): these end generation,
_EOG_TEXTS = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",  # fill-in-the-middle pad, repo and file separator
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
}
# the first of these present is the end-of-turn token when the file names none,
_EOT_TEXTS = ["<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
              "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"]
# and these, with the above, are control tokens whatever type the file stores.
_CONTROL_TEXTS = _EOG_TEXTS | set(_EOT_TEXTS) | {
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
    "<|prefix|>", "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
    "<|code_suffix|>", "<|suffix|>", "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
    "▁<MID>", "<|code_middle|>", "<|middle|>",
}
_ALWAYS_RENDERED = {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"}  # gpt-oss: user-defined

_WAY_OUT = "give --tokenizer DIR with the model's tokenizer.json instead"


def tokenizer_parts_from_gguf(metadata: dict, where: str) -> tuple[Tokenizer, dict]:
    """The tokenizer of a GGUF model and the settings `expertcache.tokenizer.Tokenizer` reads from
    tokenizer_config.json: bos_token, eos_token, add_bos_token, chat_template (plus eot_token,
    pad_token, add_eos_token and eog_token_ids, the ids llama.cpp ends generation at).

    `where` names the file in errors. An unsupported tokenizer is a one-line ExpertCacheError.
    """
    kind = metadata.get("tokenizer.ggml.model")
    if kind is None:
        raise ExpertCacheError(f"{where}: metadata key 'tokenizer.ggml.model' is missing (no tokenizer "
                               f"in this GGUF); {_WAY_OUT}")
    tokens = _list(metadata, "tokenizer.ggml.tokens", where)
    n = len(tokens)
    types = _per_token(metadata, "tokenizer.ggml.token_type", n, int, NORMAL, where)
    if "" in tokens:
        tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # what llama.cpp names an empty token
    vocab = _vocab(tokens, where)
    types = [USER_DEFINED if t in _ALWAYS_RENDERED else CONTROL if t in _CONTROL_TEXTS else ty
             for t, ty in zip(tokens, types)]
    pre = metadata.get("tokenizer.ggml.pre")
    if kind == "gpt2":
        if pre is None:
            pre = "default"  # llama.cpp's fallback, with a warning
        if pre not in PRE_TOKENIZERS:
            raise ExpertCacheError(f"{where}: pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported "
                                   f"(supported: {', '.join(sorted(PRE_TOKENIZERS))}); {_WAY_OUT}")
        regexes, ignore_merges, add_bos = PRE_TOKENIZERS[pre]
        tok = _byte_level_bpe(vocab, _merges(metadata, vocab, where), regexes, ignore_merges)
        defaults = {}  # llama.cpp's BOS=EOS=11 default for gpt2 vocabularies is an artefact; not kept
    elif kind == "gemma4":
        tok = _gemma4_bpe(vocab, _merges(metadata, vocab, where))
        add_bos, defaults = True, {}
    elif kind == "llama":
        scores = _per_token(metadata, "tokenizer.ggml.scores", n, (int, float), 0.0, where)
        add_prefix = _flag(metadata, "tokenizer.ggml.add_space_prefix", True, where)
        tok = _spm_bpe(tokens, vocab, scores, types, add_prefix)
        add_bos, defaults = True, {"bos": 1, "eos": 2, "unknown": 0}
    else:
        raise ExpertCacheError(f"{where}: tokenizer model tokenizer.ggml.model={kind!r} is not supported "
                               f"(supported: gpt2, llama, gemma4); {_WAY_OUT}")

    ids = {}
    for role in ("bos", "eos", "eot", "eom", "unknown", "padding"):
        i = metadata.get(f"tokenizer.ggml.{role}_token_id", defaults.get(role))
        if i is not None and (isinstance(i, bool) or not isinstance(i, int)):
            raise ExpertCacheError(f"{where}: metadata key 'tokenizer.ggml.{role}_token_id' is {i!r}, expected a "
                                   f"token id; {_WAY_OUT}")
        ids[role] = i if i is not None and 0 <= i < n else None
    if ids["eot"] is None:
        ids["eot"] = next((vocab[t] for t in _EOT_TEXTS if t in vocab), None)
    if kind != "gemma4":
        add_bos = _flag(metadata, "tokenizer.ggml.add_bos_token", add_bos, where)
    add_eos = _flag(metadata, "tokenizer.ggml.add_eos_token", False, where)
    eog = _end_of_generation(vocab, types, [ids[r] for r in ("eos", "eot", "eom")])
    name = str(metadata.get("general.name", "")).lower()
    _add_special_tokens(tok, tokens, types, phi3="phi-3" in name or "phi3" in name)
    if add_eos and ids["eos"] is not None:
        eos = tokens[ids["eos"]]
        tok.post_processor = processors.TemplateProcessing(single=f"$A:0 {eos}:0", pair=f"$A:0 $B:1 {eos}:1",
                                                           special_tokens=[(eos, ids["eos"])])
    text = lambda role: tokens[ids[role]] if ids[role] is not None else None  # noqa: E731
    cfg = {
        "bos_token": text("bos"), "eos_token": text("eos"), "eot_token": text("eot"), "pad_token": text("padding"),
        "add_bos_token": add_bos and ids["bos"] is not None, "add_eos_token": add_eos,
        "chat_template": _chat_template(metadata, where), "eog_token_ids": eog,
    }
    return tok, cfg


def _list(metadata: dict, key: str, where: str) -> list:
    value = metadata.get(key)
    if not isinstance(value, list) or not value:
        raise ExpertCacheError(f"{where}: metadata key {key!r} is missing or empty, expected an array of strings; "
                               f"{_WAY_OUT}")
    bad = next((v for v in value if not isinstance(v, str)), None)
    if bad is not None:
        raise ExpertCacheError(f"{where}: metadata key {key!r} holds {bad!r}, expected an array of strings; {_WAY_OUT}")
    return value


def _per_token(metadata: dict, key: str, n: int, kind, default, where: str) -> list:
    """An optional array with an entry per token (token types, scores), `default` for each where
    absent. llama.cpp reads entry i for every token i without checking the length or the type."""
    value = metadata.get(key)
    if value is None:
        return [default] * n
    if not isinstance(value, list) or len(value) < n:
        count = f"{len(value)} entries" if isinstance(value, list) else repr(value)
        raise ExpertCacheError(f"{where}: metadata key {key!r} holds {count}, expected one number per token ({n}); "
                               f"{_WAY_OUT}")
    bad = next((v for v in value if not isinstance(v, kind) or isinstance(v, bool)), None)
    if bad is not None:
        raise ExpertCacheError(f"{where}: metadata key {key!r} holds {bad!r}, expected numbers; {_WAY_OUT}")
    return value


def _flag(metadata: dict, key: str, default: bool, where: str) -> bool:
    """A bool setting: any other value is refused, as llama.cpp refuses a key of the wrong type
    (a string 'false' read as true would add BOS or EOS to every prompt)."""
    value = metadata.get(key, default)
    if not isinstance(value, bool):
        raise ExpertCacheError(f"{where}: metadata key {key!r} is {value!r}, expected a bool; {_WAY_OUT}")
    return value


def _end_of_generation(vocab: dict[str, int], types: list[int], named: list[int | None]) -> list[int]:
    """The ids llama.cpp ends generation at, with its two exceptions: gpt-oss's and Solar's <|end|>
    ends nothing (and is user-defined), and with Gemma 4's <|tool_response> </s> is a normal token."""
    eog = {vocab[t] for t in _EOG_TEXTS if t in vocab} | {i for i in named if i is not None}
    texts = {t for t, i in vocab.items() if i in eog}
    if "<|end|>" in texts and ({"<|return|>", "<|call|>"} <= texts or {"<|calls|>", "<|flush|>"} <= texts):
        eog.discard(vocab["<|end|>"])
        types[vocab["<|end|>"]] = USER_DEFINED
    if {"<|tool_response>", "</s>"} <= texts:
        eog.discard(vocab["</s>"])
        types[vocab["</s>"]] = NORMAL
    return sorted(eog)


def _vocab(tokens: list[str], where: str) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t in vocab:
            raise ExpertCacheError(f"{where}: token {t!r} appears twice in tokenizer.ggml.tokens "
                                   f"(ids {vocab[t]} and {i})")
        vocab[t] = i
    return vocab


def _merges(metadata: dict, vocab: dict[str, int], where: str) -> list[tuple[str, str]]:
    """Merge pairs in rank order. `tokenizers` refuses a pair whose parts or result are not tokens,
    so such pairs are dropped (the others keep their order); converters do not write them, and in
    llama.cpp they could only make a piece that is no token and falls back to bytes."""
    out = []
    for m in _list(metadata, "tokenizer.ggml.merges", where):
        cut = m.find(" ", 1)  # as llama.cpp: the first space after the first character
        if cut < 0:
            continue
        a, b = m[:cut], m[cut + 1:]
        if a in vocab and b in vocab and a + b in vocab:
            out.append((a, b))
    return out


def _byte_level_bpe(vocab, merges, regexes: list[str], ignore_merges: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _gemma4_bpe(vocab, merges) -> Tokenizer:
    # llama.cpp takes a newline run whole when it is a token and merges every other piece up from
    # its characters, so a line that spells a byte or control token stays text (ignore_merges would
    # take any piece that is a token whole). Where no merge joins newlines (Gemma 4's), llama.cpp
    # leaves a run that is no token as single newlines: such runs are cut so, and a run that is a
    # token is kept apart and reached by merges of its own, larger results first so that every
    # length merges up to one token.
    split = r"[^\n]+|\n+"
    if not any(not (a + b).strip("\n") for a, b in merges):
        runs = sorted((len(t) for t in vocab if t and not t.strip("\n")), reverse=True)
        merges = merges + [("\n" * j, "\n" * (k - j)) for k in runs for j in range(k - 1, 0, -1)
                           if "\n" * j in vocab and "\n" * (k - j) in vocab]
        if runs:
            split = r"[^\n]+|(?<!\n)(?:" + "|".join(f"\\n{{{k}}}" for k in runs) + r")(?!\n)|\n"
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(split), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def _spm_bpe(tokens, vocab, scores, types, add_prefix: bool) -> Tokenizer:
    # llama.cpp merges the adjacent pair whose concatenation is the highest-scored token: every
    # split of a token into two tokens is a merge, ranked by the merged token's score.
    ranked = []
    for i, t in enumerate(tokens):
        if types[i] == BYTE or len(t) < 2:
            continue
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in vocab and b in vocab:
                ranked.append((-scores[i], i, k, a, b))
    ranked.sort()
    unk = next((t for t, ty in zip(tokens, types) if ty == UNKNOWN), None)
    tok = Tokenizer(models.BPE(vocab, [(a, b) for *_, a, b in ranked], unk_token=unk, byte_fallback=True,
                               fuse_unk=True))
    steps = [normalizers.Prepend("▁")] if add_prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(dec + ([decoders.Strip(" ", 1, 0)] if add_prefix else []))
    return tok


def _add_special_tokens(tok: Tokenizer, tokens, types, phi3: bool) -> None:
    """Control, unknown and user-defined tokens are found in the raw text before the model runs;
    Phi-3 models strip the whitespace after a special token (llama.cpp keys that on the name)."""
    special, user = [], []
    for t, ty in zip(tokens, types):
        if ty in (CONTROL, UNKNOWN):
            rstrip = phi3 and t not in ("<unk>", "<s>", "<|endoftext|>")
            special.append(AddedToken(t, special=True, normalized=False, rstrip=rstrip))
        elif ty == USER_DEFINED:
            user.append(AddedToken(t, special=False, normalized=False, rstrip=phi3 and t == "</s>"))
    tok.add_special_tokens(special)
    tok.add_tokens(user)


def _chat_template(metadata: dict, where: str) -> str | None:
    template = metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        # It was read as no template: a chat was then refused for want of one, naming another file.
        raise ExpertCacheError(f"{where}: metadata key 'tokenizer.chat_template' is {template!r}, expected a string; "
                               f"{_WAY_OUT}")
    return template
