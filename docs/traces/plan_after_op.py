"""Would planning op i + 2's guesses once op i's experts have computed help point 7? A timing
experiment, not a feature (docs/benchmarks.md, "A perfect predictor, and the copy worker's wait
for a core", its last part). Upper bound: op i + 2's guesses are the trace's recorded ones (made at
op i + 1). With `--after` the prefetch-on runs plan them right after op i's expert compute, pinning
op i + 1's planned guesses; op i + 1 then plans them again as always (nothing new to read unless
its own plan evicted one). Run from the repository root, e.g.:

    python docs/traces/plan_after_op.py [--after] -m /tmp/q30a --stores disk --fractions 0.25 \\
        --prefill 64 --decode 128 --kernels native -t 1 --route-trace docs/traces/used/chat.npz \\
        --prefetch-width 2 --prefetch-min-prob 0.55 --prefetch both
"""

import bench_variant
from expertcache.models import decoder
from expertcache.tiers.policy import ExpertKey
from expertcache.tiers.residency import Residency


def plan_after_op() -> None:
    moe_experts, plan_prefetch = decoder.moe_experts, Residency.plan_prefetch

    def keep(self, layer, experts):
        pf = plan_prefetch(self, layer, experts)
        self._guessed = [ExpertKey(layer, e) for e in experts]
        return pf

    def after(k, x, routing, provider, layer, *args, **kw):
        y = moe_experts(k, x, routing, provider, layer, *args, **kw)
        p = getattr(provider, "predict", None)
        if p is None or not provider.prefetching:
            return y
        nxt = p.next.get(layer)
        target = p.next.get(nxt) if nxt is not None else None
        experts = p._experts(target) if target is not None else None
        if experts:
            r = provider.residency
            last, r._last_op = r._last_op, [k for k in getattr(r, "_guessed", []) if k.layer == nxt]
            try:
                provider.prefetch(target, experts)
            finally:
                r._last_op = last
        return y

    Residency.plan_prefetch = keep
    decoder.moe_experts = after


if __name__ == "__main__":
    bench_variant.main("--after", plan_after_op, "plan_after_op")
