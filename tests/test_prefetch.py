"""Prefetch in the runtime: the counters are exactly the trace simulator's for the same run, the
logits never depend on it (sizes, widths, policies, stores, a slowed and a failing worker), and a
failed prefetch leaves no slot claiming an expert it does not hold."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import expertcache
from expertcache import CacheConfig, ExpertCacheError
from expertcache.bench.simulate import simulate
from expertcache.bench.trace import TraceRecorder
from expertcache.errors import CopyError
from expertcache.flags import Parser, add_cache_flags, cache_config
from expertcache.models.pack import pack
from expertcache.telemetry import OP_COUNTERS
from expertcache.tiers.policy import ExpertKey
from expertcache.tiers.transfer import COPY_THREAD
from conftest import VOCAB, slots_hold_what_they_claim

IDS = torch.randint(4, VOCAB, (24,), generator=torch.Generator().manual_seed(5))
PROMPT = IDS[:10].tolist()
WORKER = COPY_THREAD


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The bundled model (32 experts, top-4, 4 MoE layers) and a packed tiny Qwen2-MoE of another
    shape: 16 experts, top-4, a shared expert, MoE layers 1 and 3 between dense ones."""
    from conftest import build_reference, save_checkpoint, tiny_config

    root = tmp_path_factory.mktemp("prefetch")
    ref = build_reference(tiny_config("qwen2_moe", experts=16, top_k=4, layers=4, dense=True), seed=7)
    qwen2 = pack(save_checkpoint(ref, root / "plain"), root / "packed", progress=False)
    return {"bundled": None, "qwen2": qwen2}


@pytest.fixture(scope="module")
def reference(models):
    """Each model's logits and greedy tokens with every expert resident."""
    out = {}
    for name, path in models.items():
        m = expertcache.load(path, cache=CacheConfig(mode="resident"))
        out[name] = (m.logits(IDS), m.generate(PROMPT, max_tokens=6, ignore_eos=True).token_ids)
    return out


def _load(path, **cache):
    return expertcache.load(path, cache=CacheConfig(mode="cache", **cache))


def _check(model, want) -> None:
    logits, tokens = want
    for _ in range(2):  # the second pass starts from what the first left resident
        assert torch.equal(model.logits(IDS), logits)
    assert model.generate(PROMPT, max_tokens=6, ignore_eos=True).token_ids == tokens


def _fail_reads_on_the_worker(store) -> list[int]:
    """Make every read on the copy worker fail; returns the list that counts the failures."""
    failed = []

    def fail(_n):
        if threading.current_thread().name == WORKER:
            failed.append(1)
            raise CopyError("injected read failure")

    store.read_hook = fail
    return failed


# ---- counters: the runtime is the simulator's replay ----------------------------------------


@pytest.mark.parametrize("name", ["bundled", "qwen2"])
def test_runtime_counters_equal_the_simulator(models, name):
    path = models[name]
    for policy, capacity, width, min_prob in [("lrfu", 5, 1.0, 0), ("lru", 9, 1.5, 0), ("s3fifo", 16, 2.0, 0),
                                              ("arc", 12, 1.0, 0), ("lfu", 24, 0.5, 0), ("lru", 3, 1.0, 0),
                                              ("lrfu", 9, 2.0, 0.1), ("lru", 16, 1.5, 0.2)]:
        model = _load(path, experts=capacity, policy=policy, prefetch="on", prefetch_width=width,
                      prefetch_min_prob=min_prob)
        rec = TraceRecorder.for_model(model, predict=True)
        rec.generate(model, PROMPT, max_tokens=6, ubatch=4, ignore_eos=True)
        with rec.attached(model):
            model.logits(IDS)
        rec.generate(model, IDS[3:9].tolist(), max_tokens=4, ignore_eos=True)
        t = rec.trace()
        total = model.telemetry()["total"]
        sim = simulate(t.ops(), model.experts.capacity, policy, t.header.expert_bytes,
                       t.predictions(width, min_prob))
        if min_prob:  # the probability drops some of the width's guesses, and the replay drops the same
            assert t.predictions(width, min_prob) != t.predictions(width)
        got = (total["ops_seen"], total["resident_hits"], total["demand_misses"], total["evictions"],
               total["copied_bytes"], total["copy_ranges"], total["prefetch_issued"], total["prefetch_used"],
               total["prefetch_wasted"])
        want = (sim.ops, sim.hits, sim.misses, sim.evictions, sim.bytes_moved, sim.copy_ranges,
                sim.prefetch_issued, sim.prefetch_used, sim.prefetch_wasted)
        assert got == want, (name, policy, capacity, width)
        # At 3 slots every op (top-4) fills the cache: nothing is left to prefetch into.
        assert (sim.prefetch_issued > 0 and sim.prefetch_used > 0) == (capacity > 3)
        assert total["demand_misses"] == total["resident_misses"]


