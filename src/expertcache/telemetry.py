"""Cache counters, per layer and in total, with the names and meanings of DESIGN.md.

Each counter counts per MoE op over the op's distinct (layer, expert) keys and sums over ops.
Copies made while loading or resizing are counted apart (`load_*`), never in these.
"""

from __future__ import annotations

import resource
import sys
import threading
import time
from collections import Counter

OP_COUNTERS = (
    "ops_seen", "used_experts_unique", "loaded_experts_before", "resident_hits", "resident_misses",
    "copied_experts", "copied_bytes", "copy_ranges", "skipped_experts", "skipped_bytes", "empty_copy_ops",
    "evictions", "waves",
    # Prefetch (docs/cache.md, "Prefetch"): used experts neither resident nor prefetched when their
    # op began (= resident_misses); experts a prefetch planned; of those, hit by an op before being
    # evicted, and evicted unused. Prefetch copies count in copied_* and copy_ranges, and their
    # victims in evictions, under the prefetched experts' layer.
    "demand_misses", "prefetch_issued", "prefetch_used", "prefetch_wasted",
)
INVALIDATION_REASONS = ("source", "dtype", "shape", "expert_count", "pool")


class Telemetry:
    """`expert_bytes` maps each MoE layer to the bytes of one of its experts (layers of a
    quantized file may differ). `trace_every` > 0 prints `line()` on stderr every that many ops."""

    def __init__(self, expert_bytes: dict[int, int], trace_every: int = 0):
        self.expert_bytes = expert_bytes
        self.layers: dict[int, Counter] = {}
        self.invalidations: Counter = Counter({r: 0 for r in INVALIDATION_REASONS})
        self.pre_invalid_loaded = 0
        self.pre_invalid_hit = 0
        self.load_copied_experts = 0
        self.load_copied_bytes = 0
        self.copy_failures = 0  # copies that failed; their slots were left empty
        self.copy_seconds = 0.0  # wall time spent issuing copies (on a CPU: doing them)
        self.prefetch_copy_seconds = 0.0  # the same for prefetch copies (on the worker thread)
        self.stall_seconds = 0.0  # wall time compute waited before a wave: its copies, or prefetches
        # Bytes of planned prefetch copies never made: the expert lost its slot before its copy
        # started. copied_bytes counts a prefetch when planned (as the simulator does); this
        # depends on timing, like the *_seconds, so bytes read = copied_bytes - this.
        self.prefetch_dropped_bytes = 0
        self.trace_every = trace_every
        self._ops = 0
        self._time_lock = threading.Lock()

    def after_fork_in_child(self) -> None:
        """A forked child's lock: the copy worker may have held the parent's at the fork."""
        self._time_lock = threading.Lock()

    def add_seconds(self, name: str, seconds: float) -> None:
        """Add to one of the `*_seconds` sums: the copy worker and the op's thread both time
        copies, and `+=` on an attribute can lose one of two concurrent updates."""
        with self._time_lock:
            setattr(self, name, getattr(self, name) + seconds)

    def _layer(self, layer: int) -> Counter:
        c = self.layers.get(layer)
        if c is None:
            c = self.layers[layer] = Counter({k: 0 for k in OP_COUNTERS})
        return c

    def op(self, layer: int, used: int, loaded_before: int, hits: int, copied: int, ranges: int,
           evictions: int, waves: int, prefetch_used: int = 0, wasted=()) -> None:
        """One MoE op; `wasted`: the unused prefetched keys (layer, expert) it evicted."""
        c = self._layer(layer)
        c["ops_seen"] += 1
        c["used_experts_unique"] += used
        c["loaded_experts_before"] += loaded_before
        c["resident_hits"] += hits
        c["resident_misses"] += used - hits
        c["copied_experts"] += copied
        size = self.expert_bytes[layer]
        c["copied_bytes"] += copied * size
        c["copy_ranges"] += ranges
        c["skipped_experts"] += hits
        c["skipped_bytes"] += hits * size
        # An op with misses tried to copy and waited, even where it copied nothing (its copy
        # failed, or its caller left first): not an op that had nothing to copy.
        c["empty_copy_ops"] += copied == 0 and hits == used
        c["evictions"] += evictions
        c["waves"] += waves
        c["demand_misses"] += used - hits
        c["prefetch_used"] += prefetch_used
        for key in wasted:
            self._layer(key.layer)["prefetch_wasted"] += 1
        self._ops += 1
        if self.trace_every and self._ops % self.trace_every == 0:
            print(self.line(), file=sys.stderr, flush=True)

    def prefetched(self, layer: int, issued: int, ranges: int, evictions: int, wasted=()) -> None:
        """One prefetch planned: `issued` experts of `layer` to copy in `ranges` transfers."""
        c = self._layer(layer)
        c["prefetch_issued"] += issued
        c["copied_experts"] += issued
        c["copied_bytes"] += issued * self.expert_bytes[layer]
        c["copy_ranges"] += ranges
        c["evictions"] += evictions
        for key in wasted:
            self._layer(key.layer)["prefetch_wasted"] += 1

    def copied_bytes(self) -> int:
        """Bytes copied into slots by ops and prefetches so far (`total()["copied_bytes"]`, at a
        fraction of its cost: every prefill reads it twice)."""
        return sum(c["copied_bytes"] for c in self.layers.values())

    def total(self) -> dict:
        t = Counter({k: 0 for k in OP_COUNTERS})
        # A copy of the values, taken at once: the server reads this on its event loop while the
        # worker's first ops add layers, and a live view would fail with "changed size".
        for c in list(self.layers.values()):
            t.update(c)
        out = dict(t)
        used = out["used_experts_unique"]
        out["hit_rate"] = out["resident_hits"] / used if used else 0.0
        return out

    def line(self) -> str:
        t = self.total()
        return (f"expertcache cache: ops={t['ops_seen']} used={t['used_experts_unique']} "
                f"hits={t['resident_hits']} misses={t['resident_misses']} hit_rate={t['hit_rate']:.3f} "
                f"copied={t['copied_experts']} ({t['copied_bytes'] / 1e6:.1f} MB in {t['copy_ranges']} ranges) "
                f"evictions={t['evictions']} empty_copy_ops={t['empty_copy_ops']} "
                f"invalidations={sum(self.invalidations.values())} demand_misses={t['demand_misses']} "
                f"prefetch issued={t['prefetch_issued']} used={t['prefetch_used']} wasted={t['prefetch_wasted']} "
                f"stall={self.stall_seconds:.3f}s")

    def as_dict(self) -> dict:
        return {
            "total": self.total(),
            "layers": {str(k): dict(v) for k, v in sorted(self.layers.items())},
            "invalidations": dict(self.invalidations),
            "pre_invalid_loaded": self.pre_invalid_loaded,
            "pre_invalid_hit": self.pre_invalid_hit,
            "load_copied_experts": self.load_copied_experts,
            "load_copied_bytes": self.load_copied_bytes,
            "copy_failures": self.copy_failures,
            "copy_seconds": self.copy_seconds,
            "prefetch_copy_seconds": self.prefetch_copy_seconds,
            "stall_seconds": self.stall_seconds,
            "prefetch_dropped_bytes": self.prefetch_dropped_bytes,
        }


class StepTimer:
    """Wall time per part of a forward (routing, attention, experts, rest), for `bench speed`.

    `lap(name)` charges the time since the previous lap to `name`. On a GPU the caller must
    synchronise for the split to mean anything; the benchmark runs on the CPU.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def start(self) -> None:
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now


def peak_rss_bytes() -> int:
    """This process's peak resident memory."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
