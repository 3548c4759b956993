"""Slot bookkeeping: counts, pinning, runs of consecutive slots, waves, invalidation, invariants."""

import random

import pytest

from expertcache.tiers.policy import LFU, LRU, POLICIES, ExpertKey, make_policy
from expertcache.tiers.residency import OpPlan, Residency, Wave


def K(layer: int, expert: int) -> ExpertKey:
    return ExpertKey(layer, expert)


def lru(capacity: int) -> Residency:
    return Residency(capacity, LRU(capacity))


def test_counts_hits_misses_and_loaded_before():
    res = lru(8)
    p = res.plan(0, [1, 4])
    assert (p.hits, p.misses, p.loaded_before) == ([], [1, 4], 0)
    res.plan(1, [0])
    p = res.plan(0, [0, 1, 2, 4])
    assert (p.hits, p.misses, p.loaded_before) == ([1, 4], [0, 2], 2)
    assert res.resident_mask(0) == 0b10111 and res.resident_mask(1) == 0b1 and res.resident_mask(5) == 0
    # nothing missing: one wave, no copies, no evictions
    p = res.plan(0, [0, 1])
    assert p.misses == [] and len(p.waves) == 1 and p.waves[0].fills == [] and p.copy_ranges == 0
    assert p.waves[0].experts == [0, 1] and p.waves[0].slots == [res.slot_of(K(0, 0)), res.slot_of(K(0, 1))]


def test_runs_of_missing_experts_go_to_consecutive_slots():
    res = lru(6)
    # empty pool: 0..5 of layer 0 into slots 0..5, one copy
    p = res.plan(0, [0, 1, 2, 3, 4, 5])
    assert p.waves[0].copy_runs == [(0, 0, 6)]
    assert res.invalidate([K(0, 1), K(0, 3), K(0, 4)]) == [K(0, 1), K(0, 3), K(0, 4)]
    assert res.free_slots() == [1, 3, 4]
    # the run 0,1 of layer 1 skips the lone free slot 1 for the run of free slots 3,4
    p = res.plan(1, [0, 1])
    assert p.waves[0].fills == [(0, 3), (1, 4)] and p.waves[0].copy_runs == [(0, 3, 2)]
    # 7,8 need 2 slots, 1 is free: LRU evicts (0,0) (least recent; the op's keys are pinned), which
    # frees slot 0 next to free slot 1: one copy into 0,1
    p = res.plan(1, [7, 8])
    assert p.evicted == [K(0, 0)]
    assert p.waves[0].fills == [(7, 0), (8, 1)] and p.waves[0].copy_runs == [(7, 0, 2)]
    # no run of 2 free slots (2 and 5): the lowest free slots, two copies
    res.invalidate([K(0, 2), K(0, 5)])
    p = res.plan(2, [3, 4])
    assert p.waves[0].fills == [(3, 2), (4, 5)] and p.waves[0].copy_runs == [(3, 2, 1), (4, 5, 1)]
    # a lone missing expert takes the lowest free slot; non-consecutive ids are separate runs
    res.invalidate([K(1, 0), K(1, 1), K(2, 3)])
    assert res.free_slots() == [2, 3, 4]
    p = res.plan(3, [1, 3])
    assert p.waves[0].fills == [(1, 2), (3, 3)] and p.waves[0].copy_runs == [(1, 2, 1), (3, 3, 1)]


def test_pinned_keys_are_never_victims():
    # LFU, capacity 2: (0,1) reaches count 3 and (0,0) count 1. The op [0, 2] hits (0,0) (count 2)
    # and needs a slot for (0,2): without pinning LFU would take (0,0), the least frequent; it is
    # in use by the op, so (0,1) goes.
    res = Residency(2, LFU(2, halve_every=1000))
    res.plan(0, [0, 1])
    res.plan(0, [1])
    res.plan(0, [1])
    p = res.plan(0, [0, 2])
    assert p.hits == [0] and p.misses == [2] and p.evicted == [K(0, 1)]
    assert res.resident_keys() == [K(0, 0), K(0, 2)]


