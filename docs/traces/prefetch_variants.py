"""Two prefetch variants tried on the fitted predictor's traces and not adopted (docs/benchmarks.md,
"A fitted predictor"): prefetched keys entering LRFU with their past score and no added use
(`QuietResidency`, from extra_tables.py), and an admission rule: a predicted key is prefetched
into an occupied slot only if the lowest LRFU score among the unpinned resident keys is below the
predicted key's score plus `alpha`; a recency guard (`GuardResidency`): a prefetch never evicts a
key used by the last `window` ops (one decode step: as many ops as MoE layers), not only the op in
flight; and, as a bound rather than a variant, each prediction without the experts its op does not
use (`right only`: the predictor's recall, no wrong guesses), and a better predictor simulated by
replacing a share q of each decode prediction's wrong guesses with experts its op uses that it
missed (`better q`, printed with the resulting precision P at width 1.0). Each cell: demand misses over MIN's / bytes over lrfu's
without prefetch, width 1.0. Run from the repository root:
`python docs/traces/prefetch_variants.py docs/traces/fitted/chat.npz docs/traces/moe64/fitted/long-prefill.npz`.
"""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from extra_tables import QuietPrefetchLRFU, QuietResidency
from expertcache.bench.trace import load_trace
from expertcache.bench.simulate import simulate, simulate_belady, parse_capacities
from expertcache.tiers.residency import Residency
from expertcache.tiers.policy import LRFU, ExpertKey


class AdmitResidency(Residency):
    """Drops predicted keys whose admission would evict a key scored above theirs + alpha."""

    alpha = 1.0
    def plan_prefetch(self, layer, experts):
        pol = self.policy
        pinned = {k for k in self._last_op if k in self._slot_of}
        unpinned = [k for k in self._slot_of if k not in pinned]
        mask = self._masks.get(layer, 0)
        keep = []
        free = len(self._free)
        scores = sorted(pol.score(k) for k in unpinned)
        j = 0
        for e in experts:
            if mask >> e & 1:
                keep.append(e); continue
            if free > 0:
                free -= 1; keep.append(e); continue
            if j >= len(scores): break
            if scores[j] < pol.score(ExpertKey(layer, e)) + self.alpha:
                keep.append(e); j += 1
        return super().plan_prefetch(layer, keep)

class GuardResidency(Residency):
    """Pins, for a prefetch, the keys of the last `window` ops instead of the last op's alone."""

    window = 4
    def plan(self, layer, experts):
        p = super().plan(layer, experts)
        self._recent = (getattr(self, "_recent", []) + [[ExpertKey(layer, e) for e in experts]])[-self.window:]
        return p

    def plan_prefetch(self, layer, experts):
        last, self._last_op = self._last_op, [k for op in self._recent for k in op]
        try:
            return super().plan_prefetch(layer, experts)
        finally:
            self._last_op = last

def better_guesses(ops, preds, q, seed=0):
    """Each decode op's prediction with a share `q` of its wrong guesses (drawn with a fixed seed)
    replaced by used experts it missed; returns them and their precision."""
    rng = random.Random(seed)
    out, right, total = [], 0, 0
    for (_, used), pred in zip(ops, preds):
        if pred is None or len(used) > len(pred):  # not predicted, or a prefill op: as recorded
            out.append(pred)
            continue
        missed = [e for e in used if e not in pred]
        new = [missed.pop() if e not in used and missed and rng.random() < q else e for e in pred]
        right += len(set(new).intersection(used))
        total += len(new)
        out.append(new)
    return out, right / total


def run(ops, cap, preds, res_cls, pol_cls, b, alpha=None, window=None):
    pol = pol_cls(cap)
    res = res_cls(cap, pol)
    if alpha is not None: res.alpha = alpha
    if window is not None: res.window = window
    misses = issued = 0
    for i, (layer, ex) in enumerate(ops):
        misses += len(res.plan(layer, ex).misses)
        if i + 1 < len(ops) and preds[i + 1]:
            issued += len(res.plan_prefetch(ops[i + 1][0], preds[i + 1]).experts)
    return misses, (misses + issued)

for path in sys.argv[1:]:
    t = load_trace(path); h = t.header; ops = t.ops(); b = h.expert_bytes
    preds = t.predictions(1.0)
    for label, cap in parse_capacities("25%,50%", h.total_experts):
        mn = simulate_belady(ops, cap, b).misses
        base = simulate(ops, cap, "lrfu", b).misses
        out = [f"{path.removeprefix('docs/traces/')} {label}"]
        m, c = run(ops, cap, preds, Residency, LRFU, b); out.append(f"plain {m/mn:.2f}/{c/base:.2f}")
        m, c = run(ops, cap, preds, QuietResidency, QuietPrefetchLRFU, b); out.append(f"quiet {m/mn:.2f}/{c/base:.2f}")
        for a in (0.25, 0.5, 1.0):
            m, c = run(ops, cap, preds, AdmitResidency, LRFU, b, a); out.append(f"admit{a} {m/mn:.2f}/{c/base:.2f}")
        layers = len({layer for layer, _ in ops})
        m, c = run(ops, cap, preds, GuardResidency, LRFU, b, window=layers); out.append(f"guard{layers} {m/mn:.2f}/{c/base:.2f}")
        right = [p if p is None else [e for e in p if e in set(ops[i][1])] for i, p in enumerate(preds)]
        m, c = run(ops, cap, right, Residency, LRFU, b); out.append(f"right-only {m/mn:.2f}/{c/base:.2f}")
        for q in (0.25, 0.5, 0.75):
            better, p = better_guesses(ops, preds, q)
            m, c = run(ops, cap, better, Residency, LRFU, b); out.append(f"better{q} P={p:.2f} {m/mn:.2f}/{c/base:.2f}")
        print("  ".join(out), flush=True)
