"""Slot bookkeeping of the resident-expert cache, in pure Python: which key is in which slot.

`Residency.plan` decides, for one MoE op, what is hit, what is missing, which slots the missing
experts go to, what is evicted to make room, and in how many waves the op runs when it needs more
experts than there are slots. `Residency.plan_prefetch` reserves slots for the experts predicted
for the next op (prefetch). The runtime cache executes the plans with tensors; the trace
simulator only counts them. Both use this class, so what the simulator reports is what the
runtime does.
"""

from __future__ import annotations

import operator
from bisect import insort
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from .policy import ExpertKey, Policy


@dataclass(slots=True)
class Wave:
    """One pass of an op: the experts it makes available, all resident at once."""

    experts: list[int]  # id order
    slots: list[int]  # slot of each of `experts`
    fills: list[tuple[int, int]] = field(default_factory=list)  # (expert, slot) to copy in, id order
    copy_runs: list[tuple[int, int, int]] = field(default_factory=list)  # (first expert, first slot, length)
    evicted: list[ExpertKey] = field(default_factory=list)  # in the order the policy chose them


@dataclass(slots=True)
class OpPlan:
    """What one MoE op does to the cache. `hits` + `misses` = the op's distinct experts."""

    layer: int
    hits: list[int]
    misses: list[int]
    waves: list[Wave]
    loaded_before: int  # experts of `layer` resident when the op began
    # Hits that a prefetch planned and no op had used yet (`plan_prefetch`): prefetches used.
    prefetched: list[int] = field(default_factory=list)
    # Keys evicted by this op that a prefetch planned and no op used: prefetches wasted.
    wasted: list[ExpertKey] = field(default_factory=list)

    @property
    def evicted(self) -> list[ExpertKey]:
        return [k for w in self.waves for k in w.evicted]

    @property
    def copy_ranges(self) -> int:
        """Transfers the op issues: one per merged run."""
        return sum(len(w.copy_runs) for w in self.waves)


@dataclass(slots=True)
class PrefetchPlan:
    """What one prefetch does to the cache: the predicted experts it reserved slots for."""

    layer: int
    experts: list[int]  # planned (not resident before), id order
    slots: list[int]  # slot of each of `experts`
    copy_runs: list[tuple[int, int, int]] = field(default_factory=list)  # (first expert, first slot, length)
    evicted: list[ExpertKey] = field(default_factory=list)  # in the order the policy chose them
    wasted: list[ExpertKey] = field(default_factory=list)  # evicted prefetches that no op had used
    dropped: list[int] = field(default_factory=list)  # predicted, not resident, no room: not planned
    # What it could not evict: the op in flight and its own guesses already resident.
    pinned: list[ExpertKey] = field(default_factory=list)


