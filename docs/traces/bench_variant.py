"""The harness of the timing experiments beside it (`lookahead_two.py`, `first_layer_early.py`,
`plan_after_op.py`, ...): `expertcache bench cache` with the command line's arguments, each
configuration in its own process as the command runs them; with the experiment's flag given, the
prefetch-on runs first apply its change. Prints the command's table and bounds, then one JSON line."""

import json
import subprocess
import sys
from collections.abc import Callable

from expertcache.bench import cache_bench


def main(flag: str, change: Callable[[], None], name: str) -> None:
    if sys.argv[1:2] == ["--child"]:
        if sys.argv[3] == "changed":
            change()
        print(json.dumps(cache_bench.run_one(json.loads(sys.argv[2]))))
        return
    from expertcache.cli import build_parser

    on = flag in sys.argv
    args = build_parser().parse_args(["bench", "cache"] + [a for a in sys.argv[1:] if a != flag])
    rows = []
    for spec in cache_bench.configurations(args):
        mode = "changed" if on and spec.get("prefetch") == "on" else "plain"
        p = subprocess.run([sys.executable, sys.argv[0], "--child", json.dumps(spec), mode], capture_output=True,
                           text=True, check=True)
        rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
    print(cache_bench.table(rows))
    print(cache_bench.bounds_text(cache_bench.overlap_bounds(rows)))
    print(json.dumps({name: on, "prefetch_bounds": cache_bench.overlap_bounds(rows)}))
