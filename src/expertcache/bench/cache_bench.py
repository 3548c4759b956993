"""`expertcache bench cache`: decode and prefill in resident, staging and cache modes at several
capacities with each slow tier, measuring tok/s, hit rate, bytes copied per token, achieved copy
bandwidth and peak resident memory; in cache mode with prefetch on or off (`--prefetch both`
measures both), with its counters and the time compute waited for copies. With `--route-trace`
the routing follows a recorded trace, and so do the predictions prefetch plans (the trace's own).

Each configuration runs in its own process, so that peak memory and the page cache of one do not
leak into the next. Measure on a checkpoint well above the last-level cache (`expertcache synth`),
or copy bandwidth is cache bandwidth.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm


DEFAULT_FRACTIONS = (0.25, 0.5, 0.75)
# Experts the read-rate probe reads after a configuration's decode (`read_rate`): about 0.6 GB at
# Qwen3-30B-A3B's 9.4 MB, a third of a second from a disk that reads 2 GB/s.
READ_PROBE_EXPERTS = 64


def run_one(spec: dict) -> dict:
    """One configuration, in this process: load, warm up, prefill, decode; return the figures."""
    import expertcache
    from expertcache import CacheConfig

    torch.set_num_threads(spec["threads"])
    cache = CacheConfig(mode=spec["mode"], fraction=spec.get("fraction"), store=spec["store"],
                        policy=spec.get("policy") or CacheConfig().policy, prefetch=spec.get("prefetch", "auto"),
                        prefetch_width=spec.get("prefetch_width", 1.0),
                        prefetch_min_prob=spec.get("prefetch_min_prob", 0.0))
    t0 = time.perf_counter()
    device = spec.get("device", "cpu")
    model = expertcache.load(spec["model"], device=device, dtype=spec.get("dtype"), cache=cache,
                             ctx_size=spec["prefill"] + spec["decode"] + 8, kernels=spec.get("kernels", "torch"),
                             activations=spec.get("activations", "auto"), prefill_stretch=spec.get("prefill_stretch", 4096), prefill_mem=spec.get("prefill_mem"))
    load_s = time.perf_counter() - t0
    replay = None
    if spec.get("route_trace"):
        from ..models.linear_predictor import FITTED
        from .trace import load_trace

        trace = load_trace(spec["route_trace"])
        replay = RoutingReplay(trace, model.cfg)
        model.net.routing_override = replay
        # The model's own predictor would rank its experts for routing that is not used: plan the
        # trace's recorded predictions instead (none recorded: no prefetch).
        model.net.residual_hook = model.net.forward_hook = model.experts.predict = None
        # `--prefetch auto` decides as the runtime would with the predictor the trace was recorded
        # with: on a CPU, fitted maps (not the routers) with direct disk reads.
        model.experts.fitted_predictor = trace.has_predictions and trace.header.predictor.startswith(FITTED)
        if model.experts.prefetching and trace.has_predictions:
            predictions = PredictionReplay(trace, model.cfg, replay, cache.prefetch_width, model.experts.prefetch,
                                           cache.prefetch_min_prob)
            model.net.forward_hook = predictions.begin
            model.experts.predict = predictions
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.cfg.vocab_size, (spec["prefill"],), generator=gen).tolist()

    # A GPU runs its kernels asynchronously: time up to the end of the work, not its launch.
    # The model's device, not the current one (device 0 unless set): a model on cuda:1 is timed there.
    device = model.net.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def phase(fn):
        before = model.telemetry()
        sync()
        t = time.perf_counter()
        n = fn()
        sync()
        dt = time.perf_counter() - t
        # Untimed: the phase's prefetch copies still in flight end here. Their bytes count when
        # planned, their time when done: left running, that time went to the next phase.
        model.experts.quiesce()
        after = model.telemetry()
        tot_b, tot_a = before["total"], after["total"]
        d = {k: tot_a[k] - tot_b[k] for k in ("used_experts_unique", "resident_hits", "copied_experts",
                                               "copied_bytes", "copy_ranges", "demand_misses", "prefetch_issued",
                                               "prefetch_used", "prefetch_wasted")}
        copy_s = after["copy_seconds"] - before["copy_seconds"]
        pf_s = after["prefetch_copy_seconds"] - before["prefetch_copy_seconds"]
        dropped = after["prefetch_dropped_bytes"] - before["prefetch_dropped_bytes"]
        return {"tokens": n, "seconds": dt, "tok_s": n / dt,
                "demand_misses": d["demand_misses"], "prefetch_issued": d["prefetch_issued"],
                "prefetch_used": d["prefetch_used"], "prefetch_wasted": d["prefetch_wasted"],
                "stall_seconds": after["stall_seconds"] - before["stall_seconds"], "prefetch_copy_seconds": pf_s,
                "hit_rate": d["resident_hits"] / d["used_experts_unique"] if d["used_experts_unique"] else 0.0,
                "copied_bytes_per_token": d["copied_bytes"] / n, "read_bytes_per_token": (d["copied_bytes"] - dropped) / n,
                "copy_ranges": d["copy_ranges"],
                "copy_seconds": copy_s,
                "copy_gb_s": (d["copied_bytes"] - dropped) / (copy_s + pf_s) / 1e9 if copy_s + pf_s > 0 else 0.0}

    # Warm-up: a short prompt and a few decode steps, so that first-call costs are not measured.
    model.generate(prompt[:8], max_tokens=4, ignore_eos=True)
    if replay is not None:
        replay.rewind()
    # The measured prompt starts from empty slots, as after a load: the warm-up's experts (those of
    # the prompt's first tokens, or the trace's first rows) would otherwise be hits it never paid.
    model.experts.clear()
    session = model.new_session()

    def do_prefill():
        model.prefill(session, prompt, spec["ubatch"])
        return len(prompt)

    prefill = phase(do_prefill)
    # What the slow tier gave the prompt, per token: expert bytes x stretches at most, once
    # every expert is used in each stretch.
    prefill.update(bytes_read_per_token=model.last_prefill.bytes_per_token, stretches=model.last_prefill.stretches)

    def decode():
        tok = prompt[-1]
        for _ in range(spec["decode"]):
            logits = model.prefill(session, [tok])
            tok = int(logits.argmax())
        return spec["decode"]

    dec = phase(decode)
    if spec["mode"] != "resident" and model.net.device.type == "cpu":
        dec["probe_gb_s"] = read_rate(model.experts) / 1e9
    from ..telemetry import peak_rss_bytes

    tel = model.telemetry()
    return {"mode": spec["mode"], "store": spec["store"], "fraction": spec.get("fraction"), "device": str(model.net.device),
            "prefetch": model.experts.predict is not None, "prefetch_width": cache.prefetch_width,
            "prefetch_min_prob": cache.prefetch_min_prob,
            "capacity": tel["capacity"], "total_experts": tel["total_experts"], "expert_bytes": tel["expert_bytes"],
            "policy": tel["policy"], "load_seconds": load_s, "prefill": prefill, "decode": dec,
            "expert_bytes_total": sum(model.experts.expert_bytes[i] for i in model.cfg.moe_layers) * model.cfg.num_experts,
            "prefill_stretch": model.stretch, "stretch_activation_bytes": model.net.activation_bytes(model.stretch),
            "peak_rss_bytes": peak_rss_bytes()}


def read_rate(cache, n: int = READ_PROBE_EXPERTS) -> float:
    """The slow tier's rate now, in expert bytes a second: `n` experts read one after another by
    the store's own reads (as a demand copy makes them) into the cache's slots in turn, with
    nothing computing beside them. It empties the cache first: the slots are its destination.

    The same slots the decode read into, not one buffer: on a virtual machine whose disk is the
    host's copy into guest memory, reads into one 9 MiB buffer, still in the host's cache, ran
    2.6-2.8 GB/s where reads into the cache's slots in turn ran 2.0 in the same minute
    (docs/benchmarks.md, "The probe's destination"), and only the second is a rate the decode's
    copies can reach. After a decode, so that the disk is timed as it was for it: a shared
    machine's disk reads 1.8-2.3 GB/s from one minute to the next."""
    cache.clear()
    layers = cache.moe_layers
    keys = [(layers[i % len(layers)], (i * 7) % cache.num_experts) for i in range(n)]
    t = time.perf_counter()
    for i, (layer, expert) in enumerate(keys):
        slot = i % cache.capacity
        cache.store.copy_run(layer, expert, cache.pool[slot: slot + 1])
    return sum(cache.expert_bytes[layer] for layer, _ in keys) / (time.perf_counter() - t)


