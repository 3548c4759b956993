"""The routed MoE block: top-k routing, then each chosen expert computed from weights that an
`ExpertProvider` hands out, combined in a fixed order.

The layer never sees where experts live. It asks the provider for the sorted distinct experts an
op uses; the provider yields them in one or more waves (a cache smaller than the op cannot hold
them all at once). Each expert's output goes to its own rows of a buffer laid out by token and
router rank, and the weighted sum over ranks is taken once at the end, so the result does not
depend on how many waves there were or in which order experts arrived.

T = tokens, D = hidden, E = experts, A = active experts per token (top-k), I = expert width.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import ExpertCacheError
from ..kernels import Kernels
from ..memory import host_zeros
from ..tiers.layout import ExpertWeights


class ExpertProvider(Protocol):
    def acquire(self, layer: int, experts: Sequence[int], meanwhile: Callable[[], None] | None = None
                ) -> Iterator[list[tuple[int, ExpertWeights]]]:
        """Yield the experts of `layer` in waves of (id, weights); each wave's views are valid
        until the next one.

        `experts` are the op's distinct expert ids, sorted. Leaving the generator (exhausted,
        closed or on error) releases what it pinned, so a caller that stops early leaves nothing
        pinned. `meanwhile`: work of the caller's that needs no expert (Gemma 4's dense MLP),
        called once before the first wave is yielded, while that wave's copies are in
        flight where they are made asynchronously.
        """
        ...


@dataclass(slots=True)
class Routing:
    weights: torch.Tensor  # [T, A] routing weights, in router-rank order
    ids: torch.Tensor      # [T, A] expert ids


def route(k: Kernels, x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool,
          weights_fp32: bool = False) -> Routing:
    return Routing(*k.route(x, router, top_k, normalize, weights_fp32))


class Workspace:
    """The buffers of a multi-token MoE op, kept between ops and grown only when an op needs more
    rows: a prefill stretch of thousands of tokens needs hundreds of MB of them, and allocating
    them afresh for every layer costs a page fault per 4 KiB each time."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A [rows, D] buffer with `like`'s width, dtype and device; contents undefined."""
        buf = self.buffers.get(name)
        D = like.shape[1]
        if (buf is None or buf.shape[0] < rows or buf.shape[1] != D or buf.dtype != like.dtype
                or buf.device != like.device):
            buf = self.buffers[name] = host_zeros((rows, D), like.dtype, like.device)
        return buf[:rows]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())


# The [T*A, D] buffers of one op (`Workspace`): inputs grouped by expert, outputs likewise, outputs
# by token.
OP_BUFFERS = 3


def moe_experts(k: Kernels, x: torch.Tensor, routing: Routing, provider: ExpertProvider,
                layer: int, act: str = "silu", workspace: Workspace | None = None,
                meanwhile: Callable[[], None] | None = None) -> torch.Tensor:
    """The op's output [T, D]. `meanwhile` (`ExpertProvider.acquire`) runs once, while the op's
    first copies are in flight: work beside the experts overlaps their reads."""
    T, D = x.shape
    A = routing.ids.shape[1]
    if T == 1:
        return _moe_one_token(k, x, routing, provider, layer, act, meanwhile)
    if workspace is None:
        workspace = Workspace()
    flat = routing.ids.reshape(-1)                              # [T*A]
    order = torch.argsort(flat, stable=True)                    # [T*A] rows grouped by expert id
    used_t, counts_t = torch.unique_consecutive(flat[order], return_counts=True)
    used, counts = torch.stack((used_t, counts_t)).tolist()    # one read-back (a GPU waits once)
    start = {}
    acc = 0
    for e, c in zip(used, counts):
        start[e] = (acc, acc + c)
        acc += c
    xs = torch.index_select(x, 0, order // A, out=workspace.take("xs", T * A, x))  # [T*A, D] grouped by expert
    ys = workspace.take("ys", T * A, x)                         # [T*A, D] outputs, same grouping
    for wave in provider.acquire(layer, used, meanwhile):
        for e, w in wave:
            a, b = start[e]
            ys[a:b] = k.expert(xs[a:b], w, act)                 # [n, D]
    out = workspace.take("out", T * A, x).index_copy_(0, order, ys)  # [T*A, D] by token, then rank
    # The weighted sum over ranks as one batched product, [T, 1, A] x [T, A, D], accumulated in
    # fp32 by the matrix kernel and rounded once.
    w = routing.weights.to(out.dtype).unsqueeze(1)                # [T, 1, A]
    return torch.bmm(w, out.view(T, A, D)).view(T, D)             # [T, D]


def _moe_one_token(k: Kernels, x: torch.Tensor, routing: Routing, provider: ExpertProvider,
                   layer: int, act: str = "silu", meanwhile: Callable[[], None] | None = None) -> torch.Tensor:
    """The decode step: one token, so no grouping of rows; the same fixed-order combine."""
    ranked = routing.ids[0].tolist()                               # expert ids in router-rank order
    # Where the kernels can, they write each expert's output (fp32) to its rank's row and sum the
    # rows themselves: a few calls per op instead of a slice per expert, a join and a product.
    rows = torch.empty((len(ranked), x.shape[1]), dtype=torch.float32, device=x.device) if k.ranked_rows else None
    rank = {e: j for j, e in enumerate(ranked)}
    ys: dict[int, torch.Tensor] = {}
    written = False
    for wave in provider.acquire(layer, sorted(ranked), meanwhile):
        if rows is not None:
            if k.experts_one_row(x, wave, act, rows, [rank[e] for e, _ in wave]) is not None:
                written = True
                continue
            if written:  # a layer's experts share one format, so its waves all take one path
                raise ExpertCacheError(f"layer {layer}: the kernels took one wave of experts in rank rows, not the next")
            rows = None
        # The whole wave in one call where the kernels have one; each expert's row is what it
        # would be alone, so the result does not depend on the waves.
        yw = k.experts_one_row(x, wave, act)                       # [n, D] or None
        if yw is not None:
            for j, (e, _) in enumerate(wave):
                ys[e] = yw[j: j + 1]
            continue
        for e, w in wave:
            ys[e] = k.expert(x, w, act)                            # [1, D]
    if rows is not None:
        return k.combine(routing.weights, rows, x)                 # [1, D]
    out = torch.cat([ys[e] for e in ranked])                       # [A, D] in rank order
    w = routing.weights.to(out.dtype)                              # [1, A]
    # As a matrix-vector product over the A outputs: `linear` takes the BLAS path for one bf16
    # row, ~10x faster here than oneDNN's [1, A] x [A, D] product.
    return k.linear(w, out.t())                                    # [1, D]
