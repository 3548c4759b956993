"""Replay a routing trace through the runtime's own residency bookkeeping and count, without tensors.

A trace is a list of ops, each `(layer, experts)` with `experts` the sorted distinct ids the op
uses. `simulate` runs it through `tiers.residency.Residency` and a policy, exactly as the cache
would; `simulate_belady` does the same with Belady's MIN; `brute_force_min_misses` searches every
eviction choice (tiny traces only) and is the reference the other two are tested against.

With `predictions` (op i's predicted experts, best first, or None), `simulate` also replays
prefetch: right after op i is planned, the prediction of op i + 1 is planned with
`Residency.plan_prefetch` (docs/cache.md, "Prefetch"), so a correct prediction turns a miss of op
i + 1 into a prefetch used and moves the copy off the demand path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from itertools import combinations

from ..tiers.policy import Belady, ExpertKey, Policy, make_policy
from ..tiers.residency import Residency

Op = tuple[int, Sequence[int]]  # (layer, sorted distinct expert ids)


@dataclass(frozen=True, slots=True)
class SimResult:
    policy: str
    capacity: int
    ops: int
    hits: int
    misses: int
    compulsory_misses: int  # first uses: no cache avoids them
    evictions: int  # by ops and by prefetches
    bytes_moved: int  # (misses + prefetch_issued) x expert size
    copy_ranges: int  # transfers after merging runs of consecutive experts into consecutive slots
    # Prefetch (all 0 without predictions). `misses` are then the demand misses: used experts
    # neither resident nor planned by a prefetch when their op began.
    prefetch_issued: int = 0  # experts a prefetch planned (each one copy)
    prefetch_used: int = 0  # of those, hit by an op before being evicted
    prefetch_wasted: int = 0  # of those, evicted before any op used them

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def as_dict(self) -> dict[str, object]:
        return asdict(self) | {"hit_rate": self.hit_rate}


def trace_keys(ops: Sequence[Op]) -> list[list[ExpertKey]]:
    """The keys of each op, as `Belady` wants them."""
    return [[ExpertKey(layer, e) for e in experts] for layer, experts in ops]


def simulate(ops: Sequence[Op], capacity: int, policy: str | Policy, expert_bytes: int,
             predictions: Sequence[Sequence[int] | None] | None = None) -> SimResult:
    """Replay `ops` through a `Residency` of `capacity` slots with `policy` (a name or a fresh policy).

    `predictions[i]`: the experts predicted for op i (distinct, best first; None or empty: none),
    planned as a prefetch right after op i - 1. None: no prefetch (the demand-only replay).
    """
    if isinstance(policy, str):
        policy = make_policy(policy, capacity)
    if predictions is not None and len(predictions) != len(ops):
        raise ValueError(f"{len(predictions)} predictions for {len(ops)} ops: expected one (or None) per op")
    if predictions is not None and isinstance(policy, Belady):
        raise ValueError("Belady's MIN loads on demand only: replay prefetch with a runtime policy")
    residency = Residency(capacity, policy)
    hits = misses = evictions = ranges = 0
    issued = used = wasted = 0
    first_uses = 0
    seen: dict[int, int] = {}  # layer -> bitset of the experts used so far
    for i, (layer, experts) in enumerate(ops):
        plan = residency.plan(layer, experts)
        hits += len(plan.hits)
        misses += len(plan.misses)
        evictions += len(plan.evicted)
        ranges += plan.copy_ranges
        used += len(plan.prefetched)
        wasted += len(plan.wasted)
        before = seen.get(layer, 0)
        seen[layer] = after = before | sum(1 << e for e in experts)
        first_uses += (after & ~before).bit_count()
        if predictions is not None and i + 1 < len(ops) and predictions[i + 1]:
            pf = residency.plan_prefetch(ops[i + 1][0], predictions[i + 1])
            issued += len(pf.experts)
            evictions += len(pf.evicted)
            ranges += len(pf.copy_runs)
            wasted += len(pf.wasted)
    return SimResult(
        policy=policy.name,
        capacity=capacity,
        ops=len(ops),
        hits=hits,
        misses=misses,
        compulsory_misses=first_uses,
        evictions=evictions,
        bytes_moved=(misses + issued) * expert_bytes,
        copy_ranges=ranges,
        prefetch_issued=issued,
        prefetch_used=used,
        prefetch_wasted=wasted,
    )


def simulate_belady(ops: Sequence[Op], capacity: int, expert_bytes: int) -> SimResult:
    """`simulate` with Belady's MIN, which knows the whole trace."""
    return simulate(ops, capacity, Belady(capacity, trace_keys(ops)), expert_bytes)