def test_runtime_predictor_is_what_the_recorder_records(models):
    # Without a recorder the runtime's own predictor plans: the same counters as with one.
    counters = []
    for record in (False, True):
        model = _load(models["bundled"], experts=20, prefetch="on", prefetch_width=1.5)
        if record:
            TraceRecorder.for_model(model, predict=True).generate(model, PROMPT, max_tokens=6, ignore_eos=True)
        else:
            model.generate(PROMPT, max_tokens=6, ignore_eos=True)
        counters.append({k: model.telemetry()["total"][k] for k in OP_COUNTERS})
    assert counters[0] == counters[1] and counters[0]["prefetch_issued"] > 0


def test_prefetch_lowers_demand_misses_on_the_bundled_model(models):
    rows = {}
    for pf in ("off", "on"):
        model = _load(models["bundled"], fraction=0.25, prefetch=pf)
        model.generate(PROMPT, max_tokens=24, ignore_eos=True)
        rows[pf] = model.telemetry()["total"]
    assert rows["off"]["prefetch_issued"] == 0
    assert rows["on"]["demand_misses"] < rows["off"]["demand_misses"]


# ---- results never depend on prefetch -------------------------------------------------------


@pytest.mark.parametrize("name", ["bundled", "qwen2"])
@pytest.mark.parametrize("store", ["ram", "mmap", "disk"])
def test_logits_bitwise_equal_with_prefetch(models, reference, name, store):
    for policy, size, width, min_prob in [("lrfu", 1, 1.0, 0), ("lru", 6, 2.0, 0), ("s3fifo", 12, 1.0, 0),
                                          ("lrfu", 0.5, 1.5, 0), ("arc", 1.0, 1.0, 0), ("lrfu", 10, 2.0, 0.1)]:
        sized = {"fraction": size} if isinstance(size, float) else {"experts": size}
        model = _load(models[name], store=store, policy=policy, prefetch="on", prefetch_width=width,
                      prefetch_min_prob=min_prob, **sized)
        _check(model, reference[name])
        if size != 1.0 and size != 1:
            assert model.telemetry()["total"]["prefetch_issued"] > 0, (store, policy, size)
        slots_hold_what_they_claim(model.experts)


def test_slowed_worker_changes_nothing(models, reference):
    model = _load(models["qwen2"], experts=10, store="disk", prefetch="on", prefetch_width=2.0)

    def slow(_n):
        if threading.current_thread().name == WORKER:
            time.sleep(0.003)

    model.experts.store.read_hook = slow
    _check(model, reference["qwen2"])
    t = model.telemetry()
    assert t["total"]["prefetch_used"] > 0 and t["copy_failures"] == 0 and t["stall_seconds"] > 0
    slots_hold_what_they_claim(model.experts)


def test_bytes_read_are_the_copied_bytes_less_the_prefetches_dropped_before_their_copy(models, reference,
                                                                                       monkeypatch):
    # A planned prefetch counts in copied_bytes (as the simulator counts it); one whose expert loses
    # its slot before its copy starts is never copied, and says so. The op's thread makes its own
    # copies and the worker starts no job, so which prefetches are taken over and which dropped is
    # the planning's alone.
    from expertcache.tiers import cache as cache_module

    monkeypatch.setattr(cache_module, "_core_to_spare", lambda: False)
    model = _load(models["qwen2"], experts=6, store="ram", prefetch="on", prefetch_width=2.0)
    cache = model.experts
    worker = cache._start_worker()
    with worker._cond:
        worker._demand += 1  # as if a demand copy never ended: the worker waits
    copied, plain_copy = [], cache.store.copy_run

    def counting_copy(layer, first, dst, non_blocking=False):
        copied.append(dst.shape[0] * cache.expert_bytes[layer])
        return plain_copy(layer, first, dst, non_blocking)

    monkeypatch.setattr(cache.store, "copy_run", counting_copy)
    try:
        _check(model, reference["qwen2"])
    finally:
        with worker._cond:
            worker._demand -= 1
            worker._cond.notify_all()
    cache.quiesce()
    t = model.telemetry()
    assert t["prefetch_dropped_bytes"] > 0
    assert sum(copied) == t["total"]["copied_bytes"] - t["prefetch_dropped_bytes"]


@pytest.mark.parametrize("name", ["bundled", "qwen2"])
def test_failing_worker_rolls_back_and_demand_recovers(models, reference, name):
    model = _load(models[name], experts=12, store="disk", prefetch="on", prefetch_width=1.5)
    failed = _fail_reads_on_the_worker(model.experts.store)
    _check(model, reference[name])
    assert failed and model.telemetry()["copy_failures"] > 0
    assert slots_hold_what_they_claim(model.experts) > 0
    # Every failure after the first few: still the same bits.
    _check(model, reference[name])
    slots_hold_what_they_claim(model.experts)


