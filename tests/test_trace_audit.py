"""Routing traces, the trace simulator and the eviction policies against hand computations and
exhaustive search: damaged trace files, each policy's eviction order, Belady's MIN against every
possible sequence of eviction choices made through `Residency` itself, and what `trace stats` and
`trace simulate --prefetch` print for small traces worked out by hand."""

import io
import json
import random
import zipfile

import numpy as np
import pytest

from conftest import assert_one_line_error, run_cli
from expertcache.bench.simulate import brute_force_min_misses, simulate, simulate_belady
from expertcache.bench.trace import Trace, TraceHeader, save_trace
from expertcache.cli import main
from expertcache.tiers.policy import (
    ARC,
    LFU,
    LRFU,
    LRU,
    POLICIES,
    S3FIFO,
    ExpertKey,
    NoVictimError,
    Policy,
    make_policy,
)
from expertcache.tiers.residency import Residency
from test_policy import K


HEADER = {"format": "expertcache-trace", "version": 1, "num_experts": 4, "num_layers": 2, "moe_layers": [0, 1],
          "top_k": 2, "expert_bytes": 10, "model": "", "meta": {}}
ARRAYS = {"layer": np.array([0, 1]), "tokens": np.array([1, 2]), "phase": np.array([0, 0]),
          "ids": np.array([[0, 1], [2, 3], [1, 0]])}


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def _zip(path, entries: dict[str, bytes]):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for k, v in entries.items():
            z.writestr(k, v)
    return path


def _entries(header=None, **arrays) -> dict[str, bytes]:
    a = ARRAYS | arrays
    return {"header.npy": _npy(np.array(json.dumps(HEADER | (header or {}))))} | {
        f"{k}.npy": _npy(v) for k, v in a.items()}


def _corrupt_compressed(d):
    """A trace as `trace record` writes it (compressed), with bytes inside the compressed data of
    'ids' flipped: zipfile's inflate fails with zlib.error, before any CRC check."""
    rng = np.random.default_rng(0)
    n = 400
    h = TraceHeader(num_experts=4, num_layers=2, moe_layers=(0, 1), top_k=2, expert_bytes=10)
    trace = Trace(h, np.tile([0, 1], n // 2).astype(np.int32), np.ones(n, np.int32), np.zeros(n, np.uint8),
                  np.stack([rng.permutation(4)[:2] for _ in range(n)]).astype(np.uint8))
    path = d / "recorded.npz"
    save_trace(trace, path)
    data = bytearray(path.read_bytes())
    info = zipfile.ZipFile(path).getinfo("ids.npy")
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)  # the local header's size
    for i in range(start + 20, start + 60):
        data[i] ^= 0x55
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("make, needle", [
    (_corrupt_compressed, "decompressing"),
    # a mangled .npy header inside the archive: numpy's header parser raises a tokenize error
    (lambda d: _zip(d / "hdr.npz", _entries() | {"ids.npy": _npy(ARRAYS["ids"])[:10] + b"garbage"
                                                  + _npy(ARRAYS["ids"])[17:]}), "not an expertcache trace"),
    # entries that are not .npy files: numpy hands back their bytes
    (lambda d: _zip(d / "text.npz", _entries() | {"ids.npy": b"hello world"}), "entry 'ids' is not a NumPy array"),
    (lambda d: _zip(d / "empty.npz", _entries() | {"header.npy": b""}), "entry 'header' is not a NumPy array"),
    # a 0-d 'layer': its length is the op count
    (lambda d: _zip(d / "l0.npz", _entries(layer=np.array(0))), "array 'layer' has shape ()"),
    # phases are 0 or 1; any integer dtype is read, so -1 must be refused too
    (lambda d: _zip(d / "ph.npz", _entries(phase=np.array([0, -1]))), "'phase' must be 0 (prefill) or 1"),
    # an absurd expert count: tables of ops x experts are made from it
    (lambda d: _zip(d / "ne.npz", _entries({"num_experts": 10**30})), "more than the 1048576 experts"),
    # JSON booleans are not layer indices
    (lambda d: _zip(d / "mb.npz", _entries({"moe_layers": [False, True]})), "'moe_layers' must be"),
])
def test_damaged_traces_are_one_line_errors_naming_the_file(tmp_path, capsys, make, needle):
    path = make(tmp_path)
    for command in ("simulate", "stats"):
        assert_one_line_error(*run_cli(capsys, "trace", command, str(path)), str(path), needle)


