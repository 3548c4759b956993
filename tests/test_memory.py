"""Huge-page host memory: zero-filled, aligned, advised, and alive as long as its tensor."""

import gc
import sys

import torch

from expertcache import memory
from expertcache.memory import HUGE_PAGE, host_copy, host_zeros


def vm_flags(address: int) -> set[str]:
    """The kernel's flags for the mapping that holds `address` (Linux /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_large_tensor_is_zeroed_aligned_and_advised():
    t = host_zeros((3, HUGE_PAGE // 2 + 5), torch.bfloat16)
    assert t.shape == (3, HUGE_PAGE // 2 + 5) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    # Where the advice exists (Linux), the tensor starts on a huge page and its mapping carries it.
    assert memory._CAN_ADVISE == (sys.platform == "linux")
    if memory._CAN_ADVISE:
        assert t.data_ptr() % HUGE_PAGE == 0
        assert "hg" in vm_flags(t.data_ptr())


def test_without_the_advice_it_is_plain_torch_memory(monkeypatch):
    monkeypatch.setattr(memory, "_CAN_ADVISE", False)

    def no_mapping(*args, **kwargs):
        raise AssertionError("host_zeros mapped memory of its own without the advice")

    # Whether torch's own allocator's memory carries the huge-page flag depends on the C library
    # and the kernel (malloc tunables, reused heap), so what is checked is that no mapping of
    # ours is made.
    monkeypatch.setattr(memory.mmap, "mmap", no_mapping)
    t = host_zeros((3, HUGE_PAGE), torch.uint8)
    assert torch.equal(t, torch.zeros(3, HUGE_PAGE, dtype=torch.uint8))
    t.fill_(1)  # an ordinary, writable allocation
    assert int(t.sum()) == 3 * HUGE_PAGE


def test_mapping_lives_as_long_as_a_view_of_it():
    row = host_zeros((4, HUGE_PAGE), torch.uint8)[2]
    gc.collect()
    row.fill_(7)  # would fault if the mapping had been released with the parent tensor
    assert int(row.sum()) == 7 * HUGE_PAGE


def test_small_tensors_and_copies():
    small = host_zeros((2, 3), torch.float32)
    assert torch.equal(small, torch.zeros(2, 3))
    src = torch.randn(1024, 1024)
    dst = host_copy(src)
    assert torch.equal(dst, src) and dst.data_ptr() != src.data_ptr()
