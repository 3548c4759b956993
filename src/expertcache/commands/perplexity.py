"""`expertcache perplexity`: llama-perplexity's default measurement over a text file, and with
`--compare` the same text in several cache modes, checked chunk by chunk for bitwise equality."""

from __future__ import annotations

import dataclasses
import sys

from ..config import CACHE_MODES
from ..errors import ExpertCacheError
from ..perplexity import PerplexityResult, exp_nll, first_difference, num_chunks, perplexity, perplexity_bos_id
from ..flags import add_cache_flags, cache_config, json_line, positive_int
from ..telemetry import peak_rss_bytes
from .common import add_model_flags, read_text_file


def cmd_perplexity(args) -> int:
    modes = _parse_modes(args.compare) if args.compare is not None else None
    if modes and args.cache_mode is not None:
        raise ExpertCacheError("give --cache-mode or --compare, not both")
    text = read_text_file(args.file)
    # llama-perplexity's -f drops one trailing newline (common/arg.cpp); the text then tokenizes,
    # and counts, as there.
    if text.endswith("\n"):
        text = text[:-1]
    if not text:
        raise ExpertCacheError(f"{args.file}: the file is empty")
    base = cache_config(args)
    progress: dict = {}  # what the run has done so far, for a Ctrl-C report
    try:
        runs, model_path = _measure(args, text, modes or [base.mode], base, modes is not None, progress)
    except KeyboardInterrupt:
        print(f"expertcache: perplexity interrupted{_interrupted_at(progress)}", file=sys.stderr)
        return 130
    header = _header(args, model_path, next(iter(runs.values()))[0])
    if modes is None:
        ((mode, (res, tel)),) = runs.items()
        if args.json:
            print(json_line({**header, **_run_json(res, tel)}))
        else:
            _print_run(res)
            _print_summary(mode, res, tel)
        return 0
    return _report_compare(args, header, runs)


def _interrupted_at(progress: dict) -> str:
    """Where an interrupted run stopped: the chunks done and the PPL over them, if any."""
    where = f" in {progress['mode']}" if progress.get("mode") else ""
    done, total = progress.get("done", 0), progress.get("total")
    if not done:
        return f"{where} before the first chunk" + (f" of {total}" if total else "")
    ppl = exp_nll(progress["nll"] / progress["count"])
    return f"{where} after {done} of {total} chunks (PPL over them {ppl:.4f}, not a final estimate)"


def _measure(args, text: str, modes: list[str], base, labelled: bool, progress: dict):
    """Run the text once per mode, each with a freshly loaded model; {mode: (result, telemetry)}.
    `progress` follows the running mode's chunks."""
    runs: dict[str, tuple[PerplexityResult, dict]] = {}
    ids = bos_id = path = None
    for mode in modes:
        progress.clear()  # a mode's load and chunks; none done yet
        progress["mode"] = mode if labelled else None
        # The size is the cache's and staging's: resident holds every expert and takes none.
        unsized = {"experts": None, "mem": None, "fraction": None} if mode == "resident" else {}
        model = _load(args, dataclasses.replace(base, mode=mode, **unsized))
        if ids is None:  # tokenize once, with the first model's tokenizer (all modes share it)
            ids, bos_id = _tokenize(model, text, args)
            path = str(model.path)
            if args.ctx_size > model.cfg.max_position:
                print(f"expertcache: warning: the model was trained on only {model.cfg.max_position} context "
                      f"tokens ({args.ctx_size} specified)", file=sys.stderr)
        runs[mode] = (_run(model, ids, bos_id, args, mode if labelled else None, progress), model.telemetry())
        del model  # one model in memory at a time
    return runs, path


def _report_compare(args, header: dict, runs) -> int:
    diff = first_difference({m: r for m, (r, _) in runs.items()})
    if args.json:
        out = {**header, "modes": {m: _run_json(r, t) for m, (r, t) in runs.items()},
               "bitwise_equal": diff is None, "first_difference": None}
        if diff is not None:
            out["first_difference"] = {"chunk": diff + 1, **_chunk_values(runs, diff)}
        print(json_line(out))
        return 0 if diff is None else 1
    for mode, (res, _) in runs.items():
        print(f"{mode}:")
        _print_run(res)
    _print_table(runs)
    if diff is None:
        print(f"bitwise equal: all {header['chunks']} chunks in {', '.join(runs)}")
        return 0
    vals = _chunk_values(runs, diff)["ppl"]
    print(f"DIFFERENT: chunk {diff + 1} differs: " + ", ".join(f"{m} {v!r}" for m, v in vals.items()))
    return 1


def _parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in CACHE_MODES]
    if bad:
        raise ExpertCacheError(f"--compare: unknown cache mode {bad[0]!r}: expected a comma-separated list of "
                               f"{', '.join(CACHE_MODES)}")
    if len(modes) < 2 or len(set(modes)) != len(modes):
        raise ExpertCacheError(f"--compare {text!r}: give at least two different cache modes, e.g. resident,cache")
    return modes


def _load(args, cache):
    from ..engine import load
    from ..flags import prefill_options
    from .args import rope_options

    return load(args.model, device=args.device, dtype=args.dtype, cache=cache, ctx_size=args.ctx_size,
                threads=args.threads, kernels=args.kernels, activations=args.activations, tokenizer=args.tokenizer,
                **prefill_options(args), **rope_options(args))


def _tokenize(model, text: str, args) -> tuple[list[int], int | None]:
    if model.tokenizer is None:
        raise ExpertCacheError(f"{model.path}: no tokenizer.json; perplexity of a text needs the model's tokenizer")
    # As llama-perplexity tokenizes: BOS added, but text that spells a special token is text.
    ids = model.tokenizer.encode(text, add_special_tokens=True, parse_special=False)
    try:
        num_chunks(len(ids), args.ctx_size)
    except ExpertCacheError as e:
        raise ExpertCacheError(f"{args.file}: {e}") from None
    return ids, perplexity_bos_id(model.tokenizer)


