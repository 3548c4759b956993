"""Memory a load takes, against what the flags and the docs say it takes: the slot pool's resident
pages within `--cache-mem` (docs/cache.md, "Memory": "the budget is the pool, nothing else")."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest
import torch

import expertcache
from expertcache import CacheConfig, memory
from expertcache.memory import HUGE_PAGE, PAGE, host_zeros
from test_memory import vm_flags

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/pagemap (Linux)")


def present_pages(start: int, end: int) -> int:
    """Pages of [start, end) that are in memory (bit 63 of each /proc/self/pagemap entry): what
    the range adds to RSS, page by page, whatever else shares its mapping."""
    first, last = start // PAGE, -(-end // PAGE)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read((last - first) * 8)
    return sum(1 for (entry,) in struct.iter_unpack("<Q", raw) if entry >> 63)


def mapped_pages(t: torch.Tensor) -> int:
    """Pages in memory of the whole allocation `t` is a view of."""
    storage = t.untyped_storage()
    return present_pages(storage.data_ptr(), storage.data_ptr() + storage.nbytes())


def assert_tail_not_huge(t: torch.Tensor) -> None:
    """The part of `t` after its last whole 2 MiB page (or the byte after it) is advised against
    huge pages: no huge page can reach past the tensor."""
    tail = t.data_ptr() + t.nbytes // HUGE_PAGE * HUGE_PAGE
    flags = vm_flags(tail)
    assert "hg" not in flags and "nh" in flags, flags


@pytest.mark.parametrize("nbytes", [HUGE_PAGE + 1, 3 * HUGE_PAGE // 2 + 12345, 5 * HUGE_PAGE - PAGE, 3 * HUGE_PAGE])
def test_host_zeros_faults_in_no_page_beyond_the_tensor(nbytes):
    """A huge page over the tensor's tail was faulted in whole: up to 2 MiB - 4 KiB of RSS beyond
    the tensor for every weight, RAM-tier layer and slot pool (measured: a 3.01 MiB tensor took
    4 MiB; 14 MiB over 226 MiB of host tensors loading a Gemma 4 Q4_K_M of two layers). Its whole
    2 MiB pages keep the advice."""
    t = host_zeros((nbytes,), torch.uint8)
    assert present_pages(t.data_ptr(), t.data_ptr() + nbytes) == -(-nbytes // PAGE)  # written, so faulted in
    # The whole mapping (the tensor's storage: a huge page more, to align it) adds no page more.
    assert mapped_pages(t) == -(-nbytes // PAGE)
    if memory._CAN_ADVISE:
        assert t.data_ptr() % HUGE_PAGE == 0 and "hg" in vm_flags(t.data_ptr())
        # Whether the kernel would have backed the tail with a huge page depends on where the
        # mapping landed (the page must fit in it); the advice says it never will.
        assert_tail_not_huge(t)
    assert not t.any()


def test_pool_pages_stay_within_cache_mem(tmp_path):
    """`--cache-mem` bounds the pool's resident memory, not only its tensor's size: a pool of 100
    slots of 24 KiB (2.34 MiB, a budget of the same) took 4 MiB, its last huge page faulted in
    whole."""
    from conftest import build_reference, save_checkpoint, tiny_config

    path = save_checkpoint(build_reference(tiny_config("qwen3_moe", experts=64, top_k=2, layers=2)),
                           tmp_path / "m")
    probe = expertcache.load(path, cache=CacheConfig(mode="cache", store="disk", experts=1), dtype="float32")
    slot = probe.experts.slot_bytes
    assert slot == 3 * 64 * 32 * 4  # gate, up, down of [32, 64] in fp32: no padding at this size
    budget = 100 * slot
    assert budget % HUGE_PAGE and budget > HUGE_PAGE
    model = expertcache.load(path, cache=CacheConfig(mode="cache", store="disk", mem=budget), dtype="float32")
    pool = model.experts.pool
    assert pool.nbytes == budget and model.experts.capacity == 100
    assert mapped_pages(pool) * PAGE <= budget
    if memory._CAN_ADVISE:
        assert_tail_not_huge(pool)
    # The pool works as before: the logits of every size are the resident ones.
    ids = torch.arange(3, 40)
    want = expertcache.load(path, cache=CacheConfig(mode="resident"), dtype="float32").logits(ids)
    assert torch.equal(model.logits(ids), want)


def test_a_reload_to_wider_weights_cuts_the_stretch_to_prefill_mem_again(tmp_path):
    """The stretch was planned once, at load: a checkpoint replaced by one taking more per token
    (here top-8 routing where it was top-2: four times the MoE op's buffers) ran stretches of the
    old length, over --prefill-mem, and `run --json` reported them so (`stretch_activation_bytes`)."""
    import os
    import shutil

    from conftest import build_reference, save_checkpoint, tiny_config

    narrow = save_checkpoint(build_reference(tiny_config("qwen3_moe", experts=8, top_k=2)), tmp_path / "narrow")
    wide = save_checkpoint(build_reference(tiny_config("qwen3_moe", experts=8, top_k=8), seed=1), tmp_path / "wide")
    work = tmp_path / "model"
    shutil.copytree(narrow, work)
    per_token = expertcache.load(narrow).net.activation_bytes(1)
    budget = 40 * per_token
    model = expertcache.load(work, prefill_mem=budget, prefill_stretch=4096, ctx_size=256)
    assert model.stretch == 40
    for name in ("model.safetensors", "config.json"):
        shutil.copy(wide / name, work / f"{name}.tmp")
        os.replace(work / f"{name}.tmp", work / name)
    ids = list(range(3, 103))
    got = model.generate(ids, max_tokens=1, ignore_eos=True)
    assert model.cfg.top_k == 8
    want_stretch = budget // model.net.activation_bytes(1)
    assert model.stretch == want_stretch < 40
    assert model.prefill_info()["stretch_activation_bytes"] <= budget
    assert model.last_prefill.stretches == -(-len(ids) // want_stretch)
    # The same tokens as a fresh load of the new weights with the same budget.
    fresh = expertcache.load(wide, prefill_mem=budget, prefill_stretch=4096, ctx_size=256)
    assert fresh.stretch == want_stretch
    assert got.token_ids == fresh.generate(ids, max_tokens=1, ignore_eos=True).token_ids


PINNED_PROBE = """
import torch
from expertcache.memory import host_zeros
calls = []
torch.zeros = lambda *a, **k: calls.append(k) or torch.empty(0)  # no CUDA here to pin with
host_zeros((1024,), torch.uint8, pin=True)
assert calls and calls[0]["pin_memory"] is True
print(torch._C._accelerator_getAllocatorSettings())
"""


@pytest.mark.parametrize("env, expect", [
    ("", memory.EXACT_PINNED),
    ("max_split_size_mb:64", "max_split_size_mb:64," + memory.EXACT_PINNED),  # the user's setting kept
    ("pinned_max_cached_size_mb:8", "pinned_max_cached_size_mb:8"),  # the user's choice stands
])
def test_pinned_ram_tier_is_not_rounded_to_a_power_of_two(env, expect):
    """A pinned RAM tier (a GPU's slow tier) asks torch's host allocator, whose header
    (ATen/core/CachingHostAllocator.h) rounds a block up to a power of two below
    `pinned_max_round_threshold` and caches it freed below `pinned_max_cached_size`: both are set
    before the first pinned block, over the settings the process already had."""
    out = subprocess.run([sys.executable, "-c", PINNED_PROBE], capture_output=True, text=True,
                         env={**os.environ, "PYTORCH_ALLOC_CONF": env}, check=True).stdout
    assert out.strip() == expect


def test_pinned_memory_on_a_torch_without_the_settings(monkeypatch):
    """An older torch (pyproject allows 2.5) has neither the accelerator settings nor their pinned keys: the tier is
    pinned as torch pins it, not refused."""
    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings")
    calls = []
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: calls.append(k) or torch.empty(0))
    host_zeros((1024,), torch.uint8, pin=True)
    assert calls and calls[0]["pin_memory"] is True
