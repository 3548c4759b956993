"""The figures of docs/benchmarks.md on these traces that `expertcache trace simulate` does not print:
the LRFU half-life sweep, the static-popularity oracle, perfect predictions and the three prefetch
variants tried and not adopted, as one JSON object. Run from the repository root:
`python docs/traces/extra_tables.py [FOLDER]` (default docs/traces; the prefetch figures only for
traces with predictions).

Every replay goes through the runtime's own `Residency` (the variants subclass it or the policy);
ratios are misses over Belady's MIN at the same capacity, bytes over `lrfu`'s without prefetch.
"""

from __future__ import annotations

import heapq
import json
import math
import sys
from collections import Counter, OrderedDict
from collections.abc import Set

from expertcache.bench.simulate import simulate, simulate_belady
from expertcache.bench.trace import load_trace
from expertcache.tiers.policy import LRFU, ExpertKey, Policy
from expertcache.tiers.residency import Residency

TRACES = ("chat", "long-prefill", "multiturn")


class StaticPopularity(Policy):
    """Evicts the resident key with the fewest uses (ops) over the whole trace, ties to the least
    recently used: a policy that knows each expert's popularity in advance, and nothing else."""

    name = "static"

    def __init__(self, capacity: int, uses: Counter) -> None:
        self.uses = uses
        super().__init__(capacity)

    def _reset_state(self) -> None:
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()  # least recent first

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def hit(self, key: ExpertKey) -> None:
        self._order.move_to_end(key)

    def insert(self, key: ExpertKey) -> None:
        self._order[key] = None

    def evict(self, pinned: Set[ExpertKey]) -> ExpertKey:
        self._check_evictable(pinned)
        # min() keeps the first of equal counts: the least recently used.
        key = min((k for k in self._order if k not in pinned), key=lambda k: self.uses[k])
        del self._order[key]
        return key

    def remove(self, key: ExpertKey) -> None:
        del self._order[key]


class QuietPrefetchLRFU(LRFU):
    """LRFU where a prefetched key enters with its past (decayed) score and no added use; a later
    hit counts as its use. `prefetching` is set by `QuietResidency` around a prefetch."""

    prefetching = False

    def insert(self, key: ExpertKey) -> None:
        if not self.prefetching:
            return super().insert(key)
        score = self.score(key)
        entry = (float("-inf") if score == 0 else math.log2(score) + self._op / self.half_life, self._op)
        self._rank[key] = entry
        heapq.heappush(self._heap, (*entry, key))


class QuietResidency(Residency):
    """Tells a `QuietPrefetchLRFU` when its inserts come from a prefetch."""

    def plan_prefetch(self, layer, experts):
        self.policy.prefetching = True
        try:
            return super().plan_prefetch(layer, experts)
        finally:
            self.policy.prefetching = False


class UnusedFirstResidency(Residency):
    """A prefetch takes the slots of unused prefetched keys (the policy's choice among them) before
    asking the policy for a victim among all unpinned keys. A slot taken so is an invalidation:
    the key's history goes with it (for `LRFU`, its score)."""

    def plan_prefetch(self, layer, experts):
        policy = self.policy
        evict = policy.evict

        def unused_first(pinned):
            others = {k for k in self.resident_keys() if k not in self._prefetched} | set(pinned)
            if len(others) < len(policy):
                key = evict(others)
                policy._history.pop(key, None)
                return key
            return evict(pinned)

        policy.evict = unused_first
        try:
            return super().plan_prefetch(layer, experts)
        finally:
            del policy.evict


def replay(ops, capacity, policy, predictions, residency=Residency) -> tuple[int, int]:
    """(demand misses, prefetches issued): `simulate`'s loop with a chosen `Residency` class."""
    res = residency(capacity, policy)
    misses = issued = 0
    for i, (layer, experts) in enumerate(ops):
        misses += len(res.plan(layer, experts).misses)
        if i + 1 < len(ops) and predictions[i + 1]:
            issued += len(res.plan_prefetch(ops[i + 1][0], predictions[i + 1]).experts)
    return misses, issued


def main(folder: str) -> None:
    out = {}
    for name in TRACES:
        trace = load_trace(f"{folder}/{name}.npz")
        ops, b = trace.ops(), trace.header.expert_bytes
        total = trace.header.total_experts
        pred = trace.predictions(1.0)
        uses = Counter(ExpertKey(layer, e) for layer, experts in ops for e in experts)
        t = out[name] = {}
        for pct in (10, 25, 50, 75):
            cap = max(1, int(pct / 100 * total + 1e-9))
            mn = simulate_belady(ops, cap, b).misses
            base = simulate(ops, cap, "lrfu", b).misses
            row = t[f"{pct}%"] = {"min": mn, "lrfu": base}
            if pct in (25, 50):
                for h in (1, 2, 4, 8):
                    row[f"half_life {h}x"] = simulate(ops, cap, LRFU(cap, half_life=h * cap), b).misses / mn
                row["static oracle"] = simulate(ops, cap, StaticPopularity(cap, uses), b).misses / mn
            if not trace.has_predictions:
                continue
            # Sanity: this loop is simulate()'s.
            r = simulate(ops, cap, "lrfu", b, pred)
            assert replay(ops, cap, LRFU(cap), pred) == (r.misses, r.prefetch_issued)
            variants = {
                "perfect": (LRFU(cap), [list(e) for _, e in ops], Residency),
                "layers 2-3 only": (LRFU(cap), [p if ops[i][0] >= 2 else None for i, p in enumerate(pred)], Residency),
                "prefetch without a use": (QuietPrefetchLRFU(cap), pred, QuietResidency),
                "unused prefetches first": (LRFU(cap), pred, UnusedFirstResidency),
            }
            for label, (policy, p, residency) in variants.items():
                m, issued = replay(ops, cap, policy, p, residency)
                row[label] = {"x MIN": m / mn, "x bytes": (m + issued) / base}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/traces")
