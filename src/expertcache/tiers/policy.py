"""Eviction policies over `ExpertKey`s: pure Python bookkeeping that never sees a tensor.

A policy tracks exactly the keys that are resident and, when asked, names a victim among those
that are not pinned by the op in flight. It never decides *when* to evict (the caller, see
`residency.Residency`, evicts only when no slot is free) and never owns memory.

Call protocol, per MoE op: `begin_op(i)`, then `hit(k)` for every used key that was resident, then
for each wave `evict(pinned)` as many times as slots are lacking and `insert(k)` for each key that
became resident. `remove(k)` forgets a key dropped for another reason (invalidation).

Runtime policies are in `POLICIES` (`make_policy` builds one by name). `Belady` is the offline
optimum on a recorded trace: it needs the future, so it is not in the registry.
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence, Set
from typing import ClassVar, NamedTuple

from ..config import DEFAULT_POLICY, POLICY_NAMES


class ExpertKey(NamedTuple):
    """One expert of one layer: the unit that is resident or not. A tuple, ordered by layer then
    expert: the bookkeeping hashes and compares keys a few dozen times per op, and a tuple's hash
    and equality run in C (a dataclass's are Python calls, 7x slower in a dict lookup)."""

    layer: int
    expert: int


class NoVictimError(RuntimeError):
    """`evict` was called while every resident key is pinned (a caller bug, never a user error)."""


class Policy(ABC):
    """Chooses victims among the resident keys. Subclasses set `name` and implement the four calls."""

    name: ClassVar[str]

    def __init__(self, capacity: int) -> None:
        self.capacity = _check_capacity(capacity)
        self._reset_state()

    def reset(self, capacity: int) -> None:
        """Forget every key and all history; used when the slot pool is reallocated."""
        self.capacity = _check_capacity(capacity)
        self._reset_state()

    def begin_op(self, op_index: int) -> None:
        """Called once per op before any hit/insert. Policies that need a clock override it."""

    @abstractmethod
    def _reset_state(self) -> None: ...

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys tracked."""

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def hit(self, key: ExpertKey) -> None:
        """`key` was resident and is used by the current op."""

    def hits(self, keys: list[ExpertKey]) -> None:
        """`hit` on each of `keys` in turn (an op's hits, id order); policies may do it faster."""
        for key in keys:
            self.hit(key)

    @abstractmethod
    def insert(self, key: ExpertKey) -> None:
        """`key` just became resident (after a miss)."""

    @abstractmethod
    def evict(self, pinned: Set[ExpertKey]) -> ExpertKey:
        """Choose a resident key not in `pinned`, forget it and return it."""

    @abstractmethod
    def remove(self, key: ExpertKey) -> None:
        """`key` was dropped for another reason (invalidation): forget it, leave no history."""

    def _check_evictable(self, pinned: Set[ExpertKey]) -> None:
        # O(|pinned|): pinned keys that are resident vs all resident keys.
        if sum(1 for k in pinned if k in self) >= len(self):
            raise NoVictimError(
                f"{self.name}: cannot evict, all {len(self)} resident keys are pinned by the op in flight"
            )


def _check_capacity(capacity: int) -> int:
    if not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"cache capacity must be an integer >= 1 slot, got {capacity!r}")
    return capacity


class LRU(Policy):
    """Least recently used. Keys used by one op are touched in id order."""

    name = "lru"

    def _reset_state(self) -> None:
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()  # least recent first

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def hit(self, key: ExpertKey) -> None:
        self._order.move_to_end(key)

    def insert(self, key: ExpertKey) -> None:
        assert key not in self._order, key
        self._order[key] = None

    def evict(self, pinned: Set[ExpertKey]) -> ExpertKey:
        # Pinned keys were touched by the current op, so they sit at the recent end: the scan is short.
        for key in self._order:
            if key not in pinned:
                del self._order[key]
                return key
        self._check_evictable(pinned)
        raise AssertionError("unreachable")

    def remove(self, key: ExpertKey) -> None:
        del self._order[key]


class LFU(Policy):
    """Least frequently used, with aging; ties go to the least recently used key.

    An insert counts 1 and each hit adds 1. After every `halve_every`-th access (hit or insert;
    default 16 x capacity) every count is halved, rounded down, so that experts that
    were hot long ago (a past prompt's topic) lose their lead. Evicts the key with the lowest
    count; among equal counts, the one whose last access is oldest. O(log n) per call amortized
    (a heap with lazy deletion, rebuilt on each halving).
    """

    name = "lfu"

    def __init__(self, capacity: int, halve_every: int | None = None) -> None:
        if halve_every is not None and (not isinstance(halve_every, int) or halve_every < 1):
            raise ValueError(f"LFU halve_every must be an integer >= 1, got {halve_every!r}")
        self._halve_every = halve_every
        super().__init__(capacity)

    def _reset_state(self) -> None:
        self.halve_every = self._halve_every or 16 * self.capacity
        self._count: dict[ExpertKey, int] = {}
        self._last: dict[ExpertKey, int] = {}
        self._clock = 0
        self._heap: list[tuple[int, int, ExpertKey]] = []  # (count, last access, key), lazily stale

    def __len__(self) -> int:
        return len(self._count)

    def __contains__(self, key: object) -> bool:
        return key in self._count

    def count(self, key: ExpertKey) -> int:
        return self._count[key]

    def hit(self, key: ExpertKey) -> None:
        self._touch(key, self._count[key] + 1)

    def insert(self, key: ExpertKey) -> None:
        assert key not in self._count, key
        self._touch(key, 1)

    def _touch(self, key: ExpertKey, count: int) -> None:
        self._clock += 1
        self._count[key] = count
        self._last[key] = self._clock
        heapq.heappush(self._heap, (count, self._clock, key))
        if self._clock % self.halve_every == 0:
            for k in self._count:
                self._count[k] >>= 1
            self._rebuild()
        elif len(self._heap) > 4 * len(self._count) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(c, self._last[k], k) for k, c in self._count.items()]
        heapq.heapify(self._heap)

    def _valid(self, entry: tuple[int, int, ExpertKey]) -> bool:
        count, last, key = entry
        return self._count.get(key) == count and self._last[key] == last

    def evict(self, pinned: Set[ExpertKey]) -> ExpertKey:
        self._check_evictable(pinned)
        key = _pop_unpinned(self._heap, self._valid, pinned)
        del self._count[key], self._last[key]
        return key

    def remove(self, key: ExpertKey) -> None:
        del self._count[key], self._last[key]


