"""The fast tier: one slot pool, allocated once and owned by the cache, shared by all layers.

Per MoE op the cache plans with `Residency` (pure bookkeeping: hits, misses, victims, waves),
copies only the missing experts (runs of experts contiguous in the slow tier into consecutive
slots as one copy), and yields views into the slots wave by wave. When nothing is missing no copy
is issued and nothing waits. Slots are described by what they hold (key, source file version,
the expert's format: each matrix's storage type and shape); a lookup is only valid while all of
those match, and slots are invalidated exactly when one of them changes, counted by reason.

The pool is bytes: a slot holds one expert as the slow tier stores it (float matrices in the
compute dtype, quantized ones as the file's blocks or the kernels' tiles of them), and the cache
never interprets them.

`acquire(layer, experts)` is the provider call the MoE layer makes: a generator that yields the
op's experts wave by wave; leaving it (exhausted, closed or on error) releases what it pinned.

Modes: `cache` (the slot cache), `resident` (every expert in a slot from the start: the upper
bound) and `staging` (the control: every op copies every expert it uses, no reuse).

Prefetch (`cache` mode, docs/cache.md "Prefetch"): right after an op is planned, `predict(layer)`
names the next op's predicted experts and `prefetch` plans them (`Residency.plan_prefetch`: the
bookkeeping the trace simulator replays); their copies run on a worker thread (`CopyWorker`) while
the op computes. An op that hits a prefetched expert takes its copy over if it has not started
(on a CPU, where the worker makes every copy an op waits for, moves it to the front of the
worker's queue), waits for it if it runs, and copies it itself if it failed; a prefetch whose
expert lost its slot before its copy started is not copied; a failed one leaves the bookkeeping,
as a failed demand copy does.
"""

from __future__ import annotations


import functools
import os
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator, Sequence, Set
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from ..config import CacheConfig
from ..errors import CopyError, ExpertCacheError
from ..memory import host_zeros
from ..telemetry import Telemetry
from .layout import ExpertFormat, ExpertWeights, expert_weights
from .policy import ExpertKey, make_policy
from .residency import Residency, Wave
from .store import LARGE_LOAD_BYTES, ExpertStore, FileVersion, file_version
from .transfer import DONE, CopyJob, CopyWorker, Transfers

_NOTHING: frozenset = frozenset()

# After an op of a layer is planned: the next op's layer and its predicted experts (distinct,
# best first), or None.
Predict = Callable[[int], "tuple[int, list[int]] | None"]


# Every cache of the process, for what a fork must set right in the child (`_after_fork_in_child`).
_CACHES: weakref.WeakSet[ExpertCache] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for cache in list(_CACHES):
        cache._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass(frozen=True, slots=True)
class SlotContent:
    key: ExpertKey
    version: tuple[FileVersion, ...]  # of every file the expert was read from (`ExpertStore.version_of`)
    format: ExpertFormat  # each matrix's storage type, shape and offset
    nbytes: int


