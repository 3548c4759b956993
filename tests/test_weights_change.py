"""Everything derived from the weights follows their version (shared/DESIGN.md): the prompt
cache's state is dropped when the checkpoint changes, a call sees one version or fails with
`ModelChangedError`, and a failed copy leaves no slot marked as holding an expert. Changes are
made at exact points of a call through the store's read hook, so no test can pass by missing
the window."""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import expertcache
from expertcache import CacheConfig
from expertcache.errors import CopyError, ExpertCacheError, ModelChangedError
from conftest import build_reference, save_checkpoint, tiny_config

IDS = list(range(3, 40))
MODES = [CacheConfig(mode="resident"), CacheConfig(mode="staging", store="disk"),
         CacheConfig(mode="cache", experts=5, store="disk"), CacheConfig(mode="cache", experts=5, store="mmap"),
         CacheConfig(mode="cache", experts=5)]
MODE_IDS = ["resident", "staging-disk", "cache-disk", "cache-mmap", "cache-ram"]


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """Two checkpoints of the same shapes and byte size: the old weights and the new."""
    root = tmp_path_factory.mktemp("versions")
    old = save_checkpoint(build_reference(tiny_config("qwen3_moe", experts=8, top_k=2)), root / "old")
    new = root / "new"
    shutil.copytree(old, new)
    tensors = load_file(str(new / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if t.dim() >= 2:
            tensors[name] = t + 0.05 * torch.randn(t.shape, generator=gen)
    save_file(tensors, str(new / "model.safetensors"), metadata={"format": "pt"})
    assert (old / "model.safetensors").stat().st_size == (new / "model.safetensors").stat().st_size
    return old, new


def _work(tmp_path, src):
    work = tmp_path / "model"
    shutil.copytree(src, work)
    return work


def _replace_atomically(src, dst):
    tmp = dst.with_suffix(".tmp")
    shutil.copy(src, tmp)
    os.replace(tmp, dst)


def _rewrite_in_place(src, dst):
    data = src.read_bytes()
    with open(dst, "r+b") as f:
        f.write(data)


@pytest.mark.parametrize("cache", MODES, ids=MODE_IDS)
def test_a_session_never_reuses_state_of_old_weights(versions, tmp_path, cache):
    old, new = versions
    work = _work(tmp_path, old)
    model = expertcache.load(work, cache=cache)
    session = model.new_session()
    model.generate(IDS[:20], max_tokens=4, session=session, ignore_eos=True)
    _replace_atomically(new / "model.safetensors", work / "model.safetensors")
    got = model.generate(IDS, max_tokens=6, session=session, ignore_eos=True)
    fresh = expertcache.load(new).generate(IDS, max_tokens=6, ignore_eos=True)
    assert got.cached_tokens == 0  # the prefix was computed with the old weights: not reused
    assert got.token_ids == fresh.token_ids
    # the state now follows the new weights and is reused again
    again = model.generate(IDS + got.token_ids, max_tokens=3, session=session, ignore_eos=True)
    assert again.cached_tokens > 0
    assert again.token_ids == expertcache.load(new).generate(IDS + got.token_ids, max_tokens=3,
                                                              ignore_eos=True).token_ids


@pytest.mark.parametrize("store", ["disk", "mmap"])
def test_an_atomic_replacement_does_not_reach_a_call_in_flight(versions, tmp_path, store):
    old, new = versions
    work = _work(tmp_path, old)
    model = expertcache.load(work, cache=CacheConfig(mode="cache", experts=3, store=store))
    expected_old = expertcache.load(old).logits(IDS)
    model.experts.store.read_hook = lambda n: n == 2 and _replace_atomically(new / "model.safetensors",
                                                                              work / "model.safetensors")
    assert torch.equal(model.logits(IDS), expected_old)  # the open file is the old one to the end
    assert model.experts.store.reads > 2
    assert torch.equal(model.logits(IDS), expertcache.load(new).logits(IDS))


@pytest.mark.parametrize("store", ["disk", "mmap"])
@pytest.mark.parametrize("change", ["rewrite", "truncate"])
def test_an_in_place_change_stops_the_call_and_the_next_runs_on_the_new_version(versions, tmp_path, store,
                                                                                 change):
    old, new = versions
    work = _work(tmp_path, old)
    target = work / "model.safetensors"
    model = expertcache.load(work, cache=CacheConfig(mode="cache", experts=3, store=store))

    def hook(n):
        if n == 3:
            if change == "rewrite":
                _rewrite_in_place(new / "model.safetensors", target)
            else:
                os.truncate(target, target.stat().st_size // 2)

    model.experts.store.read_hook = hook
    with pytest.raises((ModelChangedError, CopyError)) as err:
        model.logits(IDS)
    assert isinstance(err.value, ModelChangedError), err.value
    assert "changed on disk" in str(err.value)
    if change == "truncate":
        _rewrite_in_place(new / "model.safetensors", target)
    assert torch.equal(model.logits(IDS), expertcache.load(new).logits(IDS))


def test_model_changed_is_a_503_with_its_code():
    assert ModelChangedError.status == 503 and ModelChangedError.code == "model_changed"
    assert issubclass(ModelChangedError, ExpertCacheError)


class _Flaky:
    """A read hook that fails reads at random points."""

    def __init__(self, seed: int, rate: float):
        self.rng, self.rate, self.failures = random.Random(seed), rate, 0

    def __call__(self, n: int) -> None:
        if self.rng.random() < self.rate:
            self.failures += 1
            raise CopyError(f"injected failure at read {n}")


@pytest.mark.parametrize("cache", [CacheConfig(mode="cache", experts=3, store="disk"),
                                   CacheConfig(mode="cache", experts=9, store="mmap", policy="lfu"),
                                   CacheConfig(mode="staging", store="disk")], ids=["3-disk", "9-mmap", "staging"])
def test_failed_copies_never_leave_a_slot_claiming_an_expert(versions, cache):
    old, _ = versions
    reference = expertcache.load(old)
    prompts = [IDS[i: i + 9] for i in range(0, 27, 3)]
    expected = [reference.logits(p) for p in prompts]
    model = expertcache.load(old, cache=cache)
    flaky = _Flaky(seed=7, rate=0.15)
    failed = 0
    for round_ in range(4):
        for p, want in zip(prompts, expected):
            model.experts.store.read_hook = flaky
            try:
                model.logits(p)
            except CopyError:
                failed += 1
            model.experts.store.read_hook = None
            # Whatever failed before, the cache now serves exactly the all-resident result.
            assert torch.equal(model.logits(p), want)
            # Every slot the bookkeeping calls resident holds what it says.
            for s in range(model.experts.capacity):
                key = model.experts.residency.key_in(s)
                assert key is None or (model.experts.content[s] is not None and model.experts.content[s].key == key)
    # Each failed read is one failed copy. A wave's demand copy that failed on the copy worker is
    # made again by the op (a disk store reads a wave's misses there), so fewer may have raised.
    assert 0 < failed <= flaky.failures == model.telemetry()["copy_failures"]


@pytest.mark.parametrize("store", ["disk", "mmap"])
def test_a_failed_refill_of_resident_slots_leaves_none_claiming_an_expert(versions, tmp_path, monkeypatch, store):
    from expertcache.tiers.store import DiskStore

    old, new = versions
    work = _work(tmp_path, old)
    model = expertcache.load(work, cache=CacheConfig(mode="resident", store=store))
    model.logits(IDS)
    _replace_atomically(new / "model.safetensors", work / "model.safetensors")
    read, reads = DiskStore._read, []

    def failing(self, seg, targets):  # the reload's refill fails at its second read
        reads.append(seg)
        if len(reads) == 2:
            raise CopyError("injected failure")
        return read(self, seg, targets)

    monkeypatch.setattr(DiskStore, "_read", failing)
    with pytest.raises(CopyError):
        model.logits(IDS)
    monkeypatch.setattr(DiskStore, "_read", read)
    cache = model.experts
    for s in range(cache.capacity):
        key = cache.residency.key_in(s)
        assert key is None or (cache.content[s] is not None and cache.content[s].key == key)
    # The next call runs on the new weights alone (dense and experts), and resident mode is whole again.
    assert torch.equal(model.logits(IDS), expertcache.load(new).logits(IDS))
    assert len(cache.residency) == cache.capacity


def test_a_replacement_whose_experts_outgrow_the_cache_fails_every_call_clearly(versions, tmp_path):
    old, _ = versions
    work = _work(tmp_path, old)
    config = tiny_config("qwen3_moe", experts=8, top_k=2)
    config.moe_intermediate_size *= 2
    wide = save_checkpoint(build_reference(config), tmp_path / "wide")
    model = expertcache.load(work, cache=CacheConfig(mode="cache", mem=expertcache.load(old).experts.slot_bytes))
    expected = model.logits(IDS)
    for name in ("model.safetensors", "config.json"):
        _replace_atomically(wide / name, work / name)
    for _ in range(2):  # the cache is left as it was, not half-switched: the same clear error again
        with pytest.raises(ExpertCacheError, match="too small for one wave"):
            model.logits(IDS)
    for name in ("model.safetensors", "config.json"):
        _replace_atomically(old / name, work / name)
    assert torch.equal(model.logits(IDS), expected)


def _chat(client, words: str, n: int = 8) -> dict:
    return client.post("/v1/completions", json={"prompt": words, "max_tokens": n, "temperature": 0,
                                                "ignore_eos": True})


@pytest.mark.parametrize("cache", MODES[:3], ids=MODE_IDS[:3])
def test_a_server_follows_a_replaced_checkpoint(versions, tmp_path, cache):
    from fastapi.testclient import TestClient

    from expertcache.server.app import create_app

    old, new = versions
    work = _work(tmp_path, old)
    prompt = "w3 w4 w5 w6 w7 w8"
    with TestClient(create_app(expertcache.load(work, cache=cache), n_slots=1)) as client, \
            TestClient(create_app(expertcache.load(new), n_slots=1)) as fresh:
        assert _chat(client, prompt).status_code == 200
        _replace_atomically(new / "model.safetensors", work / "model.safetensors")
        got = _chat(client, prompt + " w9").json()
        want = _chat(fresh, prompt + " w9").json()
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert got["timings"]["cache_n"] == 0
        # A change in the middle of a request is a 503 `model_changed`; the next request runs.
        if cache.store == "disk":
            store = client.app.state.scheduler.model.experts.store
            first = store.reads + 1
            store.read_hook = lambda n: n == first and _rewrite_in_place(old / "model.safetensors",
                                                                         work / "model.safetensors")
            r = _chat(client, "w20 w21 w22 w23")
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_changed"
            client.app.state.scheduler.model.experts.store.read_hook = None
            ok = _chat(client, prompt + " w9")
            with TestClient(create_app(expertcache.load(old), n_slots=1)) as back:
                assert ok.json()["choices"][0]["text"] == _chat(back, prompt + " w9").json()["choices"][0]["text"]


def test_a_session_follows_weights_of_another_shape(tmp_path):
    # The checkpoint is replaced by one with another layer: a session from before holds keys and
    # values shaped for the old layers. Its next generation starts afresh on the new weights, as
    # a new session would (its buffers were cut back and reused before, and the call failed).
    work = _work(tmp_path, save_checkpoint(build_reference(tiny_config("qwen3_moe"), seed=0), tmp_path / "old"))
    deeper = save_checkpoint(build_reference(tiny_config("qwen3_moe", layers=4), seed=1), tmp_path / "deeper")
    model = expertcache.load(work, ctx_size=64)
    session = model.new_session()
    model.generate(IDS[:6], max_tokens=3, session=session, ignore_eos=True)
    for name in ("model.safetensors", "config.json"):
        _replace_atomically(deeper / name, work / name)
    got = model.generate(IDS[:8], max_tokens=4, session=session, ignore_eos=True)
    want = expertcache.load(deeper, ctx_size=64).generate(IDS[:8], max_tokens=4, ignore_eos=True)
    assert got.token_ids == want.token_ids and got.cached_tokens == 0
    assert model.cfg.num_layers == 4
