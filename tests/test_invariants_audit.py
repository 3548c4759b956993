"""The cache's core invariants (shared/DESIGN.md) under attack: a reload whose new pool cannot be
allocated, the copy streams' ordering against the pool's allocation on a GPU (faked streams:
no GPU here), and seeded random configurations of the GGUF fixtures (quantized, layers of mixed
formats, Gemma 4, Qwen3.5) against the all-resident model, with the cache cleared or resized in
the middle of a session."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
import torch

import expertcache
from expertcache import CacheConfig, ExpertCacheError
from expertcache.tiers import cache as cache_module
from expertcache.tiers import transfer as transfer_module
from expertcache.tiers.policy import POLICIES
from conftest import build_reference, save_checkpoint, tiny_config

IDS = list(range(3, 40))
FIXTURES = Path(__file__).parent / "fixtures" / "gguf"


# ---- a reload whose pool cannot be allocated ------------------------------------------------

@pytest.fixture(scope="module")
def narrow_and_wide(tmp_path_factory):
    """Two checkpoints of one architecture whose experts differ in width (slot size)."""
    root = tmp_path_factory.mktemp("geometry")
    narrow = save_checkpoint(build_reference(tiny_config("qwen3_moe", experts=8, top_k=2)), root / "narrow")
    config = tiny_config("qwen3_moe", experts=8, top_k=2)
    config.moe_intermediate_size *= 2
    wide = save_checkpoint(build_reference(config, seed=1), root / "wide")
    return {"narrow": narrow, "wide": wide}


def _replace(src: Path, dst: Path) -> None:
    for name in ("model.safetensors", "config.json"):
        tmp = dst / (name + ".tmp")
        shutil.copy(src / name, tmp)
        os.replace(tmp, dst / name)


@pytest.mark.parametrize("store", ["ram", "disk"])
@pytest.mark.parametrize("before,after", [("narrow", "wide"), ("wide", "narrow")])
def test_a_reload_whose_pool_cannot_be_allocated_fails_once_then_runs_the_new_weights(
        narrow_and_wide, tmp_path, monkeypatch, store, before, after):
    # The checkpoint is replaced by one whose experts have another size: the reload needs a new
    # pool. When it cannot be allocated the call fails clearly; the next call tries again and
    # computes with the new weights. Before, the failed switch kept the new geometry over the old
    # pool, the retry saw no change, and every later call copied new experts into slots of the
    # old size: a size mismatch error (ram) or silently wrong logits (disk).
    work = shutil.copytree(narrow_and_wide[before], tmp_path / "model")
    model = expertcache.load(work, cache=CacheConfig(mode="cache", experts=6, store=store))
    model.logits(IDS)
    _replace(narrow_and_wide[after], work)
    real, failed = cache_module.host_zeros, []

    def no_memory_once(*args, **kwargs):
        if not failed:
            failed.append(True)
            raise MemoryError("injected: no memory for the pool")
        return real(*args, **kwargs)

    monkeypatch.setattr(cache_module, "host_zeros", no_memory_once)
    with pytest.raises(ExpertCacheError, match="cannot allocate 6 expert slots"):
        model.logits(IDS)
    want = expertcache.load(narrow_and_wide[after], cache=CacheConfig(mode="resident")).logits(IDS)
    assert torch.equal(model.logits(IDS), want)
    cache = model.experts
    assert cache.pool.shape[1] == cache.slot_bytes == expertcache.load(narrow_and_wide[after]).experts.slot_bytes
    _check_slots(cache)


# ---- the GPU path's ordering, with faked streams ------------------------------------------

class _Stream:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(("wait", self.name, other.name))

    def wait_event(self, event) -> None:
        self.log.append(("wait_event", self.name))


class _Pool:
    def __init__(self, log: list):
        self.log = log

    def record_stream(self, stream: _Stream) -> None:
        self.log.append(("record", stream.name))


def test_on_a_gpu_the_copy_streams_follow_the_pools_allocation_and_hold_its_memory(monkeypatch):
    # The pool is allocated (and zero-filled) on the compute stream; the copies into it run on two
    # other streams. Torch's allocator orders a block only on the stream it was allocated on, so
    # the copy streams must wait for the compute stream before their first copy (else a copy may
    # land before the zero fill, or while kernels still read the recycled memory) and the pool must
    # be recorded on them (else a freed pool goes to another tensor while copies into it are
    # queued). torch.cuda.Stream.wait_stream and Tensor.record_stream are those two calls.
    log: list = []
    streams = iter(["copy", "prefetch"])
    compute = _Stream("compute", log)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device, priority=0: _Stream(next(streams), log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: _Using(s, log))
    transfers = transfer_module.Transfers(torch.device("cuda", 0), 2)
    transfers.own(_Pool(log))
    transfers.copy([0], lambda non_blocking: log.append(("copy", non_blocking)))
    first_copy = log.index(("copy", True))
    for name in ("copy", "prefetch"):
        assert log.index(("wait", name, "compute")) < first_copy, log
        assert ("record", name) in log, log

    # And the cache hands every pool it allocates (load, resize) to its transfers.
    owned = []
    monkeypatch.setattr(transfer_module.Transfers, "own", lambda self, pool: owned.append(pool))
    model = expertcache.load(cache=CacheConfig(mode="cache", experts=5))
    assert owned and owned[-1] is model.experts.pool
    model.resize_cache(CacheConfig(mode="cache", experts=7))
    assert owned[-1] is model.experts.pool and len(owned) == 2


class _Using:
    def __init__(self, stream: _Stream, log: list):
        self.stream, self.log = stream, log

    def __enter__(self):
        self.log.append(("on", self.stream.name))

    def __exit__(self, *exc):
        return False


# ---- seeded random configurations of the GGUF fixtures --------------------------------------

def _check_slots(cache) -> int:
    """Every resident key's slot holds that expert's bytes as the slow tier gives them and is
    described as holding it. Only the expert's own bytes are compared: a slot is as large as the
    largest expert of any layer, and past a smaller one's bytes it keeps whatever an expert of
    another layer left there (no matrix view reaches them), which the conftest oracle, comparing
    whole slots, takes for stale bytes on a model whose layers have different formats."""
    cache.quiesce()
    n = 0
    for key in cache.residency.resident_keys():
        slot = cache.residency.slot_of(key)
        nbytes = cache.expert_bytes[key.layer]
        want = torch.zeros_like(cache.pool[slot: slot + 1])
        cache.store.copy_run(key.layer, key.expert, want)
        assert torch.equal(cache.pool[slot, :nbytes], want[0, :nbytes]), (key, slot)
        content = cache.content[slot]
        assert content is not None and content.key == key and content.nbytes == nbytes, (key, slot)
        n += 1
    return n


GGUF_MODELS = {"mixed-k-quants": "qwen3_moe-mix.gguf", "qwen2_moe-Q4_K_M": "qwen2_moe-Q4_K_M.gguf",
               "gemma4-Q8_0": "gemma4/gemma4-Q8_0.gguf", "qwen3_5_moe-Q8_0": "qwen3_5_moe/qwen3_5_moe-Q8_0.gguf"}


def _session_logits(model, ids: list[int], ubatch: int, between=lambda: None) -> torch.Tensor:
    """Logits of the second half of `ids`, prefilled on a session after the first half, with
    `between` run in between."""
    session = model.new_session()
    model.prefill(session, ids[:len(ids) // 2], ubatch=ubatch)
    between()
    return model.prefill(session, ids[len(ids) // 2:], ubatch=ubatch, all_logits=True)


@pytest.mark.parametrize("name", sorted(GGUF_MODELS))
def test_random_configurations_of_quantized_models_are_bitwise_resident(name, monkeypatch):
    path = FIXTURES / GGUF_MODELS[name]
    rng = random.Random(name)
    ref = expertcache.load(path, cache=CacheConfig(mode="resident"))
    vocab = min(ref.cfg.vocab_size, 200)
    ids = [rng.randrange(4, vocab) for _ in range(16)]
    total, ubatches = ref.experts.total_experts, (1, 3, 512)
    want = ref.logits(ids)
    want_session = {u: _session_logits(ref, ids, u) for u in ubatches}
    want_tokens = ref.generate(ids[:5], max_tokens=5, ignore_eos=True).token_ids
    del ref
    for _ in range(5):
        mode = rng.choice(["cache", "cache", "staging"])
        kw = dict(mode=mode, experts=rng.choice([1, 2, 3, max(1, total // 4), total]),
                  policy=rng.choice(sorted(POLICIES)), store=rng.choice(["ram", "mmap", "disk"]),
                  verify=rng.random() < 0.5)
        if mode == "cache":
            kw.update(prefetch=rng.choice(["on", "off"]), prefetch_width=rng.choice([0.5, 1.0, 2.0]))
        model = expertcache.load(path, cache=CacheConfig(**kw))
        # Whether torch's threads leave a core to the copy worker decides whether a wave's
        # experts that are there compute while the worker copies the rest (drawn, rather than
        # the thread count: results are bitwise only for one thread count).
        spare = rng.random() < 0.5
        monkeypatch.setattr(cache_module, "_core_to_spare", lambda: spare)
        what = (name, spare, kw)
        for _ in range(2):  # the second with what the first left resident
            assert torch.equal(model.logits(ids), want), what
            _check_slots(model.experts)
        ubatch, action = rng.choice(ubatches), rng.choice(["clear", "resize", "none"])
        resized = CacheConfig(mode="cache", experts=rng.choice([1, 3, total]), policy=kw["policy"],
                              verify=kw["verify"], prefetch=kw.get("prefetch", "auto"))
        between = {"clear": model.experts.clear, "resize": lambda: model.resize_cache(resized),
                   "none": lambda: None}[action]
        assert torch.equal(_session_logits(model, ids, ubatch, between), want_session[ubatch]), (what, action)
        _check_slots(model.experts)
        assert model.generate(ids[:5], max_tokens=5, ignore_eos=True).token_ids == want_tokens, (what, action)
