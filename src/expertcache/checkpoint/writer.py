"""Writing checkpoints: a streaming safetensors writer (tensors are produced one at a time, so a
model larger than memory can be written) and an output directory that appears only when complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ExpertCacheError
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


def write_safetensors(path: Path, tensors: list[PlannedTensor], on_bytes: Callable[[int], None] | None = None) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors:
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


@contextlib.contextmanager
def atomic_output_dir(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside `out`; it becomes `out` only if the block completes.
    On any error or interrupt it is removed, so no half-written output is ever left."""
    out = Path(out)
    if out.exists() and not force:
        raise ExpertCacheError(f"output {str(out)!r} already exists (remove it or pass --force)")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.exists():
        raise ExpertCacheError(f"output directory's parent {str(parent)!r} does not exist")
    tmp = parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, chat template and generation config: everything but weights and config.json."""
    for p in src.iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(p, dst / p.name)
