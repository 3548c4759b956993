"""The cache and its prefetch under faults: a copy that fails (an OSError-like `CopyError`, a
MemoryError, a KeyboardInterrupt) on the copy worker or on the op's thread, a take-over
interrupted, a worker thread that cannot start, a model dropped while its worker reads. After
each, no slot claims an expert it does not hold, the next call gives the all-resident logits
bitwise, and no thread is left behind."""

from __future__ import annotations

import gc
import itertools
import os
import random
import signal
import sys
import threading
import time
import traceback
import weakref

import pytest
import torch

import expertcache
from expertcache import CacheConfig
from expertcache.errors import CopyError
from expertcache.tiers import cache as cache_module
from expertcache.tiers.policy import ExpertKey
from expertcache.tiers.transfer import COPY_THREAD, CopyWorker
from conftest import VOCAB, slots_hold_what_they_claim

IDS = torch.randint(4, VOCAB, (24,), generator=torch.Generator().manual_seed(5))
INPUTS = [IDS[:10], IDS[10:11], IDS[3:20]]


@pytest.fixture(scope="module")
def reference():
    """The bundled model's logits for INPUTS with every expert resident."""
    model = expertcache.load(cache=CacheConfig(mode="resident"))
    return [model.logits(x) for x in INPUTS]


def _load(**cache):
    return expertcache.load(cache=CacheConfig(mode="cache", prefetch="on", **cache))


def _recovers(model, reference) -> None:
    slots_hold_what_they_claim(model.experts)
    for x, want in zip(INPUTS, reference):
        assert torch.equal(model.logits(x), want)
    total = model.telemetry()["total"]
    assert total["resident_hits"] + total["resident_misses"] == total["used_experts_unique"]
    assert total["prefetch_used"] + total["prefetch_wasted"] <= total["prefetch_issued"]
    slots_hold_what_they_claim(model.experts)


class _FailingCopies:
    """The store's `copy_run`, failing at the `at`-th copy made on the chosen thread (the worker,
    the op's thread, or any) with `exc`, after scribbling over the slots it was to fill (a read
    cut short leaves them so)."""

    def __init__(self, store, at: int, exc: type[BaseException], where: str):
        self.copy_run, self.at, self.exc, self.where = store.copy_run, at, exc, where
        self.calls, self.fired = 0, False

    def __call__(self, layer, first, dst, non_blocking=False):
        on_worker = threading.current_thread().name == COPY_THREAD
        if self.where == "any" or (self.where == "worker") == on_worker:
            self.calls += 1
            if self.calls == self.at:
                self.fired = True
                dst[:, :64].fill_(0xAB)
                raise self.exc("injected copy failure")
        return self.copy_run(layer, first, dst, non_blocking)


def _hold_worker(cache) -> CopyWorker:
    """The worker starts no job (as if a demand copy never ended): every prefetch an op hits is
    taken over by the op's thread."""
    worker = cache._start_worker()
    worker.drain()
    with worker._cond:
        worker._demand += 1
    return worker


def _let_go(worker: CopyWorker) -> None:
    with worker._cond:
        worker._demand -= 1
        worker._cond.notify_all()


def _called_from(name: str) -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False


@pytest.mark.parametrize("where", ["copy", "wait"])
def test_an_interrupted_take_over_leaves_its_prefetch_failed_and_ended(reference, monkeypatch, where):
    # The RAM store with every core computing: the op's thread takes over the prefetches it hits
    # (the worker is held, so every one of them). A KeyboardInterrupt in the take-over's copy, or
    # while it waits for the worker before copying, must leave the job failed (its experts rolled
    # back before the next plan) and ended (no later op waits for it forever); it once left the
    # job "done" with no error and its slot claiming an expert whose copy never finished, or (the
    # wait) the job running for ever.
    monkeypatch.setattr(cache_module, "_core_to_spare", lambda: False)
    in_take_over = 0
    for at in range(1, 12, 2):
        model = _load(experts=12, store="ram", prefetch_width=2.0)
        model.logits(IDS[:3])
        cache = model.experts
        worker = _hold_worker(cache)
        calls, fired = [0], []
        if where == "copy":
            copy_run = cache.store.copy_run

            def failing(layer, first, dst, non_blocking=False):
                calls[0] += 1
                if calls[0] == at:
                    fired.append(_called_from("_run_job"))
                    dst[:, :64].fill_(0xAB)  # a copy cut short
                    raise KeyboardInterrupt
                return copy_run(layer, first, dst, non_blocking)

            cache.store.copy_run = failing
        else:
            wait = worker.wait_for_slots

            def failing(slots):
                calls[0] += 1
                if calls[0] == at:
                    fired.append(_called_from("_take_prefetched"))
                    raise KeyboardInterrupt
                return wait(slots)

            worker.wait_for_slots = failing
        try:
            with pytest.raises(KeyboardInterrupt):
                for x in INPUTS:
                    model.logits(x)
        finally:
            if where == "copy":
                del cache.store.copy_run
            else:
                del worker.wait_for_slots
            _let_go(worker)
        in_take_over += fired == [True]
        cache.quiesce()
        assert all(job.done.is_set() for job in [*cache._jobs, *(job for job, _ in cache._pending.values())]), at
        _recovers(model, reference)
    assert in_take_over > 0  # some of the interrupts fell in a take-over


