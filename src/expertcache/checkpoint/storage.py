"""Storage types: how a matrix's bytes are laid out in a file, a slot or memory.

A storage type is either a torch dtype (plain elements) or one of ggml's block quantization types
(`gguf.GGMLQuantizationType`), in which each row of `cols` weights is `cols / block` blocks of a
fixed byte size. Nothing here interprets the bytes of a quantized matrix; kernels do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import ExpertCacheError

Storage = torch.dtype | GGMLQuantizationType

# ggml's unquantized types are torch dtypes here, so that one float matrix is the same thing
# whichever format it came from.
GGML_DTYPES = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16,
               GGMLQuantizationType.BF16: torch.bfloat16}


def storage_name(s: Storage) -> str:
    return str(s).removeprefix("torch.") if isinstance(s, torch.dtype) else s.name


def is_quantized(s: Storage) -> bool:
    return not isinstance(s, torch.dtype)


def row_nbytes(s: Storage, cols: int) -> int:
    """Bytes of one row of `cols` weights; a row must be whole blocks."""
    if isinstance(s, torch.dtype):
        return cols * s.itemsize
    block, size = GGML_QUANT_SIZES[s]
    if cols % block:
        raise ExpertCacheError(f"a row of {cols} weights is not whole {s.name} blocks of {block}")
    return cols // block * size


def nbytes(s: Storage, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of `shape` (torch order: the last dimension is the row)."""
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows * row_nbytes(s, shape[-1]) if shape else (s.itemsize if isinstance(s, torch.dtype) else 0)


@dataclass(frozen=True, slots=True)
class QuantTensor:
    """A quantized matrix: `raw` [rows, row bytes] uint8 holding the blocks of `shape` [rows, cols]."""

    raw: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, int]

    def rows(self, start: int, stop: int) -> QuantTensor:
        return QuantTensor(self.raw[start:stop], self.qtype, (stop - start, self.shape[1]))
