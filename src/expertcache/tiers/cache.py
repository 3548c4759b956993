"""The fast tier: one slot pool, allocated once and owned by the cache, shared by all layers.

Per MoE op the cache plans with `Residency` (pure bookkeeping: hits, misses, victims, waves),
copies only the missing experts (runs of experts contiguous in the slow tier into consecutive
slots as one copy), and yields views into the slots wave by wave. When nothing is missing no copy
is issued and nothing waits. Slots are described by what they hold (key, source file version,
the expert's format: each matrix's storage type and shape); a lookup is only valid while all of
those match, and slots are invalidated exactly when one of them changes, counted by reason.

The pool is bytes: a slot holds one expert as the slow tier stores it (float matrices in the
compute dtype, quantized ones as the file's blocks), and the cache never interprets them.

`acquire(layer, experts)` is the provider call the MoE layer makes: a generator that yields the
op's experts wave by wave; leaving it (exhausted, closed or on error) releases what it pinned.

Modes: `cache` (the slot cache), `resident` (every expert in a slot from the start: the upper
bound) and `staging` (the control: every op copies every expert it uses, no reuse).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ..config import CacheConfig
from ..errors import ExpertCacheError
from ..memory import host_zeros
from ..telemetry import Telemetry
from .layout import ExpertFormat, ExpertWeights, expert_weights
from .policy import ExpertKey, make_policy
from .residency import Residency
from .store import LARGE_LOAD_BYTES, ExpertStore, FileVersion, file_version
from .transfer import Transfers


@dataclass(frozen=True, slots=True)
class SlotContent:
    key: ExpertKey
    version: FileVersion  # of the file the expert was read from
    format: ExpertFormat  # each matrix's storage type, shape and offset
    nbytes: int


class ExpertCache:
    def __init__(self, store: ExpertStore, config: CacheConfig, device: torch.device):
        self.store, self.config, self.device = store, config, device
        self.mode = config.mode
        self._adopt_geometry(store)
        self.telemetry_ = Telemetry(self.expert_bytes, config.trace_every)
        self._pending_invalid: dict[int, set[int]] = {}
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

    def _capacity_for(self, config: CacheConfig) -> int:
        if config.mode == "staging" and not config.sized:
            return self.num_experts  # room for any one op
        n = config.slots_for(self.total_experts, self.slot_bytes)
        if n < 1:
            raise ExpertCacheError(f"cache of {config.mem} bytes is too small for one wave: one expert slot "
                                   f"needs {self.slot_bytes} bytes")
        return n

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        try:
            self.pool = host_zeros((capacity, self.slot_bytes), torch.uint8, self.device)  # [S, slot bytes]
        except (RuntimeError, MemoryError) as e:
            raise ExpertCacheError(f"cannot allocate {capacity} expert slots "
                                   f"({capacity * self.slot_bytes / 2**20:.0f} MiB): {e}") from None
        # Each slot's views in each layer format, made once: they stay valid as long as the pool.
        by_format: dict[ExpertFormat, list[ExpertWeights]] = {}
        for fmt in self.formats.values():
            if fmt not in by_format:
                by_format[fmt] = [expert_weights(row, fmt) for row in self.pool]
        self.views = {layer: by_format[fmt] for layer, fmt in self.formats.items()}
        self.residency = Residency(capacity, make_policy(self.config.policy, capacity))
        self.content: list[SlotContent | None] = [None] * capacity
        self.checksums: list[int | None] = [None] * capacity
        self.transfers = Transfers(self.device, capacity)
        if self.mode == "resident":
            self._fill_all()

    def _fill_all(self) -> None:
        """Resident mode: every expert in its slot before the first op (counted as load copies)."""
        big = sum(self.expert_bytes.values()) * self.num_experts >= LARGE_LOAD_BYTES
        for layer in tqdm(self.moe_layers, desc="filling slots", unit="layer", leave=False, disable=not big):
            plan = self.residency.plan(layer, list(range(self.num_experts)))
            for wave in plan.waves:
                self._copy_wave(layer, wave)
                self.telemetry_.load_copied_experts += len(wave.fills)
                self.telemetry_.load_copied_bytes += len(wave.fills) * self.expert_bytes[layer]
        self.transfers.synchronize()

    def resize(self, config: CacheConfig) -> None:
        """Reallocate the pool at a new size; every slot is invalidated (reason `pool`)."""
        self._invalidate_all("pool")
        self.config = config
        self.mode = config.mode
        self.pool = None
        self._allocate(self._capacity_for(config))

    # ---- one op ----
    def acquire(self, layer: int, experts: Sequence[int]) -> Iterator[list[tuple[int, ExpertWeights]]]:
        """Make `experts` (sorted distinct ids of `layer`) available, wave by wave: each wave is a
        list of (expert, weights), valid until the next wave; closing the generator releases them."""
        if self.mode == "staging":
            self.residency.clear()  # no reuse: the control copies every expert every op
        plan = self.residency.plan(layer, experts)
        pending = self._pending_invalid.pop(layer, None)
        if pending:
            self.telemetry_.pre_invalid_hit += len(pending.intersection(experts))
        views = self.views[layer]
        copied = ranges = 0
        done = 0  # waves whose copies completed; the residency of later waves' fills is only a plan
        try:
            for wave in plan.waves:
                if wave.fills:
                    try:
                        ranges += self._copy_wave(layer, wave)
                    except BaseException:
                        self.telemetry_.copy_failures += 1
                        raise
                    copied += len(wave.fills)
                done += 1
                self.transfers.before_compute()
                if self.config.verify:
                    for e, s in zip(wave.experts, wave.slots):
                        self._verify(layer, e, s)
                try:
                    yield [(e, views[s]) for e, s in zip(wave.experts, wave.slots)]
                finally:
                    self.transfers.after_compute(wave.slots)
        finally:
            # A copy that failed, or a caller that left early, leaves the bookkeeping as if the
            # remaining copies had never been planned: their slots are not marked resident.
            self._unplan(layer, plan.waves[done:])
        self.telemetry_.op(layer, len(experts), plan.loaded_before, len(plan.hits), copied, ranges,
                           len(plan.evicted), len(plan.waves))

    def _unplan(self, layer: int, waves: list) -> None:
        keys = [ExpertKey(layer, e) for w in waves for e, _ in w.fills]
        if not keys:
            return
        slots = [self.residency.slot_of(k) for k in keys]
        self.residency.invalidate(keys)
        for s in slots:
            if s is not None:
                self.content[s] = None
                self.checksums[s] = None

    def _copy_wave(self, layer: int, wave) -> int:
        """Issue the wave's copies; return how many transfers were issued."""
        issued = 0
        t0 = time.perf_counter()
        for e0, s0, n in wave.copy_runs:
            if n > 1 and not self.store.contiguous_run(layer, e0, n):
                pieces = [(e0 + i, s0 + i, 1) for i in range(n)]
            else:
                pieces = [(e0, s0, n)]
            for first, slot, count in pieces:
                dst = self.pool[slot: slot + count]
                self.transfers.copy(list(range(slot, slot + count)),
                                    lambda nb, f=first, d=dst: self.store.copy_run(layer, f, d, nb))
                issued += self.store.ranges(layer, first, count)
        self.telemetry_.copy_seconds += time.perf_counter() - t0
        version = self.store.versions
        fmt = self.formats[layer]
        for e, s in wave.fills:
            path = self.store.file_of(layer, e)
            self.content[s] = SlotContent(ExpertKey(layer, e), version[path], fmt, fmt.nbytes)
            if self.config.verify:
                self.transfers.synchronize()
                self.checksums[s] = self._checksum(s)
        return issued

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
        old = self.store
        src = store.source
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
            self._adopt_geometry(store)
            self.telemetry_.expert_bytes = self.expert_bytes
            self.pool = None
            self._allocate(self._capacity_for(self.config))
            return {reason: 1}
        stale = [c.key for c in self.content
                 if c is not None and store.versions.get(store.file_of(c.key.layer, c.key.expert)) != c.version]
        self._invalidate(stale, reason)
        if self.mode == "resident" and stale:
            self._fill_all()
        return {reason: len(stale)}

    def _invalidate(self, keys: list[ExpertKey], reason: str) -> None:
        if not keys:
            return
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
                   slot_bytes=self.slot_bytes, pool_bytes=self.capacity * self.slot_bytes)
        return out