def test_a_worker_that_cannot_start_plans_no_prefetch(reference, monkeypatch):
    # A prefetch planned and then left without its copy worker (no thread to be had) once kept its
    # keys resident: the next op read slots no one had filled.
    monkeypatch.setattr(cache_module, "_core_to_spare", lambda: False)
    start = threading.Thread.start

    def no_copy_thread(thread):
        if thread.name == COPY_THREAD:
            raise RuntimeError("can't start new thread")
        return start(thread)

    for store in ("ram", "mmap"):
        model = _load(experts=12, store=store, prefetch_width=2.0)
        monkeypatch.setattr(threading.Thread, "start", no_copy_thread)
        with pytest.raises(RuntimeError, match="can't start new thread"):
            model.logits(IDS[:2])  # an op of few experts: its prediction finds room
        monkeypatch.setattr(threading.Thread, "start", start)
        assert model.experts._worker is None
        assert not model.experts.residency.prefetched_unused()
        _recovers(model, reference)
        assert model.telemetry()["total"]["prefetch_used"] > 0


def test_copies_failing_anywhere_leave_no_slot_claiming_an_expert(reference, monkeypatch):
    # Randomized: a failure of each kind, on the worker, on the op's thread or on either, at the
    # n-th copy of a few calls, with split waves (a core to spare) or not, in caches from 5 slots
    # (ops in waves) to 40, and prefetch widths 0.5-2.
    rng = random.Random(11)
    cases = list(itertools.product(["ram", "mmap", "disk"], [False, True], [5, 12, 40], [0.5, 2.0],
                                   [CopyError, MemoryError, KeyboardInterrupt], ["worker", "main", "any"]))
    fired = 0
    for store, spare, capacity, width, exc, where in rng.sample(cases, 24):
        monkeypatch.setattr(cache_module, "_core_to_spare", lambda spare=spare: spare)
        model = _load(experts=capacity, store=store, prefetch_width=width)
        failing = _FailingCopies(model.experts.store, rng.randint(1, 30), exc, where)
        model.experts.store.copy_run = failing
        try:
            for x in INPUTS:
                model.logits(x)
        except (CopyError, MemoryError, KeyboardInterrupt) as e:
            assert isinstance(e, exc) and failing.fired
        model.experts.store.copy_run = failing.copy_run
        fired += failing.fired
        if failing.fired:
            assert model.telemetry()["copy_failures"] >= 1, (store, spare, capacity, width, exc, where)
        _recovers(model, reference)
    assert fired >= 8  # most cases reached their failure (which thread copies what varies with timing)


def _worker_held_in_a_read(n: int):
    """A model whose copy worker is held inside the read of a prefetch of `n` absent experts of
    the first MoE layer until `go` is set: (model, cache, go)."""
    model = _load(experts=12, store="disk", prefetch_width=2.0)
    model.logits(IDS[:3])
    cache = model.experts
    reading, go = threading.Event(), threading.Event()

    def hold(_n):
        if threading.current_thread().name == COPY_THREAD:
            reading.set()
            assert go.wait(30)

    cache.store.read_hook = hold
    layer = cache.moe_layers[0]
    cache.prefetch(layer, [e for e in range(cache.num_experts) if not cache.residency.is_resident(ExpertKey(layer, e))][:n])
    assert reading.wait(30)
    return model, cache, go


