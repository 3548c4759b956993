"""The tensors and metadata of a GGUF model (one file or a gguf-split set), validated at the boundary.

Each tensor is named with its storage type (a `gguf.GGMLQuantizationType`), its shape in torch
order (the last dimension is the row length) and its absolute byte range in its file; tensor
data is read as raw bytes, never dequantized, so quantized experts can be copied as they are
stored. Nothing here knows of model architectures.

The header is parsed here with gguf-py's tables (magic, versions, value types, block sizes)
rather than by `gguf.GGUFReader`, which builds numpy views per array element: tens of seconds
for a 150k-token vocabulary. Data is read with `os.pread` into fresh tensors rather than handed
out as views of a memory map, so a file truncated or replaced while open is an error, not a
SIGBUS that kills the process.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

from ..errors import ExpertCacheError
from .files import close_when_collected
from .safetensors_io import Segment

SUPPORTED_VERSIONS = (2, 3)
_MAX_DIMS = 4  # GGML_MAX_DIMS
_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_SCALARS = {  # value type -> (struct code, size)
    GGUFValueType.UINT8: ("B", 1), GGUFValueType.INT8: ("b", 1), GGUFValueType.UINT16: ("H", 2),
    GGUFValueType.INT16: ("h", 2), GGUFValueType.UINT32: ("I", 4), GGUFValueType.INT32: ("i", 4),
    GGUFValueType.FLOAT32: ("f", 4), GGUFValueType.BOOL: ("?", 1), GGUFValueType.UINT64: ("Q", 8),
    GGUFValueType.INT64: ("q", 8), GGUFValueType.FLOAT64: ("d", 8),
}
_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
TORCH_DTYPES = {
    GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16, GGMLQuantizationType.F64: torch.float64,
    GGMLQuantizationType.I8: torch.int8, GGMLQuantizationType.I16: torch.int16,
    GGMLQuantizationType.I32: torch.int32, GGMLQuantizationType.I64: torch.int64,
}


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    file: Path
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: shape[-1] is the row length (ggml's ne[0])
    offset: int             # absolute byte offset of the data in `file`
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of `shape[-1]` elements (a whole number of quantization blocks)."""
        block, size = GGML_QUANT_SIZES[self.qtype]
        return self.shape[-1] // block * size if self.shape else size

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """The shape of the raw bytes `read` returns: rows of `row_bytes`."""
        return (*self.shape[:-1], self.row_bytes)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype when the storage type is a plain one (F32, F16, BF16, ints), else None."""
        return TORCH_DTYPES.get(self.qtype)

    @property
    def storage(self) -> torch.dtype | GGMLQuantizationType:
        """The storage type as the engine names it: a torch dtype for F32, F16 and BF16 (one float
        matrix is the same thing whichever format it came from), else the ggml type."""
        return TORCH_DTYPES[self.qtype] if self.qtype in _FLOAT_TYPES else self.qtype


class _Header:
    """A cursor over the header of one GGUF file, read in growing chunks, every length checked
    against the file size first so that a corrupt count cannot ask for gigabytes."""

    def __init__(self, path: Path, f, size: int):
        self.path, self.f, self.size = path, f, size
        self.buf, self.pos = bytearray(), 0
        self.what = "the header"

    def need(self, n: int) -> None:
        end = self.pos + n
        if end > self.size:
            raise ExpertCacheError(f"{self.path}: truncated: the header ends inside {self.what} "
                                   f"(needs byte {end}, the file has {self.size})")
        if end > len(self.buf):
            self.f.seek(len(self.buf))
            chunk = self.f.read(max(end - len(self.buf), 1 << 20))
            self.buf += chunk
            if end > len(self.buf):
                raise ExpertCacheError(f"{self.path}: cannot read {self.what}: the file shrank while read")

    def scalar(self, vtype: GGUFValueType):
        code, n = _SCALARS[vtype]
        self.need(n)
        (v,) = struct.unpack_from("<" + code, self.buf, self.pos)
        self.pos += n
        return v

    def u32(self) -> int:
        return self.scalar(GGUFValueType.UINT32)

    def u64(self) -> int:
        return self.scalar(GGUFValueType.UINT64)

    def string(self) -> str:
        n = self.u64()
        self.need(n)
        raw = bytes(self.buf[self.pos: self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ExpertCacheError(f"{self.path}: {self.what} holds a string that is not valid UTF-8") from None

    def vtype(self) -> GGUFValueType:
        raw = self.u32()
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ExpertCacheError(f"{self.path}: {self.what} has unknown value type {raw}") from None

    def value(self, vtype: GGUFValueType) -> tuple[Any, tuple]:
        """(value, type description): arrays become lists, strings are decoded."""
        if vtype == GGUFValueType.STRING:
            return self.string(), (vtype,)
        if vtype != GGUFValueType.ARRAY:
            return self.scalar(vtype), (vtype,)
        itype = self.vtype()
        count = self.u64()
        if itype in _SCALARS:
            code, n = _SCALARS[itype]
            self.need(count * n)
            values = list(struct.unpack_from(f"<{count}{code}", self.buf, self.pos))
            self.pos += count * n
            return values, (vtype, itype)
        if itype != GGUFValueType.STRING:  # as in llama.cpp's reader
            raise ExpertCacheError(f"{self.path}: {self.what} is an array of arrays, which GGUF readers do not support")
        self.need(count * 8)  # every string takes at least 8 bytes
        return [self.string() for _ in range(count)], (vtype, itype)


@dataclass(frozen=True, slots=True)
class _Part:
    path: Path
    metadata: dict
    types: dict
    tensors: dict[str, GGUFTensorInfo]


def _read_part(path: Path) -> _Part:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            return _parse(path, f, size)
    except OSError as e:
        raise ExpertCacheError(f"{path}: cannot read: {e.strerror}") from None


def _parse(path: Path, f, size: int) -> _Part:
    h = _Header(path, f, size)
    h.what = "the magic number"
    if size < 4:
        raise ExpertCacheError(f"{path}: not a GGUF file (only {size} bytes)")
    h.need(4)
    if struct.unpack_from("<I", h.buf, 0)[0] != GGUF_MAGIC:
        raise ExpertCacheError(f"{path}: not a GGUF file (magic {bytes(h.buf[:4])!r}, expected b'GGUF')")
    h.pos, h.what = 4, "the version"
    version = h.u32()
    if version not in SUPPORTED_VERSIONS:
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise ExpertCacheError(f"{path}: GGUF version {version} is not supported{hint}; "
                               f"expected one of {list(SUPPORTED_VERSIONS)}")
    h.what = "the tensor and key counts"
    n_tensors, n_kv = h.u64(), h.u64()
    metadata, types = {}, {}
    for i in range(n_kv):
        h.what = f"metadata key #{i}"
        key = h.string()
        h.what = f"metadata key {key!r}"
        if key in metadata:
            raise ExpertCacheError(f"{path}: metadata key {key!r} appears twice")
        metadata[key], types[key] = h.value(h.vtype())
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if "general.alignment" in types and (types["general.alignment"] != (GGUFValueType.UINT32,)
                                         or alignment <= 0 or alignment & (alignment - 1)):
        raise ExpertCacheError(f"{path}: metadata key 'general.alignment' is {alignment!r}, "
                               "expected a power of two stored as uint32")
    raw = []
    for i in range(n_tensors):
        h.what = f"tensor info #{i}"
        name = h.string()
        h.what = f"the info of tensor {name!r}"
        n_dims = h.u32()
        if n_dims > _MAX_DIMS:
            raise ExpertCacheError(f"{path}: tensor {name!r} has {n_dims} dimensions, expected at most {_MAX_DIMS}")
        ne = [h.u64() for _ in range(n_dims)]
        qraw, rel = h.u32(), h.u64()
        raw.append((name, ne, qraw, rel))
    data_start = -(-h.pos // alignment) * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, ne, qraw, rel in raw:
        info = _tensor_info(path, name, ne, qraw, data_start + rel, alignment)
        if name in tensors:
            raise ExpertCacheError(f"{path}: tensor {name!r} appears twice")
        tensors[name] = info
    _check_extents(path, tensors, size)
    return _Part(path, metadata, types, tensors)


def _tensor_info(path: Path, name: str, ne: list[int], qraw: int, offset: int, alignment: int) -> GGUFTensorInfo:
    try:
        qtype = GGMLQuantizationType(qraw)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ExpertCacheError(f"{path}: tensor {name!r} has unknown storage type {qraw}") from None
    row = ne[0] if ne else 1
    if row % block:
        raise ExpertCacheError(f"{path}: tensor {name!r} has rows of {row} elements, not a multiple of "
                               f"the {qtype.name} block size {block}")
    numel = 1
    for d in ne:
        numel *= d
    if offset % alignment:
        raise ExpertCacheError(f"{path}: tensor {name!r} starts at byte {offset}, not a multiple of "
                               f"the alignment {alignment}")
    return GGUFTensorInfo(name, path, qtype, tuple(reversed(ne)), offset, numel // block * type_size)


def _check_extents(path: Path, tensors: dict[str, GGUFTensorInfo], size: int) -> None:
    """Every tensor lies inside the file and ends before the next one begins: a shape or type that
    claims more bytes than the file gives it is caught here, since GGUF stores no byte sizes."""
    ordered = sorted(tensors.values(), key=lambda t: t.offset)
    for t, nxt in zip(ordered, ordered[1:] + [None]):
        end = t.offset + t.nbytes
        if nxt is not None and end > nxt.offset:
            raise ExpertCacheError(f"{path}: tensor {t.name!r} ({t.qtype.name} {list(t.shape)}) needs {t.nbytes} "
                                   f"bytes but tensor {nxt.name!r} begins {nxt.offset - t.offset} bytes after it")
        if end > size:
            raise ExpertCacheError(f"{path}: truncated: tensor {t.name!r} ends at byte {end} "
                                   f"but the file has {size} bytes")


def _split_name(name: str) -> re.Match | None:
    """The parts of a gguf-split name NAME-0000i-of-0000N.gguf, or None for any other name: part
    numbers outside 1..N (-00001-of-00000) do not name a part of a set, so such a file is read as
    the one file it is, as llama.cpp reads it (it goes by split.count, not by the name)."""
    m = _SPLIT_NAME.match(name)
    return m if m is not None and 1 <= int(m["no"]) <= int(m["count"]) else None


def _model_files(path: Path) -> list[Path]:
    """The files of the one GGUF model at `path`: a file (any part of a split set) or a directory."""
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.suffix == ".gguf" and p.is_file())
        models = sorted({(m := _split_name(p.name)) and m["prefix"] or p.name for p in found})
        if not models:
            raise ExpertCacheError(f"{path}: no .gguf file in this directory")
        if len(models) > 1:
            raise ExpertCacheError(f"{path}: holds several GGUF models ({', '.join(models)}); give the path of one")
        path = found[0]
    elif not path.exists():
        raise ExpertCacheError(f"{path}: no such file or directory")
    m = _split_name(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    parts = [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    for p in parts:
        if not p.exists():
            raise ExpertCacheError(f"{p}: missing (part of the {count}-part GGUF model {parts[0].name})")
    return parts


class GGUFCheckpoint:
    """All tensors and the metadata of one GGUF model: a file, any part of a split set, or a
    directory holding exactly one of either."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.files = _model_files(self.path)
        parts = [_read_part(p) for p in self.files]
        self.metadata: dict[str, Any] = parts[0].metadata
        self.metadata_types: dict[str, tuple] = parts[0].types
        self.tensors: dict[str, GGUFTensorInfo] = {}
        if len(parts) == 1 and _split_key(parts[0], "split.count", 1) > 1:
            raise ExpertCacheError(f"{self.files[0]}: part {_split_key(parts[0], 'split.no', 0) + 1} of a "
                                   f"{parts[0].metadata['split.count']}-part model (split.count), but its name is not "
                                   "NAME-0000i-of-0000N.gguf; give the parts their gguf-split names")
        for i, part in enumerate(parts):
            if len(parts) > 1:
                _check_split(part, i, len(parts))
            for name, info in part.tensors.items():
                if name in self.tensors:
                    raise ExpertCacheError(f"tensor {name!r} appears twice: in {self.tensors[name].file.name} "
                                           f"and {part.path.name}")
                self.tensors[name] = info
        expected = _split_key(parts[0], "split.tensors.count", None)
        if expected is not None and expected != len(self.tensors):
            raise ExpertCacheError(f"{self.files[0]}: split.tensors.count is {expected} but the "
                                   f"{len(self.files)} parts hold {len(self.tensors)} tensors")
        self._fds: dict[Path, int] = {}
        self._closer = close_when_collected(self, self._fds)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> GGUFTensorInfo:
        return self.tensors[name]

    def require(self, key: str) -> Any:
        """The value of metadata `key`, or an error naming the file and the key."""
        if key not in self.metadata:
            raise ExpertCacheError(f"{self.files[0]}: metadata key {key!r} is missing")
        return self.metadata[key]

    def segment(self, name: str, index: int | None = None) -> Segment:
        """The byte range of tensor `name`, or of `name[index]` (one expert of an [E, rows, cols] tensor)."""
        info = self.tensors[name]
        if index is None:
            return Segment(info.file, info.offset, info.nbytes)
        if len(info.shape) != 3:
            raise ExpertCacheError(f"{info.file}: tensor {name!r} has shape {list(info.shape)}, "
                                   "expected [experts, rows, cols] to take expert slices")
        if not 0 <= index < info.shape[0]:
            raise IndexError(f"expert {index} of tensor {name!r} with {info.shape[0]} experts")
        each = info.nbytes // info.shape[0]
        return Segment(info.file, info.offset + index * each, each)

    def read(self, name: str) -> torch.Tensor:
        """The raw bytes of tensor `name` (uint8, shape `info.byte_shape`), in a fresh tensor."""
        info = self.tensors[name]
        return self._pread(self.segment(name)).view(info.byte_shape)

    def read_rows(self, name: str, index: int) -> torch.Tensor:
        """The raw bytes of `tensor[index]` of a 3-D expert tensor (uint8, [rows, row_bytes])."""
        info = self.tensors[name]
        return self._pread(self.segment(name, index)).view(info.byte_shape[1:])

    def read_range(self, seg: Segment) -> torch.Tensor:
        """The bytes of a range of one of the files (uint8), in a fresh tensor."""
        return self._pread(seg)

    def _pread(self, seg: Segment) -> torch.Tensor:
        out = torch.empty(seg.nbytes, dtype=torch.uint8)  # [nbytes]
        view, done = memoryview(out.numpy()), 0
        fd = self._fd(seg.file)
        while done < seg.nbytes:
            try:
                n = os.preadv(fd, [view[done:]], seg.offset + done)
            except OSError as e:
                raise ExpertCacheError(f"{seg.file}: cannot read: {e.strerror}") from None
            if n == 0:
                raise ExpertCacheError(f"{seg.file}: truncated: byte {seg.offset + done} is past the end "
                                       "(the file changed after it was opened)")
            done += n
        return out

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise ExpertCacheError(f"{path}: cannot open: {e.strerror}") from None
            self._fds[path] = fd
        return fd

    def close(self) -> None:
        self._closer()

    def __enter__(self) -> GGUFCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _split_key(part: _Part, key: str, default: int | None) -> int | None:
    """A split.* count or index (gguf-split writes them as integers); another kind of value is an
    error naming it, not a comparison that fails inside Python or passes by its printed form."""
    value = part.metadata.get(key, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ExpertCacheError(f"{part.path}: metadata key {key!r} is {value!r}, expected an integer")
    return value


def _check_split(part: _Part, i: int, count: int) -> None:
    """Part `i` (0-based) of a `count`-part set says so in its split.* metadata, as gguf-split writes it."""
    no, n = _split_key(part, "split.no", None), _split_key(part, "split.count", None)
    if no != i or n != count:
        raise ExpertCacheError(f"{part.path}: split.no={no}, split.count={n}; expected split.no={i}, "
                               f"split.count={count} from the file name")
