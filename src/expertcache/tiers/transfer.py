"""Copies into slots and what compute waits for.

On a CPU a copy is done when `copy_` returns, so there is nothing to wait for. On a GPU copies run
on a dedicated stream with non-blocking transfers from pinned memory; each slot remembers the
event of the last kernel that read it, a refill of that slot waits on that event and nothing
else, and compute waits only for the copies of the wave it is about to run (and for nothing when
nothing was copied).

Prefetch copies (`CopyWorker`) run on a thread of their own, one job at a time, and never start
while a demand copy is being made (on a CPU the worker also makes a wave's demand copies, first
in its queue, while the op computes the experts already there); on a GPU the worker issues them
on a second, lower-priority stream and records an event after each job, which compute waits on
before reading its slots.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

import torch


class Transfers:
    def __init__(self, device: torch.device, capacity: int):
        self.cuda = device.type == "cuda"
        # Compute runs on the current stream of the model's device: named with its index, since
        # torch's current stream without one is the current device's (device 0 unless set).
        if self.cuda and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        # Demand copies at a higher priority than prefetch copies (lower number, higher priority).
        self.stream = torch.cuda.Stream(device, priority=-1) if self.cuda else None
        self.prefetch_stream = torch.cuda.Stream(device, priority=0) if self.cuda else None
        self.last_reader: list = [None] * capacity
        self.last_prefetch: list = [None] * capacity  # event after the last prefetch copy into each slot
        self._pending = False

    def own(self, pool: torch.Tensor) -> None:
        """Take `pool` (just allocated on the compute stream) for the copy streams. Torch's
        allocator orders a block's reuse on the stream it was allocated on only: without this,
        a first copy could land before the pool's own zero fill (or before the last kernels
        reading the memory the allocator gave it), and a freed pool (resized, reloaded, the
        model dropped) could go to another tensor while copies into it are still queued."""
        if not self.cuda:
            return
        compute = torch.cuda.current_stream(self.device)
        for stream in (self.stream, self.prefetch_stream):
            stream.wait_stream(compute)
            pool.record_stream(stream)

    def copy(self, slots: list[int], do_copy: Callable[[bool], None]) -> None:
        """Run `do_copy(non_blocking)` to fill `slots`, after their last readers (and any
        prefetch copy into them) have finished."""
        if not self.cuda:
            do_copy(False)
            return
        with torch.cuda.stream(self.stream):
            waited = set()
            for s in slots:
                for ev in (self.last_reader[s], self.last_prefetch[s]):
                    if ev is not None and id(ev) not in waited:
                        self.stream.wait_event(ev)
                        waited.add(id(ev))
            do_copy(True)
        self._pending = True

    def prefetch_copy(self, slots: list[int], do_copy: Callable[[bool], None]):
        """On the prefetch worker: `do_copy(non_blocking)` into `slots` after their last readers
        and the demand copies issued so far; returns the event compute waits on (None on a CPU,
        where the copy is done when this returns)."""
        if not self.cuda:
            do_copy(False)
            return None
        with torch.cuda.stream(self.prefetch_stream):
            self.prefetch_stream.wait_stream(self.stream)
            waited = set()
            for s in slots:
                ev = self.last_reader[s]
                if ev is not None and id(ev) not in waited:
                    self.prefetch_stream.wait_event(ev)
                    waited.add(id(ev))
            try:
                do_copy(True)
            finally:
                # Also after a failure part-way: the copies already queued still write the slots,
                # and a later copy into them must wait for those.
                done = torch.cuda.Event()
                done.record(self.prefetch_stream)
                for s in slots:
                    self.last_prefetch[s] = done
        return done

    def wait_prefetched(self, event) -> None:
        """Make compute wait for a prefetch job's copies (nothing on a CPU)."""
        if self.cuda and event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def before_compute(self) -> None:
        """Make the compute stream wait for the copies issued since the last call, if any."""
        if self._pending:
            done = torch.cuda.Event()
            done.record(self.stream)
            torch.cuda.current_stream(self.device).wait_event(done)
            self._pending = False

    def after_compute(self, slots: list[int]) -> None:
        """Record that the kernels queued so far are the last readers of `slots`."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            for s in slots:
                self.last_reader[s] = ev

    def synchronize(self) -> None:
        if self.cuda:
            self.stream.synchronize()
            self.prefetch_stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()


# ---- prefetch copies ---------------------------------------------------------------------------

QUEUED, RUNNING, DONE = "queued", "running", "done"


class CopyJob:
    """One prefetch copy: a run of experts of one layer into consecutive slots. `live[i]` turns
    False when expert i's slot was given to another key before the copy started (the copy skips
    it). Once RUNNING, only the thread running it touches it until `done` is set. A job with a
    `wave` is instead that wave's demand copies, made on the worker while the op computes the
    wave's other experts (`ranges`: the transfers they issued)."""

    __slots__ = ("layer", "experts", "slots", "wave", "ranges", "live", "state", "error", "done", "event", "counted")

    def __init__(self, layer: int, experts: list[int], slots: list[int], wave=None):
        self.layer, self.experts, self.slots, self.wave = layer, experts, slots, wave
        self.ranges = 0
        self.live = [True] * len(experts)
        self.state = QUEUED
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.event = None  # on a GPU: recorded on the prefetch stream after the job's copies
        self.counted = False  # its failure is in the telemetry's copy_failures


