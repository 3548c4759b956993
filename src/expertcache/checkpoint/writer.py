"""Writing checkpoints: a streaming safetensors writer (tensors are produced one at a time, so a
model larger than memory can be written) and an output directory that appears only when complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ExpertCacheError
from ..memory import PAGE
from .safetensors_io import DTYPE_CODES


@dataclass(slots=True)
class PlannedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    # Yields the tensor's data in order, as tensors of `dtype` whose bytes concatenate to it.
    produce: Callable[[], Iterator[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


# Where the files written here put their tensors: a safetensors file's data starts on a boundary
# of this many bytes, and every tensor whose size is a multiple of it comes first, so that such a
# tensor (the experts, in any model large enough to need a disk store) starts on one too; a
# packed GGUF aligns every tensor to it. The disk store reads those with O_DIRECT (store.py).
DATA_ALIGN = PAGE


def write_safetensors(path: Path, tensors: list[PlannedTensor], on_bytes: Callable[[int], None] | None = None) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    order = sorted(tensors, key=lambda t: t.nbytes % DATA_ALIGN != 0)  # stable: planned order within each
    offsets, offset = {}, 0
    for t in order:
        offsets[t.name] = offset
        offset += t.nbytes
    for t in tensors:  # the header lists them as planned; the offsets say where each lies
        header[t.name] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offsets[t.name], offsets[t.name] + t.nbytes]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % DATA_ALIGN)  # the header's padding, which safetensors allows
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in order:
            written = 0
            for part in t.produce():
                if part.dtype != t.dtype:
                    raise AssertionError(f"{t.name}: produced {part.dtype}, planned {t.dtype}")
                data = part.contiguous().cpu().view(torch.uint8).numpy()
                f.write(memoryview(data))
                written += data.nbytes
                if on_bytes:
                    on_bytes(data.nbytes)
            if written != t.nbytes:
                raise AssertionError(f"{t.name}: wrote {written} bytes, planned {t.nbytes}")


# Every directory `atomic_output_dir` writes holds this file: --force replaces only such outputs.
OUTPUT_MARKER = ".expertcache-output"


def check_output(out: Path, force: bool, sources: tuple[Path, ...] = ()) -> Path:
    """Refuse an output path whose replacement could delete what this command did not write:
    the current directory or one above it, a source or a directory holding one, or an existing
    path that is not an earlier output of ours. Returns the path, resolved."""
    out = Path(out)
    full = out.resolve()
    cwd = Path.cwd().resolve()
    if full == cwd or full in cwd.parents:
        raise ExpertCacheError(f"output {str(out)!r} is the current directory or one above it: "
                               "expected a new directory to write")
    for src in sources:
        src = Path(src).resolve()
        if full == src or full in src.parents or src in full.parents:
            raise ExpertCacheError(f"output {str(out)!r} overlaps the source {str(src)!r}: expected a path "
                                   "outside it")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ExpertCacheError(f"output {str(out)!r} exists and is not a directory this command wrote: "
                               "expected a new path")
    if out.exists():
        if not (out / OUTPUT_MARKER).is_file():
            raise ExpertCacheError(f"output {str(out)!r} exists and was not written by expertcache "
                                   f"(no {OUTPUT_MARKER} in it): expected a new path; --force replaces "
                                   "only earlier outputs of pack and synth")
        if not force:
            raise ExpertCacheError(f"output {str(out)!r} already exists (remove it or pass --force)")
        # The marker lists the files the earlier run wrote: anything added since (notes, a fitted
        # predictor) is the user's, and replacing the directory would delete it.
        written = _written_files(out)
        if written is None:
            raise ExpertCacheError(f"output {str(out)!r} was written by an earlier expertcache, whose marker does "
                                   "not list the files it wrote: remove the directory yourself to replace it")
        extra = sorted(p.name for p in out.iterdir() if p.name != OUTPUT_MARKER and (
            p.name not in written or p.is_symlink() or not p.is_file()))
        if extra:
            raise ExpertCacheError(f"output {str(out)!r} holds {extra[0]!r}, which expertcache did not write"
                                   f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}: --force "
                                   "replaces only what pack and synth wrote; move it out or remove the directory")
    if not full.parent.is_dir():
        raise ExpertCacheError(f"output {str(out)!r}: {no_directory(full.parent)}: expected a path in an existing "
                               "directory")
    return full


def no_directory(parent: Path) -> str:
    """Why `parent` (not a directory) cannot take an output: missing, or a file in the way
    (`-o notes.txt/out`), which is not a directory that does not exist."""
    above = next((p for p in (parent, *parent.parents) if p.exists()), None)
    if above is not None and not above.is_dir():
        return f"{str(above)!r} is a file, not a directory"
    return f"directory {str(parent)!r} does not exist"


def check_output_file(out: str | Path, force: bool, what: str, is_ours: Callable[[Path], bool]) -> Path:
    """Before any work, the one file a command will write: an existing file is replaced (with
    `force`) only when `is_ours` recognises it as `what`, an earlier output of the command, so
    that `-o` never overwrites an input, a model's weights or any other file of the user's; and
    its directory must exist and take a new file, so that a bad path fails now, not after the run."""
    full = Path(out).resolve()
    if full.is_dir() or Path(out).is_symlink():
        raise ExpertCacheError(f"cannot write {str(out)!r}: it is a directory or a link: expected a file path")
    if full.exists():
        if not is_ours(full):
            raise ExpertCacheError(f"cannot write {str(out)!r}: it exists and is not {what} (only {what} of an "
                                   "earlier run is replaced): expected a new path")
        if not force:
            raise ExpertCacheError(f"output {str(out)!r} already exists (remove it or pass --force)")
    if not full.parent.is_dir():
        raise ExpertCacheError(f"cannot write {str(out)!r}: {no_directory(full.parent)}")
    if not os.access(full.parent, os.W_OK | os.X_OK):
        raise ExpertCacheError(f"cannot write {str(out)!r}: directory {str(full.parent)!r} is not writable")
    return full


def _written_files(out: Path) -> set[str] | None:
    """The files an earlier output's marker lists; None where it lists none (written before the
    marker did, or not JSON)."""
    try:
        files = json.loads((out / OUTPUT_MARKER).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return set(files) if isinstance(files, list) and all(isinstance(f, str) for f in files) else None


@contextlib.contextmanager
def _signals_end_cleanly() -> Iterator[None]:
    """SIGTERM and SIGHUP (`kill`, `timeout`, a closed terminal, a cancelled job) end the process
    as Python's default does not: through the `except` that removes the partial output, as Ctrl-C
    does, with the exit status of the signal. A signal ignored (`nohup`) or handled by the caller
    stays so; off the main thread (where no handler can be set) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    saved = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            saved[sig] = signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


