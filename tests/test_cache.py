"""The resident-expert cache: results never depend on it, compute reads the slots, invalidation is
exact, telemetry adds up, bad sizes and names are clear errors."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import expertcache
from expertcache import CacheConfig, ExpertCacheError
from expertcache.models.pack import pack
from expertcache.cli import main
from expertcache.tiers.policy import POLICIES
from conftest import VOCAB, assert_one_line_error, run_cli

IDS = torch.randint(4, VOCAB, (48,), generator=torch.Generator().manual_seed(3))
EXPERTS, LAYERS = 16, 3
TOTAL = EXPERTS * LAYERS


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """An unpacked (per-expert) and a packed copy of one tiny Qwen3-MoE with 16 experts, top-4."""
    from conftest import build_reference, save_checkpoint, tiny_config

    root = tmp_path_factory.mktemp("cache")
    ref = build_reference(tiny_config("qwen3_moe", experts=EXPERTS, top_k=4, layers=LAYERS))
    plain = save_checkpoint(ref, root / "plain")
    packed = pack(plain, root / "packed", progress=False)
    return {"plain": plain, "packed": packed}


@pytest.fixture(scope="module")
def reference_logits(checkpoints):
    return expertcache.load(checkpoints["plain"], cache=CacheConfig(mode="resident")).logits(IDS)


SIZES = {"smallest": 1, "10%": TOTAL // 10, "25%": TOTAL // 4, "50%": TOTAL // 2, "100%": TOTAL}


@pytest.mark.parametrize("layout", ["plain", "packed"])
@pytest.mark.parametrize("store", ["ram", "mmap", "disk"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_logits_bitwise_identical_across_sizes(checkpoints, reference_logits, layout, store, policy):
    for size in SIZES.values():
        model = expertcache.load(checkpoints[layout], cache=CacheConfig(mode="cache", experts=size,
                                                                         policy=policy, store=store))
        # Twice: the second pass runs with whatever the first left resident.
        for _ in range(2):
            assert torch.equal(model.logits(IDS), reference_logits), f"cache of {size} slots"


@pytest.mark.parametrize("layout", ["plain", "packed"])
@pytest.mark.parametrize("store", ["ram", "mmap", "disk"])
def test_staging_and_resident_bitwise_identical(checkpoints, reference_logits, layout, store):
    for cache in (CacheConfig(mode="staging", store=store), CacheConfig(mode="staging", experts=3, store=store),
                  CacheConfig(mode="resident", store=store)):
        assert torch.equal(expertcache.load(checkpoints[layout], cache=cache).logits(IDS), reference_logits)


def test_greedy_generation_identical_in_every_mode(checkpoints):
    prompt = IDS[:10].tolist()
    expected = expertcache.load(checkpoints["plain"]).generate(prompt, max_tokens=24, ignore_eos=True).token_ids
    for cache in (CacheConfig(mode="staging"), CacheConfig(mode="cache", experts=1),
                  CacheConfig(mode="cache", fraction=0.25, policy="s3fifo", store="disk"),
                  CacheConfig(mode="cache", fraction=0.5, policy="lfu", store="mmap")):
        for layout in ("plain", "packed"):
            model = expertcache.load(checkpoints[layout], cache=cache)
            assert model.generate(prompt, max_tokens=24, ignore_eos=True).token_ids == expected


def _used_slot(model) -> tuple[int, int, int]:
    """(layer, expert, slot) of an expert that the forward over IDS uses and that is resident."""
    seen = []
    model.net.routing_hook = lambda layer, r: seen.append((layer, sorted(set(r.ids.flatten().tolist()))))
    model.logits(IDS)
    model.net.routing_hook = None
    res = model.experts.residency
    for layer, experts in seen:
        for e in experts:
            key = expertcache.tiers.policy.ExpertKey(layer, e)
            if res.is_resident(key):
                return layer, e, res.slot_of(key)
    raise AssertionError("no used expert is resident")


@pytest.mark.parametrize("mode", ["cache", "resident"])
def test_compute_reads_the_slots(checkpoints, mode):
    model = expertcache.load(checkpoints["plain"], cache=CacheConfig(mode=mode))
    before = model.logits(IDS)
    _, _, slot = _used_slot(model)
    model.experts.pool[slot].view(model.net.dtype).mul_(0.5)  # behind the cache's back (the pool is bytes)
    assert not torch.equal(model.logits(IDS), before)


def test_verify_mode_names_layer_expert_and_slot(checkpoints):
    model = expertcache.load(checkpoints["plain"], cache=CacheConfig(mode="cache", verify=True))
    layer, expert, slot = _used_slot(model)
    model.experts.pool[slot, 5] += 1
    with pytest.raises(ExpertCacheError, match=rf"slot {slot} holding layer {layer} expert {expert}"):
        model.logits(IDS)


def _scale_experts(path, factor: float) -> None:
    """Rewrite model.safetensors with expert weights scaled: temp file, then rename over it."""
    tensors = load_file(path / "model.safetensors")
    for name in tensors:
        if ".experts." in name:
            tensors[name] = tensors[name] * factor
    tmp = path / "model.safetensors.tmp"
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, path / "model.safetensors")


@pytest.mark.parametrize("store", ["ram", "mmap", "disk"])
def test_replaced_checkpoint_gives_new_logits(checkpoints, tmp_path, store):
    d = shutil.copytree(checkpoints["packed"], tmp_path / "m")
    model = expertcache.load(d, cache=CacheConfig(mode="cache", fraction=0.5, store=store))
    old = model.logits(IDS)
    resident = len(model.experts.residency)
    assert resident > 0
    _scale_experts(d, 1.5)
    new = model.logits(IDS)
    fresh = expertcache.load(d, cache=CacheConfig(mode="resident")).logits(IDS)
    assert not torch.equal(new, old)
    assert torch.equal(new, fresh)
    tel = model.telemetry()
    assert tel["invalidations"]["source"] == resident
    assert tel["pre_invalid_loaded"] == resident and tel["pre_invalid_hit"] > 0
    assert sum(v for k, v in tel["invalidations"].items() if k != "source") == 0
    # An unchanged source invalidates nothing between calls.
    model.logits(IDS)
    assert model.telemetry()["invalidations"]["source"] == resident


def test_clear_forgets_invalidations(checkpoints, tmp_path):
    """After `clear()` every op misses anyway: an invalidation before it is not `pre_invalid_hit`."""
    d = shutil.copytree(checkpoints["packed"], tmp_path / "m")
    model = expertcache.load(d, cache=CacheConfig(mode="cache", fraction=0.5, store="disk"))
    model.logits(IDS)
    _scale_experts(d, 1.5)
    model.begin_call()  # finds the change: every resident slot invalidated
    assert model.telemetry()["pre_invalid_loaded"] > 0
    model.experts.clear()
    model.logits(IDS)
    assert model.telemetry()["pre_invalid_hit"] == 0


def test_resize_while_loaded(checkpoints, reference_logits):
    model = expertcache.load(checkpoints["plain"], cache=CacheConfig(mode="cache", experts=TOTAL // 2))
    model.logits(IDS)
    before = model.telemetry()
    resident = len(model.experts.residency)
    model.resize_cache(CacheConfig(mode="cache", experts=7))
    assert model.experts.capacity == 7 and model.experts.pool.shape[0] == 7
    assert torch.equal(model.logits(IDS), reference_logits)
    after = model.telemetry()
    assert after["invalidations"]["pool"] == resident
    assert after["total"]["ops_seen"] == 2 * before["total"]["ops_seen"]  # counters survive a resize


def test_a_refused_resize_leaves_the_cache_working(checkpoints, reference_logits):
    model = expertcache.load(checkpoints["plain"], cache=CacheConfig(mode="cache", experts=5))
    model.logits(IDS)
    slot = model.experts.slot_bytes
    with pytest.raises(ExpertCacheError, match="too small for one wave"):
        model.resize_cache(CacheConfig(mode="cache", mem=slot - 1))
    # Another store would be ignored by a resize: refused by name, nothing changed.
    with pytest.raises(ExpertCacheError, match="keeps the store 'ram'"):
        model.resize_cache(CacheConfig(mode="cache", experts=5, store="disk"))
    assert model.experts.capacity == 5 and model.experts.config.store == "ram"
    assert torch.equal(model.logits(IDS), reference_logits)
    model.resize_cache(CacheConfig(mode="cache", mem=slot))
    assert model.experts.capacity == 1 and torch.equal(model.logits(IDS), reference_logits)
    # A config left at the default store keeps the model's, and says so.
    disk = expertcache.load(checkpoints["plain"], cache=CacheConfig(mode="cache", experts=5, store="disk"))
    disk.resize_cache(CacheConfig(mode="cache", experts=7))
    assert disk.experts.store.name == disk.experts.config.store == "disk" and disk.experts.capacity == 7
    assert torch.equal(disk.logits(IDS), reference_logits)


def _check_counters(t: dict, expert_bytes: int) -> None:
    assert t["resident_hits"] + t["resident_misses"] == t["used_experts_unique"]
    assert t["copied_bytes"] == t["copied_experts"] * expert_bytes
    assert t["skipped_experts"] == t["resident_hits"]
    assert t["skipped_bytes"] == t["resident_hits"] * expert_bytes
    assert t["copied_experts"] == t["resident_misses"]


def test_telemetry_adds_up(checkpoints):
    ops = []
    model = expertcache.load(checkpoints["packed"], cache=CacheConfig(mode="cache", fraction=0.5))
    model.net.routing_hook = lambda layer, r: ops.append((layer, len(set(r.ids.flatten().tolist()))))
    model.generate(IDS[:12].tolist(), max_tokens=8, ignore_eos=True)
    tel = model.telemetry()
    t = tel["total"]
    sizes = model.experts.expert_bytes  # per MoE layer; one size here (3 x 64 x 32 fp32 values)
    assert set(sizes.values()) == {3 * 64 * 32 * 4} and tel["expert_bytes"] == 3 * 64 * 32 * 4
    _check_counters(t, tel["expert_bytes"])
    assert t["ops_seen"] == len(ops)
    assert t["used_experts_unique"] == sum(n for _, n in ops)
    for layer, c in tel["layers"].items():
        _check_counters(c, sizes[int(layer)])
        assert c["used_experts_unique"] == sum(n for l, n in ops if l == int(layer))
    assert t["resident_hits"] > 0 and t["evictions"] > 0


def test_staging_copies_everything_and_resident_nothing(checkpoints):
    staging = expertcache.load(checkpoints["packed"], cache=CacheConfig(mode="staging"))
    staging.logits(IDS)
    staging.logits(IDS)
    t = staging.telemetry()["total"]
    assert t["resident_hits"] == 0 and t["copied_experts"] == t["used_experts_unique"] > 0
    # A run of consecutive experts into consecutive staging slots is one copy on a packed checkpoint.
    assert t["copy_ranges"] < t["copied_experts"]

    resident = expertcache.load(checkpoints["packed"], cache=CacheConfig(mode="resident"))
    tel = resident.telemetry()
    assert tel["load_copied_experts"] == TOTAL
    resident.logits(IDS)
    t = resident.telemetry()["total"]
    assert t["copied_experts"] == 0 and t["copy_ranges"] == 0
    assert t["resident_hits"] == t["used_experts_unique"] and t["empty_copy_ops"] == t["ops_seen"]


def test_full_cache_second_pass_copies_nothing(checkpoints):
    model = expertcache.load(checkpoints["plain"], cache=CacheConfig(mode="cache"))
    model.logits(IDS)
    first = model.telemetry()["total"]
    model.logits(IDS)
    second = model.telemetry()["total"]
    assert second["copied_experts"] == first["copied_experts"]
    assert second["empty_copy_ops"] - first["empty_copy_ops"] == second["ops_seen"] - first["ops_seen"]


def test_trace_line_on_stderr(checkpoints, capsys):
    model = expertcache.load(checkpoints["plain"], cache=CacheConfig(mode="cache", experts=10, trace_every=2))
    capsys.readouterr()
    model.logits(IDS)
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("expertcache cache:")]
    assert len(lines) == LAYERS // 2 and "hit_rate=" in lines[0]


def test_run_json_reports_hit_rate(checkpoints, capsys):
    assert main(["run", "-m", str(checkpoints["plain"]), "-p", "w5 w6 w7", "-n", "12", "--ignore-eos",
                 "--cache-fraction", "0.25", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    t = out["telemetry"]["total"]
    assert out["telemetry"]["mode"] == "cache" and out["telemetry"]["capacity"] == TOTAL // 4
    assert 0 < t["hit_rate"] < 1 and t["hit_rate"] == t["resident_hits"] / t["used_experts_unique"]


@pytest.mark.parametrize("argv,needle", [
    (["--cache-mem", "1KB"], "too small for one wave"),
    (["--cache-mem", "lots"], "'lots'"),
    (["--cache-policy", "mru"], "'mru'"),
    (["--store", "tape"], "'tape'"),
    (["--cache-fraction", "1.5"], "1.5"),
])
def test_bad_cache_flags(checkpoints, capsys, argv, needle):
    assert_one_line_error(*run_cli(capsys, "run", "-m", str(checkpoints["plain"]), "-p", "w1", *argv), needle)


@pytest.mark.parametrize("field,value,needle", [
    ("fraction", True, "cache fraction True"), ("fraction", float("nan"), "cache fraction nan"),
    ("fraction", 0, "cache fraction 0"), ("experts", True, "cache experts True"), ("mem", 0, "cache mem 0"),
])
def test_bad_cache_config_values_are_refused_by_name(field, value, needle):
    with pytest.raises(ExpertCacheError, match=needle):
        CacheConfig(mode="cache", **{field: value})


def test_interrupted_pack_leaves_nothing(checkpoints, tmp_path, monkeypatch):
    import expertcache.models.pack as packmod

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(packmod, "write_safetensors", boom)
    with pytest.raises(KeyboardInterrupt):
        packmod.pack(checkpoints["plain"], tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_packed_checkpoint_layout(checkpoints):
    from expertcache.checkpoint.safetensors_io import Checkpoint

    ck = Checkpoint(checkpoints["packed"])
    info = ck.info("model.layers.0.mlp.experts.packed")
    assert info.shape == (EXPERTS, 3 * 64 * 32)
    plain = Checkpoint(checkpoints["plain"])
    # Expert 5 of layer 1: gate, up, down back to back.
    row = ck.read_rows("model.layers.1.mlp.experts.packed", 5)
    parts = [plain.read(f"model.layers.1.mlp.experts.5.{p}_proj.weight").reshape(-1) for p in ("gate", "up", "down")]
    assert torch.equal(row, torch.cat(parts))


def test_written_checkpoints_start_their_experts_on_pages(checkpoints):
    """`pack` (and `synth`, through the same writer) puts every tensor whose size is a whole number
    of 4 KiB pages on a page boundary, experts first; the header's padding is what safetensors
    allows, so its reader (behind `Checkpoint.read`) gives the same tensors."""
    from expertcache.checkpoint.safetensors_io import Checkpoint

    ck, plain = Checkpoint(checkpoints["packed"]), Checkpoint(checkpoints["plain"])
    for layer in range(LAYERS):
        info = ck.info(f"model.layers.{layer}.mlp.experts.packed")
        assert info.nbytes % 4096 == 0 and info.offset % 4096 == 0
    for name in plain.tensors:
        if ".experts." not in name:
            assert torch.equal(ck.read(name), plain.read(name)), name


def _o_direct_here(path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except (AttributeError, OSError):
        return False


def test_disk_store_reads_page_aligned_experts_with_o_direct(checkpoints, reference_logits):
    """Every read of a packed checkpoint is direct where the file system has O_DIRECT; where it
    has none, the store opens no direct descriptor and every read is buffered. Either way the
    logits are the all-resident path's."""
    path = checkpoints["packed"]
    direct_here = _o_direct_here(path / "model.safetensors")
    model = expertcache.load(path, cache=CacheConfig(mode="cache", experts=TOTAL // 4, store="disk"))
    assert torch.equal(model.logits(IDS), reference_logits)
    store = model.experts.store
    assert bool(store._direct_fds) == direct_here
    assert store.reads > 0 and store.direct_reads == (store.reads if direct_here else 0)
    # In another compute dtype the reads land in a bounce buffer, on a page too, then convert.
    conv = expertcache.load(path, dtype="bfloat16", cache=CacheConfig(mode="cache", experts=TOTAL // 4, store="disk"))
    assert torch.equal(conv.logits(IDS), expertcache.load(path, dtype="bfloat16").logits(IDS))
    cs = conv.experts.store
    assert cs.formats != cs.src_formats
    assert cs.reads > 0 and cs.direct_reads == (cs.reads if direct_here else 0)
    # The per-expert checkpoint of transformers' writer is not aligned: every read is buffered.
    plain = expertcache.load(checkpoints["plain"], cache=CacheConfig(mode="cache", experts=TOTAL // 4, store="disk"))
    assert torch.equal(plain.logits(IDS), reference_logits)
    assert plain.experts.store.reads > 0 and plain.experts.store.direct_reads == 0


def test_merged_reads_join_ranges_that_follow_one_another(monkeypatch):
    """Hand-made ranges, out of order: those back to back in one file become one read, its
    buffers in file order; another file, a gap, or a read at its limits start a new one."""
    from pathlib import Path

    from expertcache.checkpoint.safetensors_io import Segment
    from expertcache.tiers import store as storemod

    a, b = Path("a"), Path("b")
    buf = {name: memoryview(bytearray(8)) for name in "pqrstu"}
    pieces = [(Segment(a, 100, 50), buf["q"]), (Segment(a, 0, 100), buf["p"]), (Segment(b, 150, 10), buf["r"]),
              (Segment(a, 200, 5), buf["s"]), (Segment(a, 150, 50), buf["t"]), (Segment(b, 160, 1), buf["u"])]
    got = [(seg, [next(k for k, v in buf.items() if v is t) for t in targets])
           for seg, targets in storemod.merged_reads(pieces)]
    assert got == [(Segment(a, 0, 205), ["p", "q", "t", "s"]), (Segment(b, 150, 11), ["r", "u"])]
    monkeypatch.setattr(storemod, "MAX_READ_BUFFERS", 2)
    assert [seg for seg, _ in storemod.merged_reads(pieces)] == [Segment(a, 0, 150), Segment(a, 150, 55),
                                                                  Segment(b, 150, 11)]
    monkeypatch.setattr(storemod, "MAX_READ_BYTES", 100)
    assert [seg for seg, _ in storemod.merged_reads(pieces)] == [Segment(a, 0, 100), Segment(a, 100, 100),
                                                                  Segment(a, 200, 5), Segment(b, 150, 11)]


def test_disk_store_reads_an_experts_matrices_in_one_call(checkpoints, reference_logits):
    """transformers' writer puts an expert's three matrices back to back (down, gate, up: by name),
    in another order than a slot holds them: the store reads each expert in one call, scattered
    into its slot, and the logits are the all-resident path's."""
    from expertcache.checkpoint.safetensors_io import Checkpoint

    ck = Checkpoint(checkpoints["plain"])
    for layer in range(LAYERS):
        for e in range(EXPERTS):
            names = [f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
            infos = sorted((ck.info(name) for name in names), key=lambda i: i.offset)
            assert all(x.offset + x.nbytes == y.offset for x, y in zip(infos, infos[1:]))
    for store in ("disk", "mmap"):
        cache = CacheConfig(mode="cache", experts=TOTAL // 4, store=store)
        model = expertcache.load(checkpoints["plain"], cache=cache)
        assert torch.equal(model.logits(IDS), reference_logits)
        copied = model.telemetry()["total"]["copied_experts"]
        assert copied > 0 and model.experts.store.reads == copied, store


def test_o_direct_refused_falls_back_to_buffered_reads(checkpoints, reference_logits, monkeypatch):
    """A device asking for a coarser alignment answers EINVAL: the read is made again buffered,
    and that file is read buffered from then on."""
    import errno

    from expertcache.tiers import store as storemod

    model = expertcache.load(checkpoints["packed"], cache=CacheConfig(mode="cache", experts=TOTAL // 4,
                                                                      store="disk"))
    store = model.experts.store
    if not store._direct_fds:  # a file system without O_DIRECT: stand-in descriptors take the refusal
        store._direct_fds = {p: os.open(p, os.O_RDONLY) for p in store._fds}
    direct = set(store._direct_fds.values())
    real = os.preadv
    refused = []

    def preadv(fd, buffers, offset):
        if fd in direct:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset)

    monkeypatch.setattr(storemod.os, "preadv", preadv)
    assert torch.equal(model.logits(IDS), reference_logits)
    assert len(refused) == 1 and store._direct_fds == {} and store.direct_reads == 0 and store.reads > 0
