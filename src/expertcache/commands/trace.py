"""`expertcache trace record | simulate | stats | fit-predictor`: record routing traces (and what
the predictor predicted for each op), replay them through the runtime's policies against Belady's
MIN, with or without prefetch, summarise how experts are used and how well they were predicted,
and fit a predictor better than the routers."""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import ExpertCacheError
from ..flags import add_cache_flags, add_prefetch_width_flag, json_line, nonneg_int, positive_int
from .args import finite_float, seed
from ..checkpoint.writer import atomic_file, check_output_file
from ..plots import check_png_path, pyplot, save_png
from .common import (PrefillBar, add_model_flags, add_sampling_flags, load_model,
                     read_text_file, sampling_options, writing)

DEFAULT_CAPACITIES = "10%,25%,50%,75%"


# ---- record ------------------------------------------------------------------------------------


def cmd_record(args) -> int:
    from ..bench.trace import TraceRecorder, parse_prompts, run_prompts, save_trace

    # Before the run, not after it; an earlier trace at the path is replaced without --force.
    out = check_output_file(args.output, True, "a trace", _is_trace)
    items = parse_prompts(read_text_file(args.prompts), args.prompts) if args.prompts else None
    text = read_text_file(args.file) if args.file else None
    sampling = sampling_options(args)
    model = load_model(args)  # the cache flags only matter for memory: routing does not depend on them
    if model.tokenizer is None:
        raise ExpertCacheError(f"{model.path}: no tokenizer.json, cannot encode the prompt")
    gen = dict(**sampling, ubatch=args.ubatch)
    meta = {"source": args.file or args.prompts, "kind": "file" if args.file else "prompts",
            "max_tokens": args.n_predict, "max_prompt_tokens": args.max_prompt_tokens, **gen,
            "dtype": str(model.net.dtype).removeprefix("torch."), "device": str(model.net.device)}
    recorder = TraceRecorder.for_model(model, meta, predict=not args.no_predictions)

    def progress(res) -> None:
        print(f"[prompt {res.prompt_tokens} tok ({res.cached_tokens} reused), generated "
              f"{len(res.token_ids)} tok, {res.gen_tps:.1f} tok/s, {res.finish_reason}]", file=sys.stderr)

    with PrefillBar() as bar:  # a long prompt's prefill is minutes of silence without it
        if text is not None:
            ids = model.tokenizer.encode(text)
            if args.max_prompt_tokens is not None:
                ids = ids[: args.max_prompt_tokens]
            progress(recorder.generate(model, ids, max_tokens=args.n_predict, progress=bar, **gen))
        else:
            run_prompts(model, recorder, items, args.n_predict, on_result=progress, progress=bar, **gen)
    trace = recorder.trace()
    with writing(args.output), atomic_file(out) as tmp:
        save_trace(trace, tmp, name=args.output)  # errors name the output, not the temporary file
    size = out.stat().st_size
    print(f"wrote {args.output}: {trace.num_ops} ops, {trace.prefill_tokens()} prefill and "
          f"{trace.decode_tokens()} decode tokens, {size:,} bytes")
    return 0


def _is_trace(path: Path) -> bool:
    """Whether `path` is a trace (`load_trace` reads it): what `trace record` may replace."""
    from ..bench.trace import load_trace

    try:
        load_trace(path)
    except ExpertCacheError:
        return False
    return True


# ---- simulate ----------------------------------------------------------------------------------


def _policies(spec: str) -> list[str]:
    from ..config import POLICY_NAMES as POLICIES

    if spec == "all":
        return list(POLICIES)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise ExpertCacheError(f"unknown policy {', '.join(map(repr, unknown)) or repr(spec)}: expected 'all' "
                               f"or a comma-separated list of {', '.join(POLICIES)}")
    return list(dict.fromkeys(names))