class RoutingReplay:
    """Forces each MoE layer's routing to follow a recorded trace (`model.net.routing_override`).

    The model's i-th MoE layer replays the trace's i-th MoE layer: its routed token rows, in order,
    as one stream (an op of T tokens takes the next T rows; the stream wraps around at its end),
    each chosen expert weighted 1/k. Copy costs are then those of the model's real expert size
    with the trace's realistic routing.
    """

    def __init__(self, trace, cfg):
        from ..errors import ExpertCacheError

        h = trace.header
        if (h.num_experts, h.top_k, len(h.moe_layers)) != (cfg.num_experts, cfg.top_k, len(cfg.moe_layers)):
            raise ExpertCacheError(
                f"trace has {h.num_experts} experts, top-{h.top_k}, {len(h.moe_layers)} MoE layers; the model has "
                f"{cfg.num_experts}, top-{cfg.top_k}, {len(cfg.moe_layers)} (make one with expertcache synth "
                f"--experts {h.num_experts} --top-k {h.top_k} --layers {len(h.moe_layers)})")
        starts = np.concatenate([[0], np.cumsum(trace.tokens)])
        self.rows = {}
        for ours, theirs in zip(cfg.moe_layers, h.moe_layers):
            ops = np.flatnonzero(trace.layer == theirs)
            self.rows[ours] = np.concatenate([trace.ids[starts[i]: starts[i + 1]] for i in ops]).astype(np.int64)
        self.k = cfg.top_k
        self.rewind()

    def rewind(self) -> None:
        self.pos = dict.fromkeys(self.rows, 0)

    def __call__(self, layer: int, routing):
        from ..models.moe import Routing

        rows = self.rows[layer]
        T = routing.ids.shape[0]
        take = (self.pos[layer] + np.arange(T)) % len(rows)
        self.pos[layer] += T
        ids = torch.from_numpy(rows[take]).to(routing.ids.device)                       # [T, k]
        weights = torch.full_like(routing.weights, 1.0 / self.k)                       # [T, k]
        return Routing(weights, ids)