def test_an_op_larger_than_the_cache_runs_in_waves():
    # capacity 3, LRU. (0,1) in slot 0, (1,0) in slot 1, slot 2 free. Op: layer 0, experts 0..6.
    res = lru(3)
    res.plan(0, [1])
    res.plan(1, [0])
    p = res.plan(0, [0, 1, 2, 3, 4, 5, 6])
    assert (p.hits, p.misses, p.loaded_before) == ([1], [0, 2, 3, 4, 5, 6], 1)
    assert len(p.waves) == 3
    # wave 1: the hit 1 plus the first two misses 0 and 2; one free slot (2), so LRU evicts (1,0)
    # (LRU order after the hit: (1,0) (0,1)); 0 and 2 are not consecutive: 0 -> slot 1, 2 -> slot 2
    assert p.waves[0] == Wave(
        experts=[0, 1, 2], slots=[1, 0, 2], fills=[(0, 1), (2, 2)],
        copy_runs=[(0, 1, 1), (2, 2, 1)], evicted=[K(1, 0)],
    )
    # wave 2: wave 1's pins are released; 3 4 5 evict all of wave 1 (LRU order (0,1) (0,0) (0,2))
    # and go as one run into slots 0 1 2
    assert p.waves[1] == Wave(
        experts=[3, 4, 5], slots=[0, 1, 2], fills=[(3, 0), (4, 1), (5, 2)],
        copy_runs=[(3, 0, 3)], evicted=[K(0, 1), K(0, 0), K(0, 2)],
    )
    # wave 3: 6 evicts the least recent of wave 2, (0,3) in slot 0
    assert p.waves[2] == Wave(experts=[6], slots=[0], fills=[(6, 0)], copy_runs=[(6, 0, 1)], evicted=[K(0, 3)])
    assert res.resident_keys() == [K(0, 4), K(0, 5), K(0, 6)]
    assert [res.slot_of(k) for k in res.resident_keys()] == [1, 2, 0]
    assert res.resident_mask(0) == 0b1110000 and res.resident_mask(1) == 0
    assert p.copy_ranges == 4 and len(p.evicted) == 5


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_an_op_larger_than_the_cache_flushes_it(name):
    # wave 2 needs every slot, whatever the policy: nothing of the earlier state survives
    res = Residency(4, make_policy(name, 4))
    for _ in range(3):
        res.plan(1, [0, 1])
    res.plan(0, list(range(8)))
    assert res.resident_keys() == [K(0, 4), K(0, 5), K(0, 6), K(0, 7)]


def test_bad_ops_and_capacities_are_value_errors():
    res = lru(2)
    for layer, experts, match in [
        (0, [], "at least one expert"),
        (0, [2, 1], "sorted and distinct"),
        (0, [1, 1], "sorted and distinct"),
        (0, [-1, 2], ">= 0"),
        (0, [0.5], "integers"),
        (-1, [0], "layer"),
    ]:
        with pytest.raises(ValueError, match=match):
            res.plan(layer, experts)
    assert res.ops_planned == 0
    with pytest.raises(ValueError, match="capacity"):
        Residency(0, LRU(1))
    with pytest.raises(ValueError, match="built for 3 slots"):
        Residency(2, LRU(3))
    with pytest.raises(ValueError, match="capacity"):
        res.resize(0)


