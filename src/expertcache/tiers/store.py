"""The slow tier: where every expert lives, and the one routine that copies a run of experts of
one layer into consecutive slots.

- `RamStore`: every expert packed in host memory in its slot format, one row per expert (pinned
  when the fast tier is a GPU), so a run of experts is one copy.
- `MmapStore`: experts read from the checkpoint through the page cache, which keeps them.
- `DiskStore`: experts read with `preadv` straight into their slots (or through a bounce buffer
  when float matrices must change dtype), then `posix_fadvise(DONTNEED)` so the page cache does
  not quietly hold the model and a RAM budget stays honest. Where a read's file offset, length
  and buffers lie on 4 KiB boundaries (the checkpoints `synth` and `pack` write put the experts
  there), it is made with O_DIRECT: the device writes into the slot, and no core copies the bytes
  out of the page cache (which took a core about 0.15-0.3 s per GB here, time taken from compute).

A store sees experts only through an `ExpertSource` (bytes and their format) and copies bytes: a
quantized matrix is copied as the file holds it; a float matrix is converted to the compute dtype
when the file's differs. Given a `Tiler`, a store whose slots are filled once (`RamStore`, or any
store in resident mode: `make_store_for`) holds the matrices it names as tiles, interleaved as
they are filled; a store read on every miss keeps the file's rows, which its reads land on
directly. `mmap` and `disk` read byte ranges that lie back to back in a file in one call,
scattered into their slots (`merged_reads`): an expert's matrices, a run of experts.

A store also knows the identity and version of the files it reads (device, inode, size, mtime and
ctime in nanoseconds), which the cache compares at the start of each top-level call; the file
stores also check it after every copy, so a call never uses bytes of two versions.
"""

from __future__ import annotations

import errno
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from tqdm import tqdm

from ..checkpoint.files import close_when_collected
from ..checkpoint.safetensors_io import Segment
from ..errors import CopyError, ModelChangedError
from ..memory import PAGE, host_zeros, page_aligned_empty
from .layout import ExpertFormat, Tiler, slot_nbytes

FileVersion = tuple[int, int, int, int, int]
LARGE_LOAD_BYTES = 256 << 20  # loads larger than this show a progress bar
# A copy that converts (float matrices to another dtype, a GPU's slots, tiles formed after the
# read) reads into a host bounce buffer of at most this many bytes (one expert at least) at a
# time: a run of experts as long as a layer would otherwise take a buffer as large as the
# layer's experts (288 MiB at Qwen3-30B-A3B's 9 MiB experts and 32 of them, 1.1 GiB at 128),
# beyond the cache's budget.
BOUNCE_BYTES = 64 << 20
LOAD_RUN_BYTES = 64 << 20  # the RAM store's load: experts read per call


def file_version(path: Path) -> FileVersion:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class ExpertSource(Protocol):
    """A checkpoint's experts as bytes: what a store needs and nothing about the model."""

    files: list[Path]
    layers: list[int]  # the MoE layers
    num_experts: int

    def format(self, layer: int) -> ExpertFormat:
        """The expert format of `layer` as the file stores it."""

    def segments(self, layer: int, e: int) -> list[Segment]:
        """Expert (layer, e)'s bytes: one range per matrix, in the format's order."""

    def run_parts(self, layer: int, first: int, n: int) -> list[tuple[Segment, int, int]] | None:
        """Experts first..first+n-1 as a few ranges of the file, when they are: each part is one
        range holding the n experts' pieces of `size` bytes back to back, each piece going to byte
        `offset` of its expert's slot, as (range, offset, size); None when the run is not."""

    def read(self, layer: int, e: int) -> torch.Tensor:
        """Expert (layer, e)'s bytes [nbytes] uint8, in the file's format."""


DIRECT_ALIGN = PAGE  # O_DIRECT's offsets, lengths and buffer addresses: a multiple of any device's block


def aligned(offset: int, targets: list[memoryview]) -> bool:
    """Whether a read at `offset` into `targets` meets O_DIRECT's alignment."""
    return offset % DIRECT_ALIGN == 0 and all(
        t.nbytes % DIRECT_ALIGN == 0 and np.frombuffer(t, np.uint8).ctypes.data % DIRECT_ALIGN == 0 for t in targets)


# One read's limits: Linux moves at most 2 GiB - 4 KiB per call, and takes at most IOV_MAX buffers.
MAX_READ_BYTES = 1 << 30
MAX_READ_BUFFERS = min(getattr(os, "IOV_MAX", 1024), 1024)