class PredictionReplay:
    """The trace's recorded predictions, for the ops `RoutingReplay` routes: once the op of MoE
    layer l is planned, the next MoE layer's prediction for the rows it is about to take (the
    union of their `width` predictions at `min_prob`, `Trace.predictions`' rule); at a forward's
    start, the first MoE layer's. Rows recorded without a prediction contribute none."""

    def __init__(self, trace, cfg, replay: RoutingReplay, width: float, plan, min_prob: float = 0.0):
        from ..models.predict import next_moe_layers, width_experts

        h = trace.header
        self.n = width_experts(width, h.top_k, h.pred_width)
        trace.check_floor(min_prob)
        self.min_prob = min_prob
        starts = np.concatenate([[0], np.cumsum(trace.tokens)])
        self.pred, self.prob, self.has = {}, {}, {}
        for ours, theirs in zip(cfg.moe_layers, h.moe_layers):
            ops = np.flatnonzero(trace.layer == theirs)
            self.pred[ours] = np.concatenate([trace.pred[starts[i]: starts[i + 1], : self.n] for i in ops])
            if min_prob > 0:
                self.prob[ours] = np.concatenate([trace.pred_prob[starts[i]: starts[i + 1], : self.n] for i in ops])
            self.has[ours] = np.concatenate([np.full(trace.tokens[i], bool(trace.predicted[i])) for i in ops])
        self.replay, self.plan = replay, plan
        self.first, self.next = cfg.moe_layers[0], next_moe_layers(cfg.moe_layers)
        self.T = 1

    def _experts(self, layer: int) -> list[int] | None:
        from ..models.predict import op_prediction

        rows = (self.replay.pos[layer] + np.arange(self.T)) % len(self.pred[layer])
        rows = rows[self.has[layer][rows]]
        if not self.n or not len(rows):
            return None
        if self.min_prob > 0:
            return op_prediction(self.pred[layer][rows].tolist(), self.n, self.prob[layer][rows].tolist(),
                                 self.min_prob) or None
        return op_prediction(self.pred[layer][rows].tolist(), self.n)

    def begin(self, tokens) -> None:
        self.T = int(tokens.shape[0])
        experts = self._experts(self.first)
        if experts:
            self.plan(self.first, experts)

    def __call__(self, layer: int):
        nxt = self.next.get(layer)
        experts = self._experts(nxt) if nxt is not None else None
        return (nxt, experts) if experts else None


