"""Where decode's time goes with the disk store, prefetch off and on: a timeline of one
`bench cache` configuration each (the same run as `expertcache bench cache --route-trace`, in this
process), from timestamps around the store's reads, the MoE layer's waits for its experts and the
model's forward calls; and the CPU time a cold read costs on this machine.

    python tools/prefetch_timeline.py /tmp/q30a docs/traces/fitted/chat.npz --threads 2 --rounds 2

Each configuration (prefetch off and on; with `--reads both`, the default, the store's reads
direct where the file allows and buffered, in turn on the same file) runs `--rounds` times in
turn. Prints, per run and per decoded token: the disk's rate (the copies' bytes over their time),
the time, the time the disk was reading (two reads at once count once), the MoE layers' waits for
copies, their expert compute, the rest of the step (attention, routing, sampling), and where the
disk was idle; how much of that idle time came while a copy job was already queued (the copy
worker not yet back from its last read, or held back while the MoE layer made a demand copy:
"held"), the rest with nothing to read; the time copy jobs took from their start to their first
read, and of it what was not CPU time of the thread (it waited for a core, or for Python's lock);
then the CPU milliseconds per GB of a cold `preadv` (page cache filled and copied out), of a hot
one (the copy alone) and of a cold one with O_DIRECT (the device writes the buffer); then one
JSON line. The store reads with O_DIRECT only where the experts lie on 4 KiB
pages (a checkpoint `synth` or `pack` wrote since 54934f3): the first line says what share of the
reads did. Wrapping the calls costs a few microseconds each (about 60 per token).
"""

from __future__ import annotations

import argparse
import bisect
import json
import mmap
import os
import sys
import threading
import time

from expertcache.bench.cache_bench import run_one
from expertcache.errors import ExpertCacheError
from expertcache.flags import positive_int
from expertcache.models.decoder import Decoder
from expertcache.tiers.cache import ExpertCache
from expertcache.tiers import store, transfer
from expertcache.tiers.store import DiskStore

EVENTS: list[tuple[str, float, float]] = []
# At the end of each store read: (end time, copy jobs queued, of them held back by a demand copy).
QUEUED: list[tuple[float, int, bool]] = []
WORKERS: list[transfer.CopyWorker] = []
# Per copy job: (its start, wall seconds from its start to its first read, of them CPU seconds).
STARTS: list[tuple[float, float, float]] = []
_JOB = threading.local()


def watched_reads() -> None:
    """Each store read, as a "read" event, and at its end whether a copy job was waiting: the disk
    idles after it either with work queued (the worker not yet back, or held by a demand copy) or
    with nothing to read. Both are noted with the same end time, so that a gap is matched with the
    read before it (a second timestamp, taken a moment later, would match the read before that)."""
    orig_init, orig_read, orig_run_job = transfer.CopyWorker.__init__, DiskStore._read, ExpertCache._run_job

    def init(self, *a, **k):
        WORKERS.append(self)
        orig_init(self, *a, **k)

    def read(self, *a, **k):
        t = time.perf_counter()
        started = getattr(_JOB, "start", None)
        if started is not None:
            _JOB.start = None
            STARTS.append((started[0], t - started[0], time.thread_time() - started[1]))
        try:
            return orig_read(self, *a, **k)
        finally:
            end = time.perf_counter()
            EVENTS.append(("read", t, end))
            queued = sum(len(w._queue) for w in WORKERS)
            QUEUED.append((end, queued, queued > 0 and any(w._demand for w in WORKERS)))

    def run_job(self, *a, **k):
        _JOB.start = (time.perf_counter(), time.thread_time())
        try:
            return orig_run_job(self, *a, **k)
        finally:
            _JOB.start = None

    transfer.CopyWorker.__init__ = init
    DiskStore._read = read
    ExpertCache._run_job = run_job


def timed(cls, name: str, tag: str) -> None:
    orig = getattr(cls, name)

    def call(self, *a, **k):
        t = time.perf_counter()
        try:
            return orig(self, *a, **k)
        finally:
            EVENTS.append((tag, t, time.perf_counter()))

    setattr(cls, name, call)


