"""The `expertcache` command. Each subcommand lives in `expertcache.commands` and registers its
own flags; a user-facing error becomes one line on stderr and exit code 2."""

from __future__ import annotations

import importlib
import os
import sys

from .flags import Parser
from .commands.args import check_device
from .errors import ExpertCacheError

# Each module has `register(subparsers)`.
COMMANDS = ("run", "pack", "synth", "perplexity", "bench", "trace", "serve")


def build_parser() -> Parser:
    p = Parser(prog="expertcache", description="Run MoE models with a resident-expert cache.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name in COMMANDS:
        importlib.import_module(f"expertcache.commands.{name}").register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "device", None) is not None:
            check_device(args.device)  # before any command loads a model onto it
        return args.func(args) or 0
    except ExpertCacheError as e:
        print(f"expertcache: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `expertcache ... | head`: the reader has gone. Stop quietly, as other tools do; stdout now
        # goes nowhere, or Python's flush at exit would fail on the closed pipe again.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # a stdout without a file descriptor (a test's capture)
            pass
        return 141  # 128 + SIGPIPE, what a shell reports of a tool the pipe stopped
    except OSError as e:
        # A read or write that failed where no command foresaw it (a read-only or full disk, stdout
        # into /dev/full): still one line, not a traceback.
        where = f"{e.filename}: " if e.filename is not None else ""
        print(f"expertcache: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