def configurations(args) -> list[dict]:
    base = {"model": args.model, "threads": args.threads, "prefill": args.prefill, "decode": args.decode,
            "ubatch": args.ubatch, "dtype": args.dtype, "policy": args.cache_policy, "route_trace": args.route_trace,
            "kernels": args.kernels, "activations": args.activations, "prefill_stretch": args.prefill_stretch, "prefill_mem": args.prefill_mem,
            "prefetch_width": args.prefetch_width, "prefetch_min_prob": args.prefetch_min_prob,
            "device": args.device}
    prefetch = ["off", "on"] if args.prefetch == "both" else [args.prefetch]
    specs = []
    for store in args.stores.split(","):
        specs.append({**base, "mode": "resident", "store": store})
        specs.append({**base, "mode": "staging", "store": store})
        for f in args.fractions:
            for pf in prefetch:
                specs.append({**base, "mode": "cache", "store": store, "fraction": f, "prefetch": pf})
    return specs


def table(rows: list[dict]) -> str:
    """One line per configuration: prefill tok/s (and as a ratio of the resident mode's on the
    same store), the slow tier's bytes per prompt token (and as a multiple of all expert bytes
    per stretch), then decode; a legend names what each short header measures."""
    head = (f"{'mode':<9}{'store':<6}{'cap':>6}{'slots':>7}{'prefetch':>9}  {'prefill t/s':>11}{'x res':>7}"
            f"{'read MB/tok':>12}{'x all':>7}  {'decode t/s':>10}{'hit rate':>9}{'MB/tok':>9}{'copy GB/s':>10}"
            f"{'stall ms/tok':>13}{'peak RSS MiB':>13}")
    lines = [head, "-" * len(head)]
    resident = {r["store"]: r["prefill"]["tok_s"] for r in rows if r["mode"] == "resident"}
    for r in rows:
        cap = "all" if r["mode"] == "resident" else ("-" if r["fraction"] is None else f"{r['fraction']:.0%}")
        d, p = r["decode"], r["prefill"]
        ratio = f"{p['tok_s'] / resident[r['store']]:.2f}" if r["store"] in resident else "-"
        read = p["bytes_read_per_token"] * p["tokens"]
        amortized = read / (r["expert_bytes_total"] * max(1, p["stretches"]))
        # Prefetch is a cache-mode setting: "-" where it does not apply, "off" where it was off.
        pf = "-" if r["mode"] != "cache" else ("on" if r.get("prefetch") else "off")
        stall = d.get("stall_seconds", 0.0) / max(1, d["tokens"]) * 1e3
        lines.append(f"{r['mode']:<9}{r['store']:<6}{cap:>6}{r['capacity']:>7}{pf:>9}  {p['tok_s']:>11.1f}{ratio:>7}"
                     f"{p['bytes_read_per_token'] / 1e6:>12.3f}{amortized:>7.2f}  "
                     f"{d['tok_s']:>10.2f}{d['hit_rate']:>9.3f}{d['copied_bytes_per_token'] / 1e6:>9.2f}"
                     f"{d['copy_gb_s']:>10.2f}{stall:>13.2f}{r['peak_rss_bytes'] / 2**20:>13.0f}")
    first = rows[0] if rows else None
    if first is not None:
        lines.append(f"prefill: stretches of {first['prefill_stretch']} tokens, "
                     f"{first['stretch_activation_bytes'] / 2**20:.0f} MiB of activations each")
    lines.append(textwrap.fill(
        "cap: cache size, % of all experts; slots: experts the fast tier holds. prefill: x res = tok/s over "
        "the resident mode's on the same store; read MB/tok = slow-tier bytes read per prompt token; "
        "x all = those bytes over all expert bytes per stretch (1 = each expert read once). decode: hit "
        "rate = share of the experts used that were resident; MB/tok = bytes copied per token; stall "
        "ms/tok = time waiting for copies per token. MB, GB: 10^6, 10^9 bytes; MiB: 2^20.", len(head)))
    return "\n".join(lines)


