"""`expertcache run` (generate, chat) and `expertcache info`."""

from __future__ import annotations

import contextlib
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import ExpertCacheError
from ..flags import add_cache_flags, json_line, nonneg_int
from ..telemetry import peak_rss_bytes
from .common import (PrefillBar, add_model_flags, add_sampling_flags, load_model, read_text_file,
                     sampling_options)


def cmd_run(args) -> int:
    if sum(x is not None and x is not False for x in (args.prompt, args.file, args.chat or None)) != 1:
        raise ExpertCacheError("give exactly one of -p/--prompt, -f/--file or --chat")
    if args.system is not None and not args.chat:  # it would be dropped without a word
        raise ExpertCacheError("--system applies only to --chat (with -p or -f, put it in the prompt)")
    if args.json and args.chat:  # it would be dropped without a word: a chat streams its answers
        raise ExpertCacheError("--json applies only to -p/--prompt or -f/--file, not to --chat")
    prompt = read_text_file(args.file) if args.file else args.prompt
    sampling = sampling_options(args)
    _check_tokenizer_file(args.model)
    model = load_model(args)
    if model.tokenizer is None:
        raise ExpertCacheError(f"{model.path}: `run` needs a tokenizer, and tokenizer.json is missing")
    gen = dict(max_tokens=args.n_predict, **sampling, stop=args.stop, ubatch=args.ubatch)
    if args.chat:
        return _chat_loop(model, gen, args)

    def stream(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    def echo() -> None:  # the prompt, once its prefill's bar is gone
        sys.stdout.write(prompt)
        sys.stdout.flush()

    try:
        with PrefillBar(then=None if args.json else echo) as bar:
            res = model.generate(prompt, on_text=None if args.json else stream, progress=bar, **gen)
    except KeyboardInterrupt:
        if not args.json:  # the text streamed so far ends its line, as a finished one does
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
    if args.json:
        print(json_line(_result_json(model, res)))
    else:
        sys.stdout.write("\n")
        _context_notice(model, res, args.n_predict)
        print(f"[prompt {res.prompt_tokens} tok, {res.prompt_tps:.1f} tok/s | "
              f"generated {len(res.token_ids)} tok, {res.gen_tps:.1f} tok/s]", file=sys.stderr)
    return 0


def _context_notice(model, res, n_predict: int) -> None:
    """One line when generation ended at the end of the context rather than after -n tokens:
    both are finish reason `length`, and the text alone does not say it was cut."""
    if res.finish_reason == "length" and len(res.token_ids) < n_predict:
        sys.stdout.flush()
        print(f"expertcache: stopped at the end of the context ({model.ctx_size} tokens) after "
              f"{len(res.token_ids)} of {n_predict} tokens (raise -c/--ctx-size)", file=sys.stderr, flush=True)


def _check_tokenizer_file(model_dir: str | None) -> None:
    """Before loading: a model directory without tokenizer.json cannot take a text prompt."""
    if model_dir is None:
        return
    d = Path(model_dir)
    if d.is_dir() and (d / "config.json").exists() and not (d / "tokenizer.json").exists():
        raise ExpertCacheError(f"{d}: `run` needs a tokenizer, and {d / 'tokenizer.json'} is missing")


def _result_json(model, res) -> dict:
    return {"text": res.text, "token_ids": res.token_ids, "prompt_tokens": res.prompt_tokens,
            "completion_tokens": len(res.token_ids), "finish_reason": res.finish_reason,
            "timings": {"prompt_seconds": res.prompt_seconds, "gen_seconds": res.gen_seconds,
                        "prompt_tokens_per_second": res.prompt_tps, "gen_tokens_per_second": res.gen_tps},
            "prefill": model.prefill_info(), "peak_rss_bytes": peak_rss_bytes(), "telemetry": model.telemetry()}


def _chat_loop(model, gen, args) -> int:
    """One user message per line of stdin, each answered in turn in one session, so that each
    turn reuses the KV state of the turns before it. On a terminal a person is at the keyboard:
    Ctrl-C stops the answer (the conversation goes on), and a line the chat cannot take is said
    and skipped; from a pipe (a script), such a line is an error, as with -p."""
    model.tokenizer.check_chat_template()  # said before the user types, not after
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []  # user and assistant messages, alternating, oldest first
    session = model.new_session()
    interactive = sys.stdin.isatty()
    # Room kept for an answer when the conversation grows past the context; at most half of it,
    # so that a large -n does not drop the whole conversation at every turn.
    room = min(args.n_predict, model.ctx_size // 2)
    number = 0
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        try:
            raw = _read_line()
        except KeyboardInterrupt:  # Ctrl-C at the prompt ends the chat; the shell's prompt then starts a line
            if interactive:
                sys.stdout.write("\n")
                sys.stdout.flush()
            raise
        if not raw:
            if interactive:  # Ctrl-D: the shell's prompt then starts a line of its own
                sys.stdout.write("\n")
                sys.stdout.flush()
            break
        number += 1
        try:
            line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        except UnicodeDecodeError as e:
            _refuse(f"line {number} of stdin is not valid UTF-8 (byte {e.start})", interactive)
            continue
        line = line.rstrip("\r\n")  # CRLF too (Windows, a pasted file): no message ends in a stray "\r"
        if not line.strip():
            continue
        user = {"role": "user", "content": line}
        ids = model.tokenizer.encode_chat(system + [user])
        if len(ids) > model.ctx_size:
            _refuse(f"line {number}: this message takes {len(ids)} tokens with the chat template, more than the "
                    f"context of {model.ctx_size} tokens (raise -c/--ctx-size or shorten it)",
                    interactive)
            continue
        ids = model.tokenizer.encode_chat(system + history + [user])
        dropped = 0
        # A conversation that outgrew the context loses its oldest exchanges, as chat tools do,
        # rather than ending: the user can go on.
        while history and len(ids) + room > model.ctx_size:
            del history[:2]
            dropped += 1
            ids = model.tokenizer.encode_chat(system + history + [user])
        if dropped:
            sys.stdout.flush()
            what = "its oldest exchange was" if dropped == 1 else f"its {dropped} oldest exchanges were"
            print(f"expertcache: the conversation outgrew the context of {model.ctx_size} tokens: {what} "
                  "dropped (raise -c/--ctx-size to keep more)",
                  file=sys.stderr, flush=True)

        def stream(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        with PrefillBar() as bar, _ctrl_c_stops(interactive) as stopped:
            res = model.generate(ids, session=session, on_text=stream, progress=bar, should_stop=stopped, **gen)
        sys.stdout.write("\n")
        sys.stdout.flush()
        if res.finish_reason == "abort" and not res.token_ids:
            continue  # stopped before any answer: the message goes unanswered, and is not kept
        _context_notice(model, res, args.n_predict)
        history += [user, {"role": "assistant", "content": res.text}]
    return 0


def _read_line():
    """The next line of stdin as bytes (decoded by the caller, which says where a byte is not
    UTF-8, where the text layer would raise or smuggle in surrogates); b"" at its end."""
    buffer = getattr(sys.stdin, "buffer", None)
    return buffer.readline() if buffer is not None else sys.stdin.readline()


def _refuse(message: str, interactive: bool) -> None:
    """A line the chat cannot take: at a terminal, said on one line and skipped; from a pipe,
    an error (one line, exit code 2)."""
    if not interactive:
        raise ExpertCacheError(message)
    sys.stdout.flush()
    print(f"expertcache: {message}; it was not sent", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _ctrl_c_stops(interactive: bool) -> Iterator[Callable[[], bool] | None]:
    """While an answer is generated at a terminal, Ctrl-C stops it at the next token (or
    micro-batch of its prompt) instead of ending the chat, and the session stays consistent
    (an interrupt inside a forward would leave part of a token's KV state written); a second
    Ctrl-C before the answer stops ends the chat. Yields generate's `should_stop`."""
    if not interactive or threading.current_thread() is not threading.main_thread():
        yield None
        return
    pressed = []

    def on_sigint(signum, frame) -> None:
        if pressed:
            raise KeyboardInterrupt
        pressed.append(True)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield lambda: bool(pressed)
    finally:
        signal.signal(signal.SIGINT, previous)


def cmd_info(args) -> int:
    from ..models.loader import expected_shapes, open_model

    m = open_model(args.model or _default_model())
    cfg, layout, src = m.cfg, m.layout, m.experts
    shapes = expected_shapes(cfg, m.arch, layout)
    total = sum(_numel(s) for s in shapes.values())
    expert_numel = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    expert_params = expert_numel * cfg.num_experts * len(cfg.moe_layers)
    active = total - expert_params + expert_numel * cfg.top_k * len(cfg.moe_layers)
    from ..checkpoint.storage import storage_name
    from ..models.mixers import describe_layers

    by_format: dict = {}
    for i in cfg.moe_layers:
        by_format.setdefault(src.format(i).describe(), []).append(i)
    expert_bytes = {i: src.format(i).nbytes for i in cfg.moe_layers}
    gguf = hasattr(m.ckpt, "gg")
    info = {
        "path": str(m.path), "format": "gguf" if gguf else "safetensors", "architecture": cfg.model_type,
        "layout": "gguf" if gguf else layout.name,
        "layers": cfg.num_layers, "moe_layers": len(cfg.moe_layers), "hidden_size": cfg.hidden_size,
        "layer_pattern": describe_layers(m.arch.mixers(cfg)),
        "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "context_length": cfg.max_position,
        "experts_per_layer": cfg.num_experts, "top_k": cfg.top_k,
        "expert_intermediate_size": cfg.moe_intermediate_size,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
        "params_total": total, "params_active_per_token": active,
        "checkpoint_dtype": str(src.dtype).removeprefix("torch.") if src.dtype is not None else "quantized",
        "expert_formats": {f: _ranges(layers) for f, layers in by_format.items()},
        "bytes_per_expert": max(expert_bytes.values()),
        "bytes_per_expert_by_layer": expert_bytes,
        "experts_total": cfg.num_experts * len(cfg.moe_layers),
        "expert_bytes_total": sum(expert_bytes.values()) * cfg.num_experts,
    }
    # The tensors' bytes, not the files' sizes: a header (a GGUF's tokenizer metadata) is no weight.
    tensors = m.ckpt.gg.tensors if gguf else m.ckpt.tensors
    info["dense_bytes_in_file"] = sum(t.nbytes for t in tensors.values()) - info["expert_bytes_total"]
    if gguf:
        groups: dict = {}
        for name, t in m.ckpt.gg.tensors.items():
            group = re.sub(r"^blk\.\d+\.", "", name).removesuffix(".weight")
            kinds = groups.setdefault(group, {})
            kinds[storage_name(t.storage)] = kinds.get(storage_name(t.storage), 0) + 1
        info["tensor_types"] = groups
        dense = m.ckpt
        blocks = [n for n in dense.names if dense.row_order(n) is not None]
        nbytes = sum(dense.gg.info(dense.names[n]).nbytes for n in blocks)
        info["dense_weights"] = (
            f"{len(blocks)} quantized matrices ({_human_bytes(nbytes)}) stay the file's blocks where the kernels "
            "multiply blocks (with 8-bit activations: the CPU default, or --activations q8; routers and family-specific "
            f"projections excepted); everything else is dequantized at load to {str(cfg.dtype).removeprefix('torch.')} "
            "(--dtype)")
    if args.json:
        print(json_line(info))
        return 0
    width = max(len(k) for k in info)
    for k, v in info.items():
        print(f"{k:<{width}}  {_info_value(k, v)}")
    return 0


def _info_value(key: str, v) -> str:
    """A value of `info` as a person reads it: counts with thousands separators and bytes beside
    their size in binary units; nested tables as one line, not Python's repr."""
    if key == "bytes_per_expert_by_layer":  # {layer: bytes}: layers of one size together
        by_size: dict[int, list[int]] = {}
        for layer, n in v.items():
            by_size.setdefault(n, []).append(layer)
        return "; ".join(f"{n:,} ({_human_bytes(n)}): {_ranges(layers)}" for n, layers in by_size.items())
    if key == "tensor_types":  # {group: {type: count}}
        return "; ".join(f"{g}: " + ", ".join(f"{t}" + (f" x{n}" if n > 1 else "") for t, n in kinds.items())
                         for g, kinds in v.items())
    if isinstance(v, dict):
        return "; ".join(f"{a}: {b}" for a, b in v.items())
    if isinstance(v, int) and key.startswith("params"):
        return f"{v:,} ({v / 1e9:.2f}B)" if v >= 1e9 else f"{v:,} ({v / 1e6:.1f}M)"
    if isinstance(v, int) and key.startswith(("bytes", "expert_bytes", "dense_bytes")):
        return f"{v:,} ({_human_bytes(v)})"
    return str(v)


def _human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _ranges(layers: list[int]) -> str:
    """'0-3, 5' for [0, 1, 2, 3, 5]."""
    out, start = [], None
    for i, n in enumerate(layers):
        if start is None:
            start = n
        if i + 1 == len(layers) or layers[i + 1] != n + 1:
            out.append(f"layers {start}-{n}" if n > start else f"layer {n}")
            start = None
    return ", ".join(out)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _default_model() -> str:
    from ..engine import default_model_path

    return str(default_model_path())


def register(sub) -> None:
    r = sub.add_parser("run", help="generate text from a prompt, a file, or a chat on stdin")
    add_model_flags(r)
    add_cache_flags(r)
    r.add_argument("-p", "--prompt", help="prompt text")
    r.add_argument("-f", "--file", help="read the prompt from a UTF-8 file")
    r.add_argument("--chat", action="store_true", help="chat: one user message per line on stdin (at a terminal, "
                                                        "Ctrl-C stops an answer and Ctrl-D ends the chat)")
    r.add_argument("--system", help="system message for --chat")
    r.add_argument("-n", "--n-predict", type=nonneg_int, default=128, help="tokens to generate (default: 128)")
    add_sampling_flags(r)
    r.add_argument("--stop", action="append", help="stop string (repeatable)")
    r.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    r.set_defaults(func=cmd_run)

    i = sub.add_parser("info", help="architecture, parameter counts and expert sizes of a checkpoint")
    i.add_argument("-m", "--model", help="a checkpoint directory or a GGUF file (default: the bundled tiny "
                                         "Qwen3-MoE)")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.set_defaults(func=cmd_info)