class Residency:
    """Key <-> slot maps, per-layer residency bitsets and the free list, driven by a `Policy`.

    Op semantics (exact; the runtime depends on them):
    - hits are the used experts resident at op start, misses the others;
    - wave 1 holds every hit plus as many misses as fit, in id order; each further wave takes the
      next `capacity` misses (one wave when the op fits);
    - the experts of the current wave are pinned: never evicted while it runs; an earlier wave's
      experts are not pinned in later waves;
    - a wave's fills take free slots first and evict (policy's choice) only for the rest;
    - a run of consecutive missing expert ids goes into the lowest run of consecutive free slots
      long enough for it, so that it is one copy; otherwise into the lowest free slots.
    The policy hears `begin_op`, then `hit` for each hit in id order, then per wave every `evict`
    before the wave's `insert`s (id order).

    Prefetch semantics (`plan_prefetch`; exact, the runtime follows them):
    - a prefetch is planned after an op's `plan`, for a later op's predicted experts; its keys
      become resident at once in the bookkeeping (slot reserved), whether or not the copy ran;
    - it pins the keys of the op last planned that are resident (the op in flight) and the
      predicted keys already resident, and never evicts them: a prefetch does not drop one of its
      own guesses to make room for another; predicted keys already resident cost no copy and do
      not reach the policy;
    - it plans the predicted keys in the caller's priority order as long as a slot is free or an
      unpinned key can be evicted, then places them like a wave's fills (free slots first, id runs
      into slot runs, evictions by the policy before the inserts, inserts in id order); the policy
      sees a prefetch as an insert (a use);
    - a prefetched key is *unused* until an op hits it: that hit is reported in
      `OpPlan.prefetched` (a prefetch used, whether or not its copy had started); evicting it
      while unused reports it in `wasted`; `invalidate` forgets the mark.
    """

    def __init__(self, capacity: int, policy: Policy) -> None:
        self._reset(capacity)
        if policy.capacity != capacity:
            raise ValueError(
                f"policy {policy.name!r} was built for {policy.capacity} slots, the cache has {capacity}"
            )
        self._policy = policy
        self._ops = 0

    def _reset(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"cache capacity must be an integer >= 1 slot, got {capacity!r}")
        self._capacity = capacity
        self._slot_of: dict[ExpertKey, int] = {}
        self._key_of: list[ExpertKey | None] = [None] * capacity
        self._masks: dict[int, int] = {}  # layer -> bit e set when expert e is resident
        self._free: list[int] = list(range(capacity))  # sorted
        self._prefetched: set[ExpertKey] = set()  # planned by a prefetch, not used by an op since
        self._wasted_now: set[ExpertKey] = set()  # unused prefetches dropped by the plan being made
        self._last_op: list[ExpertKey] = []  # the keys of the op last planned (a prefetch pins them)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def ops_planned(self) -> int:
        return self._ops

    def __len__(self) -> int:
        return len(self._slot_of)

    def is_resident(self, key: ExpertKey) -> bool:
        return key in self._slot_of

    def slot_of(self, key: ExpertKey) -> int | None:
        return self._slot_of.get(key)

    def key_in(self, slot: int) -> ExpertKey | None:
        return self._key_of[slot]

    def resident_mask(self, layer: int) -> int:
        return self._masks.get(layer, 0)

    def resident_keys(self) -> list[ExpertKey]:
        return sorted(self._slot_of)

    def free_slots(self) -> list[int]:
        return list(self._free)

    def prefetched_unused(self) -> list[ExpertKey]:
        """Resident keys that a prefetch planned and no op has used since, sorted."""
        return sorted(self._prefetched)

    # -- one op -----------------------------------------------------------------------------------

    def plan(self, layer: int, experts: Sequence[int]) -> OpPlan:
        """Make `experts` (sorted, distinct ids of `layer`) resident, wave by wave; see the class."""
        experts = _check_op(layer, experts)
        self._policy.begin_op(self._ops)
        self._ops += 1

        keys = {e: ExpertKey(layer, e) for e in experts}
        mask = self._masks.get(layer, 0)
        hits = [e for e in experts if mask >> e & 1]
        misses = [e for e in experts if not mask >> e & 1]
        self._policy.hits([keys[e] for e in hits])
        prefetched = [e for e in hits if keys[e] in self._prefetched] if self._prefetched else []
        if prefetched:
            self._prefetched.difference_update(keys[e] for e in prefetched)

        room = self._capacity - len(hits)
        first = experts if not misses else sorted(hits + misses[:room])
        waves = [self._wave(layer, keys, first, misses[:room])]
        for i in range(room, len(misses), self._capacity):
            chunk = misses[i : i + self._capacity]
            waves.append(self._wave(layer, keys, chunk, chunk))
        self._last_op = list(keys.values())
        wasted = [k for w in waves for k in w.evicted if k in self._wasted_now] if self._wasted_now else []
        self._wasted_now.clear()
        return OpPlan(layer, hits, misses, waves, loaded_before=mask.bit_count(), prefetched=prefetched,
                      wasted=wasted)

    def plan_prefetch(self, layer: int, experts: Sequence[int]) -> PrefetchPlan:
        """Reserve slots for `experts` of `layer` (distinct ids, best first), predicted for a later
        op; see the class for the semantics."""
        experts = _check_prefetch(layer, experts)
        mask = self._masks.get(layer, 0)
        pinned = {k for k in self._last_op if k in self._slot_of}
        pinned.update(ExpertKey(layer, e) for e in experts if mask >> e & 1)
        wanted = [e for e in experts if not mask >> e & 1]
        room = len(self._free) + len(self._slot_of) - len(pinned)
        take, dropped = sorted(wanted[:room]), wanted[room:]
        evicted = []
        for _ in range(len(take) - len(self._free)):
            victim = self._policy.evict(pinned)
            assert victim not in pinned and victim in self._slot_of, victim
            self._drop(victim)
            evicted.append(victim)
        wasted = [k for k in evicted if k in self._wasted_now]
        self._wasted_now.clear()
        placed = self._place(take)
        mask = self._masks.get(layer, 0)
        for e, slot in placed:
            key = ExpertKey(layer, e)
            self._slot_of[key] = slot
            self._key_of[slot] = key
            mask |= 1 << e
            self._policy.insert(key)
            self._prefetched.add(key)
        self._masks[layer] = mask
        return PrefetchPlan(layer, [e for e, _ in placed], [s for _, s in placed], _runs(placed), evicted,
                            wasted, dropped, sorted(pinned))

    def _wave(self, layer: int, keys: dict[int, ExpertKey], experts: list[int], fills: list[int]) -> Wave:
        evicted = []
        lacking = len(fills) - len(self._free)
        if lacking > 0:
            pinned = {keys[e] for e in experts}
            for _ in range(lacking):
                victim = self._policy.evict(pinned)
                assert victim not in pinned and victim in self._slot_of, victim
                self._drop(victim)
                evicted.append(victim)

        placed = self._place(fills)
        mask = self._masks.get(layer, 0)  # read after the evictions, which may clear bits of `layer`
        for e, slot in placed:
            key = keys[e]
            self._slot_of[key] = slot
            self._key_of[slot] = key
            mask |= 1 << e
            self._policy.insert(key)
        self._masks[layer] = mask

        slots = [self._slot_of[keys[e]] for e in experts]
        return Wave(experts, slots, placed, _runs(placed), evicted)

    def _place(self, fills: list[int]) -> list[tuple[int, int]]:
        """Take free slots for `fills` (id order): id runs into slot runs where the free list allows."""
        placed: list[tuple[int, int]] = []
        i = 0
        while i < len(fills):
            j = i + 1
            while j < len(fills) and fills[j] == fills[j - 1] + 1:
                j += 1
            n = j - i
            at = self._free_run(n)
            if at is None:
                taken, self._free[:n] = self._free[:n], []
            else:
                taken, self._free[at : at + n] = self._free[at : at + n], []
            placed.extend(zip(fills[i:j], taken))
            i = j
        return placed

    def _free_run(self, n: int) -> int | None:
        """Index in the free list where the lowest run of `n` consecutive free slots starts."""
        free = self._free
        start = 0
        for k in range(len(free)):
            if k > 0 and free[k] != free[k - 1] + 1:
                start = k
            if k - start + 1 >= n:
                return start
        return None

    def _drop(self, key: ExpertKey) -> None:
        if key in self._prefetched:
            self._prefetched.discard(key)
            self._wasted_now.add(key)
        slot = self._slot_of.pop(key)
        self._key_of[slot] = None
        insort(self._free, slot)
        self._masks[key.layer] &= ~(1 << key.expert)

    # -- dropping keys for other reasons ---------------------------------------------------------

    def invalidate(self, which: Iterable[ExpertKey] | Callable[[ExpertKey], bool]) -> list[ExpertKey]:
        """Drop the given resident keys (or those the predicate selects); return them sorted."""
        if callable(which):
            keys = [k for k in self._slot_of if which(k)]
        else:
            keys = {k for k in which if k in self._slot_of}
        keys = sorted(keys)
        for key in keys:
            self._policy.remove(key)
            self._drop(key)
        self._wasted_now.clear()  # an invalidated prefetch is neither used nor wasted
        return keys

    def clear(self) -> list[ExpertKey]:
        """Drop every resident key (the pool stays); return them sorted."""
        return self.invalidate(lambda _: True)

    def resize(self, capacity: int) -> list[ExpertKey]:
        """The pool is reallocated with `capacity` slots: everything is dropped and the policy reset."""
        dropped = self.resident_keys()
        self._reset(capacity)
        self._policy.reset(capacity)
        return dropped