def brute_force_min_misses(ops: Sequence[Op], capacity: int) -> int:
    """Fewest misses over every possible sequence of eviction choices, under `Residency`'s op semantics.

    Same rules as the runtime: hits/misses at op start, wave 1 = hits + the first misses that fit,
    further waves of `capacity` misses, only the current wave pinned, free slots used before any
    eviction. Dynamic programming over (op index, resident set): for tiny traces only.
    """
    keys = {k for op in trace_keys(ops) for k in op}
    if len(keys) > 16 or len(ops) > 200:
        raise ValueError(f"brute force is for tiny traces: got {len(keys)} keys, {len(ops)} ops (max 16, 200)")
    if capacity < 1:
        raise ValueError(f"cache capacity must be >= 1 slot, got {capacity}")
    trace = trace_keys(ops)

    @lru_cache(maxsize=None)
    def best(t: int, resident: frozenset[ExpertKey]) -> int:
        if t == len(trace):
            return 0
        hits = [k for k in trace[t] if k in resident]
        misses = [k for k in trace[t] if k not in resident]
        room = capacity - len(hits)
        waves = [(hits + misses[:room], misses[:room])]
        waves += [(misses[i : i + capacity],) * 2 for i in range(room, len(misses), capacity)]
        states = {resident}
        for wave, fills in waves:
            pinned = set(wave)
            after = set()
            for s in states:
                need = max(0, len(fills) - (capacity - len(s)))
                for victims in combinations(sorted(s - pinned), need):
                    after.add(s.difference(victims).union(fills))
            states = after
        return len(misses) + min(best(t + 1, s) for s in states)

    return best(0, frozenset())


# ---- comparing policies against MIN over a range of capacities ---------------------------------


def parse_capacities(spec: str, total_experts: int) -> list[tuple[str, int]]:
    """`"10%,25%,64"` -> [(label, slots)]: a percentage of all experts (rounded down, at least 1
    slot) or a slot count; more slots than experts means every expert (the runtime does the same)."""
    out: list[tuple[str, int]] = []
    for part in spec.split(","):
        text = part.strip()
        try:
            if text.endswith("%"):
                pct = float(text[:-1])
                if not 0 < pct <= 100:
                    raise ValueError
                slots = max(1, min(total_experts, int(pct / 100 * total_experts + 1e-9)))
            else:
                slots = int(text)
                if slots < 1:
                    raise ValueError
                slots = min(slots, total_experts)
        except ValueError:
            raise ValueError(f"capacity {text!r} in {spec!r}: expected a percentage in (0, 100]% "
                             f"of the {total_experts} experts, or a slot count >= 1") from None
        if slots not in (s for _, s in out):
            out.append((text, slots))
    return out


@dataclass(frozen=True, slots=True)
class Comparison:
    """One policy at one capacity, next to Belady's MIN at the same capacity."""

    result: SimResult
    belady: SimResult
    waved_ops: int  # ops using more experts than there are slots (run in waves)
    prefetch: bool = False  # `result` replayed prefetch from recorded predictions

    @property
    def misses_vs_belady(self) -> float | None:
        return _ratio(self.result.misses, self.belady.misses)

    @property
    def noncompulsory_vs_belady(self) -> float | None:
        """The ratio over the misses any demand-loading cache could avoid (misses minus first uses);
        None with prefetch, which avoids first uses too."""
        if self.prefetch:
            return None
        c = self.result.compulsory_misses
        return _ratio(self.result.misses - c, self.belady.misses - c)

    def as_dict(self) -> dict[str, object]:
        return self.result.as_dict() | {"prefetch": self.prefetch, "waved_ops": self.waved_ops,
                                        "belady_misses": self.belady.misses,
                                        "misses_vs_belady": self.misses_vs_belady,
                                        "noncompulsory_vs_belady": self.noncompulsory_vs_belady}


def _ratio(a: int, b: int) -> float | None:
    if b == 0:
        return 1.0 if a == 0 else None  # nothing to compare against
    return a / b


def compare(ops: Sequence[Op], capacities: Sequence[int], policies: Sequence[str],
            expert_bytes: int, predictions: Sequence[Sequence[int] | None] | None = None) -> list[Comparison]:
    """Belady's MIN and every policy in `policies`, at every capacity, in that order; with
    `predictions`, each policy's row is followed by the same policy with prefetch."""
    sizes = [len(experts) for _, experts in ops]
    out = []
    for capacity in capacities:
        waved = sum(1 for n in sizes if n > capacity)
        belady = simulate_belady(ops, capacity, expert_bytes)
        out.append(Comparison(belady, belady, waved))
        for name in policies:
            out.append(Comparison(simulate(ops, capacity, name, expert_bytes), belady, waved))
            if predictions is not None:
                out.append(Comparison(simulate(ops, capacity, name, expert_bytes, predictions), belady, waved,
                                      prefetch=True))
    return out
