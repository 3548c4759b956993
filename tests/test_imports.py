"""The package's imports flow one way (shared/DESIGN.md): formats know nothing of architectures
or caching, the tiers know nothing of models, the library never imports the CLI, the server or
the benchmarks. Read from the source with `ast`, so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import expertcache

ROOT = Path(expertcache.__file__).parent

# Each module's level; a module may import its own level and lower ones only.
LEVELS = [
    ("errors", "config", "memory", "telemetry"),
    ("checkpoint",),
    ("tiers",),
    ("kernels",),
    ("models",),
    ("tokenizer", "gguf_tokenizer", "sampling"),
    ("engine",),
    ("perplexity", "flags", "plots"),
    ("bench", "server", "commands"),
    ("cli", "__init__", "__main__"),
]
# Within a level, these arrows must not exist.
FORBIDDEN = {("bench", "commands"), ("server", "commands"), ("bench", "server"), ("server", "bench")}


def _top(module: str) -> str:
    return module.split(".")[0]


def _level(top: str) -> int:
    for i, names in enumerate(LEVELS):
        if top in names:
            return i
    raise AssertionError(f"module {top!r} has no declared level in tests/test_imports.py")


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        yield ".".join(rel.parts), path


def _imports(name: str, path: Path) -> set[str]:
    """Modules of this package that `name` imports, as dotted names relative to the package."""
    pkg = name.split(".")
    if path.name != "__init__.py":
        pkg = pkg[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("expertcache"):
                mod = node.module.removeprefix("expertcache").lstrip(".")
            else:
                continue
            targets = [mod] if node.module else [f"{mod}.{a.name}".lstrip(".") for a in node.names]
            out.update(t for t in targets if t)
        elif isinstance(node, ast.Import):
            out.update(a.name.removeprefix("expertcache.") for a in node.names if a.name.startswith("expertcache."))
    return out


GRAPH = {name: _imports(name, path) for name, path in _modules()}


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_imports_follow_the_declared_order(name):
    mine = _top(name)
    for target in GRAPH[name]:
        theirs = _top(target)
        if theirs == mine:
            continue
        assert _level(theirs) <= _level(mine), f"{name} imports {target}: {theirs} comes after {mine}"
        assert (mine, theirs) not in FORBIDDEN, f"{name} imports {target}: {mine} must not import {theirs}"


def test_no_import_cycle_between_top_level_modules():
    edges = {}
    for name, targets in GRAPH.items():
        edges.setdefault(_top(name), set()).update(_top(t) for t in targets if _top(t) != _top(name))
    seen, stack = set(), []

    def visit(node):
        if node in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(node):] + [node]))
        if node in seen:
            return
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            visit(nxt)
        stack.pop()
        seen.add(node)

    for node in sorted(edges):
        visit(node)


def test_the_check_sees_an_upward_import(tmp_path):
    # The walker must report a lazy import inside a function: the kind the old layout hid.
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    from ..commands.common import x\n    from .. import flags\n")
    assert _imports("bench.probe", path) == {"commands.common", "flags"}
