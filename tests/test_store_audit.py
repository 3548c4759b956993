"""The slow tier's reads (review of tiers/store.py): a read the system cuts short is read on, the
telemetry's copy ranges are the reads the store makes, and an expert whose matrices lie in
several shards is stale when any of them changes. Results are compared bitwise with the
all-resident path loaded before any fault is injected."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import expertcache
from expertcache import CacheConfig
from expertcache.checkpoint.safetensors_io import Checkpoint
from expertcache.models.pack import pack
from expertcache.tiers import store as storemod
from conftest import VOCAB

IDS = torch.randint(4, VOCAB, (40,), generator=torch.Generator().manual_seed(11))
EXPERTS, LAYERS = 8, 3
TOTAL = EXPERTS * LAYERS
PARTS = ("gate", "up", "down")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One tiny Qwen3-MoE written four ways: per-expert tensors, transformers' fused gate_up and
    down, per-expert tensors in shards of 60 KB, and packed by `expertcache pack`."""
    from conftest import build_reference, save_checkpoint, tiny_config

    root = tmp_path_factory.mktemp("store-audit")
    ref = build_reference(tiny_config("qwen3_moe", experts=EXPERTS, top_k=2, layers=LAYERS))
    plain = save_checkpoint(ref, root / "plain")
    return {"plain": plain, "fused": save_checkpoint(ref, root / "fused", fused=True),
            "sharded": save_checkpoint(ref, root / "sharded", shard="60KB"),
            "packed": pack(plain, root / "packed", progress=False)}


@pytest.fixture(scope="module")
def reference_logits(checkpoints):
    return expertcache.load(checkpoints["plain"], cache=CacheConfig(mode="resident")).logits(IDS)


def _cap_reads(monkeypatch, cap: int) -> list[int]:
    """Make every preadv move at most `cap` bytes, as Linux does past 2 GiB - 4 KiB and network or
    FUSE file systems do at their own sizes; returns the sizes each call was asked for."""
    real, asked = os.preadv, []

    def preadv(fd, buffers, offset):
        asked.append(sum(b.nbytes for b in buffers))
        out, left = [], cap
        for b in buffers:
            if left == 0:
                break
            out.append(b[: min(left, b.nbytes)])
            left -= out[-1].nbytes
        return real(fd, out, offset)

    monkeypatch.setattr(storemod.os, "preadv", preadv)
    return asked