class ExpertCache:
    def __init__(self, store: ExpertStore, config: CacheConfig, device: torch.device):
        self.store, self.config, self.device = store, config, device
        self.mode = config.mode
        self._adopt_geometry(store)
        self.telemetry_ = Telemetry(self.expert_bytes, config.trace_every)
        self._pending_invalid: dict[int, set[int]] = {}
        self.predict: Predict | None = None  # set by the engine when prefetch is active
        self.fitted_predictor = False  # set by the engine: fitted maps, not the routers, predict
        self._worker: CopyWorker | None = None
        self._worker_closer: weakref.finalize | None = None
        _CACHES.add(self)
        # Set while `set_store` has not completed: the next call opens the checkpoint again, so
        # that the engine never computes with weights of one version and experts of another.
        self._switching = False
        self._allocate(self._capacity_for(config))

    def _adopt_geometry(self, store: ExpertStore) -> None:
        src = store.source
        self.num_experts, self.moe_layers = src.num_experts, list(src.layers)
        self.formats = dict(store.formats)
        self.slot_bytes = store.slot_bytes
        self.expert_bytes = {layer: f.nbytes for layer, f in self.formats.items()}

    # ---- sizing and allocation ----
    @property
    def total_experts(self) -> int:
        return self.num_experts * len(self.moe_layers)

    def _capacity_for(self, config: CacheConfig, store: ExpertStore | None = None) -> int:
        """Slots for `config` over `store`'s geometry (the current store's by default)."""
        src = (store or self.store).source
        slot_bytes = (store or self.store).slot_bytes
        if config.mode == "staging" and not config.sized:
            return src.num_experts  # room for any one op
        n = config.slots_for(src.num_experts * len(src.layers), slot_bytes)
        if n < 1:
            raise ExpertCacheError(f"cache of {config.mem} bytes is too small for one wave: one expert slot "
                                   f"needs {slot_bytes} bytes")
        return n

    def _allocate(self, capacity: int) -> None:
        # The pool first: a failed allocation leaves the cache as it was.
        try:
            pool = host_zeros((capacity, self.slot_bytes), torch.uint8, self.device)  # [S, slot bytes]
        except (RuntimeError, MemoryError) as e:
            raise ExpertCacheError(f"cannot allocate {capacity} expert slots "
                                   f"({capacity * self.slot_bytes / 2**20:.0f} MiB): {e}") from None
        self.capacity, self.pool = capacity, pool
        self._op_reads: Set[tuple[int, ExpertKey]] = frozenset()  # (slot, key) the op in flight reads
        # Each slot's views in each layer format, made once: they stay valid as long as the pool.
        by_format: dict[ExpertFormat, list[ExpertWeights]] = {}
        for fmt in self.formats.values():
            if fmt not in by_format:
                by_format[fmt] = [expert_weights(row, fmt) for row in self.pool]
        self.views = {layer: by_format[fmt] for layer, fmt in self.formats.items()}
        self._empty()
        self.transfers = Transfers(self.device, capacity)
        self.transfers.own(pool)
        if self.mode == "resident":
            self._fill_all()

    def _empty(self) -> None:
        """Every slot empty, with new bookkeeping (its op count too: no prefetch before a first
        op) and no prefetch copy planned."""
        capacity = self.capacity
        self._pending: dict[int, tuple[CopyJob, int]] = {}  # slot -> the prefetch copy planned into it
        self._jobs: list[CopyJob] = []  # prefetch jobs submitted and not yet reaped
        self.residency = Residency(capacity, make_policy(self.config.policy, capacity))
        self.content: list[SlotContent | None] = [None] * capacity
        self.checksums: list[int | None] = [None] * capacity

    def _fill_all(self) -> None:
        """Resident mode: every expert in its slot before the first op (counted as load copies)."""
        big = sum(self.expert_bytes.values()) * self.num_experts >= LARGE_LOAD_BYTES
        for layer in tqdm(self.moe_layers, desc="filling slots", unit="layer", leave=False,
                          disable=None if big else True):  # None: a bar only on a terminal
            plan = self.residency.plan(layer, list(range(self.num_experts)))
            done = 0
            try:
                for wave in plan.waves:
                    self._copy_wave(layer, wave)
                    self.telemetry_.load_copied_experts += len(wave.fills)
                    self.telemetry_.load_copied_bytes += len(wave.fills) * self.expert_bytes[layer]
                    done += 1
            finally:
                # A failed copy (a reload's refill, a resize) leaves the experts not copied out of
                # the bookkeeping, as in an op: an op that needs one copies it on demand.
                if done < len(plan.waves):
                    self._unplan(layer, plan.waves[done:])
        self.transfers.synchronize()

    def resize(self, config: CacheConfig) -> None:
        """Reallocate the pool at a new size; every slot is invalidated (reason `pool`). A size
        that does not fit one expert, or a pool that cannot be allocated, leaves the cache as it
        was (its slots emptied, in the second case)."""
        if config.store != self.store.name:
            # The slow tier is the model's: a resize keeps it. A config left at the default store
            # takes the model's (README's `resize_cache(CacheConfig(mode=..., experts=...))`); one
            # naming another would be ignored, so it is refused.
            if config.store != CacheConfig().store:
                raise ExpertCacheError(f"a resize keeps the store {self.store.name!r} the model was loaded with, "
                                       f"not {config.store!r}: load the model again to change it")
            config = replace(config, store=self.store.name)
        capacity = self._capacity_for(config)
        self.quiesce()
        self._invalidate_all("pool")
        old, pool = (self.config, self.mode), self.pool
        self.config, self.mode = config, config.mode
        try:
            self._allocate(capacity)
        except ExpertCacheError:
            if self.pool is pool:  # not allocated: the old pool stays, and with it the old config
                self.config, self.mode = old
            raise

    def clear(self) -> None:
        """Empty every slot, and the policy's history with them: the cache as a load leaves it,
        for a measurement that must start cold after a warm-up (resident mode keeps every expert).
        The counters go on."""
        if self.mode == "resident":
            return
        self.quiesce()  # every copy ends first: none writes a slot after it is emptied
        self._empty()
        # An op after a clear misses its experts whether or not an invalidation dropped them.
        self._pending_invalid.clear()

    # ---- one op ----
    def acquire(self, layer: int, experts: Sequence[int], meanwhile: Callable[[], None] | None = None
                ) -> Iterator[list[tuple[int, ExpertWeights]]]:
        """Make `experts` (sorted distinct ids of `layer`) available, wave by wave: each wave is a
        list of (expert, weights), valid until the next wave; closing the generator releases them.
        `meanwhile` runs once (`ExpertProvider.acquire`): with the split, after the first wave's
        copies are handed to the worker and before anything waits for them; on a GPU, before the
        compute stream is made to wait for the first wave's copies; otherwise after that wave's
        copies are made and before its experts compute."""

        def work_meanwhile() -> None:
            nonlocal meanwhile
            if meanwhile is not None:
                work, meanwhile = meanwhile, None
                work()

        if self.mode == "staging":
            self.residency.clear()  # no reuse: the control copies every expert every op
        self._reap()
        plan = self.residency.plan(layer, experts)
        if self._pending:
            # The bookkeeping already holds the last wave's fills: a prefetched hit of an earlier
            # wave keeps its pending copy even where a later wave reuses its slot. (Copies planned
            # later in this op are for the next layer, so without pending ones nothing is kept.)
            self._op_reads = {(s, ExpertKey(layer, e)) for w in plan.waves for e, s in zip(w.experts, w.slots)}
            self._sync_pending()
        pending = self._pending_invalid.pop(layer, None)
        if pending:
            self.telemetry_.pre_invalid_hit += len(pending.intersection(experts))
        copied = ranges = 0
        done = 0  # waves whose copies completed; the residency of later waves' fills is only a plan
        outstanding: CopyJob | None = None  # a wave's demand copies, on the worker
        try:
            # The next op's prediction is planned here, right after this op's plan (as the trace
            # simulator does); its copies start in the background.
            if self.predict is not None and self.prefetching:
                nxt = self.predict(layer)
                if nxt is not None:
                    self.prefetch(*nxt)
            # On a CPU, a wave whose bytes are partly there computes those experts first while the
            # copy worker makes the rest: with the disk store (a read waits on the disk more than
            # on a core), and with the others once prefetch has started the worker, where a core
            # is left for its copies (with every core computing they slowed decode, docs/cache.md).
            split = self.mode == "cache" and not self.transfers.cuda and (
                self.store.waits_on_device or (self._worker is not None and _core_to_spare()))
            if split:
                self._start_worker()
            demand = self._worker.demand if self._worker is not None else nullcontext
            for wave in plan.waves:
                t0 = time.perf_counter()
                late = self._late(layer, wave) if split else None
                if late is not None:
                    ready = _part(wave, lambda s: s not in late)
                    if wave.fills:
                        outstanding = self._demand_job(layer, wave)
                    work_meanwhile()
                    t0 = time.perf_counter()  # stall_seconds: waits for copies, not that work
                    self._take_prefetched(layer, ready)  # their copies are done: nothing waits
                    self.telemetry_.add_seconds("stall_seconds", time.perf_counter() - t0)
                    yield from self._compute(layer, ready)
                    t0 = time.perf_counter()
                    wave = _part(wave, lambda s: s in late)
                if split and outstanding is None and wave.fills:
                    outstanding = self._demand_job(layer, wave)
                if meanwhile is not None and (split or self.transfers.cuda):
                    # Before the waits below: it overlaps the reads. On a GPU those waits are
                    # queued on the compute stream, and work queued after them would wait for the
                    # copies too; queued first, it runs while they copy.
                    work_meanwhile()
                    t0 = time.perf_counter()
                # With the split, every copy the wave still waits for is made on the worker: its
                # demand copies and its pending prefetches go to the front of the queue, and this
                # thread only waits (outside `demand()`, which would hold the worker back). The
                # disk then reads one thing at a time, back to back, instead of idling until this
                # thread wakes to read or to let the worker go on.
                with nullcontext() if split else demand():
                    if self._pending:
                        copied += self._take_prefetched(layer, wave, queued=split)
                    if outstanding is not None:
                        ranges += self._finish_demand(outstanding, queued=split)
                        copied += len(outstanding.experts)
                        outstanding = None
                    elif wave.fills:  # no split: this thread reads
                        if self._worker is not None:
                            self._worker.wait_for_slots([s for _, s in wave.fills])
                        ranges += self._copy_demand(layer, wave)
                        copied += len(wave.fills)
                done += 1
                self.telemetry_.add_seconds("stall_seconds", time.perf_counter() - t0)
                # On a CPU without the split, this thread made the copies above.
                work_meanwhile()
                yield from self._compute(layer, wave)
        finally:
            self._op_reads = _NOTHING
            if outstanding is not None:
                self._settle(outstanding)
            # A copy that failed, or a caller that left early, leaves the bookkeeping as if the
            # remaining copies had never been planned: their slots are not marked resident.
            if done < len(plan.waves):
                self._unplan(layer, plan.waves[done:])
                if self._pending:
                    # A prefetched hit whose wave never took its copy over keeps an entry for a slot
                    # a later wave refilled (`_op_reads`); left, a prefetch putting the expert back
                    # there would replace it, and the copy, still queued, would write that slot
                    # after it was given to another expert.
                    self._sync_pending()
            # Counted whether or not the op got through: its plan evicted and used prefetches,
            # and the copies it made moved bytes, even where a later copy failed.
            self.telemetry_.op(layer, len(experts), plan.loaded_before, len(plan.hits), copied, ranges,
                               len(plan.evicted), len(plan.waves), prefetch_used=len(plan.prefetched),
                               wasted=plan.wasted)

    def _compute(self, layer: int, wave) -> Iterator[list[tuple[int, ExpertWeights]]]:
        """Hand a wave (or part of one) whose copies are done to the caller."""
        self.transfers.before_compute()
        if self.config.verify:
            for e, s in zip(wave.experts, wave.slots):
                self._verify(layer, e, s)
        views = self.views[layer]
        try:
            yield [(e, views[s]) for e, s in zip(wave.experts, wave.slots)]
        finally:
            self.transfers.after_compute(wave.slots)

    def _late(self, layer: int, wave) -> set[int] | None:
        """The wave's slots whose bytes are not there yet (its fills, and prefetches of its experts
        not done or failed), when some of its experts are ready; None otherwise."""
        late = {s for _, s in wave.fills}
        for e, s in zip(wave.experts, wave.slots):
            entry = self._pending.get(s)
            if entry is not None:
                job, i = entry
                if (job.layer, job.experts[i]) == (layer, e) and not (job.done.is_set() and job.error is None):
                    late.add(s)
        return late if 0 < len(late) < len(wave.experts) else None

    def _demand_job(self, layer: int, wave) -> CopyJob:
        """The wave's demand copies as a job at the front of the worker's queue."""
        job = CopyJob(layer, [e for e, _ in wave.fills], [s for _, s in wave.fills], wave)
        self._worker.submit(job, first=True)
        return job

    def _finish_demand(self, job: CopyJob, queued: bool = False) -> int:
        """Wait for a wave's demand copies on the worker (or, unless `queued`, make them here if
        the worker has not started them); copies that failed there are made again here, as a
        failed prefetch's are. Returns the transfers issued."""
        self._wait_job(job, queued)
        if job.error is None:
            return job.ranges
        self.telemetry_.copy_failures += 1
        with self._worker.demand() if queued else nullcontext():
            return self._copy_demand(job.layer, job.wave)

    def _wait_job(self, job: CopyJob, queued: bool) -> None:
        """`queued`: wait for the worker to make the job (the caller moved it to the front of the
        queue); else take it over if it has not started."""
        if job.done.is_set():  # ended (in a forked child, every job did at the fork: it may have no worker)
            return
        if queued:
            job.done.wait()
        else:
            self._worker.finish(job)

    def _copy_demand(self, layer: int, wave) -> int:
        """`_copy_wave` for an op's own copies, a failure counted."""
        try:
            return self._copy_wave(layer, wave)
        except BaseException:
            self.telemetry_.copy_failures += 1
            raise

    def _settle(self, job: CopyJob) -> None:
        """A wave left early: its demand copies are not made if they have not started, and are
        waited for if they run, so that nothing writes the slots once they are given back."""
        for i in range(len(job.experts)):
            if not self._worker.drop(job, i):
                job.done.wait()
                return

    def _unplan(self, layer: int, waves: list) -> None:
        self._drop_keys([ExpertKey(layer, e) for w in waves for e, _ in w.fills])

    def _drop_keys(self, keys: list[ExpertKey]) -> None:
        """The keys leave the bookkeeping and their slots are marked empty (their copies did not happen)."""
        if not keys:
            return
        slots = [self.residency.slot_of(k) for k in keys]
        self.residency.invalidate(keys)
        for s in slots:
            if s is not None:
                self.content[s] = None
                self.checksums[s] = None

    def _pieces(self, layer: int, runs) -> list[tuple[int, int, int]]:
        """Runs (first expert, first slot, n) as the store copies them: a run that is not one
        range of the slow tier goes expert by expert."""
        out = []
        for e0, s0, n in runs:
            if n > 1 and not self.store.contiguous_run(layer, e0, n):
                out.extend((e0 + i, s0 + i, 1) for i in range(n))
            else:
                out.append((e0, s0, n))
        return out

    def _ranges(self, layer: int, runs) -> int:
        """Transfers (reads of the slow tier) that copying `runs` issues."""
        return sum(self.store.ranges(layer, first, count) for first, _, count in self._pieces(layer, runs))

    def _copy_wave(self, layer: int, wave) -> int:
        """Issue the wave's copies; return how many transfers were issued."""
        issued = 0
        t0 = time.perf_counter()
        for first, slot, count in self._pieces(layer, wave.copy_runs):
            dst = self.pool[slot: slot + count]
            self.transfers.copy(list(range(slot, slot + count)),
                                lambda nb, f=first, d=dst: self.store.copy_run(layer, f, d, nb))
            issued += self.store.ranges(layer, first, count)
        self.telemetry_.add_seconds("copy_seconds", time.perf_counter() - t0)
        self._describe(layer, wave.fills)
        if self.config.verify:
            for _, s in wave.fills:
                self.transfers.synchronize()
                self.checksums[s] = self._checksum(s)
        return issued

    def _describe(self, layer: int, fills) -> None:
        fmt = self.formats[layer]
        for e, s in fills:
            self.content[s] = SlotContent(ExpertKey(layer, e), self.store.version_of(layer, e), fmt, fmt.nbytes)
            self.checksums[s] = None

    # ---- prefetch ----
    @property
    def prefetching(self) -> bool:
        """Whether predicted experts are copied early (`CacheConfig.prefetch_active`)."""
        return self.config.prefetch_active(self.device.type, self.fitted_predictor and self.store.reads_direct)

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        """Plan `experts` of `layer` (distinct ids, best first), predicted for the next op, now
        (`Residency.plan_prefetch`) and copy them in the background. Does nothing when prefetch is
        not active, nor before the first op (the trace simulator plans a prediction only after an
        op)."""
        if not experts or not self.prefetching or self.residency.ops_planned == 0:
            return
        # The worker first: one that cannot start (no thread to be had) leaves nothing planned,
        # where a plan without its jobs would leave slots claiming experts no one copies.
        worker = self._start_worker()
        self._reap()
        pf = self.residency.plan_prefetch(layer, list(experts))
        if self._pending:
            self._sync_pending()
        self.telemetry_.prefetched(layer, len(pf.experts), self._ranges(layer, pf.copy_runs), len(pf.evicted),
                                   pf.wasted)
        if not pf.experts:
            return
        self._describe(layer, zip(pf.experts, pf.slots))
        # The runs are in id order; the worker takes them best-ranked first, so that what the op
        # most likely needs is there soonest.
        rank = {e: r for r, e in enumerate(experts)}
        for e0, s0, n in sorted(pf.copy_runs, key=lambda run: min(rank[e] for e in range(run[0], run[0] + run[2]))):
            job = CopyJob(layer, list(range(e0, e0 + n)), list(range(s0, s0 + n)))
            for i, s in enumerate(job.slots):
                self._pending[s] = (job, i)
            self._jobs.append(job)
            worker.submit(job)

    def _start_worker(self) -> CopyWorker:
        if self._worker is None:
            ref = weakref.ref(self)

            def run(job: CopyJob) -> None:  # holds the cache weakly: a dropped model frees its pool
                cache = ref()
                if cache is None:
                    raise ExpertCacheError("the expert cache was closed")
                cache._run_job(job)

            self._worker = CopyWorker(run)
            self._worker_closer = weakref.finalize(self, self._worker.close)
        return self._worker

    def _after_fork_in_child(self) -> None:
        """In a process forked from this one: the copy worker's thread did not come along, so
        the jobs it had queued or was running would never end, and its locks may be held forever.
        The jobs end as failed copies (their slots may hold part of a read; the rollback drops
        their experts, and an op copies them on demand) and a new worker starts when one is next
        needed; the old one is left alone, its locks unused."""
        if self._worker is None:
            return
        self._worker_closer.detach()
        self._worker = self._worker_closer = None
        self.telemetry_.after_fork_in_child()
        for job in self._jobs:
            job.done = threading.Event()  # the old one's lock may have been held by the worker
            if job.state != DONE:
                job.error = CopyError(f"layer {job.layer}: the prefetch copy was lost when the process forked")
                job.state = DONE
            job.done.set()

    def _run_job(self, job: CopyJob) -> None:
        """A prefetch job's live experts into their slots (on the worker, or on the caller that took
        it over); in verify mode, their checksums. A job with a wave is that wave's demand copies."""
        if job.wave is not None:
            job.ranges = self._copy_wave(job.layer, job.wave)
            return
        live = [(e, s) for e, s, ok in zip(job.experts, job.slots, job.live) if ok]
        runs = []
        for e, s in live:
            if runs and e == runs[-1][0] + runs[-1][2] and s == runs[-1][1] + runs[-1][2]:
                runs[-1][2] += 1
            else:
                runs.append([e, s, 1])
        pieces = self._pieces(job.layer, runs)
        t0 = time.perf_counter()

        def do_copy(nb: bool) -> None:
            for first, slot, count in pieces:
                self.store.copy_run(job.layer, first, self.pool[slot: slot + count], nb)

        job.event = self.transfers.prefetch_copy([s for _, s in live], do_copy)
        self.telemetry_.add_seconds("prefetch_copy_seconds", time.perf_counter() - t0)
        if self.config.verify:
            if job.event is not None:
                job.event.synchronize()
            for _, s in live:
                self.checksums[s] = self._checksum(s)

    def _take_prefetched(self, layer: int, wave, queued: bool = False) -> int:
        """Make the wave's prefetched experts whose copies are pending ready: a copy not started is
        done here (the demand path takes it over; with `queued`, it is moved to the front of the
        worker's queue instead), one running is waited for, one that failed is made again here.
        Returns the copies made again."""
        entries = []
        for e, s in zip(wave.experts, wave.slots):
            entry = self._pending.get(s)
            if entry is not None and (entry[0].layer, entry[0].experts[entry[1]]) == (layer, e):
                entries.append((e, s, *entry))
        if queued:
            self._worker.expedite([job for _, _, job, _ in entries])
        again = 0
        for e, s, job, i in entries:
            self._wait_job(job, queued)
            del self._pending[s]
            if job.error is None:
                self.transfers.wait_prefetched(job.event)
                continue
            self._count_failure(job)  # now, not when the job is reaped at a later op
            job.live[i] = False  # made again here: `_reap` leaves it resident
            try:
                with self._worker.demand() if queued else nullcontext():
                    self._copy_wave(layer, _Fill(e, s))
            except BaseException:
                self.telemetry_.copy_failures += 1
                self._drop_keys([ExpertKey(layer, e)])
                raise
            again += 1
        return again

    def _sync_pending(self) -> None:
        """Prefetch copies whose expert lost its slot (evicted, invalidated) are not made if they
        have not started; one running is waited for before its slot is written again. A (slot,
        key) the op in flight reads in one of its waves (`_op_reads`) is kept whatever the slot
        holds after the op's last wave: that wave takes the copy over."""
        for s, (job, i) in list(self._pending.items()):
            key = ExpertKey(job.layer, job.experts[i])
            if (s, key) not in self._op_reads and self.residency.key_in(s) != key:
                del self._pending[s]
                if self._worker is not None and self._worker.drop(job, i):
                    self.telemetry_.prefetch_dropped_bytes += self.expert_bytes[job.layer]

    def _reap(self) -> None:
        """Roll back prefetches whose copy failed: their experts leave the bookkeeping (an op that
        needs one copies it on demand), as those of a failed demand copy do. One the op in flight
        reads (`_op_reads`: reaped when that op plans the next prefetch) keeps its job for the next
        reap: the wave copies it again (`_take_prefetched`); dropped now, its slot could be given
        to the next prefetch while the wave reads it."""
        if not self._jobs:
            return
        keep, failed = [], []
        for job in self._jobs:
            if not job.done.is_set():
                keep.append(job)
                continue
            if job.error is None:
                continue
            entries = [(i, s, ExpertKey(job.layer, e)) for i, (e, s) in enumerate(zip(job.experts, job.slots))
                       if self._pending.get(s) == (job, i)]
            if any((s, key) in self._op_reads for _, s, key in entries):
                keep.append(job)  # reaped after the op, which takes those entries over
                continue
            self._count_failure(job)
            for i, s, key in entries:
                del self._pending[s]
                if job.live[i]:
                    failed.append(key)
        self._jobs = keep
        self._drop_keys(failed)

    def _count_failure(self, job: CopyJob) -> None:
        """A failed prefetch job counts once in copy_failures, whoever sees the failure first."""
        if not job.counted:
            job.counted = True
            self.telemetry_.copy_failures += 1

    def quiesce(self) -> None:
        """Let every prefetch copy finish and roll back the failed ones (before the pool or the
        slow tier changes, and for tests that look at the slots)."""
        if self._worker is not None:
            self._worker.drain()
            self.transfers.synchronize()
        self._reap()

    def prefetching_mask(self, layer: int) -> int:
        """Bit e set when expert e of `layer` was prefetched and its copy has not finished."""
        mask = 0
        for job, i in list(self._pending.values()):
            if job.layer == layer and not job.done.is_set() and job.live[i]:
                mask |= 1 << job.experts[i]
        return mask

    # ---- verify mode ----
    def _checksum(self, slot: int) -> int:
        data = self.pool[slot]
        if data.device.type == "cpu":
            return zlib.crc32(data.numpy())
        words = data.view(torch.int32).to(torch.int64)
        weights = torch.arange(1, words.numel() + 1, device=words.device, dtype=torch.int64) % 65521
        return int((words * weights).sum())

    def _verify(self, layer: int, expert: int, slot: int) -> None:
        self.transfers.synchronize()
        if self.checksums[slot] is None or self._checksum(slot) != self.checksums[slot]:
            raise ExpertCacheError(f"verify: slot {slot} holding layer {layer} expert {expert} does not match "
                                   "the checksum taken when it was filled (its memory was overwritten)")

    # ---- invalidation ----
    def source_changed(self) -> bool:
        if self._switching:  # a switch to a new store failed part-way: open the checkpoint again
            return True
        for path, version in self.store.versions.items():
            try:
                if file_version(path) != version:
                    return True
            except FileNotFoundError:
                return True
        return False

    def set_store(self, store: ExpertStore) -> dict[str, int]:
        """Switch to a new slow tier (the checkpoint changed); invalidate exactly the slots whose
        description no longer matches, counted by reason. Returns the counts of this change."""
        self.quiesce()
        old = self.store
        src = store.source
        try:
            capacity = self._capacity_for(self.config, store)
        except ExpertCacheError:
            store.close()  # refused before anything changed: the old store stays, and so does the change
            raise
        self._switching = True
        if src.num_experts != self.num_experts or list(src.layers) != self.moe_layers:
            reason = "expert_count"
        elif store.formats != self.formats:
            # Same matrices and shapes in other storage types is a change of dtype (or of
            # quantization type); anything else is a change of shape.
            same_shapes = all([(m.name, m.shape) for m in store.formats[layer].matrices]
                              == [(m.name, m.shape) for m in fmt.matrices] for layer, fmt in self.formats.items())
            reason = "dtype" if same_shapes else "shape"
        else:
            reason = "source"
        old.close()
        self.store = store
        if reason != "source":
            self._invalidate_all(reason)
            pool, geometry = self.pool, (self.num_experts, self.moe_layers, self.formats, self.slot_bytes,
                                         self.expert_bytes)
            self._adopt_geometry(store)
            self.telemetry_.expert_bytes = self.expert_bytes
            try:
                self._allocate(capacity)
            except ExpertCacheError:
                if self.pool is pool:
                    # Not allocated: the old pool and its views stay, and so must the geometry they
                    # were made for. Adopted, the retry (`_switching`) would find no change and
                    # keep the old pool: copies of the new experts into slots of the old size.
                    (self.num_experts, self.moe_layers, self.formats, self.slot_bytes,
                     self.expert_bytes) = geometry
                    self.telemetry_.expert_bytes = self.expert_bytes
                raise
            self._switching = False
            return {reason: 1}
        stale = [c.key for c in self.content
                 if c is not None and store.version_of(c.key.layer, c.key.expert) != c.version]
        self._invalidate(stale, reason)
        if self.mode == "resident":  # also the experts an earlier, failed refill left out
            self._fill_all()
        self._switching = False
        return {reason: len(stale)}

    def _invalidate(self, keys: list[ExpertKey], reason: str) -> None:
        if not keys:
            return
        self.quiesce()
        slots = {k: self.residency.slot_of(k) for k in keys}
        dropped = self.residency.invalidate(keys)
        for key in dropped:
            self.content[slots[key]] = None
            self.checksums[slots[key]] = None
            self._pending_invalid.setdefault(key.layer, set()).add(key.expert)
        self.telemetry_.invalidations[reason] += len(dropped)
        self.telemetry_.pre_invalid_loaded += len(dropped)

    def _invalidate_all(self, reason: str) -> None:
        self._invalidate(self.residency.resident_keys(), reason)

    # ---- reporting ----
    def telemetry(self) -> dict:
        out = self.telemetry_.as_dict()
        out.update(mode=self.mode, policy=self.config.policy, store=self.store.name, capacity=self.capacity,
                   total_experts=self.total_experts, expert_bytes=max(self.expert_bytes.values()),
                   slot_bytes=self.slot_bytes, pool_bytes=self.capacity * self.slot_bytes,
                   prefetch=self.prefetching, prefetch_width=self.config.prefetch_width,
                   prefetch_min_prob=self.config.prefetch_min_prob)
        return out


@functools.cache
def _cores() -> int:
    """This process's cores, asked once: every op of a split-capable cache checks against it."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _core_to_spare() -> bool:
    """Whether torch's threads leave one of this process's cores free."""
    return torch.get_num_threads() < _cores()


def _part(wave: Wave, keep: Callable[[int], bool]) -> Wave:
    """The experts of `wave` whose slots `keep` selects, with their fills (no copy runs: the part
    is computed, its copies are made from the whole wave)."""
    pairs = [(e, s) for e, s in zip(wave.experts, wave.slots) if keep(s)]
    return Wave([e for e, _ in pairs], [s for _, s in pairs], [(e, s) for e, s in wave.fills if keep(s)])


@dataclass(slots=True)
class _Fill:
    """One expert copied into one slot, shaped as a wave for `_copy_wave`."""

    expert: int
    slot: int

    @property
    def fills(self) -> list[tuple[int, int]]:
        return [(self.expert, self.slot)]

    @property
    def copy_runs(self) -> list[tuple[int, int, int]]:
        return [(self.expert, self.slot, 1)]