# ---- policies against their definitions, by hand -----------------------------------------------


def _use(policy: Policy, resident: set, op: int, key: ExpertKey, pinned=frozenset()) -> ExpertKey | None:
    """One op using `key` alone: a hit, or a miss that evicts (when full) and inserts; the victim."""
    policy.begin_op(op)
    if key in resident:
        policy.hit(key)
        return None
    victim = None
    if len(resident) == policy.capacity:
        victim = policy.evict({key, *pinned})
        resident.remove(victim)
    policy.insert(key)
    resident.add(key)
    return victim


def _victims(policy: Policy, seq: list[int]) -> list[int]:
    resident: set = set()
    out = [_use(policy, resident, i, K(e)) for i, e in enumerate(seq)]
    return [v.expert for v in out if v is not None]


def test_lru_evicts_the_least_recently_used():
    # capacity 3: 1 2 3 fill it (order 1 2 3); 1 hit -> 2 3 1; 4 evicts 2 -> 3 1 4; 3 hit -> 1 4 3;
    # 5 evicts 1 -> 4 3 5; 2 evicts 4 -> 3 5 2
    assert _victims(LRU(3), [1, 2, 3, 1, 4, 3, 5, 2]) == [2, 1, 4]


def test_lfu_evicts_the_least_frequent_and_ages_counts():
    # halve_every 4 accesses: 1 (clock 1, count 1), 2 (clock 2, 1), 1 (clock 3, 2), 1 (clock 4, 3:
    # the 4th access halves every count: 1 -> 1, 2 -> 0); 3 misses and evicts 2 (count 0); 3 (clock
    # 5, 1) hit (clock 6, 2); 4 misses: counts 1 -> 1, 3 -> 2, so 1 goes. Without the halving 1 would
    # have counted 3 and 3 would have gone.
    assert _victims(LFU(2, halve_every=4), [1, 2, 1, 1, 3, 3, 4]) == [2, 1]
    assert _victims(LFU(2, halve_every=1000), [1, 2, 1, 1, 3, 3, 4]) == [2, 3]
    # equal counts: the key accessed least recently goes (1 before 2, then 2 before 3)
    assert _victims(LFU(2, halve_every=1000), [1, 2, 3, 4]) == [1, 2]


def test_s3fifo_small_queue_ghost_and_main_clock():
    # capacity 10: the small queue S targets max(1, 10 // 10) = 1 key, so S is drained first.
    # 0..9 fill S (freq 0); 0 and 1 hit (freq 1). 10 misses: S's oldest 0 and 1 were hit -> moved
    # to M; 2 was not -> evicted, ghost G=[2]. 11: 3 evicted, G=[2 3]. 2 again: 4 evicted (G=[2 3 4]),
    # and 2, being in G, enters M (freq 0) instead of S: M=[0 1 2].
    p = S3FIFO(10)
    assert _victims(p, [*range(10), 0, 1, 10, 11, 2]) == [2, 3, 4]
    assert [p.queue_of(K(e)) for e in (0, 1, 2, 3, 4, 5)] == ["main", "main", "main", "ghost", "ghost", "small"]
    # a scan of new keys 12..18 passes through S: each evicts S's oldest unhit key 5, 6, ..., 11,
    # and M's keys survive it
    resident = {K(e) for e in (0, 1, 2, *range(5, 12))}
    got = [_use(p, resident, 20 + i, K(e)).expert for i, e in enumerate(range(12, 19))]
    assert got == [5, 6, 7, 8, 9, 10, 11]
    assert {K(0), K(1), K(2)} <= resident