def _after(targets: list[memoryview], n: int) -> list[memoryview]:
    """The buffers `targets` less their first `n` bytes (what a read cut short has left to fill)."""
    out = []
    for t in targets:
        if n >= t.nbytes:
            n -= t.nbytes
            continue
        out.append(t[n:])
        n = 0
    return out


def merged_reads(pieces: list[tuple[Segment, memoryview]]) -> list[tuple[Segment, list[memoryview]]]:
    """Byte ranges (each with the buffer it is read into) as reads: ranges that follow one another
    in one file become one read scattered into their buffers, in file order. An expert's matrices,
    and a run of experts, usually lie back to back: one read each instead of one per matrix, so
    that the disk idles less between reads."""
    out: list[tuple[Segment, list[memoryview]]] = []
    for seg, target in sorted(pieces, key=lambda p: (str(p[0].file), p[0].offset)):
        if out:
            last, targets = out[-1]
            if (last.file == seg.file and last.offset + last.nbytes == seg.offset
                    and last.nbytes + seg.nbytes <= MAX_READ_BYTES and len(targets) < MAX_READ_BUFFERS):
                targets.append(target)
                out[-1] = (Segment(seg.file, last.offset, last.nbytes + seg.nbytes), targets)
                continue
        out.append((seg, [target]))
    return out


def convert(src: torch.Tensor, src_fmt: ExpertFormat, dst: torch.Tensor, dst_fmt: ExpertFormat,
            non_blocking: bool = False, tiler: Tiler | None = None) -> None:
    """Copy experts src [n, >= src bytes] into dst [n, >= dst bytes] (uint8), matrix by matrix;
    float matrices change dtype on the way, quantized ones are copied as bytes, then formed into
    tiles by `tiler` where dst holds tiles (host memory)."""
    rows_fmt = dst_fmt.as_rows
    if src_fmt == rows_fmt:
        dst[:, : dst_fmt.nbytes].copy_(src[:, : src_fmt.nbytes], non_blocking=non_blocking)
    else:
        n = dst.shape[0]
        for a, b in zip(src_fmt.matrices, dst_fmt.matrices):
            s = src[:, a.offset: a.offset + a.nbytes]
            d = dst[:, b.offset: b.offset + b.nbytes]
            if a.storage == b.storage:
                d.copy_(s, non_blocking=non_blocking)
            else:
                d.view(b.storage).view(n, -1).copy_(s.view(a.storage).view(n, -1), non_blocking=non_blocking)
    if rows_fmt != dst_fmt:
        tile_in_place(dst, dst_fmt, tiler)


def tile_in_place(dst: torch.Tensor, fmt: ExpertFormat, tiler: Tiler) -> None:
    """Experts dst [n, >= bytes] (host memory) holding the file's rows: each matrix `fmt` marks
    tiled interleaved where it lies, one matrix at a time (a temporary of one matrix)."""
    for m in fmt.matrices:
        if m.tiled:
            for i in range(dst.shape[0]):
                part = dst[i, m.offset: m.offset + m.nbytes]
                part.copy_(tiler.tile_rows(part.view(m.shape[0], -1), m.storage, m.shape[1]).view(-1))