def overlap_bounds(rows: list[dict]) -> list[dict]:
    """For each store and capacity measured with prefetch off and on beside the resident mode, on
    a CPU: prefetch's decode time per token against max(compute, reads), compute being the
    resident time and reads the bytes read per token with prefetch (copied, less the planned
    prefetches whose copy never ran) over the slow tier's rate, probed right after prefetch on's
    decode (`read_rate`; where no probe ran, the rate of prefetch off's demand copies, its bytes
    over their `copy_seconds`, which `x_bound_off_copies` uses in any case); and prefetch's
    speed-up beside its
    ceiling, (compute + reads without prefetch) / max(compute, those reads). The bound holds when
    the copies overlap compute instead of adding to it (docs/cache.md, "Prefetch"). Beside it,
    `x_bound_needed`: the same time against max(compute, reads without prefetch), which wasted
    prefetch reads do not raise (a bound of the bytes with prefetch grows with its wrong guesses)."""
    resident = {r["store"]: r["decode"] for r in rows if r["mode"] == "resident" and r["device"] == "cpu"}
    by_setting: dict[tuple, dict[bool, dict]] = {}
    for r in rows:
        if r["mode"] == "cache" and r["store"] in resident:
            by_setting.setdefault((r["store"], r["fraction"]), {})[bool(r["prefetch"])] = r["decode"]
    out = []
    for (store, fraction), pair in by_setting.items():
        off, on = pair.get(False), pair.get(True)
        if off is None or on is None or off["copy_seconds"] <= 0:
            continue
        compute = 1 / resident[store]["tok_s"]
        copies = off["copied_bytes_per_token"] * off["tokens"] / off["copy_seconds"]
        # The probe after prefetch on's decode times the disk when that decode ran; prefetch off's
        # copies, in a process of its own a minute before, when another did.
        rate = on["probe_gb_s"] * 1e9 if on.get("probe_gb_s") else copies
        reads_on, reads_off = on["read_bytes_per_token"] / rate, off["copied_bytes_per_token"] / rate
        t_on, t_off = 1 / on["tok_s"], 1 / off["tok_s"]
        out.append({"store": store, "fraction": fraction, "compute_s": compute, "read_gb_s": rate / 1e9,
                    "reads_s": reads_on, "s_per_token": t_on, "x_bound": t_on / max(compute, reads_on),
                    "reads_needed_s": reads_off, "x_bound_needed": t_on / max(compute, reads_off),
                    "speedup": t_off / t_on, "ceiling": (compute + reads_off) / max(compute, reads_off),
                    "off_copies_gb_s": copies / 1e9,
                    "x_bound_off_copies": t_on / max(compute, on["read_bytes_per_token"] / copies)})
    return out


def bounds_text(bounds: list[dict]) -> str:
    return "\n".join(
        f"prefetch, {b['store']} {'-' if b['fraction'] is None else format(b['fraction'], '.0%')}: "
        f"{b['s_per_token'] * 1e3:.1f} ms/token = {b['x_bound']:.2f}x max(compute {b['compute_s'] * 1e3:.1f} ms, "
        f"reads {b['reads_s'] * 1e3:.1f} ms at {b['read_gb_s']:.2f} GB/s), {b['x_bound_needed']:.2f}x with the reads "
        f"without prefetch ({b['reads_needed_s'] * 1e3:.1f} ms); {b['speedup']:.2f}x as fast as "
        f"without prefetch, of a ceiling of {b['ceiling']:.2f}x; {b['x_bound_off_copies']:.2f}x at the rate of "
        f"prefetch off's copies ({b['off_copies_gb_s']:.2f} GB/s)" for b in bounds)


