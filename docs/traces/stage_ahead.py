"""Would reading two ops ahead into a staging buffer, beneath the store, help point 7? A timing
experiment, not a feature (docs/benchmarks.md, "A prefetch keeps its own guesses"). Planning two
ops ahead into slots (`lookahead_two.py`) costs hit rate; here the planning and every counter stay
as they are, and only the disk reads move earlier. It runs `expertcache bench cache` with a route
trace, each configuration in its own process, and with `--stage` the prefetch-on runs also hand,
right after op i is planned, op i + 2's recorded guesses that are not resident to a staging thread
beneath the disk store, which reads them into buffers of its own (at most `--buffers` experts)
while the copy worker is idle. A later copy of a staged expert into its slot is a copy from that
buffer instead of a disk read; one whose staged read has not started reads it from disk itself. Op
i + 2's guesses are the trace's own, made one op later than they are staged here: better than a
predictor two layers back could give, so the figure is an upper bound. Run from the repository root, e.g.:

    python docs/traces/stage_ahead.py [--stage] -m /tmp/q30a --stores disk --fractions 0.25 \\
        --prefill 64 --decode 128 --kernels native -t 1 --route-trace docs/traces/used/chat.npz \\
        --prefetch-width 2 --prefetch-min-prob 0.55 --prefetch both
"""

import json
import queue
import subprocess
import sys
import threading
from collections import OrderedDict

from expertcache.bench import cache_bench
from expertcache.memory import page_aligned_empty
from expertcache.tiers.policy import ExpertKey
from expertcache.tiers.store import DiskStore
from expertcache.tiers.transfer import _Demand


DEMAND_OVER = threading.Condition()  # notified whenever a demand copy lets the worker go on


class Stager:
    """Reads experts into buffers of its own on a thread, each started only while the cache's copy
    worker has nothing to do; `take` hands one over (waiting for a read in
    flight), or None, cancelling a read not started: the caller reads it itself."""

    made: list = []  # every stager of this process, for the counts

    def __init__(self, cache, buffers: int):
        Stager.made.append(self)
        self.cache, self.store, self.limit = cache, cache.store, buffers
        self.ready: OrderedDict = OrderedDict()  # key -> buffer, oldest first
        self.inflight: dict = {}  # key -> [Event, started]
        self.lock = threading.Lock()
        self.todo: queue.Queue = queue.Queue()
        self.reads = self.used = self.dropped = self.cancelled = 0
        threading.Thread(target=self._run, daemon=True).start()

    def stage(self, layer: int, experts) -> None:
        for e in experts:
            key = (layer, e)
            with self.lock:
                if key in self.ready or key in self.inflight:
                    continue
                self.inflight[key] = [threading.Event(), False]
            self.todo.put(key)

    def _wait_for_an_idle_worker(self) -> None:
        """Until the worker has no job queued or running and no demand copy holds it: waits on the
        last job's `done`, or on `DEMAND_OVER` (notified when a demand copy ends)."""
        w = self.cache._worker
        while w is not None:
            with w._cond:
                busy = w._queue[-1] if w._queue else w._running
            if busy is not None:
                busy.done.wait()
            elif w._demand:
                with DEMAND_OVER:
                    DEMAND_OVER.wait_for(lambda: not w._demand)
            else:
                return

    def _run(self) -> None:
        while True:
            layer, e = key = self.todo.get()
            self._wait_for_an_idle_worker()
            with self.lock:
                entry = self.inflight.get(key)
                if entry is None:  # cancelled: its op's copy came first
                    continue
                entry[1] = True
            segs = self.store.source.segments(layer, e)
            buf = page_aligned_empty(sum(s.nbytes for s in segs))
            pos = 0
            for seg in segs:  # once started, to the end: a copy may be waiting for it
                self.store._read(seg, [memoryview(buf[pos: pos + seg.nbytes].numpy())])
                pos += seg.nbytes
            with self.lock:
                self.reads += 1
                self.ready[key] = buf
                while len(self.ready) > self.limit:
                    self.ready.popitem(last=False)
                    self.dropped += 1
                self.inflight.pop(key)[0].set()

    def take(self, layer: int, e: int):
        key = (layer, e)
        with self.lock:
            entry = self.inflight.get(key)
            if entry is not None and not entry[1]:
                del self.inflight[key]
                self.cancelled += 1
                return None
        if entry is not None:
            entry[0].wait()
        with self.lock:
            buf = self.ready.pop(key, None)
        self.used += buf is not None
        return buf


def stage_ahead(buffers: int) -> None:
    copy_run = DiskStore.copy_run
    demand_exit = _Demand.__exit__

    def demand_over(self, *exc):
        demand_exit(self, *exc)
        with DEMAND_OVER:
            DEMAND_OVER.notify_all()

    def staged_copy_run(self, layer, first, dst, non_blocking=False):
        stager = getattr(self, "stager", None)
        n = dst.shape[0]
        in_place = self.src_formats[layer] == self.formats[layer] and dst.device.type == "cpu"
        if stager is not None and in_place:
            got = [stager.take(layer, first + i) for i in range(n)]
            if all(b is not None for b in got):
                for i, b in enumerate(got):
                    dst[i, : b.numel()].copy_(b)
                return
        return copy_run(self, layer, first, dst, non_blocking)

    def predict(self, layer):
        nxt = self.next.get(layer)
        if nxt is None:
            return None
        cache = self.plan.__self__
        after = self.next.get(nxt)
        ahead = self._experts(after) if after is not None else None
        if ahead:
            if getattr(cache.store, "stager", None) is None:
                cache.store.stager = Stager(cache, buffers)
            cache.store.stager.stage(after, [e for e in ahead if not cache.residency.is_resident(ExpertKey(after, e))])
        experts = self._experts(nxt)
        return (nxt, experts) if experts else None

    _Demand.__exit__ = demand_over
    DiskStore.copy_run = staged_copy_run
    cache_bench.PredictionReplay.__call__ = predict


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    spec, mode, buffers = json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    if mode == "stage":
        stage_ahead(buffers)
    row = cache_bench.run_one(spec)
    # Staged reads (the warm-up's too) and how many of them a slot copy took instead of a disk read.
    row["staged"] = {k: sum(getattr(s, k) for s in Stager.made) for k in ("reads", "used", "dropped", "cancelled")}
    print(json.dumps(row))
elif __name__ == "__main__":
    from expertcache.cli import build_parser

    argv = sys.argv[1:]
    stage = "--stage" in argv
    buffers = int(argv[argv.index("--buffers") + 1]) if "--buffers" in argv else 12
    if "--buffers" in argv:
        del argv[argv.index("--buffers"): argv.index("--buffers") + 2]
    args = build_parser().parse_args(["bench", "cache"] + [a for a in argv if a != "--stage"])
    rows = []
    for spec in cache_bench.configurations(args):
        mode = "stage" if stage and spec.get("prefetch") == "on" else "plain"
        p = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec), mode, str(buffers)],
                           capture_output=True, text=True, check=True)
        rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
    print(cache_bench.table(rows))
    print(cache_bench.bounds_text(cache_bench.overlap_bounds(rows)))
    for r in rows:
        if r.get("staged", {}).get("reads"):
            print(f"staged: {r['staged']['reads']} experts read ahead, {r['staged']['used']} of them copied into "
                  f"a slot from the buffer, {r['staged']['dropped']} dropped unused for room, "
                  f"{r['staged']['cancelled']} cancelled before their read started")
    print(json.dumps({"staged": stage, "prefetch_bounds": cache_bench.overlap_bounds(rows),
                      "staged_counts": [r.get("staged") for r in rows]}))
