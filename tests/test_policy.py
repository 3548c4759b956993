"""Eviction policies against traces computed by hand, and the scan-resistance property."""

import pytest

from expertcache.tiers.policy import (
    ARC,
    DEFAULT_POLICY,
    LFU,
    LRFU,
    LRU,
    POLICIES,
    S3FIFO,
    Belady,
    ExpertKey,
    NoVictimError,
    Policy,
    make_policy,
)
from expertcache.tiers.residency import Residency


def K(expert: int, layer: int = 0) -> ExpertKey:
    return ExpertKey(layer, expert)


def replay(policy: Policy, seq: list[int]) -> list[int]:
    """A cache of `policy.capacity` keys serving one key per op; returns the evicted experts in order."""
    resident: set[ExpertKey] = set()
    evicted = []
    for i, e in enumerate(seq):
        policy.begin_op(i)
        if K(e) in resident:
            policy.hit(K(e))
            continue
        if len(resident) == policy.capacity:
            victim = policy.evict({K(e)})
            resident.remove(victim)
            evicted.append(victim.expert)
        policy.insert(K(e))
        resident.add(K(e))
    assert len(policy) == len(resident)
    return evicted


def test_expert_key_is_small_typed_and_ordered():
    assert ExpertKey(1, 2) < ExpertKey(1, 3) < ExpertKey(2, 0)
    assert {ExpertKey(0, 1): "a"}[ExpertKey(0, 1)] == "a"
    with pytest.raises(AttributeError):
        ExpertKey(0, 1).layer = 2


def test_registry_and_errors():
    assert set(POLICIES) == {"lru", "lfu", "s3fifo", "arc", "lrfu"}
    assert "belady" not in POLICIES  # it needs the future
    assert DEFAULT_POLICY == "lrfu"
    for name, cls in POLICIES.items():
        p = make_policy(name, 4)
        assert isinstance(p, cls) and p.name == name and p.capacity == 4
    with pytest.raises(ValueError, match=r"'mru'.*arc, lfu, lrfu, lru, s3fifo"):
        make_policy("mru", 4)
    with pytest.raises(ValueError, match="capacity"):
        make_policy("lru", 0)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_all_pinned_is_a_clear_error_and_remove_forgets(name):
    p = make_policy(name, 2)
    p.insert(K(1))
    p.insert(K(2))
    with pytest.raises(NoVictimError, match="pinned"):
        p.evict({K(1), K(2), K(3)})
    p.remove(K(1))
    assert K(1) not in p and len(p) == 1
    assert p.evict(set()) == K(2)
    assert len(p) == 0


def test_lru_trace():
    # capacity 3, accesses 1 2 3 1 4 2 5 1 (least recent first):
    # [1 2 3] -> hit 1 [2 3 1] -> 4 evicts 2 [3 1 4] -> 2 evicts 3 [1 4 2]
    # -> 5 evicts 1 [4 2 5] -> 1 evicts 4 [2 5 1]
    assert replay(LRU(3), [1, 2, 3, 1, 4, 2, 5, 1]) == [2, 3, 1, 4]


def test_lfu_trace_and_recency_tiebreak():
    # capacity 3, no aging. 1:ins(1) 1:hit(2) 2:ins(1) 3:ins(1) 2:hit(2)
    # 4: counts 1:2 2:2 3:1 -> evict 3;  1:hit(3)
    # 5: counts 1:3 2:2 4:1 -> evict 4;  3: counts 1:3 2:2 5:1 -> evict 5
    assert replay(LFU(3, halve_every=1000), [1, 1, 2, 3, 2, 4, 1, 5, 3]) == [3, 4, 5]
    # capacity 2, equal counts go to the least recently used:
    # 3 evicts 1 (1 and 2 both count 1, 1 older); 2,3 hit (both count 2, 2 older); 1 evicts 2
    assert replay(LFU(2, halve_every=1000), [1, 2, 3, 2, 3, 1]) == [1, 2]


def test_lfu_aging_halves_counts():
    # capacity 2, accesses 1 1 1 2 2 3. Access 4 (insert of 2) triggers the halving when
    # halve_every=4: counts 1:3->1, 2:1->0; then 2 is hit (1). At 3's miss both count 1 and 1 is
    # older: evict 1. Without aging 1 has 3 and 2 has 2: evict 2.
    assert replay(LFU(2, halve_every=4), [1, 1, 1, 2, 2, 3]) == [1]
    assert replay(LFU(2, halve_every=1000), [1, 1, 1, 2, 2, 3]) == [2]
    lfu = LFU(2, halve_every=4)
    replay(lfu, [1, 1, 1, 2])
    assert (lfu.count(K(1)), lfu.count(K(2))) == (1, 0)