def test_arc_lists_and_target_by_hand():
    # capacity 2, p = 0. 1 2: T1=[1 2]. 1 hit: T1=[2], T2=[1]. 3 misses: |T1| = 1 > p -> evict 2,
    # B1=[2]; T1=[3]. 2 misses: |T1| = 1 > p -> evict 3, B1=[2 3]; 2 was in B1: p = 0 + max(1, 0 // 2)
    # = 1, T2=[1 2], B1=[3]. 4 misses: |T1| = 0, T1 has nothing -> T2's LRU 1 goes, B2=[1]; T1=[4].
    # 1 misses: |T1| = 1 = p, not above it -> T2's LRU 2 goes, B2=[1 2]; 1 was in B2:
    # p = 1 - max(1, |B1| // |B2| = 1 // 2) = 0, T2=[1].
    a = ARC(2)
    assert _victims(a, [1, 2, 1, 3, 2, 4, 1]) == [2, 3, 1, 2]
    assert a.p == 0
    assert [a.list_of(K(e)) for e in (1, 2, 3, 4)] == ["T2", "B2", "B1", "T1"]


def test_lrfu_scores_decay_and_survive_eviction():
    # half-life 2 ops; a use adds 1, a score halves every 2 ops.
    p = LRFU(2, half_life=2)
    resident: set = set()
    assert _use(p, resident, 0, K(1)) is None  # 1: 1 at op 0
    assert _use(p, resident, 1, K(2)) is None  # 2: 1 at op 1
    assert _use(p, resident, 2, K(1)) is None  # 1: 2^(-2/2) + 1 = 1.5 at op 2
    assert p.score(K(1)) == pytest.approx(1.5) and p.score(K(2)) == pytest.approx(2 ** -0.5)
    # op 3: 1 = 1.5 x 2^-0.5 = 1.06, 2 = 2^-1 = 0.5: 2 goes; 3 enters at 1
    assert _use(p, resident, 3, K(3)) == K(2)
    # op 4: 1 = 1.5 x 2^-1 = 0.75, 3 = 2^-0.5 = 0.71: 3 goes, though it is the most recent
    assert _use(p, resident, 4, K(4)) == K(3)
    # op 10: 1 = 1.5 x 2^-4 = 0.094, 4 = 2^-3 = 0.125: 1 goes. Key 2's history survived its eviction:
    # 2^(-9/2) = 0.044 at op 10
    assert _use(p, resident, 10, K(5)) == K(1)
    assert p.score(K(2)) == pytest.approx(2 ** -4.5)
    # op 11: 2 comes back with 2^(-10/2) + 1 = 1.031; 4 = 2^-3.5 = 0.088, 5 = 2^-0.5 = 0.71: 4 goes
    assert _use(p, resident, 11, K(2)) == K(4)
    assert p.score(K(2)) == pytest.approx(2 ** -5 + 1)
    # equal scores (used once, in the same op): the smaller key goes
    q = LRFU(3, half_life=2)
    q.begin_op(0)
    for e in (7, 3, 5):
        q.insert(K(e))
    assert q.evict(set()) == K(3) and q.evict(set()) == K(5)


@pytest.mark.parametrize("name", list(POLICIES))
def test_pinned_keys_are_never_victims_and_all_pinned_is_refused(name):
    rng = random.Random(name)
    p = make_policy(name, 4)
    resident: set = set()
    for op in range(300):
        key = K(rng.randrange(10), rng.randrange(2))
        pinned = set(rng.sample(sorted(resident), min(len(resident), rng.randrange(4)))) if resident else set()
        victim = _use(p, resident, op, key, pinned)
        assert victim is None or (victim not in pinned and victim != key), (op, victim, pinned)
        assert len(p) == len(resident) and all(k in p for k in resident)
    with pytest.raises(NoVictimError, match="all 4 resident keys are pinned"):
        p.evict(set(resident))
    assert len(p) == 4  # the refusal changed nothing
    survivor = sorted(resident)[0]
    assert p.evict(set(resident) - {survivor}) == survivor


# ---- Belady's MIN against every sequence of eviction choices -----------------------------------


