"""tools/prefetch_timeline.py: each idle gap of the disk is put down to what was queued when the
read just before it ended, and a copy job's time to its first read is split into CPU time and
waiting, on a hand-made timeline (clocks the test moves, no real reads)."""

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import prefetch_timeline as pt  # noqa: E402
from expertcache.tiers import transfer  # noqa: E402
from expertcache.tiers.cache import ExpertCache  # noqa: E402
from expertcache.tiers.store import DiskStore  # noqa: E402


def test_idle_gaps_and_a_jobs_wait_for_its_read(monkeypatch):
    wall, cpu = [0.0], [0.0]
    monkeypatch.setattr(pt, "time", SimpleNamespace(perf_counter=lambda: wall[0], thread_time=lambda: cpu[0]))
    worker = SimpleNamespace(_queue=[], _demand=0)
    # Three reads of 1 s: at 0, 3 and 7. The first ends with a job queued (and the worker held back
    # by a demand copy), the second with nothing queued, so only the 2 s gap after the first is
    # idle time with work queued; the 3 s gap after the second is not.
    reads = iter([(0.0, 1.0, ["job"], 1), (3.0, 4.0, [], 0), (7.0, 8.0, [], 0)])

    def fake_read(self, seg, targets):
        start, end, queue, demand = next(reads)
        assert wall[0] == start
        wall[0] = end
        worker._queue, worker._demand = queue, demand

    def fake_run_job(self, job):
        # The second read is a copy job's, started at 2 s: 1 s to its read, 0.25 s of it on a core.
        wall[0], cpu[0] = 3.0, cpu[0] + 0.25
        DiskStore._read(None, None, None)

    for cls, name, value in ((DiskStore, "_read", fake_read), (ExpertCache, "_run_job", fake_run_job),
                             (transfer.CopyWorker, "__init__", transfer.CopyWorker.__init__)):
        monkeypatch.setattr(cls, name, value)
    for name in ("EVENTS", "QUEUED", "STARTS"):
        monkeypatch.setattr(pt, name, [])
    monkeypatch.setattr(pt, "WORKERS", [worker])
    pt.watched_reads()
    DiskStore._read(None, None, None)
    wall[0] = 2.0
    ExpertCache._run_job(None, None)
    wall[0] = 7.0
    DiskStore._read(None, None, None)
    pt.EVENTS.append(("forward", 0.0, 10.0))  # one decoded token

    row = pt.summarize(pt.EVENTS, tokens=1)
    assert row["ms"] == 10_000
    assert row["disk_busy_ms"] == 3_000
    assert row["disk_idle_queued_ms"] == 2_000
    assert row["disk_idle_held_ms"] == 2_000
    assert row["job_to_read_ms"] == 1_000
    assert row["job_to_read_waiting_ms"] == 750
