"""Would the disk's idle time pay for the guesses `--prefetch-min-prob` drops? A timing
experiment, not a feature (docs/benchmarks.md, "A perfect predictor"). When the next op's guesses
at the command's probability floor are all resident already (or there are none), the one-op
look-ahead has nothing to read until that op runs; with `--fill` the prefetch-on runs then plan
the next op's guesses above a lower floor instead (`LOW`, 0.2), so that the disk reads the less
likely ones rather than idle. The rule depends on the plan only, not on timing, so the trace
simulator could replay it. Run from the repository root, e.g.:

    python docs/traces/fill_idle.py [--fill] -m /tmp/q30a --stores disk --fractions 0.25 --prefill 64 \\
        --decode 128 --kernels native -t 2 --route-trace docs/traces/used/chat.npz \\
        --prefetch-width 2 --prefetch-min-prob 0.55 --prefetch both
"""

import bench_variant
from expertcache.bench import cache_bench
from expertcache.tiers.policy import ExpertKey

LOW = 0.2


def fill_when_nothing_to_read() -> None:
    def predict(self, layer):
        nxt = self.next.get(layer)
        if nxt is None:
            return None
        experts = self._experts(nxt)
        residency = self.plan.__self__.residency  # `plan` is the cache's `prefetch`
        if not experts or all(residency.is_resident(ExpertKey(nxt, e)) for e in experts):
            floor, self.min_prob = self.min_prob, LOW
            try:
                experts = self._experts(nxt) or experts
            finally:
                self.min_prob = floor
        return (nxt, experts) if experts else None

    cache_bench.PredictionReplay.__call__ = predict


if __name__ == "__main__":
    bench_variant.main("--fill", fill_when_nothing_to_read, "fill")