def timed_acquire() -> None:
    """`acquire` yields each part of a wave once its experts are in their slots: the time before a
    yield is waiting, the time the caller holds it is expert compute."""
    orig = ExpertCache.acquire

    def acquire(self, *a, **k):
        t = time.perf_counter()
        for part in orig(self, *a, **k):
            got = time.perf_counter()
            EVENTS.append(("wait", t, got))
            yield part
            t = time.perf_counter()
            EVENTS.append(("compute", got, t))
        EVENTS.append(("wait", t, time.perf_counter()))

    ExpertCache.acquire = acquire


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap(spans: list[tuple[float, float]], a: float, b: float) -> float:
    return sum(max(0.0, min(y, b) - max(x, a)) for x, y in spans)


def counted_alignment() -> None:
    """Each read's `aligned` answer, as an event: the share of reads that could go direct."""
    orig = store.aligned

    def aligned(offset, targets):
        ok = orig(offset, targets)
        EVENTS.append(("aligned" if ok else "unaligned", 0.0, 0.0))
        return ok

    store.aligned = aligned


def summarize(events, tokens: int) -> dict:
    steps = [e for e in events if e[0] == "forward"][-tokens:]
    t0, t1 = steps[0][1], steps[-1][2]
    disk = union([(a, b) for tag, a, b in events if tag == "read" and b > t0 and a < t1])
    per = 1e3 / tokens
    row = {"ms": (t1 - t0) * per, "disk_busy_ms": overlap(disk, t0, t1) * per}
    for tag in ("wait", "compute"):
        spans = [(a, b) for k, a, b in events if k == tag and t0 <= a < t1]
        row[f"{tag}_ms"] = sum(b - a for a, b in spans) * per
        row[f"disk_idle_in_{tag}_ms"] = sum((b - a) - overlap(disk, a, b) for a, b in spans) * per
    row["rest_ms"] = row["ms"] - row["wait_ms"] - row["compute_ms"]
    row["disk_idle_in_rest_ms"] = (row["ms"] - row["disk_busy_ms"] - row["disk_idle_in_wait_ms"]
                                   - row["disk_idle_in_compute_ms"])
    # Each idle gap between reads, by what was queued when the last read before it ended.
    ends = sorted(QUEUED)
    queued = held = 0.0
    for (_, b), (c, _) in zip(disk, disk[1:]):
        if not t0 <= b < t1:
            continue
        i = bisect.bisect_right(ends, (b, float("inf"), True)) - 1
        if i >= 0 and ends[i][1]:
            queued += c - b
            held += (c - b) if ends[i][2] else 0.0
    row["disk_idle_queued_ms"], row["disk_idle_held_ms"] = queued * per, held * per
    # A job's time from its start on the worker to its first read: the Python that plans the read,
    # and what the thread waited for a core (or Python's lock) on top of it.
    starts = [(w, c) for a, w, c in STARTS if t0 <= a < t1]
    row["job_to_read_ms"] = sum(w for w, _ in starts) * per
    row["job_to_read_waiting_ms"] = sum(max(0.0, w - c) for w, c in starts) * per
    checked = [e[0] for e in events if e[0] in ("aligned", "unaligned")]
    row["aligned_share"] = checked.count("aligned") / max(1, len(checked))
    return {k: round(v, 2) for k, v in row.items()}


def weights_file(model: str) -> str:
    """The model's largest weights file: the GGUF file itself, or the largest .safetensors (or
    .gguf) of a directory."""
    if os.path.isfile(model):
        return model
    files = [os.path.join(model, f) for f in os.listdir(model) if f.endswith((".safetensors", ".gguf"))]
    return max(files, key=os.path.getsize)