def test_failed_prefetch_leaves_its_slots_empty(models):
    # The worker fails every read; what it planned must leave the bookkeeping: after a wait, no
    # resident key is one whose copy only the worker would have made.
    model = _load(models["qwen2"], experts=10, store="disk", prefetch="on", prefetch_width=2.0)
    cache = model.experts
    model.logits(IDS[:1])  # op 0 plans nothing: let some ops pass first; the last pins 4 slots

    _fail_reads_on_the_worker(cache.store)
    layer = cache.moe_layers[0]
    resident = {k.expert for k in cache.residency.resident_keys() if k.layer == layer}
    wanted = [e for e in range(cache.num_experts) if e not in resident][:3]
    cache.prefetch(layer, wanted)
    assert all(cache.residency.is_resident(ExpertKey(layer, e)) for e in wanted)
    cache.quiesce()
    assert not any(cache.residency.is_resident(ExpertKey(layer, e)) for e in wanted)
    assert cache.telemetry()["copy_failures"] >= 1


# ---- a wave's demand copies on the worker while its other experts compute -------------------


@pytest.mark.parametrize("name", ["bundled", "qwen2"])
def test_disk_store_reads_a_waves_misses_on_the_worker(models, reference, name):
    # Prefetch off: the worker runs for the disk store alone and makes every read, a wave's demand
    # copies whether or not the wave has experts to compute meanwhile. The counters stay the
    # simulator's, the logits the all-resident ones.
    model = _load(models[name], experts=12, store="disk", prefetch="off")
    readers = []
    model.experts.store.read_hook = lambda _n: readers.append(threading.current_thread().name)
    _check(model, reference[name])
    assert readers and set(readers) == {WORKER}
    model = _load(models[name], experts=12, store="disk", prefetch="off")
    rec = TraceRecorder.for_model(model)
    rec.generate(model, PROMPT, max_tokens=6, ignore_eos=True)
    t = rec.trace()
    total = model.telemetry()["total"]
    sim = simulate(t.ops(), 12, "lrfu", t.header.expert_bytes)
    assert (total["demand_misses"], total["copied_bytes"], total["prefetch_issued"]) == (sim.misses, sim.bytes_moved, 0)
    slots_hold_what_they_claim(model.experts)


def test_ram_store_splits_waves_where_a_core_is_free(models, reference, monkeypatch):
    from expertcache.tiers import cache as cache_module

    model = _load(models["bundled"], experts=12, store="ram", prefetch="on")
    split = []
    finish = model.experts._finish_demand
    model.experts._finish_demand = lambda job, **kw: (split.append(job.layer), finish(job, **kw))[1]
    monkeypatch.setattr(cache_module, "_core_to_spare", lambda: False)
    _check(model, reference["bundled"])
    assert not split
    monkeypatch.setattr(cache_module, "_core_to_spare", lambda: True)
    _check(model, reference["bundled"])
    assert split
    slots_hold_what_they_claim(model.experts)


def test_a_demand_copy_failing_on_the_worker_is_made_again(models, reference):
    model = _load(models["qwen2"], experts=10, store="disk", prefetch="off")
    failed = _fail_reads_on_the_worker(model.experts.store)
    _check(model, reference["qwen2"])
    assert failed and model.telemetry()["copy_failures"] == len(failed)
    slots_hold_what_they_claim(model.experts)


def test_a_wave_left_early_leaves_its_misses_unplanned(models):
    """The caller closes the op after its hits: the misses the worker is still reading leave the
    bookkeeping, and the close waits for that read, so nothing writes their slots afterwards."""
    model = _load(models["qwen2"], experts=10, store="disk", prefetch="off")
    cache = model.experts
    model.logits(IDS[:4])
    layer = cache.moe_layers[0]
    hits = sorted(k.expert for k in cache.residency.resident_keys() if k.layer == layer)[:2]
    misses = [e for e in range(cache.num_experts) if not cache.residency.is_resident(ExpertKey(layer, e))][:2]
    assert len(hits) == 2 and len(misses) == 2
    started, release = threading.Event(), threading.Event()

    def hold(_n):
        if threading.current_thread().name == WORKER:
            started.set()
            release.wait(10)

    cache.store.read_hook = hold
    op = cache.acquire(layer, sorted(hits + misses))
    assert [e for e, _ in next(op)] == hits  # the hits first, while the misses are read
    assert started.wait(10)
    threading.Timer(0.05, release.set).start()
    op.close()
    assert release.is_set()  # the close waited for the read in flight
    assert not any(cache.residency.is_resident(ExpertKey(layer, e)) for e in misses)
    assert all(cache.residency.is_resident(ExpertKey(layer, e)) for e in hits)
    cache.store.read_hook = None
    slots_hold_what_they_claim(cache)


