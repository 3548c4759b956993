"""Slot geometry: one expert is one contiguous range holding gate [I, D], up [I, D], down [D, I].

Rows are padded so that every expert starts on the same byte alignment in every tier and mode
(resident, staging, cache): the matrix kernels then see identically aligned operands and pick the
same code paths, which bit-exactness across modes relies on.
"""

from __future__ import annotations

import torch

SLOT_ALIGN_BYTES = 256


def padded_numel(numel: int, itemsize: int, align: int = SLOT_ALIGN_BYTES) -> int:
    """Elements per expert row, rounded up so each row starts on an `align`-byte boundary."""
    per = max(1, align // itemsize)
    return -(-numel // per) * per


def expert_views(row: torch.Tensor, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split one expert's row into gate/up [2I, D] and down [D, I] views (no copy)."""
    gu = 2 * inter * hidden
    return row[:gu].view(2 * inter, hidden), row[gu: gu + hidden * inter].view(hidden, inter)