def figure(rows: list[dict], title: str, threads: int):
    """The figure of `bench cache --plot`: decode tok/s, decode hit rate and prefill tok/s against
    the cache's capacity; a line per store and prefetch setting, the resident mode's speed on the
    same store as a dotted level and staging's as a cross at 0% (it holds the op in flight only)."""
    from ..plots import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.4), dpi=100)
    panels = [(lambda r: r["decode"]["tok_s"], "decode tokens / s"),
              (lambda r: r["decode"]["hit_rate"], "decode hit rate (share of expert uses resident)"),
              (lambda r: r["prefill"]["tok_s"], "prefill tokens / s")]
    stores = list(dict.fromkeys(r["store"] for r in rows))
    for ax, (value, label) in zip(axes, panels):
        for i, store in enumerate(stores):
            # Stores often tie (hit rates do not depend on the store): each its own marker, drawn
            # smaller in turn, so that a line over another still shows both.
            color, marker, size = f"C{i}", "osD"[i % 3], (10, 6, 3.5)[i % 3]
            lines: dict[str, list[dict]] = {}
            for r in rows:
                if r["store"] != store:
                    continue
                if r["mode"] == "cache":
                    lines.setdefault("prefetch on" if r.get("prefetch") else "prefetch off", []).append(r)
                elif r["mode"] == "resident" and "hit rate" not in label:
                    ax.axhline(value(r), color=color, linestyle=":", linewidth=1.5, label=f"{store}: resident")
                elif r["mode"] == "staging" and "hit rate" not in label:
                    ax.plot([0], [value(r)], marker="x", markersize=9, color=color, linestyle="none",
                            label=f"{store}: staging")
            for name, rs in lines.items():
                rs = sorted(rs, key=lambda r: r["fraction"])
                ax.plot([100 * r["fraction"] for r in rs], [value(r) for r in rs], color=color, marker=marker,
                        markersize=size, fillstyle="none" if name == "prefetch on" else "full",
                        linestyle="--" if name == "prefetch on" else "-", label=f"{store}: cache, {name}")
        ax.set_xlabel("cache capacity (% of all experts)")
        ax.set_ylabel(label)
        ax.set_xlim(-3, 103)
        ax.set_ylim(0, 1.02 if "hit rate" in label else None)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="best")
    fig.suptitle(f"{Path(title).name}: expert cache by capacity and slow tier "
                 f"({threads} threads)", fontsize=11)
    fig.tight_layout()
    return fig


def cmd_bench_cache(args) -> int:
    from ..models.loader import open_model
    from ..errors import ExpertCacheError
    from ..plots import check_png_path, save_png

    from ..engine import _device

    open_model(args.model)  # bad paths and devices fail here, with one line
    _device(args.device)
    if args.plot:  # before minutes of measuring, not after
        check_png_path(args.plot)
    for s in args.stores.split(","):
        if s not in ("ram", "mmap", "disk"):
            raise ExpertCacheError(f"unknown store {s!r} in --stores: expected ram, mmap, disk")
    if args.route_trace:  # a bad trace, or a floor it cannot replay, fails before any configuration runs
        from .trace import load_trace

        load_trace(args.route_trace).check_floor(args.prefetch_min_prob)
    rows, failed = [], []
    specs = configurations(args)
    # disable=None: a bar on a terminal only; in a log its carriage returns would be noise.
    for spec in tqdm(specs, desc="bench cache", unit="config", file=sys.stderr, disable=None):
        p = subprocess.run([sys.executable, "-m", "expertcache.bench.cache_bench", json.dumps(spec)],
                           capture_output=True, text=True)
        row, error = _child_result(p)
        if error is not None:
            # The other configurations still run and print: one failure (a cache too large for the
            # memory, say) does not throw away what was measured before it.
            failed.append({"mode": spec["mode"], "store": spec["store"], "fraction": spec.get("fraction"),
                           "prefetch": spec.get("prefetch"), "error": error})
            continue
        rows.append(row)
    if not rows:  # nothing measured: one line, as before
        f = failed[0]
        raise ExpertCacheError(f"configuration {failed_label(f)} failed: {f['error']}")
    print(table(rows))
    for f in failed:
        print(f"failed: {failed_label(f)}: {f['error']}")
    bounds = overlap_bounds(rows)
    if bounds:
        print(bounds_text(bounds))
    if args.plot:
        save_png(figure(rows, args.model, args.threads), args.plot)
        print(f"wrote {args.plot}")
    from ..flags import json_line
    print(json_line({"bench": "cache", "model": str(args.model), "device": args.device, "threads": args.threads,
                     "kernels": args.kernels,
                     "prefill_tokens": args.prefill, "decode_tokens": args.decode, "results": rows,
                     "failed": failed, "prefetch_bounds": bounds}))
    return 1 if failed else 0