@pytest.mark.parametrize("with_hits", [False, True])
def test_work_beside_the_experts_runs_while_the_ops_misses_are_read(models, with_hits):
    """`acquire(meanwhile=...)` (Gemma 4's dense MLP) runs once the op's misses
    are handed to the worker and before anything waits for them: it overlaps the read in flight,
    whether or not the op has hits to compute first."""
    model = _load(models["qwen2"], experts=10, store="disk", prefetch="off")
    cache = model.experts
    model.logits(IDS[:4])
    layer = cache.moe_layers[0]
    hits = sorted(k.expert for k in cache.residency.resident_keys() if k.layer == layer)[:2] if with_hits else []
    misses = [e for e in range(cache.num_experts) if not cache.residency.is_resident(ExpertKey(layer, e))][:2]
    reading, release = threading.Event(), threading.Event()
    order = []

    def hold(_n):
        if threading.current_thread().name == WORKER:
            reading.set()
            assert release.wait(10)
            order.append("read")

    def meanwhile():
        assert reading.wait(10)  # the worker is reading this op's misses now
        order.append("meanwhile")
        release.set()

    cache.store.read_hook = hold
    waves = [[e for e, _ in wave] for wave in cache.acquire(layer, sorted(hits + misses), meanwhile=meanwhile)]
    cache.store.read_hook = None
    assert order[:2] == ["meanwhile", "read"] and order.count("meanwhile") == 1
    assert sorted(e for wave in waves for e in wave) == sorted(hits + misses)
    slots_hold_what_they_claim(cache)


class _StreamOrder:
    """The cache's transfers as a GPU would order them, on the CPU: copies are made as on a CPU,
    and each point where the compute stream would be made to wait for copies is logged."""

    cuda = True

    def __init__(self, real, log: list):
        self.real, self.log = real, log

    def copy(self, slots, do_copy):
        self.real.copy(slots, do_copy)

    def prefetch_copy(self, slots, do_copy):
        self.real.prefetch_copy(slots, do_copy)
        return "event"

    def wait_prefetched(self, event):
        self.log.append("wait")

    def before_compute(self):
        self.log.append("wait")

    def after_compute(self, slots):
        pass

    def synchronize(self):
        pass


def test_on_a_gpu_work_beside_the_experts_is_queued_before_the_waits_for_copies(models):
    """On a GPU, `meanwhile` (Gemma 4's dense MLP) is queued on the compute stream before that
    stream is made to wait for the op's copies (its prefetched experts' and its demand copies');
    queued after a wait, it ran only once those copies had landed."""
    model = _load(models["qwen2"], experts=10, store="ram", prefetch="on", prefetch_width=2.0)
    cache = model.experts
    model.logits(IDS[:4])
    layer, nxt = cache.moe_layers[:2]
    log = []
    cache.transfers = _StreamOrder(cache.transfers, log)
    missing = [e for e in range(cache.num_experts) if not cache.residency.is_resident(ExpertKey(nxt, e))]
    cache.prefetch(nxt, missing[:1])  # pending when its op arrives: the op waits for it
    ops = list(cache.acquire(nxt, sorted(missing[:3]), meanwhile=lambda: log.append("meanwhile")))
    cache.quiesce()
    assert log[0] == "meanwhile" and log.count("meanwhile") == 1 and "wait" in log, log
    assert sorted(e for wave in ops for e, _ in wave) == sorted(missing[:3])
    slots_hold_what_they_claim(cache)


