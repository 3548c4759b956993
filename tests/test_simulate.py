"""The trace simulator: hand-counted traces, and Belady's MIN against an exhaustive search."""

import ast
import random
from pathlib import Path

import pytest

from expertcache.bench.simulate import (
    SimResult,
    compare,
    brute_force_min_misses,
    simulate,
    simulate_belady,
    trace_keys,
)
from expertcache.tiers.policy import LRU, POLICIES, Belady, ExpertKey
from expertcache.tiers.residency import Residency

SRC = Path(__file__).resolve().parents[1] / "src" / "expertcache"
PURE_MODULES = [SRC / "tiers" / "policy.py", SRC / "tiers" / "residency.py", SRC / "bench" / "simulate.py"]


def test_the_pure_python_modules_import_no_torch():
    # Checked on the source: the package's __init__ files import torch for the runtime, so
    # sys.modules would say nothing about these three modules themselves.
    allowed = {"expertcache.tiers.policy", "expertcache.tiers.residency"}
    for path in PURE_MODULES:
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                imported.add(node.module)
        ours = {m for m in imported if m.startswith("expertcache")}
        assert ours <= allowed, (path.name, ours)
        assert not any(m.split(".")[0] in ("torch", "numpy") for m in imported), (path.name, imported)


def test_simulate_counts_a_hand_trace():
    # capacity 2, LRU. op 0: 0 1 miss (slots 0 1, one copy). op 1: 1 hits, 2 misses and evicts 0
    # (1 is pinned), into slot 0. op 2: 0 misses, evicts 1 (LRU order 1 2), into slot 1.
    ops = [(0, [0, 1]), (0, [1, 2]), (0, [0])]
    r = simulate(ops, 2, "lru", expert_bytes=100)
    assert r == SimResult(
        policy="lru", capacity=2, ops=3, hits=1, misses=4, compulsory_misses=3,
        evictions=2, bytes_moved=400, copy_ranges=3,
    )
    assert r.hit_rate == pytest.approx(1 / 5)
    assert r.as_dict()["hit_rate"] == pytest.approx(0.2)
    assert simulate(ops, 2, LRU(2), 100) == r
    with pytest.raises(ValueError, match="built for 3 slots"):
        simulate(ops, 2, LRU(3), 100)
    with pytest.raises(ValueError, match="unknown cache policy"):
        simulate(ops, 2, "nope", 100)


def test_belady_with_multi_key_ops():
    # capacity 3. op 0: 0 1 miss. op 1: 2 misses (free slot). op 2 [1 3]: 1 hits and is pinned,
    # 3 must evict 0 or 2, both next used at op 3: the larger key, 2, goes. op 3 [0 2]: 0 hits,
    # 2 misses and evicts 3 (never used again) rather than 1 (op 4). op 4: 1 hits. 5 misses.
    ops = [(0, [0, 1]), (0, [2]), (0, [1, 3]), (0, [0, 2]), (0, [1])]
    res = Residency(3, Belady(3, trace_keys(ops)))
    evicted = [k for layer, experts in ops for k in res.plan(layer, experts).evicted]
    assert evicted == [ExpertKey(0, 2), ExpertKey(0, 3)]
    assert simulate_belady(ops, 3, 1).misses == 5 == brute_force_min_misses(ops, 3)
    assert simulate(ops, 3, "lru", 1).misses == 6  # LRU evicts 0 at op 2, and misses it at op 3


def test_brute_force_hand_cases():
    assert brute_force_min_misses([(0, [0]), (0, [1]), (0, [0])], 1) == 3
    assert brute_force_min_misses([(0, [0]), (0, [1]), (0, [0])], 2) == 2
    # one op larger than the cache: every key misses once, whatever is evicted
    assert brute_force_min_misses([(0, [0, 1, 2, 3, 4])], 2) == 5
    with pytest.raises(ValueError, match="tiny traces"):
        brute_force_min_misses([(0, list(range(17)))], 4)


def test_belady_is_not_optimal_when_ops_run_in_waves():
    # The smallest counterexample, explained in Belady's docstring: capacity 2, ops {0,1,2} twice,
    # then {0,2}. MIN keeps 0 after op 0 (tie, larger key evicted) and misses 5 times; keeping 1
    # lets op 1 load 0 last, so op 2 hits both: 4. LRU happens to do just that.
    ops = [(0, [0, 1, 2]), (0, [0, 1, 2]), (0, [0, 2])]
    assert simulate_belady(ops, 2, 1).misses == 5
    assert brute_force_min_misses(ops, 2) == 4
    assert simulate(ops, 2, "lru", 1).misses == 4


