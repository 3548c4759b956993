"""Copies into slots and what compute waits for.

On a CPU a copy is done when `copy_` returns, so there is nothing to wait for. On a GPU copies run
on a dedicated stream with non-blocking transfers from pinned memory; each slot remembers the
event of the last kernel that read it, a refill of that slot waits on that event and nothing
else, and compute waits only for the copies of the wave it is about to run (and for nothing when
nothing was copied).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class Transfers:
    def __init__(self, device: torch.device, capacity: int):
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.last_reader: list = [None] * capacity
        self._pending = False

    def copy(self, slots: list[int], do_copy: Callable[[bool], None]) -> None:
        """Run `do_copy(non_blocking)` to fill `slots`, after their last readers have finished."""
        if not self.cuda:
            do_copy(False)
            return
        with torch.cuda.stream(self.stream):
            waited = set()
            for s in slots:
                ev = self.last_reader[s]
                if ev is not None and id(ev) not in waited:
                    self.stream.wait_event(ev)
                    waited.add(id(ev))
            do_copy(True)
        self._pending = True

    def before_compute(self) -> None:
        """Make the compute stream wait for the copies issued since the last call, if any."""
        if self._pending:
            done = torch.cuda.Event()
            done.record(self.stream)
            torch.cuda.current_stream().wait_event(done)
            self._pending = False

    def after_compute(self, slots: list[int]) -> None:
        """Record that the kernels queued so far are the last readers of `slots`."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream())
            for s in slots:
                self.last_reader[s] = ev

    def synchronize(self) -> None:
        if self.cuda:
            self.stream.synchronize()
            torch.cuda.current_stream().synchronize()
