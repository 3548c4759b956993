"""Helpers the subcommands share: the model flags, loading a model, reading a text file (the
flags the benchmarks share too are in `expertcache.flags`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from safetensors import SafetensorError

from ..errors import ExpertCacheError
from ..flags import add_kernels_flag, add_prefill_flags, cache_config, nonneg_int, positive_int, prefill_options
from ..sampling import SamplingParams
from .args import add_rope_flags, finite_float, rope_options, seed, threads


def add_model_flags(p: argparse.ArgumentParser, ctx: bool = True) -> None:
    p.add_argument("-m", "--model", help="model: a Hugging Face checkpoint directory or a GGUF file "
                                         "(default: the bundled tiny Qwen3-MoE)")
    p.add_argument("--tokenizer", metavar="DIR", help="a directory with tokenizer.json (and tokenizer_config.json) "
                                                      "to use instead of the model's own tokenizer")
    p.add_argument("--dtype", help="compute dtype: float32, bfloat16 or float16 (default: the checkpoint's)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("-t", "--threads", type=threads, help="CPU threads for torch (default: torch's own, one per core)")
    if ctx:
        p.add_argument("-c", "--ctx-size", type=positive_int, help="context size (default: the model's)")
    p.add_argument("--ubatch", type=positive_int, default=512, help="prefill micro-batch size (default: 512)")
    add_prefill_flags(p)
    add_kernels_flag(p)
    add_rope_flags(p)


def load_model(args):
    from ..engine import load

    model = load(args.model, device=args.device, dtype=args.dtype, cache=cache_config(args),
                 ctx_size=getattr(args, "ctx_size", None), threads=args.threads,
                 kernels=args.kernels, activations=args.activations, tokenizer=args.tokenizer,
                 **prefill_options(args), **rope_options(args))
    if model.ctx_size > model.cfg.max_position:  # as llama.cpp warns: it runs, quality may not hold
        print(f"expertcache: warning: -c {model.ctx_size} is beyond the {model.cfg.max_position} tokens the model "
              "was trained on; output past that length may degrade", file=sys.stderr, flush=True)
    return model


class PrefillBar:
    """A progress bar of a prompt's prefill on stderr (`Model.generate(progress=...)`), on a
    terminal only, cleared when the prompt is done; `then` runs once at that point (`run` echoes
    the prompt then, so that the bar never draws over text on the same terminal)."""

    def __init__(self, then: Callable[[], None] | None = None):
        self.bar = None
        self.then = then

    def __call__(self, done: int, total: int) -> None:
        from tqdm import tqdm

        if self.bar is None:
            # The first call comes when the first layer is done, and the bar starts its clock now:
            # those tokens are its `initial`, which tqdm leaves out of the rate (counted in, they
            # made the first rate thousands of times the real one, done over a few microseconds).
            self.bar = tqdm(total=total, initial=done, desc="prefill", unit="tok", file=sys.stderr, leave=False,
                            disable=None)
        self.bar.n = done
        self.bar.refresh()
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.then is not None:
            then, self.then = self.then, None
            then()

    def __enter__(self) -> PrefillBar:
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


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
    becomes it (a read-only directory, a full disk), is one line naming `output`; so is
    safetensors' own error for a failed write (not an OSError: a full disk as "I/O error")."""
    try:
        yield
    except SafetensorError as e:
        reason = str(e).removeprefix("Error while serializing: ").removeprefix("I/O error: ")
        raise ExpertCacheError(f"cannot write {output!r}: {reason}") from None
    except OSError as e:
        out = Path(output).resolve()
        if e.filename is not None:
            p = Path(os.fsdecode(e.filename)).resolve()
            if not any(q == out or (q.parent == out.parent and q.name.startswith(f".{out.name}."))
                       for q in (p, *p.parents)):
                raise  # not the output: the source, say; cli.main names that file
        reason = e.strerror or str(e)
        # numpy's tofile (gguf-py's tensor writes) says only this of a full disk, without an errno.
        short = re.fullmatch(r"(\d+) requested and (\d+) written", reason)
        if short:
            reason = f"a short write ({short[1]} bytes requested, {short[2]} written): is the disk full?"
        raise ExpertCacheError(f"cannot write {output!r}: {reason}") from None


def add_sampling_flags(p: argparse.ArgumentParser, min_p: bool = True) -> None:
    """How the generated tokens are drawn: --temp, --top-k, --top-p (--min-p), --seed, --ignore-eos."""
    p.add_argument("--temp", type=finite_float, default=0.0, help="temperature; 0 = greedy (default)")
    p.add_argument("--top-k", type=nonneg_int, default=0, help="sample from the K likeliest tokens; 0 = all (default)")
    p.add_argument("--top-p", type=finite_float, default=1.0,
                   help="sample from the likeliest tokens whose probabilities sum to P; 0 = the likeliest alone (default: 1.0, all)")
    if min_p:
        p.add_argument("--min-p", type=finite_float, default=0.0,
                       help="drop tokens below P x the likeliest token's probability (default: 0, none)")
    p.add_argument("--seed", type=seed, help="sampling seed, 64 bits (default, or -1: a random one)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-text token")


def sampling_options(args) -> dict:
    """generate()'s sampling keywords from `add_sampling_flags`' flags, checked here, so that a bad
    value fails before a model loads."""
    opts = dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                ignore_eos=args.ignore_eos)
    if hasattr(args, "min_p"):
        opts["min_p"] = args.min_p
    SamplingParams(args.temp, args.top_k, args.top_p, opts.get("min_p", 0.0), args.seed)
    return opts
