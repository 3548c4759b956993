"""A/B speed of two versions of expertcache in one process: prefill and decode alternated,
old and new in turn, and the median of the paired ratios (new speed / old speed).

One process and alternation make host noise weigh on both sides alike. The old version is a
source tree (for example a `git worktree add /tmp/old COMMIT`), copied here under the package
name `expertcache_old` so that both import side by side.

    git worktree add /tmp/old 77dd92f
    python tools/ab_speed.py --old /tmp/old/src --model bundled --rounds 9
    python tools/ab_speed.py --old /tmp/old/src --model /tmp/q30 --threads 2 --prompt 64
    python tools/ab_speed.py --old /tmp/old/src --model /tmp/g4 --threads 2 --store disk --cache-fraction 0.5

Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import atexit
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from expertcache.flags import positive_int  # noqa: E402


def import_old(src: Path):
    work = Path(tempfile.mkdtemp(prefix="ab_speed_"))
    # The copy holds the whole package with its bundled model (tens of MB): each run left one behind.
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    shutil.copytree(src / "expertcache", work / "expertcache_old")
    for py in (work / "expertcache_old").rglob("*.py"):
        text = py.read_text()
        py.write_text(re.sub(r"\b(from|import) expertcache\.", r"\1 expertcache_old.", text))
    sys.path.insert(0, str(work))
    import expertcache_old

    return expertcache_old


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, type=Path, help="the old version's src/ directory")
    ap.add_argument("--model", default="bundled", help="a model path, or 'bundled'")
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--kernels", default="torch")
    ap.add_argument("--prompt", type=positive_int, default=128, help="prefill tokens per round")
    ap.add_argument("--steps", type=positive_int, default=8, help="decode steps per round")
    ap.add_argument("--rounds", type=positive_int, default=7)
    ap.add_argument("--store", help="with --cache-fraction: the slow tier (ram, mmap, disk); default all resident")
    ap.add_argument("--cache-fraction", type=float, help="the cache's size as a fraction of all experts")
    args = ap.parse_args()
    if not (args.old / "expertcache" / "__init__.py").is_file():
        ap.error(f"--old {str(args.old)!r} has no expertcache package: expected the src/ directory of a checkout")
    import expertcache

    old = import_old(args.old)
    torch.set_num_threads(args.threads)
    path = None if args.model == "bundled" else args.model

    def cache(pkg):  # each version's own CacheConfig
        if args.cache_fraction is None:
            return None
        return pkg.CacheConfig(store=args.store or "ram", fraction=args.cache_fraction, prefetch="off")

    models = {"old": old.load(path, kernels=args.kernels, cache=cache(old)),
              "new": expertcache.load(path, kernels=args.kernels, cache=cache(expertcache))}
    ids = [(7 * i) % 250 + 3 for i in range(args.prompt)]

    def one(m):
        s = m.new_session()
        t = time.perf_counter()
        tok = int(m.prefill(s, ids).argmax())
        p = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(args.steps):
            tok = int(m.prefill(s, [tok]).argmax())
        return p, (time.perf_counter() - t) / args.steps

    for m in models.values():
        one(m)  # warm-up
    rows = []
    for r in range(args.rounds):
        got = {}
        for k in (("old", "new") if r % 2 == 0 else ("new", "old")):
            got[k] = one(models[k])
        rows.append((got["old"][0] / got["new"][0], got["old"][1] / got["new"][1]))
    print(f"{'round':>5} {'prefill new/old':>16} {'decode new/old':>15}")
    for i, (p, d) in enumerate(rows):
        print(f"{i:>5} {p:>16.3f} {d:>15.3f}")
    out = {"model": args.model, "threads": args.threads, "kernels": args.kernels, "rounds": args.rounds,
           "store": args.store, "cache_fraction": args.cache_fraction,
           "prefill_ratio_median": statistics.median(p for p, _ in rows),
           "decode_ratio_median": statistics.median(d for _, d in rows)}
    print(f"median {out['prefill_ratio_median']:>16.3f} {out['decode_ratio_median']:>15.3f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
