"""The hand-off tests' shared helpers (tests/line/test_handoff*.py): the workers' settings and the
slack their bounds allow, each body's journaled interval, and the latencies and notes they print."""

from __future__ import annotations

import math
import statistics

from _line_support import events

from celery_singleton_lock.engine.line import SWEEP_INTERVAL

LOCK_TTL = 3.0  # the workers' singleton_lock_ttl here (CSL_LOCK_TTL)
SWEEP_LATE = SWEEP_INTERVAL * 1.25  # the sweeper's longest pause between two looks (jittered +-25%)
FEW = 5.0  # "a few seconds": slack for a loaded two-core machine on top of every bound below
WORKER_ENV = {"CSL_LOCK_TTL": str(LOCK_TTL), "CSL_JOURNAL_HANDOFF": "1"}


def intervals(wa, k: str, without: str | None = None) -> dict[str, tuple[float, float]]:
    """task id -> (start, end) of its body's last run, for every id but ``without`` (a holder that was
    killed mid-body). A body with no journaled start or end fails here: it cannot be checked for overlap."""
    out: dict[str, list[float | None]] = {}
    for e in events(wa, k):
        if e["id"] != without:
            out.setdefault(e["id"], [None, None])[0 if e["event"] == "start" else 1] = e["at"]
    missing = [i for i, (s, e) in out.items() if s is None or e is None]
    assert not missing, f"bodies of {k} without a journaled start or end: {missing}"
    return {i: (s, e) for i, (s, e) in out.items()}  # type: ignore[misc]


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def report(capsys, what: str, samples: list[float]) -> None:
    with capsys.disabled():
        print(
            f"\n[hand-off latency] {what}: n={len(samples)} p50={percentile(samples, 50) * 1000:.1f} ms "
            f"p99={percentile(samples, 99) * 1000:.1f} ms max={max(samples) * 1000:.1f} ms "
            f"mean={statistics.mean(samples) * 1000:.1f} ms"
        )


def note(capsys, text: str) -> None:
    """A measurement for the record (printed even under -q; never asserted beyond its bound)."""
    with capsys.disabled():
        print(f"\n[handoff] {text}")
