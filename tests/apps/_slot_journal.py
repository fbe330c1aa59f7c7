"""What tests/apps/slot_faults_app.py and slot_failover_app.py share: the journal their bodies write
(db 3 of CSL_REDIS_URL_BASE), so the tests count runs per call and check that no two bodies of one key
overlapped. Each body journals its start and end (id, tag, pid, fence, our headers); every delivery of
a locked task is journaled too, before its lock is tried (:func:`journal_deliveries`)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery.signals import task_prerun

from celery_singleton_lock import LockedTask
from celery_singleton_lock.delivery.headers import described


def headers_of(task: Any) -> dict:
    """This delivery's headers of ours, without the prefix (and without parked_at, a time)."""
    return {k: v for k, v in described(task.request.headers).items() if k != "parked_at"}


def run_body(journal: redis.Redis, task: Any, key: str, seconds: float, tag: str, gate: str = "") -> dict:
    """A body of ``seconds``, journaled; ``gate``: then hold on until the journal has that key (the test
    decides when the body ends), at most 60 s."""
    start = time.time()
    lock = task.lock
    journal.rpush(f"started:{key}", json.dumps({"id": task.request.id, "tag": tag, "pid": os.getpid(),
                                                "at": start, "headers": headers_of(task),
                                                "fence": lock.fencing_token if lock else None}))
    time.sleep(seconds)
    if gate:
        deadline = time.monotonic() + 60
        while not journal.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.005)
    end = time.time()
    journal.rpush(f"runs:{key}", json.dumps({"id": task.request.id, "tag": tag, "start": start, "end": end,
                                             "pid": os.getpid(), "headers": headers_of(task),
                                             "lost": bool(lock and lock.lost)}))
    return {"tag": tag, "pid": os.getpid()}


def journal_deliveries(journal: redis.Redis) -> None:
    """Journal every delivery of a locked task before its lock is tried: which message, when, with what
    headers (``delivered:<key>``)."""

    def journal_delivery(task_id: str = "", task: Any = None, args: Any = (), kwargs: Any = None, **_: Any) -> None:
        if not isinstance(task, LockedTask):
            return
        key = (kwargs or {}).get("key") or (args[0] if args else None)
        tag = (kwargs or {}).get("tag") or (args[2] if len(args) > 2 else "")
        journal.rpush(f"delivered:{key}", json.dumps({"id": task_id, "tag": tag, "at": time.time(),
                                                      "pid": os.getpid(), "headers": headers_of(task)}))

    task_prerun.connect(journal_delivery, weak=False)
