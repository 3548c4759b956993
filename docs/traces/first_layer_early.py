"""Would planning the next token's first MoE layer earlier help point 7? A timing experiment, not
a feature (docs/benchmarks.md, "Idle disk time, gap by gap"). The runtime plans the first layer's
prediction at the start of the next forward, once the token is sampled; the trace simulator
plans it right after the last layer's op, with nothing in between that touches the cache, so the
counters are the same either way. With `--early` the prefetch-on runs plan the trace's recorded
guesses for the next token's first layer there, at the last layer's op, so that the disk reads them
during the last layer's expert compute, the LM head and sampling. Those guesses were made from the
sampled token's embedding, which is not known yet at that point: the experiment is an upper bound
on what an earlier prediction of the first layer could give. Run from the repository root, e.g.:

    python docs/traces/first_layer_early.py [--early] -m /tmp/q30a --stores disk --fractions 0.25 \\
        --prefill 64 --decode 128 --kernels native -t 1 --route-trace docs/traces/used/chat.npz \\
        --prefetch-width 2 --prefetch-min-prob 0.55 --prefetch both
"""

import bench_variant
from expertcache.bench import cache_bench


def plan_first_layer_early() -> None:
    replay = cache_bench.PredictionReplay
    begin, predict = replay.begin, replay.__call__

    def early_begin(self, tokens):
        if getattr(self, "planned_first", False) and int(tokens.shape[0]) == 1:
            self.planned_first, self.T = False, 1  # a decode step: planned at the last layer's op
            return
        self.planned_first = False
        begin(self, tokens)

    def early_predict(self, layer):
        if layer != max(self.pred):
            return predict(self, layer)
        T, self.T = self.T, 1  # the next forward is one sampled token: its rows start at pos[first]
        experts = self._experts(self.first)
        self.T, self.planned_first = T, True
        return (self.first, experts) if experts else None

    replay.begin, replay.__call__ = early_begin, early_predict


if __name__ == "__main__":
    bench_variant.main("--early", plan_first_layer_early, "first_layer_early")