def cmd_simulate(args) -> int:
    from ..bench.simulate import compare, parse_capacities
    from ..bench.trace import load_trace
    from ..config import DEFAULT_POLICY

    policies = _policies(args.policy)
    trace = load_trace(args.trace)
    h = trace.header
    try:
        capacities = parse_capacities(args.capacity, h.total_experts)
    except ValueError as e:
        raise ExpertCacheError(str(e)) from None
    if not args.prefetch and (args.prefetch_width != 1.0 or args.prefetch_min_prob):
        # Without --prefetch nothing replays prefetch: the setting would be ignored without a word.
        raise ExpertCacheError("--prefetch-width and --prefetch-min-prob set the prefetch replay: add --prefetch")
    if args.plot:
        check_png_path(args.plot)
    ops = trace.ops()
    predictions = None
    if args.prefetch:
        if not trace.has_predictions:
            raise ExpertCacheError(f"{args.trace}: --prefetch needs a trace with predictions (format version 2, "
                                   f"recorded by `trace record` without --no-predictions)")
        from ..models.predict import width_experts

        predictions = trace.predictions(args.prefetch_width, args.prefetch_min_prob)
        n_pred = width_experts(args.prefetch_width, h.top_k, h.pred_width)
    rows = compare(ops, [slots for _, slots in capacities], policies, h.expert_bytes, predictions)

    print(f"{args.trace}: {trace.num_ops:,} ops ({trace.prefill_tokens():,} prefill tokens, "
          f"{trace.decode_tokens():,} decode tokens), {len(h.moe_layers)} MoE layers x {h.num_experts} experts "
          f"= {h.total_experts} experts of {h.expert_bytes:,} bytes, top-{h.top_k}")
    pf = predictions is not None
    print(f"{'capacity':>8} {'slots':>5} {'(%)':>5}  {'policy':<11} {'hits':>10} {'misses':>9} {'hit rate':>8} "
          f"{'bytes moved':>16} {'x MIN':>6} {'x MIN nc':>8}"
          + (f" {'pf issued':>9} {'pf used':>8} {'pf wasted':>9} {'x bytes':>7}" if pf else ""))
    pct = {slots: 100 * slots / h.total_experts for _, slots in capacities}
    label = {slots: text for text, slots in capacities}
    demand_bytes = {(row.result.policy, row.result.capacity): row.result.bytes_moved
                    for row in rows if not row.prefetch}
    for row in rows:
        r = row.result
        mark = "*" if r.policy == DEFAULT_POLICY else " "
        name = r.policy + ("+pf" if row.prefetch else "") + mark
        line = (f"{label[r.capacity]:>8} {r.capacity:>5} {pct[r.capacity]:>5.1f}  {name:<11} "
                f"{r.hits:>10,} {r.misses:>9,} "
                f"{r.hit_rate:>8.3f} {r.bytes_moved:>16,} {_fmt(row.misses_vs_belady):>6} "
                f"{_fmt(row.noncompulsory_vs_belady):>8}")
        if pf and row.prefetch:
            base = demand_bytes[(r.policy, r.capacity)]
            line += (f" {r.prefetch_issued:>9,} {r.prefetch_used:>8,} {r.prefetch_wasted:>9,} "
                     f"{_fmt(r.bytes_moved / base if base else None):>7}")
        print(line)
    star = f"* default policy ({DEFAULT_POLICY}). " if any(row.result.policy == DEFAULT_POLICY for row in rows) else ""
    print(f"{star}x MIN: misses / Belady's misses; x MIN nc: the same over "
          f"non-compulsory misses (misses minus first uses, {rows[0].result.compulsory_misses:,}).")
    if pf:
        at = f", probability >= {args.prefetch_min_prob:g}" if args.prefetch_min_prob else ""
        print(f"+pf: with prefetch at width {args.prefetch_width:g} ({n_pred} experts per token{at}): misses are "
              f"demand misses (neither resident nor prefetched); bytes moved count prefetches; x bytes: bytes "
              f"moved / the same policy's without prefetch.")
    waved = {row.result.capacity: row.waved_ops for row in rows if row.waved_ops}
    if waved:
        print("note: ops larger than the cache ran in waves at " +
              ", ".join(f"{s} slots ({n:,} ops)" for s, n in waved.items()) +
              ": there Belady's MIN is not the optimum, and a ratio below 1 means a policy beat it.")
    if args.plot:
        _plot(args.plot, args.trace, [row for row in rows if not row.prefetch], h.total_experts)
        print(f"wrote {args.plot}")
    print(json_line({"trace": args.trace, "ops": trace.num_ops, "total_experts": h.total_experts,
                     "expert_bytes": h.expert_bytes, "default_policy": DEFAULT_POLICY,
                     "prefetch_width": args.prefetch_width if pf else None,
                     "prefetch_min_prob": args.prefetch_min_prob if pf else None,
                     "results": [row.as_dict() | {"capacity_spec": label[row.result.capacity],
                                                  "capacity_pct": pct[row.result.capacity],
                                                  "default": row.result.policy == DEFAULT_POLICY}
                                 for row in rows]}))
    return 0


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _plot(path: str, title: str, rows, total_experts: int) -> None:
    save_png(_figure(title, rows, total_experts), path)