class ExpertStore(ABC):
    """Base: knows the source and the slot geometry; subclasses implement `copy_run`."""

    name = ""
    # Whether a copy mostly waits on a device (a disk read) rather than keeping a core busy: the
    # cache then reads a wave's misses on its worker while the wave's hits compute.
    waits_on_device = False
    # Whether copies are reads the device makes into the slots (O_DIRECT), not a core's copy.
    reads_direct = False

    def __init__(self, source: ExpertSource, dtype: torch.dtype, tiler: Tiler | None = None):
        self.source, self.dtype, self.tiler = source, dtype, tiler
        self.src_formats = {layer: source.format(layer) for layer in source.layers}
        # What a slot holds: the file's format with float matrices in the compute dtype, and the
        # quantized ones the tiler names as tiles.
        self.formats = {layer: f.with_dtype(dtype) for layer, f in self.src_formats.items()}
        if tiler is not None:
            self.formats = {layer: f.with_tiles(tiler) for layer, f in self.formats.items()}
        self.slot_bytes = slot_nbytes(list(self.formats.values()))
        self.versions = {p: file_version(p) for p in source.files}

    def version_of(self, layer: int, e: int) -> tuple[FileVersion, ...]:
        """The versions of every file expert (layer, e)'s bytes come from, in the order of its
        matrices: a sharded checkpoint may keep an expert's gate in one shard and its down in the
        next, and a slot is stale when either changes, not only the first."""
        files = dict.fromkeys(seg.file for seg in self.source.segments(layer, e))
        return tuple(self.versions[f] for f in files)

    @abstractmethod
    def copy_run(self, layer: int, first: int, dst: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy experts first .. first+len(dst)-1 of `layer` into dst [n, slot_bytes] (uint8)."""

    def contiguous_run(self, layer: int, first: int, n: int) -> bool:
        """Whether experts first..first+n-1 are copied by one call (`ranges` reads)."""
        return True

    def ranges(self, layer: int, first: int, n: int) -> int:
        """Reads (ranges of the tier) one call copying experts first..first+n-1 makes."""
        return 1

    def close(self) -> None:
        pass


class RamStore(ExpertStore):
    name = "ram"

    def __init__(self, source: ExpertSource, dtype: torch.dtype, pin: bool = False, progress: bool = True,
                 tiler: Tiler | None = None):
        super().__init__(source, dtype, tiler)
        self.rows: dict[int, torch.Tensor] = {}
        total = source.num_experts * len(source.layers)
        big = sum(f.nbytes for f in self.formats.values()) * source.num_experts >= LARGE_LOAD_BYTES
        # Filled by the disk store's reads (`preadv` into the rows, O_DIRECT where aligned, the
        # page cache dropped after the others): read through the checkpoint's memory map
        # (`source.read`), every expert stayed mapped in the process for its lifetime and in the
        # page cache after it, a second copy of the experts beside this one (1.3 GB of RSS more
        # on a 1.2 GB model: docs/cache.md, "Memory").
        reader = DiskStore(source, dtype, tiler)
        try:
            with tqdm(total=total, desc="loading experts", unit="expert", leave=False,
                      disable=None if progress and big else True) as bar:  # None: a bar only on a terminal
                for layer in source.layers:
                    rows = host_zeros((source.num_experts, self.slot_bytes), torch.uint8, pin=pin)
                    run = max(1, LOAD_RUN_BYTES // max(1, self.src_formats[layer].nbytes))
                    e = 0
                    while e < source.num_experts:
                        n = min(run, source.num_experts - e)
                        if n > 1 and not reader.contiguous_run(layer, e, n):
                            n = 1
                        reader.copy_run(layer, e, rows[e: e + n])
                        bar.update(n)
                        e += n
                    self.rows[layer] = rows
        finally:
            reader.close()

    def copy_run(self, layer: int, first: int, dst: torch.Tensor, non_blocking: bool = False) -> None:
        src = self.rows[layer][first: first + dst.shape[0]]
        if self.tiler is not None:  # host slots: the kernels' copy (`Tiler.copy_host`)
            self.tiler.copy_host(dst, src)
        else:
            dst.copy_(src, non_blocking=non_blocking)


class DiskStore(ExpertStore):
    """Reads with `preadv` from files it keeps open, so that an atomic replacement of the
    checkpoint cannot reach a call in flight; after each copy, `fstat` confirms that no file it
    read changed in place, before any byte read is used."""

    name = "disk"
    drop_cache = True  # posix_fadvise(DONTNEED) after each read: the page cache keeps nothing
    waits_on_device = True
    direct = True  # O_DIRECT for the reads whose offset, length and buffers are aligned

    def __init__(self, source: ExpertSource, dtype: torch.dtype, tiler: Tiler | None = None,
                 device: torch.device | str = "cpu"):
        super().__init__(source, dtype, tiler)
        self.device = torch.device(device)  # where the slots are: elsewhere than the host, reads bounce
        self._fds: dict[Path, int] = {}
        self._direct_fds: dict[Path, int] = {}
        self._refused_fds: list[int] = []  # direct descriptors a device refused, closed with the store
        # A store let go without close() (a model simply dropped) closes its descriptors when it is
        # collected: each load otherwise left the checkpoint open for good.
        self._closer = close_when_collected(self, self._fds, self._direct_fds, self._refused_fds)
        self._fds.update((p, os.open(p, os.O_RDONLY)) for p in source.files)
        if self.drop_cache and self.direct:
            self._direct_fds.update(self._open_direct())
        self._pages: bool | None = None  # `reads_direct`'s layout check, made once
        self.reads = 0
        self.direct_reads = 0  # of `reads`, those made with O_DIRECT
        # Called with the running count after each read; tests use it to change the file at an
        # exact point of a request, so that they cannot pass by missing the window.
        self.read_hook: Callable[[int], None] | None = None

    def contiguous_run(self, layer: int, first: int, n: int) -> bool:
        return self.source.run_parts(layer, first, n) is not None

    def ranges(self, layer: int, first: int, n: int) -> int:
        # A run through the bounce buffer is read in parts of `_bounce_run` experts (`copy_run`).
        per = self._bounce_run(layer) if self._bounces(layer) else n
        reads = 0
        for i in range(0, n, per):
            m = min(per, n - i)
            parts = self.source.run_parts(layer, first + i, m)
            if parts is None:
                # `_read_run` makes one read per range its matrices form back to back: one per
                # expert where they follow one another, more where they do not (a fused gate_up and
                # its down in two tensors, an expert's matrices in several shards).
                segs = [(seg, None) for e in range(first + i, first + i + m) for seg in self.source.segments(layer, e)]
                reads += len(merged_reads(segs))
            else:
                reads += len(parts)
        return reads

    def _bounces(self, layer: int) -> bool:
        """Whether copies of `layer` go through the bounce buffer (not read into the slots)."""
        return self.device.type != "cpu" or self.src_formats[layer] != self.formats[layer].as_rows

    @property
    def reads_direct(self) -> bool:
        """Whether every expert is read with O_DIRECT straight into its slot: every file opened
        with it, every expert's byte ranges and the slots on page boundaries, and the slots holding
        the file's bytes as they are (no conversion or tiling on a core after the read)."""
        if not self._direct_fds or len(self._direct_fds) != len(self._fds) or self.slot_bytes % DIRECT_ALIGN:
            return False
        if self._pages is None:
            src = self.source
            self._pages = all(self.src_formats[layer] == self.formats[layer] for layer in src.layers) and all(
                seg.offset % DIRECT_ALIGN == 0 and seg.nbytes % DIRECT_ALIGN == 0
                for layer in src.layers for e in range(src.num_experts) for seg in src.segments(layer, e))
        return self._pages

    def _open_direct(self) -> dict[Path, int]:
        """A second descriptor per file, opened with O_DIRECT, where the file system allows it."""
        fds = {}
        for path, fd in self._fds.items():
            try:
                direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except (AttributeError, OSError):  # no O_DIRECT here, or not on this file system (tmpfs)
                continue
            a, b = os.fstat(direct), os.fstat(fd)
            if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):  # the name was replaced between the opens
                os.close(direct)
                continue
            fds[path] = direct
        return fds

    def _read(self, seg: Segment, targets: list[memoryview]) -> None:
        fd = self._fds[seg.file]
        want = sum(t.nbytes for t in targets)
        direct = self._direct_fds.get(seg.file)
        if direct is not None and not aligned(seg.offset, targets):
            direct = None
        try:
            got = os.preadv(fd if direct is None else direct, targets, seg.offset)
        except OSError as e:
            if direct is None or e.errno != errno.EINVAL:
                raise CopyError(f"{seg.file}: cannot read {want} bytes at byte {seg.offset}: {e.strerror}") from None
            # The device asks for a coarser alignment than DIRECT_ALIGN: buffered reads from now on.
            # The op's thread and the copy worker read at once: the other may be about to read with
            # this descriptor, or have dropped it already, so it stays open until the store closes
            # (closed now, its number could name another file by the time the other reads).
            refused = self._direct_fds.pop(seg.file, None)
            if refused is not None:
                self._refused_fds.append(refused)
            return self._read(seg, targets)
        self.reads += 1
        self.direct_reads += direct is not None
        if self.read_hook is not None:
            self.read_hook(self.reads)
        # A read may return fewer bytes than asked short of the end of the file: Linux moves at
        # most 2 GiB - 4 KiB per call (a resident fill reads a packed layer in one: 2.8 GB of
        # Mixtral 8x7B's experts), and network and FUSE file systems return what they have. The
        # rest is read on; only the end of the file (a read of 0 bytes) leaves it short.
        done, buffered = got, direct is None
        while 0 < got and done < want:
            rest, at = _after(targets, done), seg.offset + done
            if direct is not None and not aligned(at, rest):
                direct, buffered = None, True
            try:
                got = os.preadv(fd if direct is None else direct, rest, at)
            except OSError as e:
                raise CopyError(f"{seg.file}: cannot read {want - done} bytes at byte {at}: {e.strerror}") from None
            done += got
        if done != want:
            self._check(seg.file)  # a file cut short in place is a change of version
            raise CopyError(f"{seg.file}: short read at byte {seg.offset}: {done} of {want} bytes "
                            f"(the file ends at byte {seg.offset + done})")
        if buffered and self.drop_cache and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, seg.offset, seg.nbytes, os.POSIX_FADV_DONTNEED)

    def _check(self, path: Path) -> None:
        # The file's contents are the same while its size and mtime are; ctime is left out, since
        # unlinking the file (an atomic replacement of its name) changes it without a byte changing.
        st = os.fstat(self._fds[path])
        if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != self.versions[path][:4]:
            raise ModelChangedError(f"{path}: the checkpoint changed on disk while it was being read; "
                                    "the call was stopped (the next one loads the new version)")

    def copy_run(self, layer: int, first: int, dst: torch.Tensor, non_blocking: bool = False) -> None:
        n = dst.shape[0]
        src_fmt, fmt = self.src_formats[layer], self.formats[layer]
        size = src_fmt.nbytes
        # Read into the slots themselves when they are host memory holding the file's bytes (as
        # they are, or then tiled in place); otherwise into a bounce buffer that is then converted
        # and copied.
        in_place = src_fmt == fmt.as_rows and dst.device.type == "cpu" and dst.is_contiguous()
        if not in_place:
            # Through a bounce buffer of at most BOUNCE_BYTES, one part of the run at a time, each
            # converted into its slots before the next is read (on a GPU a copy from pageable
            # memory has left the buffer when it returns, so the buffer is reused at once).
            per = self._bounce_run(layer)
            bounce = page_aligned_empty(min(n, per) * size)
            for i in range(0, n, per):
                m = min(per, n - i)
                host = bounce[: m * size].view(m, size)
                self._read_run(layer, first + i, host, size)
                convert(host, src_fmt, dst[i: i + m], fmt, non_blocking, self.tiler)
            return
        self._read_run(layer, first, dst, size)
        if fmt != src_fmt:
            tile_in_place(dst, fmt, self.tiler)

    def _bounce_run(self, layer: int) -> int:
        """Experts one read through the bounce buffer takes (at least one)."""
        return max(1, BOUNCE_BYTES // max(1, self.src_formats[layer].nbytes))

    def _read_run(self, layer: int, first: int, host: torch.Tensor, size: int) -> None:
        """Read experts first..first+n-1 of `layer` as the file holds them into host [n, >= size]
        (uint8, host memory), then check that no file read changed."""
        n = host.shape[0]
        rows = [memoryview(host[i, :size].numpy()) for i in range(n)]
        parts = self.source.run_parts(layer, first, n)
        files = set()
        if parts is not None:
            for seg, offset, each in parts:  # one read per part, scattered into the n slots
                self._read(seg, [row[offset: offset + each] for row in rows])
                files.add(seg.file)
        else:
            pieces = []  # every matrix of the run: (its bytes in the file, where they go)
            for i in range(n):
                pos = 0
                for seg in self.source.segments(layer, first + i):
                    pieces.append((seg, rows[i][pos: pos + seg.nbytes]))
                    pos += seg.nbytes
            for seg, targets in merged_reads(pieces):
                self._read(seg, targets)
                files.add(seg.file)
        for path in files:
            self._check(path)

    def close(self) -> None:
        self._closer()


class MmapStore(DiskStore):
    """Experts read from the checkpoint through the page cache, which keeps them (the
    memory-mapped tier). Reads are `preadv`, not loads from a mapping: a file truncated under a
    mapping kills the process with SIGBUS, while a read reports it as an error."""

    name = "mmap"
    drop_cache = False
    waits_on_device = False  # the page cache answers most reads: a copy on a core


STORE_CLASSES = {"ram": RamStore, "mmap": MmapStore, "disk": DiskStore}


def make_store(name: str, source: ExpertSource, dtype: torch.dtype, device: torch.device,
               tiler: Tiler | None = None) -> ExpertStore:
    if name == "ram":
        return RamStore(source, dtype, pin=device.type == "cuda", tiler=tiler)
    return STORE_CLASSES[name](source, dtype, tiler, device)
