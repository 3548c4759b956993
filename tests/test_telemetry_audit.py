"""The numbers the engine reports about itself, against references of their own: the cache's
counters against an independent LRU replay of the routing the model ran and the bytes the store
actually wrote, an op whose copy fails, /metrics parsed with prometheus_client against the JSON
telemetry, and the counters read by the server while the worker adds layers."""

from __future__ import annotations

import collections

import pytest
import torch

import expertcache
from expertcache import CacheConfig
from expertcache.errors import CopyError
from expertcache.server.app import create_app
from expertcache.telemetry import OP_COUNTERS, Telemetry
from fastapi.testclient import TestClient

IDS = torch.randint(4, 120, (30,), generator=torch.Generator().manual_seed(2)).tolist()


def _counting_store(cache) -> collections.Counter:
    """Wrap the store's copy_run: experts and bytes it wrote into slots, and its calls."""
    copy_run, seen = cache.store.copy_run, collections.Counter()

    def counting(layer, first, dst, non_blocking=False):
        copy_run(layer, first, dst, non_blocking)
        seen["calls"] += 1
        seen["experts"] += dst.shape[0]
        seen["bytes"] += dst.shape[0] * cache.formats[layer].nbytes

    cache.store.copy_run = counting
    return seen


def _lru_replay(ops, capacity: int) -> dict[str, collections.Counter]:
    """Per layer, the op counters of a shared LRU cache of `capacity` slots run over `ops` (layer,
    sorted distinct experts), written from docs/cache.md's op rules: hits and misses at op start;
    wave 1 = the hits and the misses that fit, then waves of `capacity` misses; only the current
    wave's experts are safe from eviction; a hit is a use, fills are inserted in id order."""
    lru: collections.OrderedDict = collections.OrderedDict()
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for layer, experts in ops:
        c = out[str(layer)]
        hits = [e for e in experts if (layer, e) in lru]
        misses = [e for e in experts if (layer, e) not in lru]
        c["ops_seen"] += 1
        c["used_experts_unique"] += len(experts)
        c["loaded_experts_before"] += sum(1 for key in lru if key[0] == layer)
        c["resident_hits"] += len(hits)
        c["resident_misses"] += len(misses)
        c["demand_misses"] += len(misses)
        c["copied_experts"] += len(misses)
        c["empty_copy_ops"] += not misses
        for e in hits:
            lru.move_to_end((layer, e))
        room = capacity - len(hits)
        waves = [(hits + misses[:room], misses[:room])]
        waves += [(misses[i: i + capacity],) * 2 for i in range(room, len(misses), capacity)]
        for wave, fills in waves:
            c["waves"] += 1
            safe = {(layer, e) for e in wave}
            for e in fills:
                if len(lru) >= capacity:
                    del lru[next(key for key in lru if key not in safe)]
                    c["evictions"] += 1
                lru[(layer, e)] = True
    return out


@pytest.mark.parametrize("store", ["ram", "disk"])
def test_counters_equal_an_lru_replay_and_the_bytes_the_store_wrote(store):
    # 10 slots for the 4 layers' ops of up to ~24 experts: prompt ops run in waves, decode ops hit.
    model = expertcache.load(cache=CacheConfig(mode="cache", experts=10, policy="lru", store=store,
                                               prefetch="off"))
    cache = model.experts
    # The file holds the experts as the slots do: the bytes written into slots are the bytes read.
    assert cache.store.src_formats == cache.formats
    seen = _counting_store(cache)
    ops = []
    model.net.routing_hook = lambda layer, r: ops.append((layer, sorted(set(r.ids.flatten().tolist()))))
    session = model.new_session()
    model.prefill(session, IDS)
    for t in IDS[:6]:
        model.prefill(session, [t])
    tel = model.telemetry()
    want = _lru_replay(ops, cache.capacity)
    assert any(c["waves"] > c["ops_seen"] for c in want.values())  # the replay covers waves
    for layer, c in want.items():
        assert {k: tel["layers"][layer][k] for k in c} == dict(c), layer
    total = tel["total"]
    for name in OP_COUNTERS:
        assert total[name] == sum(c[name] for c in tel["layers"].values()), name
    assert total["hit_rate"] == total["resident_hits"] / total["used_experts_unique"]
    # copied_* are what the store wrote into slots; skipped_* the hits
    assert total["copied_experts"] == seen["experts"] and total["copied_bytes"] == seen["bytes"]
    assert total["skipped_bytes"] == total["resident_hits"] * tel["expert_bytes"]
    if store == "ram":  # one call per merged run
        assert total["copy_ranges"] == seen["calls"]
    # the prompts' reads are the copies of the prefill calls (all of them here)
    assert model.prefill_total.bytes_read == seen["bytes"]
    assert tel["copy_seconds"] >= 0 and tel["stall_seconds"] >= 0 and tel["prefetch_copy_seconds"] == 0

    # clear() and a resize keep every counter; a resize counts the resident slots it invalidates
    cache.clear()
    model.resize_cache(CacheConfig(mode="cache", experts=20, policy="lru", prefetch="off"))
    after = model.telemetry()
    assert after["total"] == total and after["layers"] == tel["layers"]
    assert after["invalidations"]["pool"] == after["pre_invalid_loaded"] == 0  # clear() had emptied it
    model.prefill(session, [IDS[0]])
    resident = len(cache.residency.resident_keys())
    model.resize_cache(CacheConfig(mode="cache", experts=10, policy="lru", prefetch="off"))
    after = model.telemetry()
    assert resident > 0 and after["invalidations"]["pool"] == after["pre_invalid_loaded"] == resident