def _runs(placed: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Merge (expert, slot) pairs, id order, into runs of consecutive ids in consecutive slots."""
    runs: list[list[int]] = []
    for e, slot in placed:
        if runs and e == runs[-1][0] + runs[-1][2] and slot == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([e, slot, 1])
    return [tuple(r) for r in runs]


def _check_prefetch(layer: int, experts: Sequence[int]) -> list[int]:
    if not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer must be an integer >= 0, got {layer!r}")
    try:
        experts = [operator.index(e) for e in experts]
    except TypeError:
        raise ValueError(f"predicted expert ids of layer {layer} must be integers, got {list(experts)}") from None
    if len(set(experts)) != len(experts) or any(e < 0 for e in experts):
        raise ValueError(f"predicted experts of layer {layer} must be distinct ids >= 0, got {experts}")
    return experts


def _check_op(layer: int, experts: Sequence[int]) -> list[int]:
    if not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer must be an integer >= 0, got {layer!r}")
    try:
        experts = [operator.index(e) for e in experts]  # numpy ints are fine, floats are not
    except TypeError:
        raise ValueError(f"expert ids of layer {layer} must be integers, got {list(experts)}") from None
    if not experts:
        raise ValueError(f"an op of layer {layer} must use at least one expert, got none")
    for a, b in zip(experts, experts[1:]):
        if not a < b:
            raise ValueError(f"experts of layer {layer} must be sorted and distinct, got {experts}")
    if experts[0] < 0:
        raise ValueError(f"expert ids of layer {layer} must be >= 0, got {experts}")
    return experts
