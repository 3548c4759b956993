"""tools/prefetch_timeline.py: each idle gap of the disk is put down to what was queued when the
read just before it ended, on a hand-made timeline (a clock the test moves, no real reads)."""

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import prefetch_timeline as pt  # noqa: E402
from expertcache.tiers import transfer  # noqa: E402
from expertcache.tiers.store import DiskStore  # noqa: E402


def test_an_idle_gap_is_put_down_to_the_read_just_before_it(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(pt, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    worker = SimpleNamespace(_queue=[], _demand=0)
    # Three reads of 1 s: at 0, 3 and 7. The first ends with a job queued (and the worker held back
    # by a demand copy), the second with nothing queued, so only the 2 s gap after the first is
    # idle time with work queued; the 3 s gap after the second is not.
    reads = iter([(0.0, 1.0, ["job"], 1), (3.0, 4.0, [], 0), (7.0, 8.0, [], 0)])

    def fake_read(self, seg, targets):
        start, end, queue, demand = next(reads)
        assert now[0] == start
        now[0] = end
        worker._queue, worker._demand = queue, demand

    monkeypatch.setattr(DiskStore, "_read", fake_read)
    monkeypatch.setattr(transfer.CopyWorker, "__init__", transfer.CopyWorker.__init__)
    monkeypatch.setattr(pt, "EVENTS", [])
    monkeypatch.setattr(pt, "QUEUED", [])
    monkeypatch.setattr(pt, "WORKERS", [worker])
    pt.watched_reads()
    for start in (0.0, 3.0, 7.0):
        now[0] = start
        DiskStore._read(None, None, None)
    pt.EVENTS.append(("forward", 0.0, 10.0))  # one decoded token

    row = pt.summarize(pt.EVENTS, tokens=1)
    assert row["ms"] == 10_000
    assert row["disk_busy_ms"] == 3_000
    assert row["disk_idle_queued_ms"] == 2_000
    assert row["disk_idle_held_ms"] == 2_000