def test_s3fifo_trace():
    # capacity 4: small queue S targets max(1, 4 // 10) = 1 key; queues written oldest first.
    # 1 2 3 4        S=[1 2 3 4], all freq 0
    # 1 2            hits: freq(1)=freq(2)=1
    # 5              S is at target: 1 and 2 were hit -> moved to M=[1 2]; 3 was not -> evicted,
    #                G=[3]; S=[4 5]
    # 3              S: 4 (freq 0) evicted, G=[3 4]; 3 is in G -> enters M=[1 2 3], G=[4]; S=[5]
    # 6              5 evicted, G=[4 5]; S=[6]
    # 1              hit: freq(1)=2
    # 7              6 evicted, G=[4 5 6]; S=[7]
    # 4              7 evicted, G=[4 5 6 7]; 4 in G -> M=[1 2 3 4], G=[5 6 7]; S empty
    # 8              S empty -> evict from M: 1 (freq 2->1) and 2 (1->0) go round, 3 (freq 0)
    #                is evicted; M=[4 1 2]; S=[8]
    p = S3FIFO(4)
    assert replay(p, [1, 2, 3, 4, 1, 2, 5, 3, 6, 1, 7, 4, 8]) == [3, 4, 5, 6, 7, 3]
    assert [p.queue_of(K(e)) for e in (1, 2, 3, 4, 5, 6, 7, 8)] == [
        "main", "main", None, "main", "ghost", "ghost", "ghost", "small"
    ]


def test_arc_trace_and_adaptation():
    # capacity 3, p = target size of T1, lists least recent first.
    # 1 2 3      T1=[1 2 3]
    # 1          hit -> T2=[1], T1=[2 3]
    # 4          |T1|=2 > p=0: evict 2 -> B1=[2]; T1=[3 4]
    # 5          evict 3 -> B1=[2 3]; T1=[4 5]; |T1|+|B1| = 4 > 3 drops 2 from B1
    # 3          evict 4 (|T1|=2 > 0) -> B1=[3 4]; 3 was in B1: p = 0 + max(1, 0//2) = 1,
    #            T2=[1 3], T1=[5], B1=[4]
    # 6          |T1|=1 is not > p=1: evict T2's 1 -> B2=[1]; T1=[5 6]
    # 1          |T1|=2 > 1: evict 5 -> B1=[4 5]; 1 was in B2: p = 1 - max(1, 2//1) = 0 (clamped);
    #            T2=[3 1], T1=[6]
    p = ARC(3)
    assert replay(p, [1, 2, 3, 1, 4, 5, 3, 6]) == [2, 3, 4, 1]
    assert p.p == 1
    p = ARC(3)
    assert replay(p, [1, 2, 3, 1, 4, 5, 3, 6, 1]) == [2, 3, 4, 1, 5]
    assert p.p == 0
    assert [p.list_of(K(e)) for e in (1, 2, 3, 4, 5, 6)] == ["T2", None, "T2", "B1", "B1", "T1"]


def test_lrfu_trace_recency_against_frequency():
    # capacity 2, accesses 1 1 1 2 3, one per op. Half-life 1 op: 1 scores 1, then 1/2 + 1 = 1.5,
    # then 0.75 + 1 = 1.75 at op 2; 2 scores 1 at op 3. At op 4: 1 has 1.75 / 4 = 0.4375, 2 has
    # 1 / 2 = 0.5: evict 1 (recency wins). With a half-life of 1e9 ops, 1 has ~3 and 2 ~1: evict 2.
    p = LRFU(2, half_life=1)
    assert replay(p, [1, 1, 1, 2, 3]) == [1]
    assert p.score(K(3)) == 1.0 and p.score(K(1)) == 0.4375 and p.score(K(2)) == 0.5
    assert replay(LRFU(2, half_life=1e9), [1, 1, 1, 2, 3]) == [2]
    assert LRFU(4).half_life == 16  # default: 4 x capacity


def test_lrfu_remembers_evicted_keys():
    # capacity 2, no decay to speak of (half-life 1e9 ops), accesses 1 1 2 3 2 4 3:
    # op 3: {1:2, 2:1} -> evict 2.  op 4: {1:2, 3:1} -> evict 3; 2 comes back with 1 + 1 = 2.
    # op 5: {1:2 (used at op 1), 2:2 (op 4)} -> evict 1, the older.  op 6: {2:2, 4:1} -> evict 4,
    # and 3 comes back with 2. LFU forgets 2's count when it is evicted, and evicts it again at op 5.
    assert replay(LRFU(2, half_life=1e9), [1, 1, 2, 3, 2, 4, 3]) == [2, 3, 1, 4]
    assert replay(LFU(2, halve_every=1000), [1, 1, 2, 3, 2, 4, 3]) == [2, 3, 2, 4]
    p = LRFU(2, half_life=1e9)
    replay(p, [1, 1, 2])
    p.remove(K(1))  # invalidation leaves no history
    assert K(1) not in p and p.score(K(1)) == 0.0 and p.score(K(2)) == pytest.approx(1.0)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_an_ops_hits_in_one_call_are_its_hits_one_by_one(name):
    # `hits` (what `Residency.plan` calls, LRFU's inlined) must leave a policy exactly as `hit` on
    # each key in turn: the same victims afterwards, in the same order, and LRFU's same scores.
    one, many = make_policy(name, 6), make_policy(name, 6)
    ops = [[0, 1, 2], [1, 3, 4], [0, 2, 5], [1, 2, 3], [0, 4, 5], [2, 3, 5]]
    resident: list[int] = []
    for i, op in enumerate(ops):
        for p in (one, many):
            p.begin_op(i)
        hit = [e for e in op if e in resident]
        for e in hit:
            one.hit(K(e))
        many.hits([K(e) for e in hit])
        for e in op:
            if e not in resident:
                one.insert(K(e))
                many.insert(K(e))
                resident.append(e)
    if name == "lrfu":
        assert [one.score(K(e)) for e in range(6)] == [many.score(K(e)) for e in range(6)]
    assert [one.evict(set()).expert for _ in range(6)] == [many.evict(set()).expert for _ in range(6)]


