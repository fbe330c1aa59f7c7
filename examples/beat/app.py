"""A periodic task every second whose run takes three seconds, with and without LockedTask.

Celery beat sends ``beat.report_locked`` and ``beat.report_plain`` every
second. Each run takes three seconds, so without a lock runs pile up and
overlap (the plain task); with ``base=LockedTask, on_duplicate="skip"`` a tick
that finds the previous run still going is skipped, and runs never overlap.

Each run appends its interval (wall clock start:end) to a Redis list, and
every skipped tick increments a counter, so ``demo.py`` can show both.

Everything lives on one Redis, given as a base URL without a database number
in ``$BEAT_REDIS_URL`` (``demo.py`` starts a private one and sets it): db 0
broker, db 1 results, db 2 locks, db 3 the recorded runs.

    BEAT_REDIS_URL=redis://127.0.0.1:6390 celery -A app worker -B -c 6
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

from celery_singleton_lock import LockedTask, duplicate_skipped

BASE = os.environ.get("BEAT_REDIS_URL", "").rstrip("/")
if not BASE:
    raise RuntimeError(
        "set BEAT_REDIS_URL to a Redis of your own without a database number, "
        "e.g. redis://127.0.0.1:6390 (examples/beat/demo.py starts a private one and sets it)"
    )

EVERY = 1.0  # seconds between ticks
RUN = 3.0  # seconds one run takes

app = Celery("beat_demo", broker=f"{BASE}/0", backend=f"{BASE}/1")
app.conf.update(
    singleton_lock_url=f"{BASE}/2",
    singleton_lock_ttl=10,
    broker_connection_retry_on_startup=True,
    task_ignore_result=True,
    beat_schedule={
        "report-locked": {"task": "beat.report_locked", "schedule": EVERY},
        "report-plain": {"task": "beat.report_plain", "schedule": EVERY},
    },
)

journal = redis.Redis.from_url(f"{BASE}/3", decode_responses=True)


def report(kind: str) -> None:
    """The periodic job: three seconds of work, then record when it ran."""
    start = time.time()
    time.sleep(RUN)
    journal.rpush(f"runs:{kind}", f"{start}:{time.time()}")


@app.task(name="beat.report_locked", base=LockedTask, on_duplicate="skip")
def report_locked() -> None:
    report("locked")


@app.task(name="beat.report_plain")
def report_plain() -> None:
    report("plain")


@duplicate_skipped.connect
def count_skipped(sender=None, policy=None, **_):
    journal.incr(f"duplicates:{policy}")
