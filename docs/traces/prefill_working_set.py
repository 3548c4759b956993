"""Does the decode working set survive a prompt's prefill? (docs/benchmarks.md)

A prompt's prefill runs one op per MoE layer over the whole stretch, and that op uses most of the
layer's experts: with the cache smaller than the model it must evict. For each prompt that follows
decoded tokens in a trace (a turn of a multi-turn session), this replays the trace through the
runtime's own `Residency` and reports, per policy and capacity:

- `held`: the share of the experts used by the last D decoded tokens before the prompt (the decode
  working set) that are resident when the prompt's prefill begins;
- `kept`: the share of the working set still resident when the prompt's prefill is done;
- `after`: demand misses over the first D decoded tokens after the prompt;
- `skip`: the same D tokens' misses in a replay where that prompt's prefill ops are left out (as
  if the cache had stayed as decode left it); `after - skip` is what the prefill cost the decode
  that follows it (negative: the prompt loaded experts its reply needed).

Run from the repository root: `python docs/traces/prefill_working_set.py [TRACE.npz ...]` (default
docs/traces/multiturn.npz); one JSON object, the figures of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import sys

from expertcache.bench.simulate import parse_capacities
from expertcache.bench.trace import load_trace
from expertcache.tiers.policy import make_policy
from expertcache.tiers.residency import Residency

D = 32  # decoded tokens on each side of a prompt
POLICIES = ("lru", "lrfu", "s3fifo")


def segments(phase):
    """(start, end) of each run of prefill ops that follows decode ops."""
    out, i, n = [], 0, len(phase)
    while i < n:
        if phase[i] == 0:
            j = i
            while j < n and phase[j] == 0:
                j += 1
            if i > 0:
                out.append((i, j))
            i = j
        else:
            i += 1
    return out


def decode_window(phase, layer, first_layer, start, step, tokens):
    """Op indices of `tokens` decoded tokens from `start` going by `step` (+1 forward, -1 back)."""
    ops, seen, i = [], 0, start
    while 0 <= i < len(phase) and phase[i] == 1:
        ops.append(i)
        if layer[i] == first_layer:
            seen += 1
            if seen == tokens and step < 0:
                break
        if step > 0 and seen > tokens:
            ops.pop()
            break
        i += step
    return sorted(ops)


def replay(ops, keep, capacity, policy, predictions, snapshot_at=()):
    """Per-op demand misses of `ops[i] for i in keep` (in order), and the resident keys right
    before each op of `snapshot_at`, as (layer, expert) pairs."""
    residency = Residency(capacity, make_policy(policy, capacity))
    misses, snap = {}, {}
    keep = list(keep)
    for n, i in enumerate(keep):
        if i in snapshot_at:
            snap[i] = {(k.layer, k.expert) for k in residency.resident_keys()}
        plan = residency.plan(*ops[i])
        misses[i] = len(plan.misses)
        if predictions is not None and n + 1 < len(keep) and predictions[keep[n + 1]]:
            residency.plan_prefetch(ops[keep[n + 1]][0], predictions[keep[n + 1]])
    return misses, snap


def main(paths):
    report = {}
    for path in paths:
        trace = load_trace(path)
        h = trace.header
        first = h.moe_layers[0]
        ops = trace.ops()
        preds = trace.predictions(1.0) if trace.has_predictions else None
        segs = segments(trace.phase)
        rows = []
        for label, capacity in parse_capacities("10%,25%,50%", h.total_experts):
            for policy in POLICIES:
                for prefetch in ((False, True) if preds is not None else (False,)):
                    p = preds if prefetch else None
                    held = kept = after = skip = ws = 0
                    full, snaps = replay(ops, range(len(ops)), capacity, policy, p,
                                         snapshot_at={i for seg in segs for i in seg})
                    for start, end in segs:
                        before = decode_window(trace.phase, trace.layer, first, start - 1, -1, D)
                        nxt = decode_window(trace.phase, trace.layer, first, end, +1, D)
                        working = {(int(trace.layer[i]), e) for i in before for e in ops[i][1]}
                        if end not in snaps:  # the prompt ends the trace
                            continue
                        ws += len(working)
                        held += len(working & snaps[start])
                        kept += len(working & snaps[end])
                        left_out = [i for i in range(len(ops)) if not start <= i < end]
                        without, _ = replay(ops, left_out, capacity, policy, p)
                        after += sum(full[i] for i in nxt)
                        skip += sum(without[i] for i in nxt)
                    rows.append({"capacity": label, "policy": policy, "prefetch": prefetch,
                                 "prompts": len(segs), "held": round(held / ws, 3) if ws else None,
                                 "kept": round(kept / ws, 3) if ws else None,
                                 "after": after, "skip": skip})
                    print(f"{path} {label:>4} {policy:>7} prefetch={prefetch!s:5} "
                          f"held {rows[-1]['held']}  kept {rows[-1]['kept']}  misses after {after}  without the prefill {skip}",
                          file=sys.stderr)
        report[path] = {"decoded_tokens_each_side": D, "rows": rows}
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:] or ["docs/traces/multiturn.npz"])
