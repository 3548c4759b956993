"""The command line as a new user meets it: flags that would be ignored without a word are errors,
and `--help` says what the code does when a flag is left out."""

from __future__ import annotations

import argparse

import pytest

from expertcache.cli import build_parser
from expertcache.config import CacheConfig
from expertcache.flags import cache_config
from conftest import assert_one_line_error, run_cli


def _subparser(*names: str) -> argparse.ArgumentParser:
    p = build_parser()
    for name in names:
        p = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return p


@pytest.mark.parametrize("argv,mode", [
    ([], "resident"),                                   # no cache flag: every expert resident
    (["--cache-mode", "staging"], "staging"),
    (["--cache-mode", "resident", "--store", "disk"], "resident"),
])
def test_prefetch_on_outside_the_slot_cache_is_an_error(capsys, tmp_path, argv, mode):
    """Only the slot cache prefetches (CacheConfig.prefetch_active): `--prefetch on` in resident or
    staging mode ran without prefetching and without a word. It is refused before the model loads
    (the model path here does not exist: a load would say that instead)."""
    code, err = run_cli(capsys, "run", "-m", str(tmp_path / "absent"), "-p", "x", "-n", "1",
                        "--prefetch", "on", *argv)
    assert_one_line_error(code, err, "--prefetch on", f"{mode} mode")


@pytest.mark.parametrize("argv", [
    ["run", "-p", "x", "--prefetch", "on", "--cache-fraction", "0.5"],
    ["run", "-p", "x", "--prefetch", "on", "--store", "disk"],           # implies cache mode
    ["run", "-p", "x", "--prefetch", "on", "--cache-mode", "cache"],
    ["run", "-p", "x", "--prefetch", "off", "--cache-mode", "resident"],
    ["perplexity", "-f", "t.txt", "--prefetch", "on", "--compare", "resident,cache"],  # cache mode's own
])
def test_prefetch_flags_the_slot_cache_takes_are_accepted(argv):
    cfg = cache_config(build_parser().parse_args(argv))
    expected = "on" if "on" in argv else "off"
    assert cfg.prefetch == expected


@pytest.mark.parametrize("command,base", [
    (("run",), ["-p", "x"]),
    (("perplexity",), ["-f", "t.txt"]),
    (("serve",), []),
    (("trace", "record"), ["-f", "t.txt", "-o", "t.npz"]),
    (("trace", "fit-predictor"), ["-f", "t.txt", "-o", "p.safetensors"]),
])
def test_cache_mode_help_names_the_mode_each_flag_implies(command, base):
    """`--cache-mode`'s help said only "cache (default when a size is given)": a --store other than
    ram and --cache-verify imply cache mode too, and with none of them the mode is resident."""
    p = _subparser(*command)
    help_text = next(a.help for a in p._actions if "--cache-mode" in a.option_strings)
    implied = {flags: cache_config(p.parse_args([*base, *flags])).mode
               for flags in [(), ("--cache-experts", "4"), ("--store", "mmap"), ("--store", "disk"),
                             ("--cache-verify",)]}
    assert implied == {(): "resident", ("--cache-experts", "4"): "cache", ("--store", "mmap"): "cache",
                       ("--store", "disk"): "cache", ("--cache-verify",): "cache"}
    assert CacheConfig().mode == "resident"
    assert "a size, a --store other than ram or --cache-verify" in help_text
    assert "resident (every expert in fast memory; the default otherwise)" in help_text
