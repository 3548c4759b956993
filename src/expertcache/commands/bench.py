"""`expertcache bench SUITE`: benchmark suites, each registered by its own module
`expertcache.bench.SUITE` through `add_parser(bench_subparsers)`."""

from __future__ import annotations

import importlib

from .common import Parser

# Each module `expertcache.bench.NAME` has `add_parser(bench_subparsers)`.
SUITES = ("serve",)


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: serve (an OpenAI-compatible server)")
    suites = p.add_subparsers(dest="suite", required=True, parser_class=Parser)
    for name in SUITES:
        importlib.import_module(f"expertcache.bench.{name}").add_parser(suites)
