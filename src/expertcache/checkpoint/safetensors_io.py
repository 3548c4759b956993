"""The tensors of a safetensors checkpoint (one file or sharded), validated at the boundary.

Headers are parsed here so that every tensor's file, byte offset and size are known (the expert
stores read experts by byte range); tensor data is read through `safetensors.safe_open`, which
memory-maps the file rather than loading it whole.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import ExpertCacheError

DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in `file`
    nbytes: int


@dataclass(frozen=True, slots=True)
class Segment:
    """A byte range of one file (for example, part of an expert)."""

    file: Path
    offset: int
    nbytes: int


def read_header(path: Path) -> tuple[dict, int]:
    """The JSON header of one safetensors file and the offset where its data begins."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ExpertCacheError(f"{path}: not a safetensors file (only {size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise ExpertCacheError(f"{path}: corrupt or truncated safetensors header "
                                       f"(header length {n}, file size {size})")
            raw = f.read(n)
    except OSError as e:
        raise ExpertCacheError(f"{path}: cannot read: {e.strerror}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ExpertCacheError(f"{path}: corrupt safetensors header (not valid JSON)") from None
    if not isinstance(header, dict):
        raise ExpertCacheError(f"{path}: corrupt safetensors header (not a JSON object)")
    return header, 8 + n


def _tensors_of(path: Path) -> dict[str, TensorInfo]:
    header, data_start = read_header(path)
    size = path.stat().st_size
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            # safetensors refuses anything but string values when the file is opened to read.
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                raise ExpertCacheError(f"{path}: corrupt safetensors header (__metadata__ {meta!r}: "
                                       "expected a JSON object of strings)")
            continue
        try:
            code = meta["dtype"]
            shape = tuple(int(d) for d in meta["shape"])
            begin, end = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ExpertCacheError(f"{path}: corrupt header entry for tensor {name!r}") from None
        if code not in DTYPES:
            raise ExpertCacheError(f"{path}: tensor {name!r} has dtype {code!r}, expected one of {', '.join(DTYPES)}")
        dtype = DTYPES[code]
        if any(d < 0 for d in shape):
            raise ExpertCacheError(f"{path}: tensor {name!r} has shape {list(shape)}, expected no negative dimension")
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        if end - begin != nbytes or begin < 0:
            raise ExpertCacheError(f"{path}: tensor {name!r} has {end - begin} bytes, expected {nbytes} "
                                   f"for shape {list(shape)} {meta['dtype']}")
        if data_start + end > size:
            raise ExpertCacheError(f"{path}: truncated: tensor {name!r} ends at byte {data_start + end} "
                                   f"but the file has {size} bytes")
        out[name] = TensorInfo(name, path, dtype, shape, data_start + begin, nbytes)
    _check_contiguous(path, out, data_start, size)
    return out


def _check_contiguous(path: Path, tensors: dict[str, TensorInfo], data_start: int, size: int) -> None:
    """The tensors' data fill the data section exactly, one after another, as safetensors requires
    when the file is opened to read: a header whose ranges overlap, leave a hole or stop short of
    the end is refused here, when the checkpoint is opened, not at the first read."""
    at, last = data_start, None
    for t in sorted(tensors.values(), key=lambda t: (t.offset, t.nbytes)):
        if t.offset != at:
            where = f"the end of tensor {last!r}" if last is not None else "the start of the data"
            raise ExpertCacheError(f"{path}: corrupt safetensors header: tensor {t.name!r} begins at byte "
                                   f"{t.offset - data_start} of the data, expected byte {at - data_start} "
                                   f"({where}; tensors must not overlap or leave gaps)")
        at, last = t.offset + t.nbytes, t.name
    if at != size:
        raise ExpertCacheError(f"{path}: corrupt safetensors file: {size - at} bytes after the last tensor's data "
                               f"(the header's tensors end at byte {at}, the file has {size})")


class Checkpoint:
    """All tensors of the safetensors files in a model directory."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError):
                raise ExpertCacheError(f"{index}: not a valid safetensors index (expected a 'weight_map')") from None
            # Each entry names a tensor and the shard file that holds it, both strings.
            if not isinstance(weight_map, dict):
                raise ExpertCacheError(f"{index}: 'weight_map' is a {type(weight_map).__name__}, expected a JSON "
                                       "object of tensor name to file name")
            for name, fname in weight_map.items():
                if not isinstance(fname, str) or not fname:
                    raise ExpertCacheError(f"{index}: 'weight_map' names {fname!r} for tensor {name!r}, "
                                           "expected a file name")
            files = sorted(set(weight_map.values()))
        elif (self.dir / "model.safetensors").exists():
            weight_map, files = None, ["model.safetensors"]
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            weight_map = None
            if not files:
                raise ExpertCacheError(f"{self.dir}: no model.safetensors, model.safetensors.index.json "
                                       "or *.safetensors files")
        self.files = [self.dir / f for f in files]
        self.tensors: dict[str, TensorInfo] = {}
        for path in self.files:
            if not path.exists():
                raise ExpertCacheError(f"{path}: listed in the index but missing")
            for name, info in _tensors_of(path).items():
                if name in self.tensors:
                    raise ExpertCacheError(f"tensor {name!r} appears twice: in {self.tensors[name].file.name} "
                                           f"and {path.name}")
                self.tensors[name] = info
        if weight_map is not None:
            for name, fname in weight_map.items():
                info = self.tensors.get(name)
                if info is None or info.file.name != fname:
                    raise ExpertCacheError(f"{index}: tensor {name!r} is listed in {fname} but not found there")
        self._handles: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def _handle(self, path: Path):
        h = self._handles.get(path)
        if h is None:
            try:
                h = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise ExpertCacheError(f"{path}: cannot open as safetensors: {e}") from None
            self._handles[path] = h
        return h

    def read(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        return self._handle(info.file).get_tensor(name)

    def read_rows(self, name: str, index: int) -> torch.Tensor:
        """`tensor[index]` read without materialising the whole tensor."""
        info = self.tensors[name]
        return self._handle(info.file).get_slice(name)[index]

    def close(self) -> None:
        self._handles.clear()