# Policies often tie (at large capacities all of them miss only first uses): each gets its own
# marker and line style, drawn hollow and smaller in turn, so that a line drawn over another's
# still shows both.
_STYLES = [("s", "-"), ("^", "--"), ("D", "-."), ("v", ":"), ("P", "-"), ("X", "--"), ("<", "-.")]


def _figure(title: str, rows, total_experts: int):
    """The figure of `trace simulate --plot`: hit rate against capacity, one line per policy."""
    from ..config import DEFAULT_POLICY

    plt = pyplot()

    by_policy: dict[str, list] = {}
    for row in rows:
        by_policy.setdefault(row.result.policy, []).append(row.result)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    others = [name for name in by_policy if name not in ("belady", DEFAULT_POLICY)]
    for name, results in by_policy.items():
        x = [100 * r.capacity / total_experts for r in results]
        y = [r.hit_rate for r in results]
        if name == "belady":
            ax.plot(x, y, "k--", marker="o", markersize=5, label="Belady MIN", linewidth=2,
                    zorder=3)
        elif name == DEFAULT_POLICY:
            ax.plot(x, y, marker="o", markersize=11, fillstyle="none", markeredgewidth=2, color="C4",
                    label=f"{name} (default)", linewidth=2.5, alpha=0.8, zorder=2)
        else:
            i = others.index(name)
            marker, style = _STYLES[i % len(_STYLES)]
            ax.plot(x, y, marker=marker, linestyle=style, markersize=9 - 1.2 * i, fillstyle="none",
                    color=f"C{i}", label=name, linewidth=1.3, zorder=4 + i)
    ax.set_xlabel("cache capacity (% of all experts)")
    ax.set_ylabel("hit rate (share of expert uses already in the cache)")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(0, 100)
    ax.grid(alpha=0.3)
    ax.set_title(f"{Path(title).name}: hit rate by cache capacity, demand loads only", fontsize=10)
    ax.legend(loc="lower right", fontsize=9)
    fig.tight_layout()
    return fig


# ---- stats -------------------------------------------------------------------------------------


