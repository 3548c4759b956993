"""The prefetch rule before and after a prefetch kept its own guesses (docs/benchmarks.md, "A
prefetch keeps its own guesses"). Before, a prefetch pinned only the op in flight, so it could
evict one of its own guesses already resident to make room for another; now `Residency` also pins
the predicted keys already resident. Each cell: demand misses over MIN's / bytes moved over
`lrfu`'s without prefetch, earlier rule -> committed rule, on the maps of use's traces at width 2.0
and two probability floors. Run from the repository root: `python docs/traces/pin_predicted.py`.
"""

from expertcache.bench.simulate import parse_capacities, simulate, simulate_belady
from expertcache.bench.trace import load_trace
from expertcache.tiers.policy import LRFU
from expertcache.tiers.residency import Residency


class InFlightOnly(Residency):
    """`plan_prefetch` as it was: only the op in flight pinned, not the resident guesses."""

    def plan_prefetch(self, layer, experts):
        mask = self._masks.get(layer, 0)
        resident = [e for e in experts if mask >> e & 1]
        if not resident:
            return super().plan_prefetch(layer, experts)
        # Asking for the guesses not yet resident leaves them unpinned: what the earlier rule did.
        return super().plan_prefetch(layer, [e for e in experts if not mask >> e & 1])


def replay(ops, capacity, predictions):
    res = InFlightOnly(capacity, LRFU(capacity))
    misses = issued = 0
    for i, (layer, experts) in enumerate(ops):
        misses += len(res.plan(layer, experts).misses)
        if i + 1 < len(ops) and predictions[i + 1]:
            issued += len(res.plan_prefetch(ops[i + 1][0], predictions[i + 1]).experts)
    return misses, misses + issued


for name in ("chat", "long-prefill", "multiturn"):
    trace = load_trace(f"docs/traces/used/{name}.npz")
    ops, b = trace.ops(), trace.header.expert_bytes
    for min_prob in (0.5, 0.55):
        predictions = trace.predictions(2.0, min_prob)
        cells = []
        for label, capacity in parse_capacities("10%,25%,50%", trace.header.total_experts):
            best = simulate_belady(ops, capacity, b).misses
            base = simulate(ops, capacity, "lrfu", b)
            now = simulate(ops, capacity, "lrfu", b, predictions)
            misses, copies = replay(ops, capacity, predictions)
            cells.append(f"{label}: {misses / best:.3f}/{copies / base.misses:.3f} -> "
                         f"{now.misses / best:.3f}/{now.bytes_moved / base.bytes_moved:.3f}")
        print(f"{name} p>={min_prob}: " + "  ".join(cells), flush=True)
