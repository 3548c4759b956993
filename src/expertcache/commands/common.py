"""Helpers the subcommands share: the model flags, loading a model, reading a text file (the
flags the benchmarks share too are in `expertcache.flags`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from ..errors import ExpertCacheError
from ..flags import add_kernels_flag, add_prefill_flags, cache_config, positive_int, prefill_options
from .args import threads


def add_model_flags(p: argparse.ArgumentParser, ctx: bool = True) -> None:
    p.add_argument("-m", "--model", help="model: a Hugging Face checkpoint directory or a GGUF file "
                                         "(default: the bundled tiny Qwen3-MoE)")
    p.add_argument("--tokenizer", metavar="DIR", help="a directory with tokenizer.json (and tokenizer_config.json) "
                                                      "to use instead of the model's own tokenizer")
    p.add_argument("--dtype", help="compute dtype: float32, bfloat16 or float16 (default: the checkpoint's)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("-t", "--threads", type=threads, help="CPU threads for torch")
    if ctx:
        p.add_argument("-c", "--ctx-size", type=positive_int, help="context size (default: the model's)")
    p.add_argument("--ubatch", type=positive_int, default=512, help="prefill micro-batch size (default: 512)")
    add_prefill_flags(p)
    add_kernels_flag(p)


def load_model(args):
    from ..engine import load

    model = load(args.model, device=args.device, dtype=args.dtype, cache=cache_config(args),
                 ctx_size=getattr(args, "ctx_size", None), threads=args.threads,
                 kernels=args.kernels, activations=args.activations, tokenizer=args.tokenizer,
                 **prefill_options(args))
    if model.ctx_size > model.cfg.max_position:  # as llama.cpp warns: it runs, quality may not hold
        print(f"expertcache: warning: -c {model.ctx_size} is beyond the {model.cfg.max_position} tokens the model "
              "was trained on; output past that length may degrade", file=sys.stderr, flush=True)
    return model


def read_text_file(path: str) -> str:
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ExpertCacheError(f"cannot read {path!r}: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ExpertCacheError(f"{path}: not valid UTF-8 (byte {e.start})") from None


@contextlib.contextmanager
def writing(output: str) -> Iterator[None]:
    """Around the writing of `output`: an OSError on it, or on the temporary name beside it that
    becomes it (a read-only directory, a full disk), is one line naming `output`."""
    try:
        yield
    except OSError as e:
        out = Path(output).resolve()
        if e.filename is not None:
            p = Path(os.fsdecode(e.filename)).resolve()
            if not any(q == out or (q.parent == out.parent and q.name.startswith(f".{out.name}."))
                       for q in (p, *p.parents)):
                raise  # not the output: the source, say; cli.main names that file
        raise ExpertCacheError(f"cannot write {output!r}: {e.strerror or e}") from None