class _Scripted(Policy):
    """Evicts the `script[i]`-th unpinned resident key (in key order) at its i-th eviction; past the
    script, the first, noting where the first choice beyond the script was and among how many."""

    name = "scripted"

    def __init__(self, capacity: int, script: list[int]):
        self.script, self.calls, self.branch = script, 0, None
        super().__init__(capacity)

    def _reset_state(self) -> None:
        self.keys: set = set()

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key) -> bool:
        return key in self.keys

    def hit(self, key) -> None:
        pass

    def insert(self, key) -> None:
        self.keys.add(key)

    def remove(self, key) -> None:
        self.keys.discard(key)

    def evict(self, pinned):
        choices = sorted(k for k in self.keys if k not in pinned)
        if self.calls < len(self.script):
            pick = self.script[self.calls]
        else:
            pick = 0
            if self.branch is None:
                self.branch = (self.calls, len(choices))
        self.calls += 1
        self.keys.remove(choices[pick])
        return choices[pick]


def _optimum_through_residency(ops, capacity: int) -> int:
    """The fewest misses over every sequence of eviction choices, each replayed through `Residency`
    (the runtime's own op and wave semantics), by depth-first search over the choices."""
    best = None
    stack = [[]]
    while stack:
        script = stack.pop()
        policy = _Scripted(capacity, script)
        residency = Residency(capacity, policy)
        misses = sum(len(residency.plan(layer, experts).misses) for layer, experts in ops)
        best = misses if best is None else min(best, misses)
        if policy.branch is not None:
            at, n = policy.branch
            stack.extend(script + [0] * (at - len(script)) + [c] for c in range(n))
    return best


def test_min_and_brute_force_equal_an_exhaustive_search_through_residency():
    rng = random.Random(7)
    fitting = waved = 0
    for _ in range(250):
        experts, layers, capacity = rng.randint(2, 4), rng.randint(1, 2), rng.randint(1, 4)
        ops = [(rng.randrange(layers), sorted(rng.sample(range(experts), rng.randint(1, experts))))
               for _ in range(rng.randint(1, 6))]
        optimum = _optimum_through_residency(ops, capacity)
        assert brute_force_min_misses(ops, capacity) == optimum, (ops, capacity)
        belady = simulate_belady(ops, capacity, 1).misses
        assert belady >= optimum
        assert all(simulate(ops, capacity, name, 1).misses >= optimum for name in POLICIES), (ops, capacity)
        if all(len(e) <= capacity for _, e in ops):
            fitting += 1
            assert belady == optimum, (ops, capacity)
        else:
            waved += 1
    assert fitting >= 60 and waved >= 40  # both kinds were exercised


# ---- trace stats and trace simulate --prefetch, by hand ------------------------------------------


def _save(path, header: dict, **arrays):
    h = {"format": "expertcache-trace", "version": 3, "model": "", "meta": {}, "predictor": "router"} | header
    np.savez(path, header=np.array(json.dumps(h)), **arrays)
    return str(path)


def _last_json(capsys) -> tuple[list[str], dict]:
    lines = capsys.readouterr().out.splitlines()
    return lines, json.loads(lines[-1])