@pytest.mark.parametrize("layout", ["plain", "packed"])
@pytest.mark.parametrize("store", ["disk", "mmap", "ram"])
def test_a_read_cut_short_by_the_system_is_read_on(checkpoints, reference_logits, monkeypatch, layout, store):
    """A read that returns fewer bytes than asked before the end of the file is not an error: the
    rest is read, and the logits are the all-resident path's. (Before: `CopyError: short read` on
    the first copy, which made a layer of experts larger than 2 GiB unreadable in one call.)"""
    asked = _cap_reads(monkeypatch, 1000)  # less than one matrix: every read is cut
    model = expertcache.load(checkpoints[layout], cache=CacheConfig(mode="cache", experts=TOTAL // 4, store=store))
    assert torch.equal(model.logits(IDS), reference_logits)
    assert max(asked) > 1000  # reads were indeed cut
    if store != "ram":
        st = model.experts.store
        # One read as the store counts them (the telemetry's copy ranges), however many calls.
        assert len(asked) > st.reads == model.telemetry()["total"]["copy_ranges"] > 0


def test_a_resident_fill_reads_a_whole_layer_in_one_read_and_reads_it_on(checkpoints, reference_logits, monkeypatch):
    """A resident fill of a packed checkpoint asks for a layer's experts in one read, which Linux
    cuts at 2 GiB - 4 KiB (Mixtral 8x7B's packed layer is 2.8 GB): here the cut is at one expert."""
    asked = _cap_reads(monkeypatch, 6 * 4096)
    model = expertcache.load(checkpoints["packed"], cache=CacheConfig(mode="resident"))
    assert EXPERTS * 6 * 4096 in asked  # one layer, asked for at once
    assert torch.equal(model.logits(IDS), reference_logits)


def test_a_direct_read_cut_short_on_a_page_goes_on_direct(checkpoints, reference_logits, monkeypatch):
    """Linux cuts a read at 2 GiB - 4 KiB, on a page: the rest of an O_DIRECT read stays direct
    (its offset and buffers still lie on pages) and the page cache is not used for it."""
    path = checkpoints["packed"] / "model.safetensors"
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except (AttributeError, OSError):
        pytest.fail("this test needs a file system with O_DIRECT (the temporary directory's has none)")
    _cap_reads(monkeypatch, 2 * 4096)  # an expert is 6 pages here
    model = expertcache.load(checkpoints["packed"], cache=CacheConfig(mode="cache", experts=TOTAL // 4,
                                                                      store="disk"))
    assert torch.equal(model.logits(IDS), reference_logits)
    st = model.experts.store
    assert st.reads > 0 and st.direct_reads == st.reads


@pytest.mark.parametrize("store", ["disk", "mmap"])
def test_a_file_cut_short_under_a_read_still_stops_the_call(checkpoints, reference_logits, tmp_path, store):
    """Reading on after a short read stops at the end of the file: a file truncated in place
    is still a change of version, and the call stops with ModelChangedError."""
    from expertcache.errors import ModelChangedError

    work = tmp_path / "m"
    shutil.copytree(checkpoints["plain"], work)
    target = work / "model.safetensors"
    model = expertcache.load(work, cache=CacheConfig(mode="cache", experts=TOTAL // 4, store=store))
    model.experts.store.read_hook = lambda n: n == 2 and os.truncate(target, target.stat().st_size // 2)
    with pytest.raises(ModelChangedError, match="changed on disk"):
        model.logits(IDS)
    shutil.copy(checkpoints["plain"] / "model.safetensors", target)
    assert torch.equal(model.logits(IDS), reference_logits)


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
@pytest.mark.parametrize("store", ["disk", "mmap"])
@pytest.mark.parametrize("layout, per_expert", [("plain", 1), ("fused", 2), ("sharded", None)])
def test_copy_ranges_are_the_reads_the_store_makes(checkpoints, reference_logits, layout, per_expert, store, dtype):
    """docs/cache.md: `copy_ranges` counts reads of the slow tier. transformers' per-expert tensors
    put an expert's three matrices back to back (one read); its fused layout keeps an expert's
    gate_up row and down row in two tensors (two reads); shards may put them in different files.
    (Before: one range per expert whatever the reads, 24 ranges against 48 reads when fused.)"""
    cache = CacheConfig(mode="cache", experts=TOTAL // 4, store=store)
    model = expertcache.load(checkpoints[layout], cache=cache, dtype=dtype)
    if dtype is None:
        assert torch.equal(model.logits(IDS), reference_logits)
    else:  # through the bounce buffer, converted: the resident path in the same dtype
        want = expertcache.load(checkpoints["plain"], dtype=dtype).logits(IDS)
        assert torch.equal(model.logits(IDS), want)
    total, st = model.telemetry()["total"], model.experts.store
    assert total["copied_experts"] > 0
    assert total["copy_ranges"] == st.reads
    if per_expert is not None:
        assert st.reads == per_expert * total["copied_experts"]
    else:  # the shards as written: each expert's reads counted by hand from its tensors' ranges
        ck = Checkpoint(checkpoints["sharded"])
        spans = 0
        for layer in range(LAYERS):
            for e in range(EXPERTS):
                infos = sorted((ck.info(f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight") for p in PARTS),
                               key=lambda i: (str(i.file), i.offset))
                reads = 1 + sum(a.file != b.file or a.offset + a.nbytes != b.offset for a, b in zip(infos, infos[1:]))
                assert st.ranges(layer, e, 1) == reads, (layer, e)
                spans += reads > 1
        assert spans > 0  # the fixture's point: experts span shards


def _spanning(ckpt: Checkpoint) -> tuple[str, list[tuple[int, int]]]:
    """A shard that holds some expert's down matrix but not its gate (the store's first range of
    it), and every expert with a matrix in that shard."""
    for layer in range(LAYERS):
        for e in range(EXPERTS):
            files = [ckpt.info(f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight").file for p in PARTS]
            if files[2] != files[0]:
                shard = files[2]
                touched = [(L, x) for L in range(LAYERS) for x in range(EXPERTS)
                           if any(ckpt.info(f"model.layers.{L}.mlp.experts.{x}.{p}_proj.weight").file == shard
                                  for p in PARTS)]
                return shard.name, touched
    raise AssertionError("no expert spans two shards: the fixture no longer tests what it should")


@pytest.mark.parametrize("store", ["ram", "disk", "mmap"])
def test_a_shard_holding_part_of_an_expert_changed_invalidates_that_expert(checkpoints, tmp_path, store):
    """An expert whose gate lies in one shard and down in another is stale when the second shard
    changes: the next call gives the new weights' logits, bitwise, and exactly the resident
    experts with bytes in that shard are invalidated. (Before: a slot was described by the file of
    its first matrix only, so it kept the old down matrix and the logits were neither version's.)"""
    work = tmp_path / "m"
    shutil.copytree(checkpoints["sharded"], work)
    shard, touched = _spanning(Checkpoint(work))
    model = expertcache.load(work, cache=CacheConfig(mode="cache", experts=TOTAL, store=store))
    model.logits(IDS)
    resident = {(c.key.layer, c.key.expert) for c in model.experts.content if c is not None}
    tensors = {k: v + 0.25 for k, v in load_file(str(work / shard)).items()}
    tmp = work / (shard + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, work / shard)
    want = expertcache.load(work, cache=CacheConfig(mode="resident")).logits(IDS)
    assert torch.equal(model.logits(IDS), want)
    assert model.telemetry()["invalidations"]["source"] == len(resident & set(touched)) > 0


def test_an_experts_version_names_every_file_it_is_read_from(checkpoints):
    """`version_of` is the versions of the distinct files of an expert's ranges, in their order."""
    model = expertcache.load(checkpoints["sharded"], cache=CacheConfig(mode="cache", experts=4, store="disk"))
    st = model.experts.store
    for layer in range(LAYERS):
        for e in range(EXPERTS):
            files = list(dict.fromkeys(seg.file for seg in st.source.segments(layer, e)))
            assert st.version_of(layer, e) == tuple(storemod.file_version(f) for f in files)
    assert any(len(st.version_of(layer, e)) > 1 for layer in range(LAYERS) for e in range(EXPERTS))