# A partial output older than this whose process is gone was left by a kill no handler sees
# (SIGKILL, the OOM killer, a power cut); younger, it may be another machine's write in progress
# on a shared file system, where a PID says nothing.
STALE_PARTIAL_SECONDS = 600


def _remove_stale_partials(out: Path) -> None:
    """Removes `.NAME.partial-PID` files and directories beside `out` that an earlier write of
    `out` left (its process no longer runs here, nothing written to it for STALE_PARTIAL_SECONDS),
    saying so on stderr: a killed `synth` left gigabytes under a hidden name."""
    prefix = f".{out.name}.partial-"
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return
    for p in entries:
        pid = p.name.removeprefix(prefix)
        if not p.name.startswith(prefix) or not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # that process runs (or runs as someone else: PermissionError below)
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue
        try:
            if time.time() - p.stat().st_mtime < STALE_PARTIAL_SECONDS:
                continue
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        except OSError:
            continue
        print(f"expertcache: removed {str(p)!r}, a partial output that process {pid} left", file=sys.stderr)


@contextlib.contextmanager
def atomic_file(out: Path) -> Iterator[Path]:
    """A temporary path beside `out` to write; it becomes `out` only when the block completes, so a
    failed or interrupted write (an error, Ctrl-C, SIGTERM) leaves no partial file and whatever was
    at `out` before."""
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    _remove_stale_partials(out)
    with _signals_end_cleanly():
        try:
            yield tmp
            os.replace(tmp, out)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


@contextlib.contextmanager
def atomic_gguf(out: Path, arch: str) -> Iterator:
    """A `gguf.GGUFWriter` on a temporary name beside `out` (`atomic_file`)."""
    from gguf import GGUFWriter

    with atomic_file(out) as tmp:
        w = GGUFWriter(tmp, arch)
        try:
            yield w
        finally:
            w.close()


@contextlib.contextmanager
def atomic_output_dir(out: Path, force: bool = False, sources: tuple[Path, ...] = ()) -> Iterator[Path]:
    """Yield a temporary directory beside `out`; it becomes `out` only if the block completes.
    On any error or interrupt it is removed, so no half-written output is ever left. The path is
    checked first (`check_output`), before anything is written; an earlier output is replaced by
    two renames, so that `out` names a complete directory at every moment but between them."""
    full = check_output(out, force, sources)
    tmp = full.parent / f".{full.name}.partial-{os.getpid()}"
    old, aside = full.parent / f".{full.name}.old-{os.getpid()}", False
    shutil.rmtree(tmp, ignore_errors=True)
    _remove_stale_partials(full)
    with _signals_end_cleanly():
        tmp.mkdir()
        try:
            yield tmp
            # The files written, so that a later --force replaces the directory only while it holds
            # nothing else (`check_output`).
            files = sorted(p.name for p in tmp.iterdir() if p.name != OUTPUT_MARKER)
            (tmp / OUTPUT_MARKER).write_text(json.dumps({"written_by": "expertcache", "files": files}) + "\n")
            if full.exists():
                aside = True  # before the rename: a Ctrl-C just after it must still see it
                os.replace(full, old)
                os.replace(tmp, full)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, full)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            # Ctrl-C or an error between the two renames: put the earlier output back, or the path
            # is empty and the earlier output lies under a hidden name.
            if aside and old.exists() and not full.exists():
                os.replace(old, full)
            raise


# Weights in the formats a model directory holds beside safetensors (a hub repository often has
# PyTorch's too): copied, the packed directory held the source's weights again, unpacked.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")


def copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, chat template and generation config: everything but weights, their indexes
    and config.json."""
    for p in src.iterdir():
        if (p.is_file() and p.suffix not in WEIGHT_SUFFIXES and not p.name.endswith(".index.json")
                and p.name != "config.json"):
            shutil.copy2(p, dst / p.name)
