"""How much of point 7's verdict is the disk's drift? Runs `bench cache`'s resident, prefetch off
and prefetch on configurations of the issue's command in turn in this one process (through
`cache_bench.run_one`, as each child of `bench cache` runs one), for several rounds, and prints
each round's bound two ways: at the rate of prefetch off's demand copies (the bound before
0689f43) and at the disk probed after prefetch on's decode (`read_rate`, the bound since). An
experiment, not a feature (docs/benchmarks.md, "Point 7 again, the next day"). From the
repository root, after `expertcache synth --like qwen3-30b-a3b --experts 32 --top-k 4 --layers 4
-o /tmp/q30a`:

    python docs/traces/bound_drift.py /tmp/q30a --threads 1 --rounds 3
"""

import argparse

from expertcache.bench.cache_bench import overlap_bounds, run_one


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--trace", default="docs/traces/used/chat.npz")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    base = dict(model=args.model, store="disk", prefetch_width=2.0, prefetch_min_prob=0.55, threads=args.threads,
                ubatch=512, prefill=64, decode=128, kernels="native", route_trace=args.trace)
    specs = [dict(base, mode="resident", fraction=None, prefetch="off"),
             dict(base, mode="cache", fraction=0.25, prefetch="off"),
             dict(base, mode="cache", fraction=0.25, prefetch="on")]
    for rnd in range(args.rounds):
        for b in overlap_bounds([run_one(spec) for spec in specs]):
            print(f"round {rnd}: {b['s_per_token'] * 1e3:.1f} ms a token; at prefetch off's copies "
                  f"({b['off_copies_gb_s']:.2f} GB/s) {b['x_bound_off_copies']:.2f}x; at the probe "
                  f"({b['read_gb_s']:.2f} GB/s) {b['x_bound']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
