"""`expertcache bench SUITE`: benchmark suites, each registered by its own module
`expertcache.bench.MODULE` through `add_parser(bench_subparsers)`."""

from __future__ import annotations

import importlib

from ..flags import Parser

# Modules under `expertcache.bench` that each have `add_parser(bench_subparsers)`.
SUITES = ("cache_bench", "serve", "speed")


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: cache (cache modes and sizes), serve (an OpenAI-compatible server), speed (decode/prefill vs the machine)")
    suites = p.add_subparsers(dest="suite", required=True, parser_class=Parser)
    for name in SUITES:
        importlib.import_module(f"expertcache.bench.{name}").add_parser(suites)
