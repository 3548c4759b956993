"""The op's thread and the copy worker at chosen points: a wave left before it took over its
prefetched hits, a forked child whose first op hits an expert prefetched before the fork, a direct
read refused on both threads at once, and delays injected where either thread looks at what the
other did. After each, no slot claims an expert it does not hold, the logits are the all-resident
ones bitwise, and the counters are those of the same run without delays."""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch

import expertcache
from expertcache import CacheConfig
from expertcache.memory import page_aligned_empty
from expertcache.models.pack import pack
from expertcache.telemetry import OP_COUNTERS
from expertcache.tiers import cache as cache_module
from expertcache.tiers import store as storemod
from expertcache.tiers.policy import ExpertKey
from expertcache.tiers.transfer import COPY_THREAD, CopyWorker
from conftest import slots_hold_what_they_claim
from test_cache_faults import (INPUTS, _forked_child_recovers, _hold_worker, _let_go, _load, _recovers,  # noqa: F401
                               reference)  # a fixture


def test_a_wave_left_before_taking_over_its_prefetched_hit_leaves_no_copy_behind(reference, monkeypatch):
    # An op in waves whose first wave reads a prefetched expert A (its copy queued) and whose second
    # wave refills A's slot s: the caller leaves after the first wave's hits, before the wave took A
    # over (as an exception in the layer while it computes them does). The entry for s stayed,
    # naming a slot the bookkeeping had emptied; a prefetch that put A back into s replaced it, so
    # that the old copy was no longer known: still queued, it wrote A's bytes over the expert s was
    # given next.
    monkeypatch.setattr(cache_module, "_core_to_spare", lambda: True)  # the RAM store splits its waves
    model = _load(experts=12, store="ram", prefetch_width=2.0)
    model.logits(INPUTS[0][:3])
    cache = model.experts
    cache.predict = None  # only the copies planned below
    worker = _hold_worker(cache)  # a busy worker: every copy planned below stays queued
    try:
        layer = cache.moe_layers[-1]  # the last op's: its experts are resident, a prefetch keeps them

        def absent() -> list[int]:
            return [e for e in range(cache.num_experts) if not cache.residency.is_resident(ExpertKey(layer, e))]

        hits = [e for e in range(cache.num_experts) if e not in absent()]
        a = absent()[-1]
        cache.prefetch(layer, [a])
        s = cache.residency.slot_of(ExpertKey(layer, a))
        op = cache.acquire(layer, list(range(cache.num_experts)))  # 32 experts in 12 slots: three waves
        assert [e for e, _ in next(op)] == hits  # the hits, while the rest is late
        assert cache.residency.key_in(s) != ExpertKey(layer, a)  # a later wave refills A's slot
        op.close()
        # A back in s: the prefetch takes ids in order into the lowest free slots, one by one.
        free = cache.residency.free_slots()
        cache.prefetch(layer, [a, *range(a - 2, -1, -2)][: free.index(s) + 1])
        assert cache.residency.slot_of(ExpertKey(layer, a)) == s
        # An op that evicts A and gives s to another expert, copied on the op's thread.
        monkeypatch.setattr(cache_module, "_core_to_spare", lambda: False)
        for _ in cache.acquire(layer, absent()[:12]):
            pass
        assert cache.residency.key_in(s) not in (None, ExpertKey(layer, a))
    finally:
        _let_go(worker)
    _recovers(model, reference)


def test_a_forked_child_without_a_worker_takes_over_what_was_prefetched_before_the_fork(reference):
    # Prefetches copied before a fork and not yet used: the child's cache has no worker until a
    # prefetch starts one. With no prediction above the probability floor none does, and the first
    # op that hit one of them asked a worker that did not exist to finish its job.
    model = _load(experts=40, store="ram", prefetch_width=2.0, prefetch_min_prob=0.99)
    model.logits(INPUTS[0][:3])
    cache = model.experts
    assert cache._worker is None  # nothing predicted above the floor
    layer = cache.moe_layers[0]
    cache.prefetch(layer, [e for e in range(cache.num_experts) if not cache.residency.is_resident(ExpertKey(layer, e))])
    cache.quiesce()  # copied, not yet used
    assert cache._pending
    _forked_child_recovers(model, reference)
    _recovers(model, reference)


