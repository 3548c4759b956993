"""Slot geometry: what one expert's bytes are, described rather than assumed.

An expert is a few matrices (gate, up and down, or a fused gate_up and down), each with a
storage type (a torch dtype or a quantization type), a shape and a byte offset within the
expert's one contiguous range. All experts of a layer share one `ExpertFormat`; layers may
differ (a quantized file may store `down` in another type on some layers), and every slot is as
large as the largest. The cache copies these bytes and never interprets them; `expert_weights`
makes typed views of a slot for the compute path.

A quantized expert may hold float matrices too (llama.cpp's quantizer keeps a matrix whose rows
are not whole blocks of the requested type in F16/F32): in such an expert every matrix is viewed
as ggml rows (`QuantTensor`), the float ones as rows of ggml's F32, F16 or BF16 type, so that
the kernels over blocks, which multiply those types too, take the whole expert in their one path.
The views are made once per slot, so this costs nothing per token.

A float matrix the file stores as fp16 or bf16 and a float32 slot holds widened (exactly) keeps
that type (`MatrixFormat.file_dtype`, `ExpertWeights.inputs`): llama.cpp's numerics round a
product's input to it before multiplying (ggml's `vec_dot_type` for F16 and BF16), which the
kernels do under `--activations q8`; exact products ignore it.

A quantized matrix may be held as the kernels' tiles of eight rows instead of the file's rows
(`MatrixFormat.tiled`, chosen by a `Tiler`): the same bytes per matrix, interleaved when the
store fills its slots (`store.tile_in_place`), so that every product reads them as they lie.

Slots are padded so that every expert starts on the same byte alignment in every tier and mode
(resident, staging, cache): the matrix kernels then see identically aligned operands and pick the
same code paths, which bit-exactness across modes relies on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from ..checkpoint.storage import GGML_DTYPES, QuantTensor, RowParts, Storage, is_quantized, nbytes, storage_name

SLOT_ALIGN_BYTES = 256
# The file's float types whose products llama.cpp takes with the input rounded to them.
ROUNDED_FLOATS = (torch.float16, torch.bfloat16)
# A float matrix's ggml type, where it is viewed as ggml rows (beside quantized matrices).
GGML_FLOAT_TYPES = {dtype: qtype for qtype, dtype in GGML_DTYPES.items()}

Weight = torch.Tensor | QuantTensor | RowParts


class Tiler(Protocol):
    """What the CPU's kernels tell a store whose slots they read: which quantized matrices they
    read as tiles of eight rows, how those are formed, and how host bytes are copied into slots."""

    def holds_tiles(self, storage: Storage, shape: tuple[int, int]) -> bool:
        """Whether a matrix of this storage and shape is best held as tiles (which take exactly
        its rows' bytes)."""

    def tile_rows(self, raw: torch.Tensor, storage: Storage, cols: int) -> torch.Tensor:
        """Rows [N, row bytes] uint8 as tiles [N / 8, tile bytes]."""

    def copy_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst <- src: host uint8 tensors of one shape, contiguous (a slot fill)."""


@dataclass(frozen=True, slots=True)
class MatrixFormat:
    name: str               # gate | up | down | gate_up
    storage: Storage
    shape: tuple[int, int]  # [rows, cols]
    offset: int             # bytes from the start of the expert
    tiled: bool = False     # held as the kernels' tiles of eight rows (the same bytes, interleaved)
    # The file's fp16/bf16 where the slot holds the matrix widened to float32 (see the module's
    # docstring); None where the slot holds the file's type, or the file's is float32.
    file_dtype: torch.dtype | None = None

    @property
    def nbytes(self) -> int:
        return nbytes(self.storage, self.shape)

    def describe(self) -> str:
        return f"{self.name} {storage_name(self.storage)}{' tiled' if self.tiled else ''} {list(self.shape)}"


@dataclass(frozen=True, slots=True)
class ExpertFormat:
    """The matrices of one expert, back to back in the given order."""

    matrices: tuple[MatrixFormat, ...]

    @classmethod
    def of(cls, parts: list[tuple[str, Storage, tuple[int, int]]]) -> ExpertFormat:
        out, pos = [], 0
        for name, storage, shape in parts:
            m = MatrixFormat(name, storage, tuple(shape), pos)
            out.append(m)
            pos += m.nbytes
        return cls(tuple(out))

    @property
    def nbytes(self) -> int:
        last = self.matrices[-1]
        return last.offset + last.nbytes

    @property
    def quantized(self) -> bool:
        return any(is_quantized(m.storage) for m in self.matrices)

    def with_dtype(self, dtype: torch.dtype) -> ExpertFormat:
        """The same expert with its float matrices in `dtype` (quantized ones stay as they are);
        fp16 and bf16 ones widened to float32 remember the file's type (`file_dtype`)."""
        fmt = ExpertFormat.of([(m.name, m.storage if is_quantized(m.storage) else dtype, m.shape)
                               for m in self.matrices])
        if dtype != torch.float32:  # only a widening keeps the file's values, which the rounding needs
            return fmt
        return ExpertFormat(tuple(replace(m, file_dtype=f.storage) if f.storage in ROUNDED_FLOATS else m
                                  for m, f in zip(fmt.matrices, self.matrices)))

    def with_tiles(self, tiler: Tiler) -> ExpertFormat:
        """The same expert with the matrices `tiler` holds as tiles marked so (same offsets)."""
        return ExpertFormat(tuple(replace(m, tiled=is_quantized(m.storage) and tiler.holds_tiles(m.storage, m.shape))
                                  for m in self.matrices))

    @property
    def as_rows(self) -> ExpertFormat:
        """The same expert with every matrix as the file's rows (none tiled)."""
        return ExpertFormat(tuple(replace(m, tiled=False) for m in self.matrices))

    def matrix(self, name: str) -> MatrixFormat | None:
        return next((m for m in self.matrices if m.name == name), None)

    def describe(self) -> str:
        return ", ".join(m.describe() for m in self.matrices)


def slot_nbytes(formats: list[ExpertFormat], align: int = SLOT_ALIGN_BYTES) -> int:
    """Bytes per slot: the largest expert, rounded up so each slot starts on an `align` boundary."""
    return -(-max(f.nbytes for f in formats) // align) * align


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """Views of one expert's matrices in a slot. `gate_up` [2I, D] is there when gate and up are
    one matrix (fused in the file, or adjacent in one dtype or quantization type), so one product
    serves both."""

    gate: Weight     # [I, D]
    up: Weight       # [I, D]
    down: Weight     # [D, I]
    gate_up: Weight | None = None
    # The dtypes gate's, up's and down's products round their input to under llama.cpp's numerics
    # (`MatrixFormat.file_dtype`), or None where no matrix asks for it: the exact path's one test.
    inputs: tuple[torch.dtype | None, torch.dtype | None, torch.dtype | None] | None = None


def _view(row: torch.Tensor, m: MatrixFormat, rows: bool) -> Weight:
    """Matrix `m` of the expert at `row`: a tensor, or ggml rows (quantized, or `rows`: a float
    matrix as rows of its ggml float type)."""
    raw = row[m.offset: m.offset + m.nbytes]
    if is_quantized(m.storage):
        return QuantTensor(raw.view(m.shape[0] // 8 if m.tiled else m.shape[0], -1), m.storage, m.shape, m.tiled)
    if rows:
        return QuantTensor(raw.view(m.shape[0], -1), GGML_FLOAT_TYPES[m.storage], m.shape)
    return raw.view(m.storage).view(m.shape)


def expert_weights(row: torch.Tensor, fmt: ExpertFormat) -> ExpertWeights:
    """Typed views (no copy) of the expert whose bytes start `row` (uint8); in a quantized expert
    every matrix is ggml rows, its float ones too (see the module's docstring)."""
    rows = fmt.quantized
    d = fmt.matrix("down")
    down = _view(row, d, rows)
    fused = fmt.matrix("gate_up")
    if fused is not None:
        gu = _view(row, fused, rows)
        half = fused.shape[0] // 2
        inputs = _inputs(fused, fused, d)
        if isinstance(gu, QuantTensor):
            return ExpertWeights(gu.rows(0, half), gu.rows(half, 2 * half), down, gu, inputs)
        return ExpertWeights(gu[:half], gu[half:], down, gu, inputs)
    g, u = fmt.matrix("gate"), fmt.matrix("up")
    gate, up = _view(row, g, rows), _view(row, u, rows)
    gate_up = None
    # Joined only where one product serves both: the same input rounding too.
    if (g.storage == u.storage and g.shape == u.shape and g.tiled == u.tiled and g.file_dtype == u.file_dtype
            and u.offset == g.offset + g.nbytes):
        # Tiles of eight rows: gate's followed by up's are the tiles of the two joined.
        gate_up = _view(row, MatrixFormat("gate_up", g.storage, (2 * g.shape[0], g.shape[1]), g.offset, g.tiled), rows)
    return ExpertWeights(gate, up, down, gate_up, _inputs(g, u, d))


def _inputs(gate: MatrixFormat, up: MatrixFormat, down: MatrixFormat) -> tuple | None:
    """`ExpertWeights.inputs` of these matrices."""
    dtypes = (gate.file_dtype, up.file_dtype, down.file_dtype)
    return None if dtypes == (None, None, None) else dtypes
