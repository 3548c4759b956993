"""Descriptors a reader keeps open on checkpoint files: closed by its `close()`, or when the reader
is collected, so that a model simply let go does not keep its files open for good."""

from __future__ import annotations

import os
import weakref


def close_when_collected(owner: object, *held: dict | list) -> weakref.finalize:
    """Close the descriptors in `held` (dicts of them, or lists; filled and emptied in place by
    `owner`) once `owner` is collected; calling the returned finalizer closes them now, once."""
    return weakref.finalize(owner, _close, *held)


def _close(*held: dict | list) -> None:
    for fds in held:
        for fd in list(fds.values() if isinstance(fds, dict) else fds):
            os.close(fd)
        fds.clear()