def _child_result(p: subprocess.CompletedProcess) -> tuple[dict | None, str | None]:
    """(the configuration's figures, None), or (None, why it failed in one line)."""
    if p.returncode < 0:
        # Killed (the OOM killer's SIGKILL, a Ctrl-C): whatever it printed last, a warning or a
        # notice, is not the reason.
        try:
            name = signal.Signals(-p.returncode).name
        except ValueError:
            name = f"signal {-p.returncode}"
        return None, f"killed by {name}"
    if p.returncode != 0:
        return None, p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit code {p.returncode}"
    try:
        return json.loads(p.stdout.strip().splitlines()[-1]), None
    except (IndexError, ValueError):
        return None, "no result: its last line of output is not the figures' JSON"


def failed_label(f: dict) -> str:
    """A failed configuration as the table names it: mode, store, and in cache mode capacity and prefetch."""
    if f["mode"] != "cache":
        return f"{f['mode']} {f['store']}"
    return f"cache {f['store']} {f['fraction']:.0%} prefetch {f['prefetch']}"


def _fractions(text: str) -> list[float]:
    import argparse

    try:
        out = [float(x.strip().rstrip("%")) / (100 if x.strip().endswith("%") else 1) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid fractions {text!r}: expected e.g. 0.25,0.5 or 25%,50%") from None
    if not all(0 < f <= 1 for f in out):
        raise argparse.ArgumentTypeError(f"fractions {text!r} must be in (0, 1]")
    return out


def add_parser(suites) -> None:
    from ..config import POLICY_NAMES
    from ..flags import add_kernels_flag, add_prefetch_width_flag, add_prefill_flags, dtype_name, positive_int, threads

    p = suites.add_parser("cache", help="resident vs staging vs cache at several capacities and slow tiers")
    p.add_argument("-m", "--model", required=True, help="checkpoint (use `expertcache synth` for real sizes)")
    p.add_argument("--fractions", type=_fractions, default=list(DEFAULT_FRACTIONS),
                   help="cache capacities as fractions of all experts (default: 0.25,0.5,0.75)")
    p.add_argument("--stores", default="ram,mmap,disk", help="slow tiers to measure (default: ram,mmap,disk)")
    p.add_argument("--prefill", type=positive_int, default=256, help="prompt tokens (default: 256)")
    p.add_argument("--decode", type=positive_int, default=32, help="decoded tokens (default: 32)")
    p.add_argument("--ubatch", type=positive_int, default=512, help="prefill micro-batch size (default: 512)")
    add_prefill_flags(p)
    # Checked here, not when the first configuration's process starts (and then in 3 lines).
    p.add_argument("-t", "--threads", type=threads, default=torch.get_num_threads(),
                   help="CPU threads for torch (default: %(default)s, this machine's)")
    p.add_argument("--dtype", type=dtype_name, help="compute dtype: float32, bfloat16 or float16 "
                                                     "(default: the checkpoint's)")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda or cuda:N (default: cpu)")
    add_kernels_flag(p)
    p.add_argument("--cache-policy", choices=POLICY_NAMES, default=None, metavar="POLICY",
                   help=f"eviction policy: {', '.join(POLICY_NAMES)} (default: the runtime's)")
    p.add_argument("--route-trace", help="force routing to follow a recorded trace (expertcache trace record); "
                                         "prefetch then plans the trace's recorded predictions")
    p.add_argument("--prefetch", choices=("auto", "on", "off", "both"), default="auto",
                   help="prefetch in cache mode: auto (default), on, off, or both (each capacity off, then on)")
    add_prefetch_width_flag(p)
    p.add_argument("--plot", metavar="FILE.png", help="also draw decode and prefill tok/s and the hit rate "
                                                      "against capacity, per store (needs matplotlib)")
    p.set_defaults(func=cmd_bench_cache)


if __name__ == "__main__":
    print(json.dumps(run_one(json.loads(sys.argv[1]))))