def cmd_stats(args) -> int:
    from ..bench.trace import load_trace, popularity, prediction_quality, reuse_distances, reuse_summary, top_counts

    trace = load_trace(args.trace)
    # The width only picks the --prefetch-min-prob columns (1.0, 1.5 and 2.0 are always reported),
    # and a floor needs predictions: either alone would be ignored without a word.
    if args.prefetch_width != 1.0 and not args.prefetch_min_prob:
        raise ExpertCacheError("--prefetch-width in `trace stats` is the width of the --prefetch-min-prob columns: "
                               "add --prefetch-min-prob (widths 1.0, 1.5 and 2.0 are always reported)")
    if args.prefetch_min_prob and not trace.has_predictions:
        raise ExpertCacheError(f"{args.trace}: --prefetch-min-prob needs a trace with predictions (recorded by "
                               "`trace record` without --no-predictions)")
    phase = None if args.phase == "all" else args.phase
    pop = popularity(trace, phase)
    dist = reuse_distances(trace, phase)
    if not pop:
        raise ExpertCacheError(f"{args.trace}: no {args.phase} ops in this trace")
    h = trace.header
    print(f"{args.trace}: {args.phase} ops; per MoE layer, uses = (op, distinct expert) pairs; "
          f"reuse distance in ops of the same layer")
    print(f"{'layer':>5} {'uses':>8} {'top10%':>7} {'top25%':>7} {'entropy':>13} {'unused':>6} "
          f"{'p50':>5} {'p75':>5} {'p90':>6} {'p99':>6} {'<=1':>5} {'<=4':>5} {'<=16':>5}")
    layers = {}
    for layer, p in pop.items():
        s = reuse_summary(dist[layer], p["uses"] - len(dist[layer]))
        layers[layer] = p | {"reuse": s}
        entropy = f"{p['entropy_bits']:.2f}/{p['max_entropy_bits']:.2f}"  # one cell, under its header
        print(f"{layer:>5} {p['uses']:>8,} {p['top10_share']:>7.3f} {p['top25_share']:>7.3f} "
              f"{entropy:>13} {p['unused_experts']:>6} "
              f"{s.get('p50', 0):>5.0f} {s.get('p75', 0):>5.0f} {s.get('p90', 0):>6.0f} {s.get('p99', 0):>6.0f} "
              f"{s.get('share_le_1', 0):>5.2f} {s.get('share_le_4', 0):>5.2f} {s.get('share_le_16', 0):>5.2f}")
    n10, n25 = top_counts(h.num_experts)
    print(f"top10%/top25%: share of uses that go to the {n10}/{n25} most used of {h.num_experts} experts "
          f"(uniform: {n10 / h.num_experts:.3f}/{n25 / h.num_experts:.3f}); "
          f"entropy in bits (uniform: log2({h.num_experts})).")
    quality = {}
    if trace.has_predictions:
        phases = ["prefill", "decode"] if phase is None else [phase]
        floors = [(args.prefetch_width, args.prefetch_min_prob)] if args.prefetch_min_prob else []
        quality = {p: prediction_quality(trace, p, floors=floors) for p in phases}
        _print_quality(trace, quality, floors)
    print(json_line({"trace": args.trace, "phase": args.phase, "layers": {str(k): v for k, v in layers.items()},
                     "prediction": {p: {str(k): v for k, v in q.items()} for p, q in quality.items()}}))
    return 0


def _print_quality(trace, quality: dict, floors: list[tuple[float, float]]) -> None:
    from ..bench.trace import WIDTHS, quality_label
    from ..models.predict import width_experts

    h = trace.header
    ks = [width_experts(w, h.top_k, h.pred_width) for w in WIDTHS]
    labels = [str(w) for w in WIDTHS] + [quality_label(w, p) for w, p in floors]
    short = [format(w, "g") for w in WIDTHS] + [f"{w:g},p{p:g}" for w, p in floors]
    print(f"prediction ({h.predictor or 'unnamed'} predictor), per layer over its predicted ops: recall R "
          f"(used experts that were predicted) and precision P (predicted experts that were used) at width "
          + ", ".join(f"{w:g} ({k}/token)" for w, k in zip(WIDTHS, ks))
          + "".join(f"; at width {w:g} with probability >= {p:g} (W,pP)" for w, p in floors))
    wide = max(6, *(len(s) + 2 for s in short))
    print(f"{'phase':>7} {'layer':>5} {'ops':>7} " + " ".join(f"{'R@' + s:>{wide}} {'P@' + s:>{wide}}" for s in short))
    for phase, layers in quality.items():
        for layer, q in layers.items():
            cells = " ".join(f"{q['widths'][c]['recall']:>{wide}.3f} {q['widths'][c]['precision']:>{wide}.3f}"
                             for c in labels)
            print(f"{phase:>7} {layer:>5} {q['ops']:>7,} {cells}")


# ---- fit-predictor -----------------------------------------------------------------------------


def _is_predictor(path: Path) -> bool:
    """Whether `path` is a file `fit-predictor` wrote (its safetensors metadata says so): what it may replace."""
    from safetensors import safe_open

    from ..models.linear_predictor import FORMAT

    try:
        with safe_open(path, "pt") as f:
            return (f.metadata() or {}).get("format") == FORMAT
    except Exception:  # not a safetensors file at all (safetensors raises several kinds)
        return False


# Each objective's own options and their defaults (given as None, so that a value given for the
# other objective is seen).
_OBJECTIVE_OPTIONS = {"logits": {"ridge": 1.0}, "used": {"hidden": 512, "epochs": 30, "seed": 0}}


