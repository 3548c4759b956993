"""The prefetch issue's goals on both trained models' decode traces, as one JSON object and three
markdown tables (docs/benchmarks.md, "Prefetch: prediction quality and simulated misses").

For each trace: every demand-only policy's misses over Belady's MIN at 10/25/50/75% of the
experts (which default policy), and `lrfu` with prefetch from the router predictor's and the
fitted predictor's recorded predictions (the same routing, recorded twice) at widths 0.75 and 1.0:
demand misses over MIN, and bytes moved over `lrfu`'s without prefetch. Then the bundled model's
traces recorded with its maps of use (`docs/traces/used/`) against its linear maps on the same
routing (`docs/traces/used/linear/`): the linear maps at width 1.0, the maps of use at width 2.0
with `--prefetch-min-prob` 0.5, 0.55 and 0.6. Run from the repository root:
`python docs/traces/prefetch_goals.py`.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from expertcache.bench.simulate import parse_capacities, simulate, simulate_belady
from expertcache.bench.trace import load_trace
from expertcache.config import POLICY_NAMES

TRACES = {  # name -> (router predictor's trace, fitted predictor's trace: the same routing)
    "bundled chat": ("docs/traces/chat.npz", "docs/traces/fitted/chat.npz"),
    "bundled long-prefill": ("docs/traces/long-prefill.npz", "docs/traces/fitted/long-prefill.npz"),
    "bundled multiturn": ("docs/traces/multiturn.npz", "docs/traces/fitted/multiturn.npz"),
    "moe64 code": ("docs/traces/moe64/code.npz", "docs/traces/moe64/fitted/code.npz"),
    "moe64 long-prefill": ("docs/traces/moe64/long-prefill.npz", "docs/traces/moe64/fitted/long-prefill.npz"),
}
CAPACITIES = "10%,25%,50%,75%"
WIDTHS = (0.75, 1.0)
USED = {  # name -> (linear maps' trace, maps of use's trace: the same routing)
    f"bundled {t}": (f"docs/traces/used/linear/{t}.npz", f"docs/traces/used/{t}.npz")
    for t in ("chat", "long-prefill", "multiturn")}
USED_SETTINGS = (("linear", 1.0, 0.0), ("used", 2.0, 0.5), ("used", 2.0, 0.55), ("used", 2.0, 0.6))


def used_rows() -> dict:
    """Demand misses over MIN and bytes over lrfu's without prefetch, per setting of USED_SETTINGS."""
    out = {}
    for name, (linear_path, used_path) in USED.items():
        traces = {"linear": load_trace(linear_path), "used": load_trace(used_path)}
        if not np.array_equal(traces["linear"].ids, traces["used"].ids):
            sys.exit(f"{linear_path} and {used_path} do not hold the same routing")
        h = traces["used"].header
        ops = traces["used"].ops()
        rows = []
        for label, capacity in parse_capacities(CAPACITIES, h.total_experts):
            best = simulate_belady(ops, capacity, h.expert_bytes).misses
            base = simulate(ops, capacity, "lrfu", h.expert_bytes)
            row = {"capacity": label, "min": best, "lrfu": round(base.misses / best, 3)}
            for kind, width, min_prob in USED_SETTINGS:
                r = simulate(ops, capacity, "lrfu", h.expert_bytes, traces[kind].predictions(width, min_prob))
                row[f"{kind}@{width:g}" + (f",p>={min_prob:g}" if min_prob else "")] = {
                    "misses": round(r.misses / best, 3), "bytes": round(r.bytes_moved / base.bytes_moved, 3),
                    "issued": r.prefetch_issued, "wasted": r.prefetch_wasted}
            rows.append(row)
            print(name, json.dumps(row), file=sys.stderr)
        out[name] = {"trace": used_path, "decode_tokens": traces["used"].decode_tokens(), "rows": rows}
    return out


def main() -> None:
    out = {}
    for name, (router_path, fitted_path) in TRACES.items():
        router, fitted = load_trace(router_path), load_trace(fitted_path)
        if not np.array_equal(router.ids, fitted.ids):
            sys.exit(f"{router_path} and {fitted_path} do not hold the same routing")
        h = router.header
        ops = router.ops()
        rows = []
        for label, capacity in parse_capacities(CAPACITIES, h.total_experts):
            best = simulate_belady(ops, capacity, h.expert_bytes).misses
            row = {"capacity": label, "min": best,
                   "policies": {p: round(simulate(ops, capacity, p, h.expert_bytes).misses / best, 3)
                                for p in POLICY_NAMES}}
            base = simulate(ops, capacity, "lrfu", h.expert_bytes).bytes_moved
            for pred_name, trace in (("router", router), ("fitted", fitted)):
                for w in WIDTHS:
                    r = simulate(ops, capacity, "lrfu", h.expert_bytes, trace.predictions(w))
                    row[f"{pred_name}@{w:g}"] = {"misses": round(r.misses / best, 3),
                                                 "bytes": round(r.bytes_moved / base, 3),
                                                 "issued": r.prefetch_issued, "wasted": r.prefetch_wasted}
            rows.append(row)
            print(name, json.dumps(row), file=sys.stderr)
        out[name] = {"trace": router_path, "experts": h.num_experts, "top_k": h.top_k,
                     "moe_layers": len(h.moe_layers), "decode_tokens": router.decode_tokens(), "rows": rows}
    print("| trace | capacity | " + " | ".join(POLICY_NAMES) + " |")
    print("|---|---:|" + "---:|" * len(POLICY_NAMES))
    for name, t in out.items():
        for row in t["rows"]:
            print(f"| {name} | {row['capacity']} | " + " | ".join(f"{row['policies'][p]:.2f}" for p in POLICY_NAMES) + " |")
    print_prefetch_table(out, [f"{p}@{w:g}" for p in ("router", "fitted") for w in WIDTHS])
    used = used_rows()
    print_prefetch_table(used, [c for c in used[next(iter(used))]["rows"][0] if "@" in c], lrfu=True)
    print(json.dumps(out | {"maps of use": used}))


def print_prefetch_table(traces: dict, cols: list[str], lrfu: bool = False) -> None:
    """One markdown table: per trace and capacity, each column's demand misses over MIN, bytes
    over lrfu's without prefetch (with `lrfu`, first lrfu's own misses over MIN)."""
    print("\n| trace | capacity | " + ("lrfu | " if lrfu else "") + " | ".join(cols) + " |")
    print("|---|---:|" + ("---:|" if lrfu else "") + "---|" * len(cols))
    for name, t in traces.items():
        for row in t["rows"]:
            print(f"| {name} | {row['capacity']} | " + (f"{row['lrfu']:.2f} | " if lrfu else "")
                  + " | ".join(f"{row[c]['misses']:.2f}x, {row[c]['bytes']:.2f}x" for c in cols) + " |")


if __name__ == "__main__":
    main()