def _run(model, ids, bos_id, args, label: str | None, state: dict) -> PerplexityResult:
    from tqdm import tqdm

    n = num_chunks(len(ids), args.ctx_size, args.chunks)
    desc = f"perplexity [{label}]" if label else "perplexity"
    state.update(total=n, done=0, nll=0.0, count=0)
    # disable=None: a bar on a terminal only; in a log its carriage returns would be noise.
    with tqdm(total=n, desc=desc, unit="chunk", file=sys.stderr, leave=False, dynamic_ncols=True,
              disable=None) as bar:

        def progress(chunk) -> None:
            state["nll"] += chunk.nll
            state["count"] += chunk.count
            state["done"] += 1
            bar.set_postfix_str(f"ppl {exp_nll(state['nll'] / state['count']):.4f}", refresh=False)
            bar.update(1)

        return perplexity(model, ids, args.ctx_size, args.ubatch, args.chunks, bos_id, on_chunk=progress)


def _header(args, model_path: str, res: PerplexityResult) -> dict:
    return {"model": model_path, "file": args.file, "n_ctx": res.n_ctx, "ubatch": args.ubatch,
            "n_tokens": res.n_tokens, "chunks": len(res.chunks), "scored_tokens": res.count, "bos_id": res.bos_id}


def _run_json(res: PerplexityResult, telemetry: dict) -> dict:
    secs = res.seconds
    return {"ppl_cumulative": res.cumulative(), "chunk_ppl": [c.ppl for c in res.chunks],
            "chunk_nll": [c.nll for c in res.chunks], "chunk_tokens": [c.count for c in res.chunks],
            "ppl": res.ppl, "ppl_uncertainty": res.uncertainty, "seconds": secs,
            "tokens_per_second": len(res.chunks) * res.n_ctx / secs if secs > 0 else 0.0,
            "peak_rss_bytes": peak_rss_bytes(), "telemetry": telemetry}


def _chunk_values(runs, i: int) -> dict:
    return {"ppl": {m: r.chunks[i].ppl if i < len(r.chunks) else None for m, (r, _) in runs.items()},
            "nll_hex": {m: r.chunks[i].nll.hex() if i < len(r.chunks) else None for m, (r, _) in runs.items()}}


def _print_run(res: PerplexityResult) -> None:
    # llama-perplexity's format: running values, then the final estimate with its uncertainty.
    print("".join(f"[{i + 1}]{v:.4f}," for i, v in enumerate(res.cumulative())))
    unc = res.uncertainty
    if unc is None:
        print(f"Final estimate: PPL = {res.ppl:.4f}")
        print("expertcache: warning: the per-token NLL has no positive variance; no uncertainty", file=sys.stderr)
    else:
        print(f"Final estimate: PPL = {res.ppl:.4f} +/- {unc:.5f}")


def _print_summary(mode: str, res: PerplexityResult, tel: dict) -> None:
    t = tel.get("total", {})
    tps = len(res.chunks) * res.n_ctx / res.seconds if res.seconds > 0 else 0.0
    print(f"[{len(res.chunks)} chunks x {res.n_ctx} tokens, {res.count} scored, {tps:.1f} tok/s | {mode}: "
          f"hit rate {t.get('hit_rate', 0.0):.3f}, copied {t.get('copied_bytes', 0) / 1e6:.1f} MB]", file=sys.stderr)


def _print_table(runs) -> None:
    print(f"{'mode':<9} {'PPL':>10} {'+/-':>9} {'tok/s':>8} {'hit rate':>8} {'copied MB':>10} {'capacity':>8}")
    for mode, (res, tel) in runs.items():
        t = tel.get("total", {})
        tps = len(res.chunks) * res.n_ctx / res.seconds if res.seconds > 0 else 0.0
        unc = res.uncertainty
        cap = f"{tel.get('capacity', 0)}/{tel.get('total_experts', 0)}"  # one cell, under its header
        print(f"{mode:<9} {res.ppl:>10.4f} {'-' if unc is None else f'{unc:.5f}':>9} {tps:>8.1f} "
              f"{t.get('hit_rate', 0.0):>8.3f} {t.get('copied_bytes', 0) / 1e6:>10.1f} "
              f"{cap:>8}")
    # Each mode loads a fresh model in this one process: the first also pays the process's
    # one-time set-up (thread pools, kernels), which its first chunks show.
    print(f"tok/s: the chunks' wall time; {next(iter(runs))}'s includes this process's one-time set-up "
          "(compare speeds with `expertcache bench`)")


def _chunks(text: str) -> int | None:
    """--chunks N: N >= 1, or llama-perplexity's -1 for every chunk."""
    return None if text.strip() == "-1" else positive_int(text)


def register(sub) -> None:
    p = sub.add_parser("perplexity", help="perplexity of a text file, computed as llama-perplexity does")
    add_model_flags(p, ctx=False)
    p.add_argument("-c", "--ctx-size", type=positive_int, default=512,
                   help="tokens per chunk, n_ctx (default: 512)")
    add_cache_flags(p)
    p.add_argument("-f", "--file", required=True, help="UTF-8 text file to evaluate")
    p.add_argument("--chunks", type=_chunks, help="evaluate at most N chunks (default, or -1 as in llama-perplexity: all)")
    p.add_argument("--compare", metavar="MODES",
                   help="run in each cache mode (comma-separated: resident,staging,cache) and check that every "
                        "chunk is bitwise equal; exit 1 if not")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_perplexity)