def test_trace_stats_by_hand(tmp_path, capsys):
    # 4 experts, top-1, 2 predicted per token. Ops (layer, phase, each token's expert):
    #   0 (0, prefill, [0], [1])  1 (1, prefill, [2])  2 (0, decode, [0])  3 (1, decode, [3])
    #   4 (0, decode, [0])        5 (1, decode, [2], not predicted)
    path = _save(tmp_path / "t.npz", {"num_experts": 4, "num_layers": 2, "moe_layers": [0, 1], "top_k": 1,
                                      "expert_bytes": 100, "pred_width": 2},
                 layer=np.array([0, 1, 0, 1, 0, 1]), tokens=np.array([2, 1, 1, 1, 1, 1]),
                 phase=np.array([0, 0, 1, 1, 1, 1]), ids=np.array([[0], [1], [2], [0], [3], [0], [2]]),
                 pred=np.array([[0, 1], [2, 3], [2, 1], [1, 0], [2, 3], [0, 1], [3, 2]]),
                 pred_prob=np.array([[.9, .1], [.6, .3], [.8, .2], [.4, .3], [.7, .5], [.9, .05], [.6, .4]],
                                    np.float16),
                 predicted=np.array([1, 1, 1, 1, 1, 0]))
    assert main(["trace", "stats", path, "--prefetch-width", "2", "--prefetch-min-prob", "0.35"]) == 0
    lines, out = _last_json(capsys)
    # layer 0 uses {0,1}, {0}, {0}: 4 uses, expert 0 has 3 of them; the top 10% and 25% of 4 experts
    # are 1 expert: 3/4; entropy of (3/4, 1/4); 2 unused; expert 0 reused 1 and 1 layer-op later
    l0 = out["layers"]["0"]
    assert (l0["uses"], l0["top10_share"], l0["top25_share"], l0["unused_experts"]) == (4, 0.75, 0.75, 2)
    assert l0["entropy_bits"] == pytest.approx(-(0.75 * np.log2(0.75) + 0.25 * np.log2(0.25)))
    assert l0["max_entropy_bits"] == 2.0
    assert (l0["reuse"]["reuses"], l0["reuse"]["first_uses"]) == (2, 2)
    assert l0["reuse"]["p50"] == 1.0 and l0["reuse"]["share_le_1"] == 1.0
    # layer 1 uses {2}, {3}, {2}: expert 2 reused 2 layer-ops later
    l1 = out["layers"]["1"]
    assert (l1["uses"], l1["top10_share"], l1["unused_experts"]) == (3, pytest.approx(2 / 3), 2)
    assert (l1["reuse"]["reuses"], l1["reuse"]["p50"], l1["reuse"]["share_le_1"], l1["reuse"]["share_le_4"]) == (
        1, 2.0, 0.0, 1.0)
    q = out["prediction"]

    def cell(predicted, correct, used):
        return {"predicted": predicted, "correct": correct, "recall": correct / used,
                "precision": correct / predicted}

    # prefill, layer 0 (op 0 uses {0,1}; tokens rank [0 1] and [2 3]): width 1 names {0,2}: 1 right;
    # widths 1.5 and 2 (2 per token) {0,1,2,3}: 2 right; the floor 0.35 keeps 0 (.9) and 2 (.6): 1
    assert q["prefill"]["0"]["ops"] == 1 and q["prefill"]["0"]["used"] == 2
    assert q["prefill"]["0"]["widths"] == {"1.0": cell(2, 1, 2), "1.5": cell(4, 2, 2), "2.0": cell(4, 2, 2),
                                           "2.0,p>=0.35": cell(2, 1, 2)}
    # prefill, layer 1 (op 1 uses {2}; ranks [2 1], .8 .2)
    assert q["prefill"]["1"]["widths"] == {"1.0": cell(1, 1, 1), "1.5": cell(2, 1, 1), "2.0": cell(2, 1, 1),
                                           "2.0,p>=0.35": cell(1, 1, 1)}
    # decode, layer 0: op 2 uses {0} ranks [1 0] (.4, .3), op 4 uses {0} ranks [0 1] (.9, .05):
    # width 1 names {1} and {0}: 1 of 2; width 2 {0,1} twice: 2 of 4; the floor keeps {1} and {0}
    assert q["decode"]["0"]["ops"] == 2 and q["decode"]["0"]["used"] == 2
    assert q["decode"]["0"]["widths"] == {"1.0": cell(2, 1, 2), "1.5": cell(4, 2, 2), "2.0": cell(4, 2, 2),
                                          "2.0,p>=0.35": cell(2, 1, 2)}
    # decode, layer 1: only op 3 is predicted (uses {3}; ranks [2 3], .7 .5)
    assert q["decode"]["1"]["ops"] == 1
    assert q["decode"]["1"]["widths"] == {"1.0": {"predicted": 1, "correct": 0, "recall": 0.0, "precision": 0.0},
                                          "1.5": cell(2, 1, 1), "2.0": cell(2, 1, 1), "2.0,p>=0.35": cell(2, 1, 1)}
    # the table prints the same figures: the decode row of layer 0
    row = next(line.split() for line in lines if line.split()[:2] == ["decode", "0"])
    assert row[2:] == ["2", "0.500", "0.500", "1.000", "0.500", "1.000", "0.500", "0.500", "0.500"]