def test_invalidate_clear_resize():
    res = lru(4)
    res.plan(0, [0, 1])
    res.plan(1, [2, 3])
    assert res.invalidate(lambda k: k.layer == 1) == [K(1, 2), K(1, 3)]
    assert res.resident_mask(1) == 0 and res.free_slots() == [2, 3]
    assert K(1, 2) not in res.policy and len(res.policy) == 2
    assert res.invalidate([K(5, 5), K(0, 1), K(0, 1)]) == [K(0, 1)]  # absent keys are ignored
    assert res.clear() == [K(0, 0)]
    assert len(res) == 0 and len(res.policy) == 0 and res.free_slots() == [0, 1, 2, 3]
    res.plan(0, [0, 1, 2])
    assert res.resize(2) == [K(0, 0), K(0, 1), K(0, 2)]
    assert res.capacity == 2 and res.policy.capacity == 2 and res.free_slots() == [0, 1]
    p = res.plan(0, [0])
    assert p.misses == [0] and p.waves[0].fills == [(0, 0)]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_invariants_under_random_ops(name):
    rng = random.Random(name)
    capacity = 5
    res = Residency(capacity, make_policy(name, capacity))
    for i in range(400):
        layer = rng.randrange(3)
        experts = sorted(rng.sample(range(8), rng.randint(1, 7)))
        if i % 50 == 49:
            res.invalidate(lambda k: k.expert % 3 == 0)
        before = set(res.resident_keys())
        p: OpPlan = res.plan(layer, experts)
        assert sorted(p.hits + p.misses) == experts
        assert p.hits == [e for e in experts if K(layer, e) in before]
        assert sorted(e for w in p.waves for e, _ in w.fills) == p.misses
        assert p.waves[0].experts == sorted(p.hits + p.misses[: capacity - len(p.hits)])
        for w in p.waves:
            assert len(w.experts) <= capacity and len(set(w.slots)) == len(w.slots)
            assert not {k.expert for k in w.evicted if k.layer == layer} & set(w.experts)
            assert sum(n for _, _, n in w.copy_runs) == len(w.fills)
        # the last wave is resident where the plan says
        last = p.waves[-1]
        assert [res.slot_of(K(layer, e)) for e in last.experts] == last.slots
        # maps, bitsets and free list agree; the policy tracks exactly the resident keys
        keys = res.resident_keys()
        assert len(keys) <= capacity and len(res.policy) == len(keys)
        assert all(k in res.policy for k in keys)
        assert sorted([res.slot_of(k) for k in keys] + res.free_slots()) == list(range(capacity))
        for k in keys:
            assert res.key_in(res.slot_of(k)) == k
        for lay in range(3):
            assert res.resident_mask(lay) == sum(1 << k.expert for k in keys if k.layer == lay)


# ---- prefetch ------------------------------------------------------------------------------------


def test_prefetch_by_hand():
    res = lru(4)
    res.plan(0, [0, 1])  # slots 0 1; LRU order (0,0) (0,1)
    # two free slots: both predicted keys planned, as one run, in id order; the op's keys pinned
    pf = res.plan_prefetch(1, [3, 2])
    assert (pf.experts, pf.slots, pf.copy_runs, pf.evicted, pf.dropped) == ([2, 3], [2, 3], [(2, 2, 2)], [], [])
    assert pf.pinned == [K(0, 0), K(0, 1)]
    assert res.prefetched_unused() == [K(1, 2), K(1, 3)] and res.resident_mask(1) == 0b1100
    # the next op hits the prefetched 2 (a prefetch used) and misses 5, which evicts (0,0): LRU
    # order (0,0) (0,1) (1,3) (1,2) after the hit
    p = res.plan(1, [2, 5])
    assert (p.hits, p.misses, p.prefetched, p.evicted, p.wasted) == ([2], [5], [2], [K(0, 0)], [])
    assert res.prefetched_unused() == [K(1, 3)]
    # room for 2 of 3 (4 slots, the op's 2 keys pinned): the best two, 7 and 1, are planned, 0
    # dropped; LRU order (0,1) (1,3) (1,2) (1,5): it evicts (0,1), then (1,3), an unused prefetch,
    # so wasted. 1 and 7 are not consecutive: two copies, into the freed slots 1 and 3.
    pf = res.plan_prefetch(2, [7, 1, 0])
    assert (pf.experts, pf.dropped, pf.evicted, pf.wasted) == ([1, 7], [0], [K(0, 1), K(1, 3)], [K(1, 3)])
    assert (pf.slots, pf.copy_runs, pf.pinned) == ([1, 3], [(1, 1, 1), (7, 3, 1)], [K(1, 2), K(1, 5)])
    # predicted keys already resident cost nothing and change nothing
    pf = res.plan_prefetch(2, [1, 7])
    assert (pf.experts, pf.evicted, pf.dropped) == ([], [], [])
    p = res.plan(2, [0, 1])
    assert (p.hits, p.prefetched, p.misses, p.evicted) == ([1], [1], [0], [K(1, 2)])
    assert res.prefetched_unused() == [K(2, 7)]
    # an invalidated prefetch is forgotten: neither used nor wasted
    assert res.invalidate([K(2, 7)]) == [K(2, 7)] and res.prefetched_unused() == []
    p = res.plan(2, [7])
    assert p.prefetched == [] and p.misses == [7]