def _objective_options(args) -> None:
    """Fill in the defaults of the objective's options; an option of the other objective is a
    one-line error: the fit would ignore it without a word (a --seed that seeds nothing)."""
    for objective, options in _OBJECTIVE_OPTIONS.items():
        for name, default in options.items():
            if objective == args.objective:
                if getattr(args, name) is None:
                    setattr(args, name, default)
            elif getattr(args, name) is not None:
                raise ExpertCacheError(f"--{name} is an option of --objective {objective}, and this fit is "
                                       f"--objective {args.objective}: drop it")


def cmd_fit_predictor(args) -> int:
    from tqdm import tqdm

    from ..models.linear_predictor import MIN_FIT_TOKENS, fit, fit_used, split_tokens

    _objective_options(args)
    out = check_output_file(args.output, True, "a predictor file", _is_predictor)
    text = read_text_file(args.file)
    ridge = {} if args.ridge is None else {"ridge": args.ridge}  # a fit of use has no ridge
    split_tokens(max(args.tokens, MIN_FIT_TOKENS * 2), args.held_out, **ridge)  # bad options fail before loading
    model = load_model(args)
    if model.tokenizer is None:
        raise ExpertCacheError(f"{model.path}: no tokenizer.json, cannot encode {args.file}")
    ids = model.tokenizer.encode(text)[: args.tokens]
    split_tokens(len(ids), args.held_out, **ridge)
    if args.objective == "logits":
        # disable=None: a bar on a terminal only; in a log its carriage returns would be noise.
        with tqdm(total=len(ids), desc="fit", unit="tok", file=sys.stderr, disable=None) as bar:
            maps, report = fit(model, ids, chunk=args.chunk, ridge=args.ridge, held_out=args.held_out,
                               progress=bar.update)
    else:
        bars = {}  # opened at their first step: a refusal before the run prints no bar

        def step(name: str, total: int, unit: str, n: int) -> None:
            if name not in bars:
                for bar in bars.values():  # the run is over when training starts
                    bar.close()
                bars[name] = tqdm(total=total, desc=name, unit=unit, file=sys.stderr, disable=None)
            bars[name].update(n)

        epochs = len(model.cfg.moe_layers) * args.epochs
        try:
            maps, report = fit_used(model, ids, chunk=args.chunk, hidden=args.hidden, epochs=args.epochs,
                                    held_out=args.held_out, seed=args.seed,
                                    progress=lambda n: step("run", len(ids), "tok", n),
                                    on_epoch=lambda _layer: step("train", epochs, "epoch", 1))
        finally:
            for bar in bars.values():
                bar.close()
    maps.meta["text"] = args.file
    with writing(args.output):
        maps.save(out)
    first = model.cfg.moe_layers[0]
    prev = {nxt: layer for layer, nxt in zip(model.cfg.moe_layers, model.cfg.moe_layers[1:])}
    used = args.objective == "used"
    if not report["layers"]:  # --held-out 0 (or a share under one token): nothing to measure on
        print(f"fitted on {report['fit_tokens']:,} tokens; no tokens held out (--held-out {args.held_out:g}): "
              "recall not measured")
        print(f"wrote {out}")
        print(json_line({"output": str(out), **report}))
        return 0
    print(f"fitted on {report['fit_tokens']:,} tokens; recall at width 1.0 on the last "
          f"{report['held_out_tokens']:,} (held out):")
    print(f"{'layer':>5}  {'predicted from':<24} {'router':>7} {'fitted':>7}"
          + (f" {'R@p0.5':>7} {'P@p0.5':>7}" if used else ""))
    for layer, r in report["layers"].items():
        src = "the embeddings" if int(layer) == first else f"layer {prev[int(layer)]}'s residual"
        print(f"{layer:>5}  {src:<24} {r['router']:>7.3f} {r['linear']:>7.3f}"
              + (f" {r['recall_p50']:>7.3f} {r['precision_p50']:>7.3f}" if used else ""))
    if used:
        print("R@p0.5, P@p0.5: recall and precision of the experts the maps give a probability of 0.5 or more "
              "(--prefetch-min-prob 0.5)")
    print(f"wrote {out}")
    print(json_line({"output": str(out), **report}))
    return 0


