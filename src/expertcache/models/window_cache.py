"""One sequence's keys and values where some layers attend through a sliding window: those
layers keep only the last W positions, in a ring, so a long context costs full-attention memory
on the full layers alone.

A ring slot holds the position p at index p % W, with the position itself beside it (-1: empty).
A forward of T tokens attends over the ring as it was (the previous W positions) plus its own T
keys, the mask made from the positions (`append_window`), and then writes its last min(T, W)
keys into the ring; a decode step writes its key first and attends over the ring alone.

A ring forgets: once positions have slid out, cutting the sequence back to a prefix that needs
them is impossible from the ring alone. So, as for recurrent state (`state.py`), the cache keeps
snapshots of the rings, taken at the start and end of every forward of more than one token, at
each micro-batch end inside it (as `state.py` does), and every `snapshot_every` tokens while
decoding; `truncate(n)` keeps n itself when the rings still
hold what n needs, else restores the nearest snapshot at or before n and returns its position
(the caller prefills the rest again).

G = key/value heads, W = window, Dh = head dim, T = tokens in this call, P = tokens before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from .layers import KVCache
from .state import MAX_SNAPSHOTS, SNAPSHOT_EVERY, SnapshotSchedule


@dataclass(slots=True)
class Ring:
    k: torch.Tensor    # [G, W, Dh]
    v: torch.Tensor    # [G, W, Dh]
    pos: torch.Tensor  # [W] int64, -1 where empty

    def copy(self) -> Ring:
        return Ring(self.k.clone(), self.v.clone(), self.pos.clone())

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.pos.nbytes


@dataclass(slots=True)
class RingSnapshot:
    position: int
    rings: dict[int, Ring]  # never written after it is taken: copies may share it

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rings.values())


class WindowKVCache(SnapshotSchedule, KVCache):
    """`KVCache` whose layers in `windows` (layer -> W) keep a ring of the last W positions."""

    def __init__(self, cfg: ModelConfig, max_len: int, device: torch.device, dtype: torch.dtype,
                 layers: Sequence[int], shapes: dict[int, tuple[int, int]], windows: dict[int, int],
                 snapshot_every: int = SNAPSHOT_EVERY, max_snapshots: int = MAX_SNAPSHOTS):
        self.windows = dict(windows)
        super().__init__(cfg, max_len, device, dtype, [i for i in layers if i not in self.windows], shapes)
        self._init_snapshots(snapshot_every, max_snapshots)
        default = (cfg.num_kv_heads, cfg.head_dim)
        self.rings: dict[int, Ring] = {}
        for i, W in self.windows.items():
            G, Dh = self.shapes.get(i, default)
            W = min(W, max_len)  # no position reaches max_len: a shorter ring never wraps
            self.rings[i] = Ring(torch.zeros(G, W, Dh, device=device, dtype=dtype),
                                 torch.zeros(G, W, Dh, device=device, dtype=dtype),
                                 torch.full((W,), -1, dtype=torch.int64, device=device))
        # A forward wrote into the rings and has not advanced: it failed half-way, and its
        # writes may have replaced positions that the kept ones need.
        self._pending = False

    def append_window(self, layer: int, k: torch.Tensor, v: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store k, v [G, T, Dh] after the cached tokens; return the keys and values to attend
        over, [G, N, Dh], and their positions [N] (-1: none; the caller masks by position)."""
        if layer not in self.rings:
            return super().append_window(layer, k, v)
        r, P, T = self.rings[layer], self.length, k.shape[1]
        W = r.pos.shape[0]
        if T == 1:
            # A decode step: its slot held position P-W, outside its window; written first, the
            # ring alone is what it attends over (no copy of the ring per step). Until the ring
            # has wrapped, position p is in slot p and the slots after P hold nothing: only the
            # first P+1 are attended over (a short context never reads the whole window).
            slot = P % W
            self._pending = True
            r.k[:, slot].copy_(k[:, 0])
            r.v[:, slot].copy_(v[:, 0])
            r.pos[slot] = P
            n = min(W, P + 1)
            return r.k[:, :n], r.v[:, :n], r.pos[:n]
        new_pos = torch.arange(P, P + T, device=k.device)                  # [T]
        keys = torch.cat((r.k, k), dim=1)                                  # [G, W+T, Dh]
        values = torch.cat((r.v, v), dim=1)                                # [G, W+T, Dh]
        positions = torch.cat((r.pos, new_pos))                            # [W+T]
        self._pending = True
        m = min(T, W)
        slots = new_pos[T - m:] % W                                        # [m]
        r.k.index_copy_(1, slots, k[:, T - m:])
        r.v.index_copy_(1, slots, v[:, T - m:])
        r.pos.index_copy_(0, slots, new_pos[T - m:])
        return keys, values, positions

    def decode_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int, int, torch.Tensor | None]:
        """As `KVCache.decode_rows`; a sliding layer's token goes to its ring slot (as
        `append_window` places it), and the ring's positions come with it."""
        if layer not in self.rings:
            return super().decode_rows(layer)
        r, P = self.rings[layer], self.length
        slot = P % r.pos.shape[0]
        self._pending = True
        r.pos[slot] = P
        return r.k, r.v, slot, min(r.pos.shape[0], P + 1), r.pos

    def _held(self) -> dict[int, Ring]:
        return self.rings

    def _snapshot(self, position: int, rings: dict) -> RingSnapshot:
        return RingSnapshot(position, rings)

    def _incomplete(self) -> bool:
        return self._pending

    def advance(self, n: int) -> None:
        super().advance(n)
        self._pending = False

    def _rings_hold(self, n: int) -> bool:
        # Position n's queries need positions n-W+1 .. n-1, all of which must still be in the ring.
        for i, r in self.rings.items():
            need = max(0, n - self.windows[i] + 1)
            if need < n and not bool(((r.pos >= need) & (r.pos < n)).sum() == n - need):
                return False
        return True

    def truncate(self, n: int) -> int:
        """Keep at most the first n tokens; returns how many were kept: n itself when the rings
        still hold what it needs, else the position of the nearest snapshot at or before n."""
        if n >= self.length and not self._pending:
            return self.length
        n = min(n, self.length)
        for r in self.rings.values():
            r.pos[r.pos >= self.length] = -1  # a failed forward's writes
        self._pending = False
        while self.snapshots and self.snapshots[-1].position > n:
            self.snapshots.pop()
        if self._rings_hold(n):
            keep = n
        elif self.snapshots:
            snap = self.snapshots[-1]
            for i, r in self.rings.items():
                saved = snap.rings[i]
                r.k.copy_(saved.k)
                r.v.copy_(saved.v)
                r.pos.copy_(saved.pos)
            keep = snap.position
        else:
            keep = 0
        for r in self.rings.values():
            r.pos[r.pos >= keep] = -1
        self.length = keep
        return keep

    def snapshot_bytes(self) -> int:
        """Memory held by the ring snapshots kept now, in bytes."""
        return sum(s.nbytes for s in self.snapshots)

    def copy(self) -> WindowKVCache:
        other = WindowKVCache(self.cfg, self.max_len, self.device, self.dtype, self.layers, self.shapes,
                              self.windows, self.snapshot_every, self.max_snapshots)
        self._copy_into(other)
        for i, r in self.rings.items():
            o = other.rings[i]
            o.k.copy_(r.k)
            o.v.copy_(r.v)
            o.pos.copy_(r.pos)
        other.snapshots = list(self.snapshots)
        other._pending = self._pending  # a copy of a forward left half-way is as incomplete
        return other