class S3FIFO(Policy):
    """S3-FIFO (Yang et al., SOSP 2023): a small probationary FIFO, a main FIFO, a ghost FIFO.

    New keys enter the small queue S (about 10% of capacity, at least 1) unless they are in the
    ghost G, in which case they enter the main queue M. Each hit raises the key's frequency (capped
    at 3). Eviction takes from S while S holds at least its target size (or M is empty): S's oldest
    key moves to M if it was hit since insertion (or is pinned), else it is evicted and remembered in
    G (G holds at most `capacity` keys). Otherwise M's oldest key is reinserted at M's head with
    frequency - 1 if its frequency is positive (CLOCK-like), else evicted. Pinned keys in M are
    rotated without losing frequency. A scan (every expert touched once) passes through S and G
    without displacing the keys in M. Amortized O(1) per call.
    """

    name = "s3fifo"
    _MAX_FREQ = 3

    def _reset_state(self) -> None:
        self._small_target = max(1, self.capacity // 10)
        self._small: OrderedDict[ExpertKey, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[ExpertKey, None] = OrderedDict()  # oldest first
        self._ghost: OrderedDict[ExpertKey, None] = OrderedDict()  # oldest first
        self._freq: dict[ExpertKey, int] = {}

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def queue_of(self, key: ExpertKey) -> str | None:
        """'small', 'main', 'ghost' or None: for tests and diagnostics."""
        for name, q in (("small", self._small), ("main", self._main), ("ghost", self._ghost)):
            if key in q:
                return name
        return None

    def hit(self, key: ExpertKey) -> None:
        self._freq[key] = min(self._freq[key] + 1, self._MAX_FREQ)

    def insert(self, key: ExpertKey) -> None:
        assert key not in self._freq, key
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None

    def evict(self, pinned: Set[ExpertKey]) -> ExpertKey:
        self._check_evictable(pinned)
        while True:
            if self._small and (len(self._small) >= self._small_target or not self._main):
                victim = self._evict_small(pinned)
            else:
                victim = self._evict_main(pinned)
                if victim is None:  # every key in M is pinned: the victim must come from S
                    victim = self._evict_small(pinned)
            if victim is not None:
                return victim

    def _evict_small(self, pinned: Set[ExpertKey]) -> ExpertKey | None:
        while self._small:
            key, _ = self._small.popitem(last=False)
            if key in pinned or self._freq[key] > 0:
                self._main[key] = None
                continue
            del self._freq[key]
            self._ghost[key] = None
            if len(self._ghost) > self.capacity:
                self._ghost.popitem(last=False)
            return key
        return None

    def _evict_main(self, pinned: Set[ExpertKey]) -> ExpertKey | None:
        pinned_run = 0
        while pinned_run < len(self._main):
            key = next(iter(self._main))
            if key in pinned:
                self._main.move_to_end(key)
                pinned_run += 1
                continue
            pinned_run = 0
            if self._freq[key] > 0:
                self._freq[key] -= 1
                self._main.move_to_end(key)
                continue
            del self._main[key], self._freq[key]
            return key
        return None

    def remove(self, key: ExpertKey) -> None:
        del self._freq[key]
        self._small.pop(key, None)
        self._main.pop(key, None)


class ARC(Policy):
    """Adaptive Replacement Cache (Megiddo and Modha, FAST 2003).

    T1 holds keys seen once recently, T2 keys seen at least twice; B1 and B2 remember keys evicted
    from each. The target size `p` of T1 grows on an insert that was in B1 and shrinks on one that
    was in B2. Eviction takes T1's least recent key while |T1| > p, else T2's. A scan fills T1 only
    and is evicted from T1, so the keys in T2 survive it.

    Deviation forced by the call protocol: `evict` runs before the `insert` of the key that caused
    the miss, so `p` adapts on that insert and takes effect from the next eviction on, and the
    classic tie-break "x in B2 and |T1| == p" is not available. Pinned keys are skipped; if one
    list holds only pinned keys, the other one gives the victim.
    """

    name = "arc"

    def _reset_state(self) -> None:
        self.p = 0  # target size of T1
        self._t1: OrderedDict[ExpertKey, None] = OrderedDict()  # least recent first
        self._t2: OrderedDict[ExpertKey, None] = OrderedDict()
        self._b1: OrderedDict[ExpertKey, None] = OrderedDict()
        self._b2: OrderedDict[ExpertKey, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def list_of(self, key: ExpertKey) -> str | None:
        """'T1', 'T2', 'B1', 'B2' or None: for tests and diagnostics."""
        for name, q in (("T1", self._t1), ("T2", self._t2), ("B1", self._b1), ("B2", self._b2)):
            if key in q:
                return name
        return None

    def hit(self, key: ExpertKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)

    def insert(self, key: ExpertKey) -> None:
        assert key not in self, key
        c = self.capacity
        if key in self._b1:
            self.p = min(c, self.p + max(1, len(self._b2) // len(self._b1)))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self.p = max(0, self.p - max(1, len(self._b1) // len(self._b2)))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        while len(self._t1) + len(self._b1) > c and self._b1:
            self._b1.popitem(last=False)
        while len(self) + len(self._b1) + len(self._b2) > 2 * c:
            (self._b2 if self._b2 else self._b1).popitem(last=False)

    def evict(self, pinned: Set[ExpertKey]) -> ExpertKey:
        self._check_evictable(pinned)
        from_t1 = _first_unpinned(self._t1, pinned)
        from_t2 = _first_unpinned(self._t2, pinned)
        if from_t1 is not None and (len(self._t1) > self.p or from_t2 is None):
            del self._t1[from_t1]
            self._b1[from_t1] = None
            return from_t1
        assert from_t2 is not None
        del self._t2[from_t2]
        self._b2[from_t2] = None
        return from_t2

    def remove(self, key: ExpertKey) -> None:
        if key in self._t1:
            del self._t1[key]
        else:
            del self._t2[key]


class LRFU(Policy):
    """Least recently/frequently used (after Lee et al., IEEE ToC 2001), remembering every key.

    Each key has a score, the sum over its past uses of 2^(-age / half_life), age in ops (the op
    index of `begin_op`): a use adds 1 and the score halves every `half_life` ops (default
    4 x capacity: the best of 1 to 8 x, or within about 2% of it, at 25% and 50% capacity on
    the bundled model's traces; docs/benchmarks.md). Evicts the resident,
    unpinned key with the lowest score; ties go to the least recently used, then the smaller key.
    A short half-life makes it LRU, a long one LFU.

    Unlike `LFU`, scores survive eviction: the key space of a model is small and bounded (its
    experts), so every key's history is kept, and an expert that a layer keeps coming back to
    keeps its standing even when a working set larger than the cache (a decode step through all
    layers) pushed it out once. This is what lets it keep each layer's popular experts where LRU
    cycles through all of them and hits nothing. A scan (a prefill op touching every expert) adds
    1 to every key alike and reorders little. O(log n) per call: scores decay at one rate, so
    order is kept in a heap by log2(score) + op / half_life, which does not change with time.
    """

    name = "lrfu"

    def __init__(self, capacity: int, half_life: float | None = None) -> None:
        if half_life is not None and not (isinstance(half_life, (int, float)) and half_life > 0):
            raise ValueError(f"LRFU half_life must be a number > 0, got {half_life!r}")
        self._half_life = half_life
        super().__init__(capacity)

    def _reset_state(self) -> None:
        self.half_life = float(self._half_life or 4 * self.capacity)
        self._op = 0
        self._history: dict[ExpertKey, tuple[float, int]] = {}  # every key seen: (score at last use, op)
        self._rank: dict[ExpertKey, tuple[float, int]] = {}  # resident keys: (time-free rank, last op)
        self._heap: list[tuple[float, int, ExpertKey]] = []  # (rank, last op, key), lazily stale

    def __len__(self) -> int:
        return len(self._rank)

    def __contains__(self, key: object) -> bool:
        return key in self._rank

    def begin_op(self, op_index: int) -> None:
        self._op = op_index

    def score(self, key: ExpertKey) -> float:
        """The key's score now (0 if never used)."""
        score, last = self._history.get(key, (0.0, self._op))
        return score * 2.0 ** (-(self._op - last) / self.half_life)

    def hit(self, key: ExpertKey) -> None:
        assert key in self._rank, key
        self._use(key)

    def hits(self, keys: list[ExpertKey]) -> None:
        # `_use` inlined: every decode step of every MoE layer comes here.
        op, half_life, history, rank, heap = self._op, self.half_life, self._history, self._rank, self._heap
        clock, log2, push = op / half_life, math.log2, heapq.heappush
        for key in keys:
            assert key in rank, key
            score, last = history.get(key, (0.0, op))
            score = score * 2.0 ** (-(op - last) / half_life) + 1.0
            history[key] = (score, op)
            entry = rank[key] = (log2(score) + clock, op)
            push(heap, (*entry, key))
        self._compact()

    def insert(self, key: ExpertKey) -> None:
        assert key not in self._rank, key
        self._use(key)

    def _use(self, key: ExpertKey) -> None:
        score = self.score(key) + 1.0
        self._history[key] = (score, self._op)
        entry = (math.log2(score) + self._op / self.half_life, self._op)
        self._rank[key] = entry
        heapq.heappush(self._heap, (*entry, key))
        self._compact()

    def _compact(self) -> None:
        """Rebuild the heap from the live entries once stale ones outnumber them well."""
        if len(self._heap) > 4 * len(self._rank) + 64:
            self._heap = [(*e, k) for k, e in self._rank.items()]
            heapq.heapify(self._heap)

    def evict(self, pinned: Set[ExpertKey]) -> ExpertKey:
        self._check_evictable(pinned)
        # Stale entries: the key was used again since, or evicted.
        key = _pop_unpinned(self._heap, lambda e: self._rank.get(e[-1]) == e[:2], pinned)
        del self._rank[key]
        return key

    def remove(self, key: ExpertKey) -> None:
        del self._rank[key]
        self._history.pop(key, None)


def _pop_unpinned(heap: list, live: Callable[[tuple], bool], pinned: Set[ExpertKey]) -> ExpertKey:
    """Pop the smallest live heap entry (key last) whose key is not pinned, dropping stale entries
    (lazy deletion) and keeping pinned live ones."""
    aside = []
    while True:
        entry = heapq.heappop(heap)
        if not live(entry):
            continue
        if entry[-1] in pinned:
            aside.append(entry)
            continue
        break
    for e in aside:
        heapq.heappush(heap, e)
    return entry[-1]


def _first_unpinned(order: Iterable[ExpertKey], pinned: Set[ExpertKey]) -> ExpertKey | None:
    return next((k for k in order if k not in pinned), None)


class Belady(Policy):
    """Belady's MIN on a recorded trace: evict the resident, unpinned key whose next use is farthest.

    Built from the whole sequence of ops (each op: the distinct keys it uses) and told the current
    op by `begin_op`. A key never used again is infinitely far; among equally far keys the larger
    key is evicted. The next use is counted in ops after the current one: keys the current op
    already used (an earlier wave of a large op) are as far as their next op. O(log n) per call.

    Optimal exactly when every op fits in the cache (no op uses more keys than there are slots):
    each op is then one request for a set of keys that must be resident together, all pinned, and
    MIN's exchange argument carries over (ties do not matter: two keys next used by the same op
    cost one miss whichever stays). It is NOT optimal once an op runs in waves: the keys an op hits
    go into its first wave, the keys it misses into later ones, and a later wave may evict the
    first, so what is resident after the op depends on which of its keys were resident at its start,
    which next-use distances do not see. Smallest example, capacity 2, ops {0,1,2} {0,1,2} {0,2}:
    op 0 runs as {0,1} then {2}, evicting 0 or 1 (both next used by op 1). Keeping 0, op 1 hits
    0 and 2 and loads 1 in a second wave that evicts 0 or 2, so op 2 misses: 5 misses. Keeping 1,
    op 1 loads 0 in its second wave by evicting 1, and op 2 hits both: 4 misses. Neither tie-break
    is right in general, and on such traces a runtime policy (even LRU) can beat MIN; the optimum
    is `bench.simulate.brute_force_min_misses`.
    """

    name = "belady"

    def __init__(self, capacity: int, ops: Sequence[Iterable[ExpertKey]]) -> None:
        self._uses: dict[ExpertKey, list[int]] = {}
        self._n_ops = len(ops)
        for i, op in enumerate(ops):
            for key in set(op):
                self._uses.setdefault(key, []).append(i)
        super().__init__(capacity)

    def _reset_state(self) -> None:
        self._op = -1
        self._next: dict[ExpertKey, int] = {}  # resident key -> index of its next use (n_ops: never)
        self._heap: list[tuple[int, int, int, ExpertKey]] = []  # (-next, -layer, -expert, key), lazy

    def __len__(self) -> int:
        return len(self._next)

    def __contains__(self, key: object) -> bool:
        return key in self._next

    def begin_op(self, op_index: int) -> None:
        if not 0 <= op_index < self._n_ops:
            raise ValueError(f"Belady: op {op_index} is outside the recorded trace of {self._n_ops} ops")
        self._op = op_index

    def _touch(self, key: ExpertKey) -> None:
        uses = self._uses.get(key, [])
        i = bisect_right(uses, self._op)
        if i == 0 or uses[i - 1] != self._op:
            raise ValueError(f"Belady: {key} is used at op {self._op}, which the recorded trace does not say")
        nxt = uses[i] if i < len(uses) else self._n_ops
        self._next[key] = nxt
        heapq.heappush(self._heap, (-nxt, -key.layer, -key.expert, key))

    def hit(self, key: ExpertKey) -> None:
        assert key in self._next, key
        self._touch(key)

    def insert(self, key: ExpertKey) -> None:
        assert key not in self._next, key
        self._touch(key)

    def evict(self, pinned: Set[ExpertKey]) -> ExpertKey:
        self._check_evictable(pinned)
        # Stale entries: the key was used again since, or evicted.
        key = _pop_unpinned(self._heap, lambda e: self._next.get(e[-1]) == -e[0], pinned)
        del self._next[key]
        return key

    def remove(self, key: ExpertKey) -> None:
        del self._next[key]


# The default, `config.DEFAULT_POLICY` (lrfu), was chosen on routing traces of the bundled model
# (docs/benchmarks.md, "Routing traces and policies"): fewer misses than every other policy at
# 10-50% capacity on every trace, and at 75% on one of the three (on the other two S3-FIFO misses
# 2-4% less, and LFU 0.4% less on one). The names are `config.POLICY_NAMES`, in that order.
POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (LRU, LFU, S3FIFO, ARC, LRFU)}
assert tuple(POLICIES) == POLICY_NAMES and DEFAULT_POLICY in POLICIES


def make_policy(name: str, capacity: int) -> Policy:
    """Build a runtime policy by name (`POLICIES`)."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown cache policy {name!r}; expected one of: {', '.join(sorted(POLICIES))}")
    return cls(capacity)