def register(sub) -> None:
    t = sub.add_parser("trace", help="record routing traces and replay them through the cache policies")
    tsub = t.add_subparsers(dest="trace_command", required=True, parser_class=type(t))

    r = tsub.add_parser("record", help="run a model and record the routing of every MoE op")
    add_model_flags(r)
    add_cache_flags(r)
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("-f", "--file", help="prefill this UTF-8 text file, then decode -n tokens")
    src.add_argument("--prompts", help="JSONL: one {\"prompt\"|\"user\"|\"messages\": ...} per line, run in turn "
                                       "on one session (docs/traces.md)")
    r.add_argument("-n", "--n-predict", type=nonneg_int, default=128, help="tokens to generate per prompt "
                                                                            "(default: 128)")
    r.add_argument("--max-prompt-tokens", type=positive_int, help="-f: keep only the file's first N tokens")
    add_sampling_flags(r, min_p=False)
    r.add_argument("--no-predictions", action="store_true",
                   help="do not record what the predictor predicted for each op (recorded by default)")
    r.add_argument("-o", "--output", required=True, help="trace file to write (.npz)")
    r.set_defaults(func=cmd_record)

    s = tsub.add_parser("simulate", help="replay a trace through each policy and Belady's MIN")
    s.add_argument("trace", help="trace file (.npz) written by `trace record`")
    s.add_argument("--capacity", default=DEFAULT_CAPACITIES,
                   help="comma-separated percentages of all experts or slot counts (default: "
                   + DEFAULT_CAPACITIES.replace("%", "%%") + ")")
    s.add_argument("--policy", default="all", help="'all' (default) or a comma-separated list of policies")
    s.add_argument("--plot", help="draw hit rate against capacity into this PNG (demand-only rows)")
    s.add_argument("--prefetch", action="store_true",
                   help="also replay each policy with prefetch from the trace's recorded predictions")
    add_prefetch_width_flag(s)
    s.set_defaults(func=cmd_simulate)

    fp = tsub.add_parser("fit-predictor", help="fit maps that predict the next layer's experts better than "
                                                "its router (for prefetch: --predictor)")
    add_model_flags(fp)
    add_cache_flags(fp)
    fp.add_argument("-f", "--file", required=True, help="UTF-8 text to run the model over (like the text it will see)")
    fp.add_argument("-n", "--tokens", type=positive_int, default=65536,
                    help="use the file's first N tokens (default: 65536)")
    fp.add_argument("--chunk", type=positive_int, default=1024, help="tokens per sequence (default: 1024)")
    fp.add_argument("--objective", choices=("logits", "used"), default="logits",
                    help="logits (default): a linear map to the router's logits, solved by ridge regression; "
                         "used: the probability that each expert is used, trained on that (calibrated "
                         "probabilities for --prefetch-min-prob)")
    fp.add_argument("--ridge", type=finite_float, default=None,
                    help="logits: ridge regularisation of each map (default: 1.0)")
    fp.add_argument("--hidden", type=nonneg_int, default=None,
                    help="used: units of the maps' hidden layer, 0 for linear maps (default: 512)")
    fp.add_argument("--epochs", type=positive_int, default=None, help="used: passes over the text (default: 30)")
    fp.add_argument("--seed", type=seed, default=None,
                    help="used: seed of the initialisation and the batches, 64 bits (default: 0)")
    fp.add_argument("--held-out", type=finite_float, default=0.1,
                    help="share of the tokens (the last) kept out of the fit to measure recall (default: 0.1)")
    fp.add_argument("-o", "--output", required=True, help="predictor file to write (.safetensors)")
    fp.set_defaults(func=cmd_fit_predictor)

    st = tsub.add_parser("stats", help="expert popularity and reuse distances, per layer")
    st.add_argument("trace", help="trace file (.npz) written by `trace record`")
    st.add_argument("--phase", choices=("all", "prefill", "decode"), default="all",
                    help="count only the prefill or the decode ops (default: all)")
    add_prefetch_width_flag(st)  # with --prefetch-min-prob, one more pair of columns: that width and floor
    st.set_defaults(func=cmd_stats)