def test_trace_simulate_prefetch_counters_by_hand(tmp_path, capsys):
    # One MoE layer of 4 experts, top-1, decode ops using 0, 1, 2, 0, 3; predictions (width 1) for
    # ops 1..4: 1 (right), 3 (wrong), 0 (right), 3 (right). Capacity 2, LRU, expert 100 bytes.
    path = _save(tmp_path / "pf.npz", {"num_experts": 4, "num_layers": 1, "moe_layers": [0], "top_k": 1,
                                       "expert_bytes": 100, "pred_width": 2},
                 layer=np.zeros(5, int), tokens=np.ones(5, int), phase=np.ones(5, int),
                 ids=np.array([[0], [1], [2], [0], [3]]),
                 pred=np.array([[0, 1], [1, 0], [3, 0], [0, 1], [3, 2]]),
                 pred_prob=np.full((5, 2), 0.5, np.float16), predicted=np.array([0, 1, 1, 1, 1]))
    assert main(["trace", "simulate", path, "--capacity", "2", "--policy", "lru", "--prefetch"]) == 0
    _, out = _last_json(capsys)
    belady, lru, pf = out["results"]
    # MIN: 0 1 2 miss (2 evicts 1, never used again), 0 hits, 3 misses: 4 misses, all first uses
    assert (belady["policy"], belady["misses"], belady["compulsory_misses"]) == ("belady", 4, 4)
    # LRU without prefetch: each op evicts the key used two ops before: 5 misses, 3 evictions
    assert (lru["misses"], lru["hits"], lru["evictions"], lru["bytes_moved"]) == (5, 0, 3, 500)
    assert lru["noncompulsory_vs_belady"] is None and lru["misses_vs_belady"] == 5 / 4
    # With prefetch (op i's guess planned right after op i - 1, pinning op i - 1's keys):
    #   op 0: 0 misses (slot 0); prefetch 1 into the free slot 1           issued 1
    #   op 1: 1 hits, a prefetch used; prefetch 3 evicts 0 (LRU: 0 then 1)   used 1, issued 2
    #   op 2: 2 misses, evicts 1 (LRU: 1 then 3); prefetch 0 evicts 3, never used: wasted
    #   op 3: 0 hits, used; prefetch 3 evicts 2                             used 2, issued 4
    #   op 4: 3 hits, used                                                 used 3
    # demand misses 2, hits 3, evictions 0, 1, 3, 2 = 4, bytes (2 + 4) x 100, one copy range each
    assert pf["prefetch"] and (pf["misses"], pf["hits"], pf["evictions"]) == (2, 3, 4)
    assert (pf["prefetch_issued"], pf["prefetch_used"], pf["prefetch_wasted"]) == (4, 3, 1)
    assert (pf["bytes_moved"], pf["copy_ranges"]) == (600, 6)
    assert pf["misses_vs_belady"] == 0.5 and pf["noncompulsory_vs_belady"] is None
    assert out["prefetch_width"] == 1.0 and out["prefetch_min_prob"] == 0.0
    # the same replay with width 0 is the demand-only one
    assert main(["trace", "simulate", path, "--capacity", "2", "--policy", "lru", "--prefetch",
                   "--prefetch-width", "0"]) == 0
    _, zero = _last_json(capsys)
    assert {k: v for k, v in zero["results"][2].items() if k != "prefetch"} == {
        k: v for k, v in lru.items() if k != "prefetch"}
    # a floor above every recorded probability keeps no guess: the demand-only counts again
    assert main(["trace", "simulate", path, "--capacity", "2", "--policy", "lru", "--prefetch",
                   "--prefetch-min-prob", "0.6"]) == 0
    _, floored = _last_json(capsys)
    assert floored["results"][2]["misses"] == 5 and floored["results"][2]["prefetch_issued"] == 0
