#!/usr/bin/env python3
"""The beat demo: a task sent every second whose run takes three seconds.

    .venv/bin/python examples/beat/demo.py    # from the repository root

It starts a private redis-server (free loopback port, no persistence) and one
``celery worker -B`` (embedded beat, prefork, 6 processes), watches for about
ten seconds, stops the worker (a warm shutdown lets running runs finish), and
prints the recorded runs: the plain task's runs pile up and overlap; the
LockedTask's never do, the ticks that found a run still going being skipped.
Exits 1 if two LockedTask runs overlapped. Worker and Redis are stopped by PID.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from celery_singleton_lock.testing.servers import RedisServer, WorkerProcess

HERE = Path(__file__).resolve().parent
WATCH = 10.0  # seconds


def intervals(journal, kind: str) -> list[tuple[float, float]]:
    runs = [tuple(float(x) for x in item.split(":")) for item in journal.lrange(f"runs:{kind}", 0, -1)]
    return sorted(runs)


def most_at_once(runs: list[tuple[float, float]]) -> int:
    """The largest number of runs in progress at one instant."""
    events = sorted([(s, 1) for s, _ in runs] + [(e, -1) for _, e in runs])
    now = best = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def overlaps(runs: list[tuple[float, float]]) -> int:
    """How many runs started before an earlier run had ended (runs sorted by start)."""
    count, ended = 0, float("-inf")
    for start, end in runs:
        count += start < ended
        ended = max(ended, end)
    return count


def main() -> int:
    tmp = tempfile.mkdtemp(prefix="beat-demo-")
    server = RedisServer()
    worker: WorkerProcess | None = None
    crashed = False
    try:
        server.start()
        base = f"redis://127.0.0.1:{server.port}"
        worker = WorkerProcess(
            "app", pool="prefork", concurrency=6, name="beat@%h", env={"BEAT_REDIS_URL": base}, cwd=HERE,
            extra=["-B", "--schedule", os.path.join(tmp, "schedule")], logfile=os.path.join(tmp, "worker.log"),
        )
        t0 = time.time()
        worker.start().wait_ready(timeout=20)
        print(f"worker with embedded beat up (private redis-server on port {server.port}); watching {WATCH:g} s ...",
              flush=True)
        time.sleep(WATCH)
        worker.stop()  # warm shutdown: runs in progress finish and are recorded

        os.environ["BEAT_REDIS_URL"] = base
        sys.path.insert(0, str(HERE))
        import app as beat

        print(f"\nbeat sends both tasks every {beat.EVERY:g} s; a run takes {beat.RUN:g} s "
              "(times in seconds since the worker started)\n")
        locked, plain = intervals(beat.journal, "locked"), intervals(beat.journal, "plain")
        skipped = int(beat.journal.get("duplicates:skip") or 0)
        print('LockedTask, on_duplicate="skip":')
        for start, end in locked:
            print(f"  run {start - t0:5.2f} -> {end - t0:5.2f}")
        bad = overlaps(locked)
        print(f"  {len(locked)} runs, {skipped} ticks skipped, at most {most_at_once(locked)} at once, "
              f"{bad} overlapping")
        print("plain task, same body:")
        print(f"  {len(plain)} runs, at most {most_at_once(plain)} at once, {overlaps(plain)} overlapping")
        print()
        if bad:
            print(f"RESULT: {bad} LockedTask runs OVERLAPPED")
            return 1
        if len(locked) < 2:
            print(f"RESULT: only {len(locked)} LockedTask run recorded; too few to show anything")
            return 1
        print("RESULT: LockedTask runs never overlapped")
        return 0
    except Exception as exc:
        crashed = True
        print(f"\ndemo failed: {type(exc).__name__}: {exc}")
        return 1
    finally:
        if worker is not None:
            worker.stop()
            if crashed:
                print(f"--- last lines of the worker's log:\n{worker.log()[-3000:]}")
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(server.dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
