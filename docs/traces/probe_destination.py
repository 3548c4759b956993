"""Does the disk's rate depend on where its reads land? Loads a model with the disk store at 25% of
the experts and reads the same 64 experts (as `bench cache`'s probe picks them) through the
store, in rounds: into one slot-sized buffer again and again (the probe before this script's
section), into the cache's own slots in turn (the probe since), and into a fresh huge-page pool of
2, 4 and 32 slots in turn, every buffer written once before it is timed. An experiment, not a
feature (docs/benchmarks.md, "The probe's destination"). From the repository root, after
`expertcache synth --like qwen3-30b-a3b --experts 32 --top-k 4 --layers 4 -o /tmp/q30a`:

    python docs/traces/probe_destination.py /tmp/q30a --rounds 4
"""

import argparse
import json
import time

import torch

import expertcache
from expertcache import CacheConfig
from expertcache.bench.cache_bench import READ_PROBE_EXPERTS, read_rate
from expertcache.memory import host_zeros


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = expertcache.load(args.model, cache=CacheConfig(mode="cache", fraction=0.25, store="disk", prefetch="off"))
    cache = model.experts
    layers = cache.moe_layers
    keys = [(layers[i % len(layers)], (i * 7) % cache.num_experts) for i in range(READ_PROBE_EXPERTS)]
    nbytes = sum(cache.expert_bytes[layer] for layer, _ in keys)

    def into(pool: torch.Tensor) -> float:
        pool.fill_(1)  # written once, as a pool in use is: no first-touch faults in the timing
        t = time.perf_counter()
        for i, (layer, expert) in enumerate(keys):
            slot = i % pool.shape[0]
            cache.store.copy_run(layer, expert, pool[slot: slot + 1])
        return nbytes / (time.perf_counter() - t) / 1e9

    cols = ["one buffer", "the cache's slots", "2 slots", "4 slots", "32 slots"]
    print(f"{READ_PROBE_EXPERTS} experts of {cache.slot_bytes / 2**20:.1f} MiB through the disk store, GB/s")
    print("round  " + "  ".join(f"{c:>17}" for c in cols))
    rows = []
    for rnd in range(args.rounds):
        got = [into(host_zeros((1, cache.slot_bytes), torch.uint8)), read_rate(cache) / 1e9]
        got += [into(host_zeros((n, cache.slot_bytes), torch.uint8)) for n in (2, 4, 32)]
        rows.append(dict(zip(cols, (round(g, 3) for g in got))))
        print(f"{rnd:<7}" + "  ".join(f"{g:>17.2f}" for g in got), flush=True)
    print(json.dumps({"experiment": "probe_destination", "model": args.model, "rows": rows}))


if __name__ == "__main__":
    main()