def test_a_prefetch_failing_while_its_op_is_planned_keeps_its_slot_for_that_op(models):
    """A prefetch whose copy fails after the op that hits it was planned, and before that op plans
    the next prefetch: the op copies it again itself, and its slot is not given to the next
    prefetch while the op reads it (a race a failing worker hit about once in 60 generations)."""
    model = _load(models["qwen2"], experts=10, store="disk", prefetch="on", prefetch_width=2.0)
    cache = model.experts
    model.logits(IDS[:4])
    layer, nxt = cache.moe_layers
    go, ran = threading.Event(), threading.Event()

    def fail_when_told(_n):
        if threading.current_thread().name == WORKER:
            ran.set()
            go.wait(10)
            raise CopyError("injected read failure")

    cache.store.read_hook = fail_when_told
    resident = {k.expert for k in cache.residency.resident_keys() if k.layer == layer}
    hit = [e for e in range(cache.num_experts) if e not in resident][:2]
    cache.prefetch(layer, hit)
    assert ran.wait(10)  # the job is running: the op's own first reap keeps it

    def predict(at: int):
        # the op is planned; the job now fails, before this op plans the next layer's prefetch
        go.set()
        job, _ = cache._pending[cache.residency.slot_of(ExpertKey(layer, hit[0]))]
        assert job.done.wait(10) and job.error is not None
        return nxt, list(range(cache.num_experts))

    cache.predict = predict
    ops = cache.acquire(layer, sorted(hit))
    wave = next(ops)
    cache._worker.drain()  # whatever the next prefetch writes is written now
    for e, w in wave:
        slot = next(i for i, v in enumerate(cache.views[layer]) if v is w)
        want = torch.zeros_like(cache.pool[slot: slot + 1])
        cache.store.read_hook = None
        cache.store.copy_run(layer, e, want)
        assert torch.equal(cache.pool[slot], want[0]), (e, slot)
    ops.close()
    cache.predict = None
    slots_hold_what_they_claim(cache)


def _hold_worker_until_an_op_waits(cache) -> threading.Event:
    """The worker's reads wait until an op waits for a copy (the disk store: by then the op has
    moved the copies it needs to the front of the queue). Returns an event set once the worker
    is held in a read, so that the jobs queued after that one are all still queued."""
    held, release = threading.Event(), threading.Event()

    def hold(_n):
        if threading.current_thread().name == WORKER:
            held.set()
            assert release.wait(10), "no op waited for a copy within 10 s"

    wait = cache._wait_job

    def released_then_wait(job, queued):
        release.set()
        wait(job, queued)

    cache.store.read_hook = hold
    cache._wait_job = released_then_wait
    return held


def _let_worker_go(cache) -> None:
    cache.store.read_hook = None
    del cache._wait_job


def test_a_prefetch_not_started_is_taken_over(models, reference, monkeypatch):
    # Where the op's thread makes its own copies (a RAM store with every core computing, a GPU)
    # and the worker starts no job (as if a demand copy never ended): every prefetch an op needs
    # is copied by the demand path, once; the counters stay those of a free worker, the bits the
    # reference's.
    from expertcache.tiers import cache as cache_module

    monkeypatch.setattr(cache_module, "_core_to_spare", lambda: False)
    counters = []
    for held in (False, True):
        model = _load(models["qwen2"], experts=10, store="ram", prefetch="on", prefetch_width=2.0)
        model.logits(IDS[:3])
        worker = model.experts._start_worker()
        if held:
            worker.drain()
            with worker._cond:
                worker._demand += 1
        try:
            _check(model, reference["qwen2"])
            if held:
                assert worker._queue  # predicted, never used, never copied
        finally:
            if held:
                with worker._cond:
                    worker._demand -= 1
                    worker._cond.notify_all()
        counters.append({k: model.telemetry()["total"][k] for k in OP_COUNTERS})
        slots_hold_what_they_claim(model.experts)
    assert counters[0] == counters[1] and counters[1]["prefetch_used"] > 0


def test_a_prefetch_not_started_goes_first_on_the_worker(models):
    # The disk store: the worker makes every copy. A prefetched expert whose copy has not started
    # when its op arrives moves to the front of the queue, ahead of copies planned for a later op,
    # and is read once, on the worker.
    model = _load(models["qwen2"], experts=10, store="disk", prefetch="on", prefetch_width=2.0)
    cache = model.experts
    model.logits(IDS[:1])  # 4 experts of each layer resident, 2 slots free
    cache.predict = None  # only the copies planned below
    cache.quiesce()
    layer, nxt = cache.moe_layers
    ran = []
    run_job = cache._run_job
    cache._run_job = lambda job: (ran.append((job.layer, tuple(job.experts), threading.current_thread().name)),
                                  run_job(job))[1]
    held = _hold_worker_until_an_op_waits(cache)

    def absent(at: int) -> list[int]:
        return [e for e in range(cache.num_experts) if not cache.residency.is_resident(ExpertKey(at, e))]

    later = absent(nxt)[::2][:2]  # not adjacent: two jobs
    cache.prefetch(nxt, later)
    assert held.wait(10)  # the first is being read, the second queued
    now = absent(layer)[:1]
    cache.prefetch(layer, now)  # queued behind the second
    assert all(cache.residency.is_resident(ExpertKey(at, e)) for at, es in ((nxt, later), (layer, now)) for e in es)
    ops = cache.acquire(layer, now)
    assert [e for e, _ in next(ops)] == now
    ops.close()
    cache.quiesce()
    _let_worker_go(cache)
    del cache._run_job
    assert ran == [(nxt, (later[0],), WORKER), (layer, (now[0],), WORKER), (nxt, (later[1],), WORKER)], ran
    assert cache.telemetry()["copy_failures"] == 0
    slots_hold_what_they_claim(cache)


