"""A prefetch rule tried in the simulator and not adopted (docs/benchmarks.md, "Maps of use and a
probability floor"): a prefetch also pins the predicted experts that are already resident, so that
it never evicts one of its own guesses to make room for another (the committed rule pins the op in
flight only). Each cell: demand misses over MIN's / bytes moved over `lrfu`'s without prefetch, on
the maps of use's traces at width 2.0 and two probability floors. Run from the repository root:
`python docs/traces/pin_predicted.py`.
"""

from expertcache.bench.simulate import parse_capacities, simulate, simulate_belady
from expertcache.bench.trace import load_trace
from expertcache.tiers.policy import LRFU, ExpertKey
from expertcache.tiers.residency import Residency


class PinPredicted(Residency):
    """`plan_prefetch` with the predicted keys already resident pinned beside the op in flight."""

    def plan_prefetch(self, layer, experts):
        resident = [k for k in (ExpertKey(layer, e) for e in experts) if self.is_resident(k)]
        last, self._last_op = self._last_op, self._last_op + resident
        try:
            return super().plan_prefetch(layer, experts)
        finally:
            self._last_op = last


def replay(ops, capacity, predictions):
    res = PinPredicted(capacity, LRFU(capacity))
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
            plain = simulate(ops, capacity, "lrfu", b, predictions)
            misses, copies = replay(ops, capacity, predictions)
            cells.append(f"{label}: {plain.misses / best:.3f}/{plain.bytes_moved / base.bytes_moved:.3f} -> "
                         f"{misses / best:.3f}/{copies / base.misses:.3f}")
        print(f"{name} p>={min_prob}: " + "  ".join(cells), flush=True)
