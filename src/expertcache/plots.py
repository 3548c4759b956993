"""What the `--plot` flags share: the output path checked before the work it plots, matplotlib
imported with one line of error where it is missing, and the PNG written whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path

from .checkpoint.writer import atomic_file, no_directory
from .errors import ExpertCacheError


def check_png_path(path: str) -> None:
    """Fails at once, before minutes of work, for a path the plot could not be written to."""
    if not path.lower().endswith(".png"):
        raise ExpertCacheError(f"--plot {path!r}: expected a .png file name")
    parent = Path(path).parent
    if not parent.is_dir():
        raise ExpertCacheError(f"--plot {path!r}: {no_directory(parent)}")
    if Path(path).is_dir():
        raise ExpertCacheError(f"--plot {path!r} is a directory: expected a .png file name")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExpertCacheError(f"--plot {path!r}: directory {str(parent)!r} is not writable")


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    try:
        import matplotlib
    except ImportError:
        raise ExpertCacheError("--plot needs matplotlib (pip install 'expertcache[bench]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: str) -> None:
    """Writes `fig` to `path` through a temporary file (an earlier plot there survives a failed
    write), then closes it."""
    plt = pyplot()
    try:
        with atomic_file(Path(path)) as tmp:
            fig.savefig(tmp, format="png")
    except OSError as e:
        raise ExpertCacheError(f"cannot write {path!r}: {e.strerror}") from None
    finally:
        plt.close(fig)