def test_a_prefetch_never_evicts_the_op_in_flight():
    # capacity 2, the op uses both slots: nothing can be planned, the policy is not even asked
    res = Residency(2, make_policy("lrfu", 2))
    res.plan(0, [0, 1])
    pf = res.plan_prefetch(0, [2, 3])
    assert (pf.experts, pf.evicted, pf.dropped) == ([], [], [2, 3])
    assert res.resident_keys() == [K(0, 0), K(0, 1)]
    # an op that ran in waves leaves only its own keys in the pool (its first wave filled every
    # slot): all pinned, nothing is planned
    res = lru(2)
    res.plan(0, [0, 1, 2])  # waves {0,1} then {2}, which evicts (0,0)
    pf = res.plan_prefetch(1, [0])
    assert pf.pinned == [K(0, 1), K(0, 2)] and (pf.experts, pf.evicted, pf.dropped) == ([], [], [0])
    with pytest.raises(ValueError, match="distinct"):
        res.plan_prefetch(1, [3, 3])
    assert res.plan_prefetch(1, []).experts == []


def test_a_prefetch_never_evicts_its_own_resident_guesses():
    res = lru(3)
    for layer, e in ((1, 5), (1, 6), (0, 0)):
        res.plan(layer, [e])  # LRU order (1,5) (1,6) (0,0); (0,0) is the op in flight
    # 7 needs a slot; the least recently used key, (1,5), is a guess of the same prefetch: it stays,
    # and (1,6) goes instead
    pf = res.plan_prefetch(1, [7, 5])
    assert (pf.experts, pf.evicted, pf.dropped) == ([7], [K(1, 6)], [])
    assert pf.pinned == [K(0, 0), K(1, 5)]
    p = res.plan(1, [5, 7])
    assert (p.hits, p.misses, p.prefetched) == ([5, 7], [], [7])
    # with every other key pinned, a guess that finds no room is dropped rather than evict a guess
    res = lru(2)
    res.plan(1, [5])
    res.plan(0, [0])
    pf = res.plan_prefetch(1, [5, 6])
    assert (pf.experts, pf.evicted, pf.dropped) == ([], [], [6])
    assert res.resident_keys() == [K(0, 0), K(1, 5)]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_invariants_under_random_ops_with_prefetch(name):
    rng = random.Random("pf" + name)
    capacity = 5
    res = Residency(capacity, make_policy(name, capacity))
    marked: set = set()  # our own account of the unused prefetches
    for i in range(400):
        layer = rng.randrange(3)
        experts = sorted(rng.sample(range(8), rng.randint(1, 7)))
        before = set(res.resident_keys())
        p = res.plan(layer, experts)
        assert p.prefetched == [e for e in p.hits if K(layer, e) in marked]
        marked -= {K(layer, e) for e in p.hits}  # used, even if a later wave evicts them
        assert set(p.wasted) == set(p.evicted) & marked
        marked -= set(p.evicted)
        assert p.hits == [e for e in experts if K(layer, e) in before]
        in_flight = {K(layer, e) for e in experts} & set(res.resident_keys())
        nxt = rng.randrange(3)
        predicted = rng.sample(range(8), rng.randint(0, 6))
        before = set(res.resident_keys())
        pf = res.plan_prefetch(nxt, predicted)
        guessed = {K(nxt, e) for e in predicted} & before
        assert not set(pf.evicted) & (in_flight | guessed) and set(pf.pinned) == in_flight | guessed
        assert set(pf.wasted) == set(pf.evicted) & marked
        planned = {K(nxt, e) for e in pf.experts}
        assert not planned & before and planned | {K(nxt, e) for e in pf.dropped} == \
            {K(nxt, e) for e in predicted} - before
        assert [e for e in predicted if K(nxt, e) not in before][:len(pf.experts)] == \
            [e for e in predicted if K(nxt, e) in planned]  # the best ones were planned
        assert sum(n for _, _, n in pf.copy_runs) == len(pf.experts)
        marked = (marked - set(pf.evicted)) | planned
        assert res.prefetched_unused() == sorted(marked)
        keys = res.resident_keys()
        assert len(keys) <= capacity and len(res.policy) == len(keys) and all(k in res.policy for k in keys)
        assert sorted([res.slot_of(k) for k in keys] + res.free_slots()) == list(range(capacity))
        assert [res.slot_of(K(nxt, e)) for e in pf.experts] == pf.slots
        for lay in range(3):
            assert res.resident_mask(lay) == sum(1 << k.expert for k in keys if k.layer == lay)
