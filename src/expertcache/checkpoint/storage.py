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
    """A quantized matrix: `raw` [rows, row bytes] uint8 holding the blocks of `shape` [rows, cols],
    or, with `tiled`, [rows / 8, tile bytes]: the rows interleaved eight at a time for the native
    integer kernels (`Kernels.tiles`), which only they read."""

    raw: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, int]
    tiled: bool = False

    def rows(self, start: int, stop: int) -> QuantTensor:
        """Rows start..stop-1; of tiles, only whole tiles (start and stop multiples of 8)."""
        if self.tiled:
            if start % 8 or stop % 8:
                raise TypeError(f"QuantTensor.rows: rows {start}..{stop} split tiles of eight rows")
            return QuantTensor(self.raw[start // 8: stop // 8], self.qtype, (stop - start, self.shape[1]), True)
        return QuantTensor(self.raw[start:stop], self.qtype, (stop - start, self.shape[1]))

    def take(self, index: torch.Tensor) -> QuantTensor:
        """Rows `index` (a permutation or selection), as a new matrix: each row is its own blocks."""
        self._file_rows("take")
        return QuantTensor(self.raw[index].contiguous(), self.qtype, (len(index), self.shape[1]))

    def _file_rows(self, what: str) -> None:
        if self.tiled:
            raise TypeError(f"QuantTensor.{what}: the rows are interleaved tiles, not the file's rows")

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @staticmethod
    def cat(parts: list[QuantTensor]) -> QuantTensor | None:
        """The parts' rows one after another, as one matrix; None unless they share type and width."""
        first = parts[0]
        for p in parts:
            p._file_rows("cat")
        if any(p.qtype != first.qtype or p.shape[1] != first.shape[1] for p in parts):
            return None
        return QuantTensor(torch.cat([p.raw for p in parts]), first.qtype,
                           (sum(p.shape[0] for p in parts), first.shape[1]))


@dataclass(frozen=True, slots=True)
class RowParts:
    """Matrices multiplied as one whose rows cannot be joined into one tensor (quantized in
    different types, or some quantized and some not): `shape` [sum of rows, cols]; a product is
    each part's product, side by side."""

    parts: tuple  # of QuantTensor or torch.Tensor, each [rows_i, cols]
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]