@pytest.mark.parametrize("store", ["ram", "disk"])
def test_a_waved_op_takes_over_its_prefetched_hits_before_later_waves_reuse_their_slots(models, reference,
                                                                                       tmp_path, store,
                                                                                       monkeypatch):
    # After a reload every slot is free, so the first forward's prediction fills the pool; its op
    # needs more experts than there are slots and runs in waves. A later wave's fills reuse slots
    # of the first wave's prefetched hits: their copies, not started, must still be made for the
    # first wave (once seen only under load, as wrong logits). With the RAM store and every core
    # computing the worker is held and the op takes them over; with the disk store the worker
    # waits until the op waits, and makes them first.
    import shutil

    from expertcache.tiers import cache as cache_module

    monkeypatch.setattr(cache_module, "_core_to_spare", lambda: False)
    path = shutil.copytree(models["qwen2"], tmp_path / "m")
    model = _load(path, experts=10, store=store, prefetch="on", prefetch_width=2.0)
    _check(model, reference["qwen2"])
    for f in path.glob("*.safetensors"):
        data = f.read_bytes()
        f.unlink()
        f.write_bytes(data)
    worker = model.experts._start_worker()
    worker.drain()
    if store == "disk":
        _hold_worker_until_an_op_waits(model.experts)
    else:
        with worker._cond:
            worker._demand += 1
    try:
        assert torch.equal(model.logits(IDS), reference["qwen2"][0])
        assert model.telemetry()["total"]["prefetch_used"] > 0
    finally:
        if store == "disk":
            _let_worker_go(model.experts)
        else:
            with worker._cond:
                worker._demand -= 1
                worker._cond.notify_all()
    slots_hold_what_they_claim(model.experts)


# ---- configuration, flags, reporting ---------------------------------------------------------


def test_prefetch_config_and_where_auto_turns_it_on():
    assert CacheConfig().prefetch == "auto" and CacheConfig().prefetch_width == 1.0
    sized = {"cache": 4, "staging": 4, "resident": None}  # resident holds every expert and takes no size
    on = {(mode, store, dev): CacheConfig(mode=mode, store=store, experts=sized[mode]).prefetch_active(dev)
          for mode in sized for store in ("ram", "mmap", "disk") for dev in ("cpu", "cuda")}
    assert {k for k, v in on.items() if v} == {("cache", "ram", "cuda"), ("cache", "mmap", "cuda"),
                                               ("cache", "disk", "cuda")}
    # On a CPU, `auto` turns it on only for direct reads steered by fitted maps; in cache mode.
    fitted = {mode: CacheConfig(mode=mode, store="disk", experts=sized[mode]).prefetch_active("cpu", True)
              for mode in sized}
    assert fitted == {"cache": True, "staging": False, "resident": False}
    assert not CacheConfig(experts=4, store="disk", prefetch="off").prefetch_active("cpu", True)
    assert CacheConfig(experts=4, prefetch="on").prefetch_active("cpu")
    assert not CacheConfig(experts=4, store="disk", prefetch="off").prefetch_active("cpu")
    assert not CacheConfig(experts=4, prefetch="on", prefetch_width=0).prefetch_active("cpu")
    with pytest.raises(ExpertCacheError, match="unknown prefetch setting 'yes'"):
        CacheConfig(prefetch="yes")
    with pytest.raises(ExpertCacheError, match="prefetch width -1"):
        CacheConfig(prefetch_width=-1)
    for bad in (1, 1.5, -0.1, "0.5", True):
        with pytest.raises(ExpertCacheError, match=f"min-prob must be a probability in \\[0, 1\\), got {bad!r}"):
            CacheConfig(prefetch_min_prob=bad)


