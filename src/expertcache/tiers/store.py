"""The slow tier: where every expert lives, and the one routine that copies a run of experts of
one layer into consecutive slots.

- `RamStore`: every expert packed in host memory in the compute dtype, one row per expert
  (pinned when the fast tier is a GPU), so a run of experts is one copy.
- `MmapStore`: experts read from the memory-mapped checkpoint.
- `DiskStore`: experts read with `preadv` straight into their slots (or through a bounce buffer
  when the dtype must change), then `posix_fadvise(DONTNEED)` so the page cache does not quietly
  hold the model and a RAM budget stays honest.

`mmap` and `disk` read an expert's matrices as several ranges on any checkpoint, and a run of
experts as one range on a packed one (`expertcache pack`).

A store also knows the identity and version of the files it reads (device, inode, size, mtime and
ctime in nanoseconds), which the cache compares at the start of each top-level call.
"""

from __future__ import annotations

import mmap
from abc import ABC, abstractmethod
import os
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from ..checkpoint.safetensors_io import Segment
from ..memory import host_zeros

FileVersion = tuple[int, int, int, int, int]
LARGE_LOAD_BYTES = 256 << 20  # loads larger than this show a progress bar


def file_version(path: Path) -> FileVersion:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class ExpertStore(ABC):
    """Base: knows the source and the slot geometry; subclasses implement `copy_run`."""

    name = ""

    def __init__(self, source, dtype: torch.dtype, stride: int):
        self.source, self.dtype, self.stride = source, dtype, stride
        self.numel = source.numel
        self.versions = {p: file_version(p) for p in source.ckpt.files}

    def file_of(self, layer: int, e: int) -> Path:
        return self.source.segments(layer, e)[0].file

    @abstractmethod
    def copy_run(self, layer: int, first: int, dst: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy experts first .. first+len(dst)-1 of `layer` into dst [n, stride]."""

    def contiguous_run(self, layer: int, first: int, n: int) -> bool:
        """Whether experts first..first+n-1 are one range in this tier (one transfer)."""
        return True

    def close(self) -> None:
        pass


class RamStore(ExpertStore):
    name = "ram"

    def __init__(self, source, dtype: torch.dtype, stride: int, pin: bool = False,
                 progress: bool = True):
        super().__init__(source, dtype, stride)
        cfg = source.cfg
        self.rows: dict[int, torch.Tensor] = {}
        total = cfg.num_experts * len(cfg.moe_layers)
        with tqdm(total=total, desc="loading experts", unit="expert", leave=False,
                  disable=not progress or total * source.expert_nbytes < LARGE_LOAD_BYTES) as bar:
            for layer in cfg.moe_layers:
                rows = host_zeros((cfg.num_experts, stride), dtype, pin=pin)
                for e in range(cfg.num_experts):
                    rows[e, : self.numel].copy_(source.read(layer, e))
                    bar.update()
                self.rows[layer] = rows

    def copy_run(self, layer: int, first: int, dst: torch.Tensor, non_blocking: bool = False) -> None:
        dst.copy_(self.rows[layer][first: first + dst.shape[0]], non_blocking=non_blocking)


class MmapStore(ExpertStore):
    name = "mmap"

    def __init__(self, source, dtype: torch.dtype, stride: int):
        super().__init__(source, dtype, stride)
        self._maps: dict[Path, tuple[mmap.mmap, torch.Tensor]] = {}
        for path in source.ckpt.files:
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            with warnings.catch_warnings():  # read-only mapping: we never write through it
                warnings.simplefilter("ignore")
                self._maps[path] = (mm, torch.frombuffer(mm, dtype=torch.uint8))

    def _view(self, seg: Segment, dtype: torch.dtype) -> torch.Tensor:
        raw = self._maps[seg.file][1][seg.offset: seg.offset + seg.nbytes]
        if seg.offset % dtype.itemsize:
            raw = raw.clone()  # misaligned data cannot be viewed as a wider dtype
        return raw.view(dtype)

    def contiguous_run(self, layer: int, first: int, n: int) -> bool:
        return self.source.layout.packed is not None

    def copy_run(self, layer: int, first: int, dst: torch.Tensor, non_blocking: bool = False) -> None:
        n, src_dtype = dst.shape[0], self.source.dtype
        if self.source.layout.packed and n > 1:
            a = self.source.segments(layer, first)[0]
            whole = Segment(a.file, a.offset, a.nbytes * n)
            dst[:, : self.numel].copy_(self._view(whole, src_dtype).view(n, self.numel), non_blocking=non_blocking)
            return
        for i in range(n):
            pos = 0
            for seg in self.source.segments(layer, first + i):
                part = self._view(seg, src_dtype)
                dst[i, pos: pos + part.numel()].copy_(part, non_blocking=non_blocking)
                pos += part.numel()

    def close(self) -> None:
        self._maps.clear()


class DiskStore(ExpertStore):
    name = "disk"

    def __init__(self, source, dtype: torch.dtype, stride: int):
        super().__init__(source, dtype, stride)
        self._fds = {p: os.open(p, os.O_RDONLY) for p in source.ckpt.files}
        self._direct = source.dtype == dtype

    def contiguous_run(self, layer: int, first: int, n: int) -> bool:
        return self.source.layout.packed is not None

    def _read(self, seg: Segment, targets: list[memoryview]) -> None:
        fd = self._fds[seg.file]
        want = sum(t.nbytes for t in targets)
        got = os.preadv(fd, targets, seg.offset)
        if got != want:
            raise OSError(f"{seg.file}: short read at byte {seg.offset}: {got} of {want} bytes")
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, seg.offset, seg.nbytes, os.POSIX_FADV_DONTNEED)

    def copy_run(self, layer: int, first: int, dst: torch.Tensor, non_blocking: bool = False) -> None:
        n = dst.shape[0]
        # Read into the slots themselves when they are host memory of the file's dtype; otherwise
        # into a bounce buffer that is then converted and copied.
        direct = self._direct and dst.device.type == "cpu" and dst.is_contiguous()
        host = dst if direct else torch.empty(n, self.numel, dtype=self.source.dtype)
        rows = [memoryview(host[i, : self.numel].view(torch.uint8).numpy()) for i in range(n)]
        if self.source.layout.packed:
            a = self.source.segments(layer, first)[0]
            self._read(Segment(a.file, a.offset, a.nbytes * n), rows)  # one read for the run
        else:
            for i in range(n):
                pos = 0
                for seg in self.source.segments(layer, first + i):
                    self._read(seg, [rows[i][pos: pos + seg.nbytes]])
                    pos += seg.nbytes
        if not direct:
            dst[:, : self.numel].copy_(host[:, : self.numel], non_blocking=non_blocking)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def make_store(name: str, source, dtype: torch.dtype, stride: int, device: torch.device):
    if name == "ram":
        return RamStore(source, dtype, stride, pin=device.type == "cuda")
    if name == "mmap":
        return MmapStore(source, dtype, stride)
    if name == "disk":
        return DiskStore(source, dtype, stride)
    raise ValueError(name)
