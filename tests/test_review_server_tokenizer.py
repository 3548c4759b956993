"""A second review of the server's queue bound (`--max-queue`): what counts as waiting at the
moments the worker moves a job between the queue and the model. Each race is pinned where it
opens (a queue that holds the worker right after it took a job; a client that asks again from
inside its answer), never with sleeps."""

from __future__ import annotations

import queue
import threading

from expertcache.server.slots import QueueFull, Scheduler
from test_server_leftovers import TIMEOUT, HeldModel, _job


class PausingQueue(queue.Queue):
    """The worker's queue: the worker's blocking get() returns its job only once `go` is set, so
    the test runs while the job is out of the queue and not yet counted as processing."""

    def __init__(self):
        super().__init__()
        self.taken, self.go = threading.Event(), threading.Event()

    def get(self, block=True, timeout=None):
        item = super().get(block, timeout)
        if block and item is not None:
            self.taken.set()
            assert self.go.wait(TIMEOUT)
        return item


def test_a_job_the_worker_just_took_still_holds_its_place():
    """--max-queue 1: one runs and one waits. The job the worker had taken from the queue but
    not yet counted as processing counted nowhere: two more were let wait behind it."""
    model, results = HeldModel(), {}
    sched = Scheduler(model, max_queue=1)
    sched._queue = q = PausingQueue()
    sched.start()
    jobs = {name: _job(results, name) for name in ("running", "waiting", "over")}
    try:
        sched.submit(jobs["running"])
        assert q.taken.wait(TIMEOUT), "the worker did not take the job"
        assert sched.snapshot().processing == 0  # the window: taken, not yet processing
        sched.submit(jobs["waiting"])
        assert "waiting" not in results, "refused while nobody waited"
        sched.submit(jobs["over"])
        assert isinstance(results.get("over", (None, None))[1], QueueFull), "a second job was let wait behind the running one"
        assert sched.snapshot().refused == 1
    finally:
        q.go.set()
        model.release.set()
        for name in ("running", "waiting"):
            assert jobs[name].done.wait(TIMEOUT), name
        sched.stop()
    assert results["running"][1] is None and results["waiting"][1] is None


def test_max_queue_zero_refuses_while_the_taken_job_is_not_yet_counted():
    model, results = HeldModel(), {}
    sched = Scheduler(model, max_queue=0)
    sched._queue = q = PausingQueue()
    sched.start()
    a, b = _job(results, "a"), _job(results, "b")
    try:
        sched.submit(a)
        assert q.taken.wait(TIMEOUT)
        sched.submit(b)  # it would wait while `a` runs: --max-queue 0 lets none wait
        assert isinstance(results.get("b", (None, None))[1], QueueFull), results
    finally:
        q.go.set()
        model.release.set()
        assert a.done.wait(TIMEOUT)
        sched.stop()
    assert results["a"][1] is None


def test_a_client_asking_again_on_its_answer_is_not_refused():
    """A client that sends its next request the moment it has its answer (a chat loop, a bench's
    closed loop) found the worker still counting the answered request as processing: with
    --max-queue 0 (and with N clients at --max-queue N-1) it got a 503 with nobody waiting."""
    model, results = HeldModel(), {}
    model.release.set()  # generations return at once
    sched = Scheduler(model, max_queue=0)
    sched.start()
    first, second = _job(results, "first"), _job(results, "second")
    answered = first.on_done
    seen = {}

    def on_done(res, err):
        seen["processing"] = sched.snapshot().processing
        answered(res, err)
        sched.submit(second)  # from the answer itself: the earliest a client can ask again

    first.on_done = on_done
    try:
        sched.submit(first)
        assert first.done.wait(TIMEOUT) and second.done.wait(TIMEOUT)
    finally:
        sched.stop()
    assert results["first"][1] is None
    assert results["second"][1] is None, results["second"]
    assert seen["processing"] == 0, "an answered request still counted as processing"
    s = sched.snapshot()
    assert (s.requests, s.refused, s.processing, s.deferred) == (2, 0, 0, 0), s