def test_an_op_whose_copy_fails_is_not_an_op_with_nothing_to_copy():
    # docs/cache.md: empty_copy_ops counts ops that copied nothing "(and waited on nothing)". A
    # cold op whose copy fails had misses to copy and waited for the copy: it is not one.
    model = expertcache.load(cache=CacheConfig(mode="cache", fraction=0.25, prefetch="off"))
    cache = model.experts

    def failing(layer, first, dst, non_blocking=False):
        raise CopyError("injected copy failure")

    copy_run, cache.store.copy_run = cache.store.copy_run, failing
    with pytest.raises(CopyError):
        model.logits(IDS[:1])
    total = model.telemetry()["total"]
    assert total["ops_seen"] == 1 and total["resident_misses"] > 0 and total["copied_experts"] == 0
    assert total["empty_copy_ops"] == 0
    assert model.telemetry()["copy_failures"] == 1
    # One token's experts fit the pool: the call after a cold one copies nothing in any layer.
    cache.store.copy_run = copy_run
    model.logits(IDS[:1])
    model.logits(IDS[:1])
    layers = len(model.cfg.moe_layers)
    total = model.telemetry()["total"]
    assert total["ops_seen"] == 1 + 2 * layers and total["empty_copy_ops"] == layers


def test_metrics_agree_with_the_json_telemetry():
    from prometheus_client.parser import text_string_to_metric_families

    model = expertcache.load(ctx_size=512, cache=CacheConfig(mode="cache", fraction=0.25, prefetch="off"))
    with TestClient(create_app(model)) as c:
        c.post("/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0})
        text = c.get("/metrics").text
        state = c.get("/cache/state").json()
    tel = model.telemetry()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for fam in families.values():
        assert fam.documentation and fam.type in ("counter", "gauge"), fam.name
        for s in fam.samples:
            assert s.name.endswith("_total") == (fam.type == "counter"), s.name
            assert set(s.labels) <= {"layer", "reason", "mode", "policy", "store"}, s.name
    # per-op counters: one series per layer that ran an op, summing to the JSON total
    for name in OP_COUNTERS:
        fam = families[f"expertcache_cache_{name}"]
        assert fam.type == "counter"
        by_layer = {s.labels["layer"]: s.value for s in fam.samples}
        assert by_layer == {layer: c[name] for layer, c in tel["layers"].items()}, name
        assert sum(by_layer.values()) == tel["total"][name], name
    # every cache-wide counter of the JSON telemetry, `copy_seconds` included
    for name in ("pre_invalid_loaded", "pre_invalid_hit", "load_copied_experts", "load_copied_bytes",
                 "copy_failures", "copy_seconds", "stall_seconds", "prefetch_copy_seconds"):
        (sample,) = families[f"expertcache_cache_{name}"].samples
        assert sample.value == pytest.approx(tel[name]), name
    assert {s.labels["reason"]: s.value for s in families["expertcache_cache_invalidations"].samples} \
        == tel["invalidations"]
    assert families["expertcache_cache_hit_rate"].samples[0].value == pytest.approx(tel["total"]["hit_rate"])
    # `waves` counts every pass, one per op that fits: its help must not say only waved ops count
    assert tel["total"]["waves"] == tel["total"]["ops_seen"]
    assert "one per op" in families["expertcache_cache_waves"].documentation
    assert state["total"] == tel["total"] and state["copy_seconds"] == tel["copy_seconds"]


def test_totals_can_be_read_while_the_worker_adds_a_layer():
    """The server reads `model.telemetry()` on its event loop while the worker thread runs ops;
    a layer's first op adds its counters. Simulated deterministically: adding a layer while
    `total()` sums the layers (where a thread switch can put it) must not make the read fail."""
    tel = Telemetry({0: 10, 1: 10, 2: 10})
    tel.op(0, used=3, loaded_before=0, hits=1, copied=2, ranges=1, evictions=0, waves=1)
    tel.op(1, used=2, loaded_before=0, hits=0, copied=2, ranges=1, evictions=0, waves=1)

    class Interleaved(collections.Counter):
        fired = False

        def items(self):
            if not Interleaved.fired:  # the worker's op of layer 2 runs here
                Interleaved.fired = True
                tel.op(2, used=4, loaded_before=0, hits=0, copied=4, ranges=1, evictions=0, waves=1)
            return super().items()

    tel.layers[0] = Interleaved(tel.layers[0])
    total = tel.total()
    assert Interleaved.fired
    assert total["used_experts_unique"] in (5, 9)  # layer 2 seen or not, never a failed read
    assert tel.total()["used_experts_unique"] == 9 and tel.as_dict()["total"]["copied_bytes"] == 80