COPY_THREAD = "expertcache-copy"  # the worker thread's name (fault injection keys on it)


class CopyWorker:
    """A thread that runs queued copy jobs one at a time, in order, and never starts one while a
    demand copy is being made (`demand()`): prefetch yields to demand. A queued job can be
    `claim`ed, and the caller then runs it itself (the demand path takes it over), or moved to the
    front of the queue (`expedite`: the demand path waits for the worker to make it); a running
    one is waited for. `run(job)` does the copies; what it raises is kept in `job.error`."""

    def __init__(self, run: Callable[[CopyJob], None], name: str = COPY_THREAD):
        self._run = run
        self._cond = threading.Condition()
        self._queue: deque[CopyJob] = deque()
        self._running: CopyJob | None = None
        self._demand = 0
        self._closed = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def submit(self, job: CopyJob, first: bool = False) -> None:
        """Queue `job` last, or `first` (a demand copy goes before the queued prefetches)."""
        with self._cond:
            if first:
                self._queue.appendleft(job)
            else:
                self._queue.append(job)
            self._cond.notify_all()

    def expedite(self, jobs: list[CopyJob]) -> None:
        """Move the queued ones of `jobs` to the front of the queue, in their order (the op in
        flight waits for them); the running job finishes first."""
        with self._cond:
            front: list[CopyJob] = []
            for job in jobs:  # a job may be named once per expert of it
                if job.state == QUEUED and all(job is not j for j in front):
                    front.append(job)
            for job in front:
                self._queue.remove(job)
            self._queue.extendleft(reversed(front))
            if front:
                self._cond.notify_all()

    def claim(self, job: CopyJob) -> bool:
        """Take a queued job from the worker: True when the caller must now run it; False when it
        is running or done."""
        with self._cond:
            if job.state != QUEUED:
                return False
            self._queue.remove(job)
            job.state = RUNNING
            return True

    def run_claimed(self, job: CopyJob, after_slots: bool = False) -> None:
        """Run a job `claim` handed over, in the calling thread (with `after_slots`, once the job
        the worker runs no longer writes its slots); its error, if any, is kept. A BaseException
        (KeyboardInterrupt) is kept too, so that the job reads as failed and not as copied, and
        raised again; either way the job ends DONE, so that no one waits for it forever."""
        try:
            if after_slots:
                self.wait_for_slots(job.slots)
            self._run(job)
        except Exception as e:
            job.error = e
        except BaseException as e:
            job.error = e
            raise
        finally:
            with self._cond:
                job.state = DONE
                job.done.set()

    def finish(self, job: CopyJob) -> None:
        """Have `job` done: run here if the worker has not started it (once the job the worker
        runs no longer writes its slots), waited for otherwise. Its error is in `job.error`."""
        if self.claim(job):
            self.run_claimed(job, after_slots=True)
        else:
            job.done.wait()

    def drop(self, job: CopyJob, i: int) -> bool:
        """Expert i of `job` is not to be copied: True when the job had not started (nothing of it
        was written); False when it is running or done (wait before reusing its slot)."""
        with self._cond:
            if job.state != QUEUED:
                return False
            job.live[i] = False
            if not any(job.live):
                self._queue.remove(job)
                job.state = DONE
                job.done.set()
            return True

    def wait_for_slots(self, slots) -> None:
        """Wait for the job the worker is running if it writes any of `slots`."""
        with self._cond:
            job = self._running
        if job is not None and not set(job.slots).isdisjoint(slots):
            job.done.wait()

    def drain(self) -> None:
        """Wait until every queued job has run."""
        with self._cond:
            jobs = list(self._queue) + ([self._running] if self._running is not None else [])
        for job in jobs:
            job.done.wait()

    def demand(self) -> _Demand:
        return _Demand(self)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._queue or self._demand):
                    self._cond.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                job.state = RUNNING
                self._running = job
            try:
                self._run(job)
            except BaseException as e:  # kept for the cache, which rolls its bookkeeping back
                job.error = e
            with self._cond:
                self._running = None
                job.state = DONE
                job.done.set()


class _Demand:
    """While open, the worker starts no new job (one already running finishes)."""

    def __init__(self, worker: CopyWorker):
        self.worker = worker

    def __enter__(self) -> None:
        with self.worker._cond:
            self.worker._demand += 1

    def __exit__(self, *exc) -> None:
        with self.worker._cond:
            self.worker._demand -= 1
            if self.worker._queue:  # a worker with nothing queued sleeps on
                self.worker._cond.notify_all()
