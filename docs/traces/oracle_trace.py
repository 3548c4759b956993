"""What would point 7 give with a perfect predictor? Writes a copy of a recorded trace whose
predictions are each op's own experts (probability 1), followed by the recorded guesses
(probability 0), for an experiment, not a feature (docs/benchmarks.md, "A perfect predictor").
Replayed with `--prefetch-width 1 --prefetch-min-prob 0.5`, every op's experts, and nothing
else, are prefetched one op ahead, as the runtime plans them: what is left between the time per
token and the bound is the planning's, not the predictor's. Run from the repository root, e.g.:

    python docs/traces/oracle_trace.py docs/traces/used/chat.npz /tmp/oracle.npz
    expertcache bench cache -m /tmp/q30a --stores disk --fractions 0.25 --prefill 64 --decode 128 \\
        --kernels native -t 1 --route-trace /tmp/oracle.npz --prefetch-width 1 --prefetch-min-prob 0.5 \\
        --prefetch both
"""

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

from expertcache.bench.trace import load_trace, save_trace
from expertcache.checkpoint.writer import atomic_file, check_output_file
from expertcache.commands.trace import _is_trace
from expertcache.errors import ExpertCacheError


def oracle(trace):
    """`trace` with each op's experts as its predictions, best first, then the recorded guesses."""
    k = trace.ids.shape[1]
    width = max(k, trace.header.pred_width)
    pred = np.zeros((len(trace.ids), width), dtype=trace.ids.dtype)
    prob = np.zeros((len(trace.ids), width), dtype=np.float16)
    for row, used in enumerate(trace.ids):
        guesses = [] if trace.pred is None else [e for e in trace.pred[row] if e not in used]
        pred[row] = list(used) + guesses[: width - k] + [0] * max(0, width - k - len(guesses))
        prob[row, :k] = 1
    header = dataclasses.replace(trace.header, pred_width=width,
                                 predictor=f"oracle (each op's own experts; then {trace.header.predictor or 'none'})")
    return dataclasses.replace(trace, header=header, pred=pred, predicted=np.ones(trace.num_ops, np.uint8),
                               pred_prob=prob)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("out")
    args = ap.parse_args(argv)
    try:
        # As `trace record` writes one: an earlier trace is replaced, never another file, and
        # never the recording this copy is made from; a failed write leaves what was there.
        if Path(args.out).resolve() == Path(args.trace).resolve():
            raise ExpertCacheError(f"output {args.out!r} is the trace read: expected another path")
        out = check_output_file(args.out, True, "a trace", _is_trace)
        trace = oracle(load_trace(args.trace))
        with atomic_file(out) as tmp:
            save_trace(trace, tmp, name=args.out)
    except ExpertCacheError as e:
        print(f"oracle_trace: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
