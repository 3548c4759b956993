"""Would planning two ops ahead help point 7? A timing experiment, not a feature (docs/benchmarks.md,
"A prefetch keeps its own guesses"). It runs `expertcache bench cache` with a route trace, each
configuration in its own process as the command does, and with `--two` the prefetch-on runs plan,
right after op i's plan, op i + 1's prediction (as always) and then op i + 2's. Op i + 2's guesses
are the trace's recorded guesses for that op, which the predictor made one op later than this
plans them: as good as a one-op look-ahead's, better than a predictor two layers back could
make. The experiment is thus an upper bound on what a deeper look-ahead gives. A two-ahead
prefetch pins the op in flight, its own resident guesses and what the one-ahead prefetch just
planned. Only ops within one forward are planned two ahead. Run from the repository root, e.g.:

    python docs/traces/lookahead_two.py [--two] -m /tmp/q30a --stores disk --fractions 0.25 \\
        --prefill 64 --decode 128 --kernels native -t 1 --route-trace docs/traces/used/chat.npz \\
        --prefetch-width 2 --prefetch-min-prob 0.55 --prefetch both
"""

import bench_variant
from expertcache.bench import cache_bench
from expertcache.tiers.policy import ExpertKey
from expertcache.tiers.residency import Residency


def plan_two_ahead() -> None:
    plan, plan_prefetch = Residency.plan, Residency.plan_prefetch

    def plan_op(self, layer, experts):
        self._since_op = []
        return plan(self, layer, experts)

    def plan_ahead(self, layer, experts):
        since = [k for k in getattr(self, "_since_op", []) if self.is_resident(k)]
        last, self._last_op = self._last_op, self._last_op + since
        try:
            pf = plan_prefetch(self, layer, experts)
        finally:
            self._last_op = last
        self._since_op = since + [ExpertKey(layer, e) for e in pf.experts]
        return pf

    def predict(self, layer):
        nxt = self.next.get(layer)
        if nxt is None:
            return None
        for target in (nxt, self.next.get(nxt)):
            experts = self._experts(target) if target is not None else None
            if experts:
                self.plan(target, experts)
        return None  # planned here, in order

    Residency.plan, Residency.plan_prefetch = plan_op, plan_ahead
    cache_bench.PredictionReplay.__call__ = predict


if __name__ == "__main__":
    bench_variant.main("--two", plan_two_ahead, "two_ahead")
