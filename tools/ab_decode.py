"""Decode speed of two source trees of this project, A/B in alternating processes, as pair ratios.

    git worktree add /tmp/a HEAD~1 && git worktree add /tmp/b HEAD
    python tools/ab_decode.py /tmp/a /tmp/b -m FILE.gguf [--rounds 6] [--tokens 24] [--threads 2] [--prompt 64]

Each round runs one process per tree (the order alternates between rounds, so that neither side
always runs first), each loading the model from its own `src/` and timing `--tokens` decode steps
three times after a prompt of `--prompt` tokens (64 by default; a longer one times decode
against a longer context), the best of the three. A host whose load changes from minute
to minute moves both runs of a round alike, so the round's ratio B/A (time) is what to read; the
median of the rounds is reported. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# What each process runs: the decode timing of `bench speed` on the tree it is given.
CHILD = """
import json, sys, torch, expertcache
from expertcache.bench.speed import _decode
path, tokens, threads, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
m = expertcache.load(path, threads=threads, ctx_size=n + 4 * tokens + 8)
prompt = torch.randint(0, m.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
_decode(m, prompt, 4)
print(json.dumps({"ms_per_token": min(_decode(m, prompt, tokens)["ms_per_token"] for _ in range(3))}))
"""


def run_tree(tree: Path, model: str, tokens: int, threads: int, prompt: int) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    out = subprocess.run([sys.executable, "-c", CHILD, model, str(tokens), str(threads), str(prompt)], env=env,
                         capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"ab_decode: the run of {tree} failed: {last}")
    return json.loads(lines[-1])["ms_per_token"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", type=Path, help="tree A (a checkout of this project)")
    p.add_argument("b", type=Path, help="tree B")
    p.add_argument("-m", "--model", required=True, help="model path (GGUF file or checkpoint directory)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tokens", type=int, default=24, help="decode steps per timing (default 24)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens before the decode steps (default 64)")
    args = p.parse_args(argv)
    for tree in (args.a, args.b):
        if not (tree / "src" / "expertcache").is_dir():
            p.error(f"{tree}: no src/expertcache in it; expected a checkout of this project")
    if args.rounds < 1 or args.tokens < 1 or args.threads < 1 or args.prompt < 1:
        p.error("--rounds, --tokens, --threads and --prompt must be at least 1")
    a, b = [], []
    print(f"{'round':>5} {'A ms/token':>11} {'B ms/token':>11} {'B/A':>7}")
    for r in range(args.rounds):
        # By side, not by tree: with A and B the same tree (an A/A run, the noise floor) a dict
        # keyed by the path kept one time for both, and every ratio read exactly 1.
        order = ("a", "b") if r % 2 == 0 else ("b", "a")
        times = {side: run_tree(getattr(args, side), args.model, args.tokens, args.threads, args.prompt)
                 for side in order}
        a.append(times["a"])
        b.append(times["b"])
        print(f"{r + 1:>5} {a[-1]:>11.3f} {b[-1]:>11.3f} {b[-1] / a[-1]:>7.3f}", flush=True)
    ratios = [y / x for x, y in zip(a, b)]
    median = statistics.median(ratios)
    print(f"B/A time per token: median {median:.3f} over {args.rounds} rounds (range {min(ratios):.3f}-{max(ratios):.3f})")
    print(json.dumps({"tool": "ab_decode", "model": args.model, "prompt": args.prompt, "a": str(args.a), "b": str(args.b),
                      "a_ms": a, "b_ms": b, "ratios": ratios, "median_ratio": median}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