def read_cost(path: str, size: int = 9 << 20, n: int = 64) -> dict | None:
    """CPU ms per GB of a cold preadv (after DONTNEED), of the same read again (page cache hot),
    and of a cold one with O_DIRECT (page-aligned offsets into a page-aligned buffer); None for a
    file too small to hold one pair of reads."""
    if os.path.getsize(path) < 4096 + 2 * size:
        return None
    fd = os.open(path, os.O_RDONLY)
    direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        end = os.fstat(fd).st_size
        os.posix_fadvise(fd, 0, end, os.POSIX_FADV_DONTNEED)
        buf = memoryview(mmap.mmap(-1, size))
        cpu = {"cold": 0.0, "hot": 0.0, "direct": 0.0}
        count = 0
        for off in range(4096, end - 2 * size, 2 * size)[:n]:
            for kind, f, at in (("cold", fd, off), ("hot", fd, off), ("direct", direct, off + size)):
                c = time.thread_time()
                os.preadv(f, [buf], at)
                cpu[kind] += time.thread_time() - c
            os.posix_fadvise(fd, off, size, os.POSIX_FADV_DONTNEED)
            count += 1
    finally:
        os.close(fd)
        os.close(direct)
    gb = count * size / 1e9
    return {f"{kind}_cpu_ms_per_gb": round(t / gb * 1e3) for kind, t in cpu.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("trace")
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--decode", type=positive_int, default=64)
    ap.add_argument("--reads", choices=("direct", "buffered", "both"), default="both",
                    help="the disk store's reads: O_DIRECT where the file allows (its default), buffered, "
                         "or both in turn (default)")
    ap.add_argument("--rounds", type=positive_int, default=1,
                    help="rounds of every configuration, in turn (default: 1)")
    ap.add_argument("--prefetch-width", type=float, default=1.0, help="as `bench cache` (default: 1.0)")
    ap.add_argument("--prefetch-min-prob", type=float, default=0.0, help="as `bench cache` (default: 0)")
    args = ap.parse_args(argv)
    try:
        return measure(args)
    except ExpertCacheError as e:
        print(f"prefetch_timeline: {e}", file=sys.stderr)
        return 2


def measure(args) -> int:
    timed(Decoder, "forward", "forward")
    timed_acquire()
    counted_alignment()
    watched_reads()
    spec = {"model": args.model, "threads": args.threads, "prefill": 64, "decode": args.decode, "ubatch": 512,
            "dtype": None, "policy": None, "route_trace": args.trace, "kernels": "native", "activations": "auto",
            "prefill_stretch": 4096, "prefill_mem": None, "prefetch_width": args.prefetch_width, "prefetch_min_prob": args.prefetch_min_prob, "device": "cpu", "mode": "cache",
            "store": "disk", "fraction": args.fraction}
    reads = ("direct", "buffered") if args.reads == "both" else (args.reads,)
    rows = []
    for rnd in range(args.rounds):
        for prefetch in ("off", "on"):
            for how in reads:
                DiskStore.direct = how == "direct"
                EVENTS.clear()
                QUEUED.clear()
                STARTS.clear()
                got = run_one({**spec, "prefetch": prefetch})
                rows.append({"round": rnd, "reads": how, "prefetch": prefetch,
                             "disk_gb_s": round(got["decode"]["copy_gb_s"], 3), **summarize(EVENTS, args.decode)})
    cols = ("ms", "disk_busy_ms", "wait_ms", "compute_ms", "rest_ms", "disk_idle_in_wait_ms",
            "disk_idle_in_compute_ms", "disk_idle_in_rest_ms", "disk_idle_queued_ms", "disk_idle_held_ms",
            "job_to_read_ms", "job_to_read_waiting_ms")
    heads = ("ms/token", "disk busy", "waits", "experts", "rest", "idle: waits", "idle: experts", "idle: rest",
             "idle, queued", "of it held", "job to read", "of it waiting")
    share = min(r["aligned_share"] for r in rows if r["reads"] == "direct") if "direct" in reads else None
    print(f"disk store, {args.threads} threads, {args.fraction:.0%} of the experts, per decoded token (ms)"
          + (f"; {share:.0%} of the reads page-aligned (direct where the store may)" if share is not None else ""))
    print(f"{'round':<6}{'reads':<9}{'prefetch':<9}{'GB/s':>6}" + "".join(f"{h:>14}" for h in heads))
    for row in rows:
        print(f"{row['round']:<6}{row['reads']:<9}{row['prefetch']:<9}{row['disk_gb_s']:>6.2f}"
              + "".join(f"{row[c]:>14.1f}" for c in cols))
    cost = read_cost(weights_file(args.model))
    if cost is None:
        print("the model's weights are under 18 MiB: too small to time a cold 9 MiB preadv")
    else:
        print(f"a cold 9 MiB preadv costs {cost['cold_cpu_ms_per_gb']} ms of CPU per GB, the copy from a hot "
              f"page cache {cost['hot_cpu_ms_per_gb']}, a cold read with O_DIRECT {cost['direct_cpu_ms_per_gb']}")
    print(json.dumps({"threads": args.threads, "fraction": args.fraction, "rows": rows, "read_cost": cost}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
