"""One sequence's state in a hybrid model: keys and values of its attention layers, and the
recurrent (DeltaNet) state of its linear-attention layers, with snapshots so that a prefix can be
reused.

Keys and values truncate to any prefix; a recurrent state does not (it folds every token into
one matrix). So the state keeps snapshots of the recurrent layers, each a copy of every DeltaNet
layer's state at one position, taken:

- at the start and at the end of every forward of more than one token, and at each micro-batch
  end inside it: the start is where the previous request ended (or where a reused prefix
  resumed), the end is the end of a prompt or of one of its stretches. A stretch runs layer by
  layer, so a micro-batch end inside it is a copy of each layer's state as that layer passes it
  (`layer_done`), made a whole snapshot when the forward ends (`PartialSnapshots`; only the
  last `max_snapshots` - 1 micro-batch ends are held, the others could not be kept);
- every `snapshot_every` tokens while decoding (a step that lands on a multiple of it).

At most `max_snapshots` are kept; beyond that the one at the earliest position goes. Position 0
needs none (a fresh state is zeros). `truncate(n)` restores the nearest snapshot at or before n
and returns that position: the caller prefills the tokens after it again. Snapshots after the
kept position describe another continuation and are dropped.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..errors import ExpertCacheError
from .deltanet import DeltaNetState
from .layers import KVCache

# Every this many tokens of decoding a snapshot is taken: with the default micro-batch of 512 a
# long prompt leaves one at each micro-batch end, and a long reply one every 512 tokens.
SNAPSHOT_EVERY = 512
# Snapshots kept per sequence; each is the size of every DeltaNet layer's state (Qwen3.6-35B-A3B:
# 30 layers of 32 x 128 x 128 fp32 plus the conv window, about 63 MiB).
MAX_SNAPSHOTS = 8


@dataclass(slots=True)
class Snapshot:
    position: int
    layers: dict[int, DeltaNetState]  # never written after it is taken: copies may share it

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.layers.values())


class PartialSnapshots:
    """Per-layer state copies at positions inside one forward, in the order the layers pass
    them; `whole` gives the positions every layer reached, ascending, and forgets the rest (a
    failed forward's copies are dropped at the next `begin`)."""

    def __init__(self) -> None:
        self.by_position: dict[int, dict[int, object]] = {}

    def add(self, position: int, layer: int, copy: Callable[[], object], limit: int) -> None:
        """Keep `copy()` for `layer` at `position`, holding the latest `limit` positions only:
        each layer passes the positions in ascending order, so an earlier one could only be
        dropped later, after its copies had held memory for the rest of the forward."""
        d = self.by_position
        if position not in d:
            if limit < 1 or (len(d) >= limit and position < min(d)):
                return
            d[position] = {}
        d[position][layer] = copy()
        while len(d) > limit:
            del d[min(d)]

    def clear(self) -> None:
        self.by_position.clear()

    def whole(self, layers: int) -> list[tuple[int, dict[int, object]]]:
        out = [(p, d) for p, d in sorted(self.by_position.items()) if len(d) == layers]
        self.by_position.clear()
        return out


class SnapshotSchedule(ABC):
    """When the caches whose state cannot be cut back (recurrent state here, sliding-window rings
    in `window_cache.py`) take snapshots, as the module docstring says. A subclass names the
    per-layer states (`_held`), how a snapshot is made of copies of them (`_snapshot`) and
    whether a failed forward left them incomplete (`_incomplete`)."""

    length: int

    def _init_snapshots(self, snapshot_every: int, max_snapshots: int) -> None:
        if snapshot_every < 1 or max_snapshots < 1:
            raise ExpertCacheError(f"snapshot_every {snapshot_every} and max_snapshots {max_snapshots} "
                                   "must be at least 1")
        self.snapshot_every, self.max_snapshots = snapshot_every, max_snapshots
        self.snapshots: list = []  # by position, ascending
        self._partial = PartialSnapshots()

    @abstractmethod
    def _held(self) -> dict:
        """The per-layer states a snapshot copies, by layer."""

    @abstractmethod
    def _snapshot(self, position: int, states: dict):
        """A snapshot at `position` made of copies of `states`."""

    @abstractmethod
    def _incomplete(self) -> bool:
        """Whether a failed forward left some layers ahead of `length`."""

    def begin(self, n: int) -> None:
        if self._incomplete():
            raise ExpertCacheError("the sequence state is incomplete after a failed forward; "
                                   "truncate it before running more tokens")
        self._partial.clear()
        if n > 1 and self.length:
            self._take()

    def layer_done(self, layer: int, position: int) -> None:
        held = self._held()
        if layer in held:
            # Of a forward's micro-batch ends, only the last max_snapshots - 1 can outlive it (its
            # end is one more snapshot, `advance`): a copy per layer of every earlier one would be
            # memory held to no end (a 32k-token stretch in micro-batches of 512: 63 copies of
            # every layer's state where 7 are kept).
            self._partial.add(position, layer, held[layer].copy, self.max_snapshots - 1)

    def advance(self, n: int) -> None:
        for position, states in self._partial.whole(len(self._held())):
            self._keep(self._snapshot(position, states))
        super().advance(n)
        if n > 1 or self.length % self.snapshot_every == 0:
            self._take()

    def _take(self) -> None:
        self._keep(self._snapshot(self.length, {i: s.copy() for i, s in self._held().items()}))

    def _keep(self, snap) -> None:
        """Append `snap` (positions ascending) and drop the earliest beyond `max_snapshots`."""
        if self.snapshots and self.snapshots[-1].position == snap.position:
            return
        self.snapshots.append(snap)
        if len(self.snapshots) > self.max_snapshots:
            del self.snapshots[0]


class SequenceState(SnapshotSchedule, KVCache):
    """`KVCache` for the attention layers plus a `DeltaNetState` per recurrent layer (`recurrent`,
    created by the model's mixers), truncatable through snapshots (module docstring)."""

    def __init__(self, cfg: ModelConfig, max_len: int, device: torch.device, dtype: torch.dtype,
                 attention_layers: Sequence[int], recurrent: dict[int, DeltaNetState],
                 snapshot_every: int = SNAPSHOT_EVERY, max_snapshots: int = MAX_SNAPSHOTS):
        super().__init__(cfg, max_len, device, dtype, attention_layers)
        self._init_snapshots(snapshot_every, max_snapshots)
        self.recurrent = recurrent

    def _consistent(self) -> bool:
        # A forward that failed half-way left some layers ahead of `length`.
        return all(s.tokens == self.length for s in self.recurrent.values())

    def _held(self) -> dict[int, DeltaNetState]:
        return self.recurrent

    def _snapshot(self, position: int, states: dict) -> Snapshot:
        return Snapshot(position, states)

    def _incomplete(self) -> bool:
        return not self._consistent()

    def truncate(self, n: int) -> int:
        """Keep at most the first n tokens; returns how many were kept: n itself when nothing
        needs cutting, else the position of the nearest snapshot at or before n (0 if none)."""
        if n >= self.length and self._consistent():
            return self.length
        while self.snapshots and self.snapshots[-1].position > n:
            self.snapshots.pop()
        if self.snapshots:
            snap = self.snapshots[-1]
            for i, s in self.recurrent.items():
                saved = snap.layers[i]
                s.recurrent.copy_(saved.recurrent)
                s.conv.copy_(saved.conv)
                s.tokens = saved.tokens
            self.length = snap.position
        else:
            for s in self.recurrent.values():
                s.recurrent.zero_()
                s.conv.zero_()
                s.tokens = 0
            self.length = 0
        return self.length

    def snapshot_bytes(self) -> int:
        """Memory held by the snapshots kept now, in bytes."""
        return sum(s.nbytes for s in self.snapshots)

    def copy(self) -> SequenceState:
        other = SequenceState(self.cfg, self.max_len, self.device, self.dtype, self.layers,
                              {i: s.copy() for i, s in self.recurrent.items()},
                              self.snapshot_every, self.max_snapshots)
        self._copy_into(other)
        other.snapshots = list(self.snapshots)
        return other
