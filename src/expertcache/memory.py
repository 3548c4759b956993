"""Host memory for weights on huge pages.

A decode step streams every weight it uses from memory once (hundreds of MB at real sizes), and
each 4 KiB page it crosses costs a TLB miss; with 2 MiB pages those misses nearly vanish. Linux
gives transparent huge pages only to memory that asks for them when the system setting is
`madvise` (a common default), and torch's allocator does not ask, so the weights, the slot pool,
the RAM tier and the bandwidth probes that judge them are all allocated here. Elsewhere (other
systems, small tensors) it is `torch.zeros` started on a 4 KiB page; for GPU tensors and pinned
memory, plain `torch.zeros`.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20
PAGE = 4096
_CAN_ADVISE = hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS")


def host_zeros(shape: tuple[int, ...] | list[int], dtype: torch.dtype, device: torch.device | str = "cpu",
               pin: bool = False) -> torch.Tensor:
    """A zero-filled tensor; on a Linux CPU, at least 2 MiB long, on memory advised for huge pages
    and faulted in.

    The tensor keeps its mapping alive and unmaps it when the last view of it is gone.
    """
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * dtype.itemsize
    if pin:
        _exact_pinned_sizes()
    if pin or torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
    if not _CAN_ADVISE or nbytes < HUGE_PAGE:
        # On a page boundary all the same, as the disk store's O_DIRECT reads into slots need.
        return page_aligned_empty(nbytes).zero_().view(dtype).view(tuple(shape))
    # One extra huge page, so that the tensor can start on a 2 MiB boundary: the kernel backs
    # only whole, aligned 2 MiB ranges with huge pages. Anonymous mappings are zero-filled.
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:
        raise MemoryError(f"cannot map {nbytes} bytes: {e.strerror}") from None
    raw = torch.frombuffer(region, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    # Huge pages for the tensor's whole 2 MiB pages only: one over its tail would be faulted in
    # whole, up to 2 MiB of RSS beyond the tensor (a slot pool beyond its --cache-mem, a MiB a
    # weight on average), and where the system gives huge pages unasked ("always") the tail must
    # be told not to take one.
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, skip, whole)
        region.madvise(mmap.MADV_NOHUGEPAGE, skip + whole, len(region) - skip - whole)
    except OSError:  # a kernel built without transparent huge pages: ordinary pages, same data
        pass
    # Written now, so that the pages are faulted in here (as huge pages, while the advice holds)
    # and not during the first forward that touches them, as torch.zeros would also do.
    return raw[skip: skip + nbytes].zero_().view(dtype).view(tuple(shape))


# torch's pinned allocator rounds every block up to a power of two and keeps freed blocks for
# reuse: a RAM tier of 1152 MiB a layer (Qwen3-30B-A3B in bf16) would pin 2048, 96 GiB for 54,
# and stay pinned after its model is dropped. Above 1 MiB these make blocks exact and freed.
EXACT_PINNED = "pinned_max_round_threshold_mb:1,pinned_max_cached_size_mb:1"


def _exact_pinned_sizes() -> None:
    try:
        current = torch._C._accelerator_getAllocatorSettings()
        if "pinned_max_" in current:  # the user's PYTORCH_ALLOC_CONF chose: theirs stands
            return
        # Setting the string resets what it does not name, so the user's settings go in with ours.
        torch._C._accelerator_setAllocatorSettings(",".join(filter(None, (current, EXACT_PINNED))))
    except (AttributeError, RuntimeError):
        pass  # an older torch, without these settings or keys: its rounding, as before


def page_aligned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised host buffer [nbytes] uint8 starting on a 4 KiB page (a bounce buffer that
    O_DIRECT reads can land in)."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE
    return raw[skip: skip + nbytes]


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` copied into `host_zeros` memory (weights that every decode step reads)."""
    out = host_zeros(t.shape, t.dtype, t.device)
    out.copy_(t)
    return out