def test_belady_trace():
    # capacity 2, ops 0..5 use 1 2 3 1 2 3.
    # op 2 (3): next uses 1@3, 2@4 -> evict 2.  op 3: 1 hits.
    # op 4 (2): next uses 1:never, 3@5 -> evict 1.  op 5: 3 hits.
    seq = [1, 2, 3, 1, 2, 3]
    assert replay(Belady(2, [[K(e)] for e in seq]), seq) == [2, 1]
    # never used again is infinitely far; among those the larger key goes first
    seq = [1, 2, 3, 1]
    assert replay(Belady(2, [[K(e)] for e in seq]), seq) == [2]
    seq = [1, 2, 3]
    assert replay(Belady(2, [[K(e)] for e in seq]), seq) == [2]


def test_belady_rejects_a_trace_mismatch():
    b = Belady(2, [[K(1)], [K(2)]])
    b.begin_op(0)
    with pytest.raises(ValueError, match="does not say"):
        b.insert(K(2))
    with pytest.raises(ValueError, match="outside the recorded trace"):
        b.begin_op(2)


# -- scan resistance -------------------------------------------------------------------------------
#
# A model of 4 layers with 4 experts each (16 keys) and a cache of 8 slots. Decode routes every
# token to expert 0 of each layer: a working set of W = 4 keys. A prefill runs one op per layer
# touching all 4 experts of that layer. (A single op larger than the cache cannot be survived by
# any policy: its later waves need every slot, see test_an_op_larger_than_the_cache_flushes_it.)
#
# LRU: after decode, LRU order (0,0) (1,0) (2,0) (3,0). Layer 0's prefill op hits (0,0) and fills
# 3 free slots; layer 1's hits (1,0) and evicts the two least recent, (2,0) and (3,0); layers 2
# and 3 then miss all 4 and evict the previous layer's prefill keys, (0,0) and (1,0) included.
# The next decode step misses (0,0) (1,0) (2,0), and its evictions take (2,1) (2,2) (2,3) (the
# least recent), so (3,0) survives: 3 misses after the prefill, 14 during it.
# S3-FIFO: at layer 1's first eviction the working set (hit, freq > 0) moves from S to M; the
# prefill keys (freq 0) are evicted from S into the ghost queue: no decode miss, 12 prefill misses.
# ARC: the working set is in T2 (seen twice); prefill keys enter T1 and, with p = 0, are evicted
# from T1. LFU: prefill keys have count 1, the working set 4 or more. LRFU (half-life 32 ops): a
# prefill key scores about 1, a working-set key used at 3 of the last 12 ops about 2.5.
LAYERS, EXPERTS, CAPACITY, STEPS = 4, 4, 8, 3
DECODE = [(layer, [0]) for _ in range(STEPS) for layer in range(LAYERS)]
PREFILL = [(layer, list(range(EXPERTS))) for layer in range(LAYERS)]


def misses_by_phase(name: str) -> tuple[int, int, int]:
    res = Residency(CAPACITY, make_policy(name, CAPACITY))
    return tuple(
        sum(len(res.plan(layer, experts).misses) for layer, experts in phase) for phase in (DECODE, PREFILL, DECODE)
    )


@pytest.mark.parametrize(
    "name, expected",
    [("lru", (4, 14, 3)), ("s3fifo", (4, 12, 0)), ("arc", (4, 12, 0)), ("lfu", (4, 12, 0)), ("lrfu", (4, 12, 0))],
)
def test_scan_resistance_prefill_keeps_decode_working_set(name, expected):
    assert misses_by_phase(name) == expected


def test_scan_resistance_one_key_per_op():
    # The classic form: capacity 4, keys 0 1 used three times, then a scan of 10..19 one per op,
    # then 0 1 again. S3-FIFO: 0 and 1 were hit, so the first eviction moves them to M and the scan
    # cycles through S. ARC: 0 and 1 are in T2, the scan cycles through T1. LRU loses both.
    seq = [0, 1] * 3 + list(range(10, 20)) + [0, 1]
    for name, lost in (("lru", 2), ("s3fifo", 0), ("arc", 0)):
        evicted = replay(make_policy(name, 4), seq)
        assert sum(e in (0, 1) for e in evicted) == lost, name