def random_traces(n: int, seed: int):
    """Seeded tiny traces: capacity 2-4, at most 6 keys (1 layer of 6 or 2 of 3), ops of 1-3 keys."""
    rng = random.Random(seed)
    for _ in range(n):
        capacity = rng.randint(2, 4)
        layers = rng.randint(1, 2)
        experts = 6 // layers
        ops = [
            (rng.randrange(layers), sorted(rng.sample(range(experts), rng.randint(1, 3))))
            for _ in range(rng.randint(4, 10))
        ]
        yield capacity, ops


def test_belady_matches_brute_force_when_every_op_fits():
    fitting = waved = 0
    for capacity, ops in random_traces(200, seed=0):
        optimum = brute_force_min_misses(ops, capacity)
        belady = simulate_belady(ops, capacity, 1)
        runtime = [simulate(ops, capacity, name, 1) for name in POLICIES]
        # the exhaustive search is a lower bound for everyone, everywhere
        assert optimum <= belady.misses and all(optimum <= r.misses for r in runtime)
        for r in [belady, *runtime]:
            assert r.hits + r.misses == sum(len(e) for _, e in ops)
            assert r.misses >= r.compulsory_misses
        if all(len(e) <= capacity for _, e in ops):
            # MIN is exactly optimal, and so no runtime policy beats it
            fitting += 1
            assert belady.misses == optimum, (capacity, ops)
            assert all(belady.misses <= r.misses for r in runtime), (capacity, ops)
        else:
            waved += 1
    assert fitting >= 100 and waved >= 40  # both kinds were exercised


# ---- prefetch ------------------------------------------------------------------------------------


def test_prefetch_counts_a_hand_trace():
    # capacity 3, LRU. Op i's prediction is planned right after op i - 1, pinning op i - 1's keys.
    # op 0 (0,[0 1]): both miss, slots 0 1.  pf [3 2] for op 1: room for one (2 pinned of 3): 3,
    #   the best, into slot 2 (a wrong guess).
    # op 1 (1,[0 2]): both miss, evict (0,0) (0,1); 0 -> slot 0, 2 -> slot 1 (two copies).
    #   pf [0] for op 2: evicts (1,3), an unused prefetch (wasted); (0,0) into slot 2.
    # op 2 (0,[0 1]): 0 hits (a prefetch used), 1 misses and evicts (1,0).
    #   pf [3] for op 3: evicts (1,2); (1,3) into slot 1.
    # op 3 (1,[2 3]): 3 hits (used), 2 misses and evicts (0,0).
    ops = [(0, [0, 1]), (1, [0, 2]), (0, [0, 1]), (1, [2, 3])]
    predictions = [None, [3, 2], [0], [3]]
    r = simulate(ops, 3, "lru", 10, predictions)
    assert r == SimResult(policy="lru", capacity=3, ops=4, hits=2, misses=6, compulsory_misses=5, evictions=6,
                          bytes_moved=(6 + 3) * 10, copy_ranges=8, prefetch_issued=3, prefetch_used=2,
                          prefetch_wasted=1)
    with pytest.raises(ValueError, match="3 predictions for 4 ops"):
        simulate(ops, 3, "lru", 10, predictions[:3])
    with pytest.raises(ValueError, match="loads on demand only"):
        simulate(ops, 3, Belady(3, trace_keys(ops)), 10, predictions)
    # compare: each policy's row, then the same with prefetch, both against MIN without it
    rows = compare(ops, [3], ["lru"], 10, predictions)
    assert [(c.result.policy, c.prefetch) for c in rows] == [("belady", False), ("lru", False), ("lru", True)]
    assert rows[2].result == r and rows[2].belady == rows[0].result
    assert rows[2].noncompulsory_vs_belady is None and rows[2].as_dict()["prefetch"] is True


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_prefetch_off_is_the_demand_only_replay(name):
    for capacity, ops in random_traces(60, seed=1):
        demand = simulate(ops, capacity, name, 3)
        assert simulate(ops, capacity, name, 3, [None] * len(ops)) == demand
        assert simulate(ops, capacity, name, 3, [[]] * len(ops)) == demand


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_perfect_predictions_leave_only_the_first_ops_misses(name):
    # With room for two ops, every op but the first is prefetched whole while its predecessor is
    # pinned, and used at once: no demand miss after op 0, nothing wasted.
    for capacity, ops in random_traces(60, seed=2):
        capacity = 2 * max(len(e) for _, e in ops)
        r = simulate(ops, capacity, name, 1, [experts for _, experts in ops])
        assert r.misses == len(ops[0][1]), (capacity, ops)
        assert r.prefetch_used == r.prefetch_issued and r.prefetch_wasted == 0
        assert r.hits == sum(len(e) for _, e in ops[1:])
        assert r.bytes_moved == r.misses + r.prefetch_issued