def test_delays_where_the_threads_meet_change_nothing(reference, monkeypatch):
    # Random short sleeps (seeded) before and after each point where one thread hands work to the
    # other or looks at its state: the worker's queue, the op's judgement of what is late, its
    # waits and take-overs, the rollback, and each copy on either thread. Split waves and not,
    # waves (5 slots) and a prefetch that fills the cache.
    rng, lock = random.Random(3), threading.Lock()

    def nap() -> None:
        with lock:
            pause = rng.random() * 0.002 if rng.random() < 0.5 else 0.0
        time.sleep(pause)

    def slowed(fn):
        def call(*args, **kwargs):
            nap()
            try:
                return fn(*args, **kwargs)
            finally:
                nap()
        return call

    def run(store, spare, capacity, delays) -> dict:
        monkeypatch.setattr(cache_module, "_core_to_spare", lambda: spare)
        model = _load(experts=capacity, store=store, prefetch_width=2.0)
        if delays:
            model.experts.store.copy_run = slowed(model.experts.store.copy_run)
        for x, want in zip(INPUTS, reference):
            assert torch.equal(model.logits(x), want), (store, spare, capacity)
        slots_hold_what_they_claim(model.experts)
        t = model.telemetry()
        assert t["copy_failures"] == 0
        return {k: t["total"][k] for k in OP_COUNTERS}

    cases = [("ram", True, 5), ("ram", False, 12), ("mmap", True, 12), ("disk", False, 5), ("disk", True, 40)]
    plain = [run(*case, delays=False) for case in cases]
    for name in ("submit", "expedite", "claim", "drop", "wait_for_slots"):
        monkeypatch.setattr(CopyWorker, name, slowed(getattr(CopyWorker, name)))
    for name in ("_late", "_take_prefetched", "_wait_job", "_run_job", "_finish_demand", "_settle", "_reap"):
        monkeypatch.setattr(cache_module.ExpertCache, name, slowed(getattr(cache_module.ExpertCache, name)))
    for _ in range(2):
        assert [run(*case, delays=True) for case in cases] == plain


def test_a_direct_read_refused_on_both_threads_at_once_falls_back_on_both(tmp_path, monkeypatch):
    # The op's thread and the copy worker read one store at once (on a GPU, a demand copy beside a
    # prefetch job; on a CPU, a failed copy made again beside the worker's next job). A device that
    # refuses O_DIRECT reads at 4 KiB answers EINVAL to both: the first to hear it closed the direct
    # descriptor the other was about to read with (EBADF here; another file opened since under
    # that number, elsewhere), or the other found it gone from the store (KeyError).
    packed = pack(Path(expertcache.__file__).parent / "assets" / "tiny-qwen3-moe", tmp_path / "packed",
                  progress=False)  # experts on pages: reads are direct
    model = expertcache.load(packed, cache=CacheConfig(mode="cache", experts=12, store="disk", prefetch="off"))
    store, layer = model.experts.store, model.experts.moe_layers[0]
    if not store._direct_fds:  # a file system without O_DIRECT: stand-in descriptors take the refusal
        store._direct_fds = {p: os.open(p, os.O_RDONLY) for p in store._fds}
    direct = set(store._direct_fds.values())

    def slot() -> torch.Tensor:
        return page_aligned_empty(store.slot_bytes).view(1, -1)

    want = {}
    for e in (0, 1):
        want[e] = slot()
        store.copy_run(layer, e, want[e])
    real, lock, both, retried = os.preadv, threading.Lock(), threading.Barrier(2, timeout=10), threading.Event()
    first = []

    def preadv(fd, buffers, offset):
        me = threading.current_thread()
        if fd not in direct:
            if first == [me]:
                retried.set()  # the first refused has read again, buffered
            return real(fd, buffers, offset)
        with lock:
            if not first:
                first.append(me)
        both.wait()  # both threads hold the direct descriptor
        if first != [me]:
            assert retried.wait(10)
            os.fstat(fd)  # the descriptor is looked up before the device refuses the read
        raise OSError(errno.EINVAL, "Invalid argument")

    got, errors = {0: slot(), 1: slot()}, []

    def read(e: int) -> None:
        try:
            store.copy_run(layer, e, got[e])
        except BaseException as exc:
            errors.append(exc)

    monkeypatch.setattr(storemod.os, "preadv", preadv)
    worker = threading.Thread(target=read, args=(1,), name=COPY_THREAD)
    worker.start()
    read(0)
    worker.join(20)
    assert not worker.is_alive() and not errors, errors
    assert all(torch.equal(got[e], want[e]) for e in (0, 1))
    assert store._direct_fds == {} and len(first) == 1
    store.close()  # the refused descriptor too
    for fd in direct:
        with pytest.raises(OSError):
            os.fstat(fd)