def test_prefetch_flags():
    p = Parser(prog="x")
    add_cache_flags(p)
    c = cache_config(p.parse_args(["--cache-experts", "4", "--prefetch", "on", "--prefetch-width", "1.5",
                                   "--prefetch-min-prob", "0.55"]))
    assert (c.prefetch, c.prefetch_width, c.prefetch_min_prob) == ("on", 1.5, 0.55)
    assert cache_config(p.parse_args([])).prefetch_min_prob == 0
    assert cache_config(p.parse_args([])).prefetch == "auto"
    for bad in (["--prefetch", "sometimes"], ["--prefetch-min-prob", "1"], ["--prefetch-min-prob", "x"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)


def test_telemetry_line_json_and_metrics(models):
    from expertcache.server.metrics import ServerCollector

    model = _load(models["qwen2"], experts=10, store="disk", prefetch="on")
    model.generate(PROMPT, max_tokens=4, ignore_eos=True)
    t = model.telemetry()
    assert t["prefetch"] is True and t["total"]["prefetch_issued"] > 0 and t["stall_seconds"] > 0
    for layer in t["layers"].values():
        assert {"demand_misses", "prefetch_issued", "prefetch_used", "prefetch_wasted"} <= set(layer)
    line = model.experts.telemetry_.line()
    assert f"demand_misses={t['total']['demand_misses']}" in line and "prefetch issued=" in line
    assert "stall=" in line

    class NoScheduler:
        slots = []

        def snapshot(self):
            from types import SimpleNamespace

            return SimpleNamespace(requests=0, aborted=0, errors=0, prompt_tokens=0, cached_tokens=0,
                                   predicted_tokens=0, prompt_seconds=0.0, predicted_seconds=0.0,
                                   processing=0, deferred=0)

    names = {m.name for m in ServerCollector(model, NoScheduler()).collect()}
    assert {"expertcache_cache_prefetch_issued", "expertcache_cache_prefetch_used",
            "expertcache_cache_prefetch_wasted", "expertcache_cache_demand_misses",
            "expertcache_cache_stall_seconds", "expertcache_cache_prefetch_active"} <= names


def test_prefetch_is_off_in_other_modes_and_by_default_on_a_cpu(models):
    for cache in (CacheConfig(mode="resident"), CacheConfig(mode="staging", store="disk", prefetch="on"),
                  CacheConfig(mode="cache", experts=8), CacheConfig(mode="cache", experts=8, store="disk")):
        model = expertcache.load(models["qwen2"], cache=cache)
        model.generate(PROMPT, max_tokens=3, ignore_eos=True)
        assert model.telemetry()["total"]["prefetch_issued"] == 0 and model.net.residual_hook is None


def test_auto_prefetches_direct_disk_reads_steered_by_fitted_maps(tmp_path, monkeypatch, capsys):
    import json
    import os
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file

    from expertcache.tiers.store import DiskStore

    assets = Path(expertcache.__file__).parent / "assets"
    maps = str(assets / "tiny-qwen3-moe.predictor.safetensors")
    open_direct = DiskStore._open_direct

    def direct_or_stand_in(store):  # a file system without O_DIRECT: stand-in descriptors
        return open_direct(store) or {p: os.open(p, os.O_RDONLY) for p in store._fds}

    monkeypatch.setattr(DiskStore, "_open_direct", direct_or_stand_in)
    packed = pack(assets / "tiny-qwen3-moe", tmp_path / "packed", progress=False)  # experts on pages
    want = expertcache.load(packed, cache=CacheConfig(mode="resident")).logits(IDS)

    def load(path, **cache):
        return expertcache.load(path, cache=CacheConfig(fraction=0.25, **cache))

    model = load(packed, store="disk", predictor=maps)
    assert model.experts.store.reads_direct and model.experts.prefetching
    assert torch.equal(model.logits(IDS), want) and model.telemetry()["total"]["prefetch_issued"] > 0
    assert model.experts.predict.own.name.startswith("linear:")
    # Not with the routers predicting, another store, prefetch off, or experts off page boundaries
    # (the bundled checkpoint as saved: its reads are buffered).
    for path, cache in ((packed, {"store": "disk"}), (packed, {"store": "mmap", "predictor": maps}),
                        (packed, {"store": "ram", "predictor": maps}),
                        (packed, {"store": "disk", "predictor": maps, "prefetch": "off"}),
                        (assets / "tiny-qwen3-moe", {"store": "disk", "predictor": maps})):
        other = load(path, **cache)
        assert not other.experts.prefetching and other.net.residual_hook is None, cache
        assert torch.equal(other.logits(IDS), want)
        assert other.telemetry()["total"]["prefetch_issued"] == 0
    # A reload whose routers no longer fit the maps: the routers would predict, so auto turns it off.
    path = shutil.copytree(packed, tmp_path / "changed")
    model = load(path, store="disk", predictor=maps)
    assert model.experts.prefetching
    # One router's rows reversed in place of its bytes, the rest of the layout kept (experts on
    # pages), the file replaced under its name.
    f = next(f for f in path.glob("*.safetensors") if any(k.endswith("mlp.gate.weight") for k in load_file(f)))
    name = next(k for k in load_file(f) if k.endswith("mlp.gate.weight"))
    data = bytearray(f.read_bytes())
    n = int.from_bytes(data[:8], "little")
    start, end = (8 + n + o for o in json.loads(data[8: 8 + n])[name]["data_offsets"])
    data[start:end] = load_file(f)[name].flip(0).contiguous().view(torch.uint8).numpy().tobytes()
    (tmp_path / "new").write_bytes(data)
    os.replace(tmp_path / "new", f)
    model.logits(IDS)
    assert model.experts.store.reads_direct
    assert "the routers predict from now on" in capsys.readouterr().err
    assert not model.experts.prefetching and model.experts.predict is None and model.net.residual_hook is None


def test_resize_and_reload_keep_prefetch_on_the_new_weights(models, reference, tmp_path):
    import shutil

    path = shutil.copytree(models["qwen2"], tmp_path / "m")
    model = _load(path, experts=10, store="disk", prefetch="on")
    _check(model, reference["qwen2"])
    old = model.net
    # A checkpoint rewritten with the same bytes under a new version: reloaded, predictor rebuilt.
    for f in path.glob("*.safetensors"):
        data = f.read_bytes()
        f.unlink()
        f.write_bytes(data)
    _check(model, reference["qwen2"])
    assert model.net is not old and model.net.residual_hook.decoder is model.net
    model.resize_cache(CacheConfig(mode="cache", experts=6, store="disk", prefetch="off"))
    assert model.net.residual_hook is None and model.experts.predict is None
    _check(model, reference["qwen2"])
    model.resize_cache(CacheConfig(mode="cache", experts=14, store="disk", prefetch="on", prefetch_width=2.0))
    _check(model, reference["qwen2"])
    assert model.telemetry()["total"]["prefetch_used"] > 0


def test_a_dropped_model_and_a_replaced_decoder_go_without_the_cycle_collector(models, tmp_path):
    # Prefetch hooks tie the decoder and the cache to each other: a dropped model (or the decoder a
    # reload replaced, with its weights) waited for gc, the slot pool (VRAM on a GPU) with it.
    import gc
    import shutil
    import weakref

    path = shutil.copytree(models["qwen2"], tmp_path / "m")
    gc.collect()
    gc.disable()
    try:
        model = _load(path, experts=10, store="disk", prefetch="on")
        model.generate(PROMPT, max_tokens=2, ignore_eos=True)
        old = weakref.ref(model.net)
        for f in path.glob("*.safetensors"):  # rewritten under a new version: the next call reloads
            data = f.read_bytes()
            f.unlink()
            f.write_bytes(data)
        model.generate(PROMPT, max_tokens=2, ignore_eos=True)
        assert old() is None
        cache, net = weakref.ref(model.experts), weakref.ref(model.net)
        del model
        assert cache() is None and net() is None
    finally:
        gc.enable()


def test_verify_mode_checks_prefetched_slots(models, reference):
    model = _load(models["bundled"], experts=40, store="disk", prefetch="on", prefetch_width=1.5, verify=True)
    _check(model, reference["bundled"])
    cache = model.experts
    assert model.telemetry()["total"]["prefetch_used"] > 0
    cache.quiesce()
    # Slots corrupted after their copies (prefetched ones among them) are caught when an op reads one.
    assert cache.residency.prefetched_unused()
    for key in cache.residency.resident_keys():
        cache.pool[cache.residency.slot_of(key), 5] += 1
    with pytest.raises(ExpertCacheError, match="verify: slot .* does not match the checksum"):
        model.logits(IDS)


def test_a_failing_predictor_leaves_the_op_unplanned(models, reference):
    model = _load(models["qwen2"], experts=10, store="ram", prefetch="on")
    model.logits(IDS[:2])
    predict = model.experts.predict

    def broken(layer):
        raise RuntimeError("predictor failed")

    model.experts.predict = broken
    with pytest.raises(RuntimeError, match="predictor failed"):
        model.logits(IDS)
    model.experts.predict = predict
    slots_hold_what_they_claim(model.experts)
    _check(model, reference["qwen2"])


@pytest.mark.parametrize("store", ["ram", "disk"])
def test_a_cleared_cache_starts_cold_and_changes_no_bit(models, reference, store):
    """`clear()` (bench cache's start from empty slots after its warm-up) with prefetch copies
    pending: every slot empty and the policy's history gone, then the same logits as every expert
    resident, and the same copies as a freshly loaded model makes."""
    model = _load(models["qwen2"], experts=10, store=store, prefetch="on", prefetch_width=2.0)
    model.logits(IDS[:8])
    model.experts.clear()
    assert not model.experts.residency.resident_keys() and not model.experts._pending
    slots_hold_what_they_claim(model.experts)
    before = model.telemetry()["total"]["copied_bytes"]
    _check(model, reference["qwen2"])
    fresh = _load(models["qwen2"], experts=10, store=store, prefetch="on", prefetch_width=2.0)
    _check(fresh, reference["qwen2"])
    assert model.telemetry()["total"]["copied_bytes"] - before == fresh.telemetry()["total"]["copied_bytes"]