def test_a_model_dropped_while_its_worker_reads_frees_its_cache_and_thread(monkeypatch):
    model, cache, go = _worker_held_in_a_read(3)
    thread, ref = cache._worker.thread, weakref.ref(cache)
    del model, cache
    go.set()
    # The worker holds the cache while its read ends; once it lets go, a collection frees the
    # cache and the thread ends. How soon depends on the machine's load: poll, with a deadline.
    deadline = time.monotonic() + 60
    while (thread.is_alive() or ref() is not None) and time.monotonic() < deadline:
        gc.collect()
        thread.join(0.05)
    assert not thread.is_alive() and ref() is None


def _forked_child_recovers(model, reference, in_child=lambda: None, in_parent=lambda: None) -> None:
    """Fork: the child (after `in_child`) gives the all-resident logits bitwise and its slots hold
    what they claim; the parent runs `in_parent` meanwhile. The child's exit is waited for on a
    thread, so that a hung child fails the test (killed at the deadline) instead of hanging it."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest from here on, only an exit code
        code = 1
        try:
            in_child()
            code = 0 if all(torch.equal(model.logits(x), want) for x, want in zip(INPUTS, reference)) else 3
            slots_hold_what_they_claim(model.experts)
        except BaseException:
            traceback.print_exc()
            code = 4
        finally:
            os._exit(code)
    in_parent()
    statuses = []
    waiter = threading.Thread(target=lambda: statuses.append(os.waitpid(pid, 0)[1]), daemon=True)
    waiter.start()
    waiter.join(120)
    if waiter.is_alive():
        os.kill(pid, signal.SIGKILL)
        waiter.join()
        pytest.fail("the forked child hung")
    (status,) = statuses
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_process_forked_while_its_worker_reads_recovers_in_the_child(reference):
    """A fork while the copy worker reads (one prefetch running, one queued): the child has no
    worker thread, and its copies of the two jobs never end. Its cache takes them as failed
    copies (the rollback drops their experts; an op copies them on demand), starts a worker of its
    own, and gives the all-resident logits bitwise; the parent goes on as if nothing happened."""
    model, cache, go = _worker_held_in_a_read(2)
    cache.prefetch(cache.moe_layers[1], list(range(2)))  # queued behind the running job

    def in_child() -> None:
        cache.store.read_hook = None

    _forked_child_recovers(model, reference, in_child, in_parent=go.set)
    cache.store.read_hook = None
    _recovers(model, reference)


@pytest.mark.parametrize("store", ["ram", "disk"])
def test_an_op_whose_copy_fails_is_counted_with_the_copies_it_made(reference, store):
    # 5 slots: a 10-token prompt's ops run in waves of 5, so the failing op has completed a wave
    # before its failure. The telemetry counts that op (its plan's hits, misses and evictions
    # happened) and the copies of its completed waves.
    model = expertcache.load(cache=CacheConfig(mode="cache", experts=5, store=store, prefetch="off"))
    cache = model.experts
    copy_run, copied, ops = cache.store.copy_run, [0], [0]
    plan = cache.residency.plan

    def counting_plan(layer, experts):
        ops[0] += 1
        return plan(layer, experts)

    def failing(layer, first, dst, non_blocking=False):
        if copied[0] >= 7:
            raise CopyError("injected copy failure")
        copy_run(layer, first, dst, non_blocking)
        copied[0] += dst.shape[0]

    cache.residency.plan = counting_plan
    cache.store.copy_run = failing
    with pytest.raises(CopyError):
        model.logits(INPUTS[0])
    total = model.telemetry()["total"]
    assert total["ops_seen"] == ops[0] >= 1
    # The first wave's 5 copies (a cold cache of 5 slots) completed and count; the second wave's
    # 2 before the failure are rolled back with it (their experts are not in the cache).
    assert copied[0] == 7 and total["copied_experts"] == 5
    assert total["copied_bytes"] == 5 * model.telemetry()["expert_bytes"]
    assert total["resident_hits"] + total["resident_misses"] == total["used_experts_unique"]
    cache.store.copy_run = copy_run
    _recovers(model, reference)
