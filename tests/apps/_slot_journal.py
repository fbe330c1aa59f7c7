"""What tests/apps/slot_faults_app.py and slot_failover_app.py share: their app's settings
(:func:`slot_app`), and the journal their bodies write (db 3 of CSL_REDIS_URL_BASE), so the tests count
runs per call and check that no two bodies of one key overlapped. Each body journals its start and end
(id, tag, pid, fence, our headers); every delivery of a locked task is journaled too, before its lock is
tried (:func:`journal_deliveries`)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
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


def slot_app(name: str, **conf: Any) -> tuple[Celery, redis.Redis]:
    """The app ``name`` and its journal. Broker (db 0), results (db 1) and the journal (db 3) on
    CSL_REDIS_URL_BASE; the locks at CSL_LOCK_URL (db 2 of that server unless set); one message
    prefetched at a time, results kept, kombu restoring unacked messages every second; ``conf`` on top
    (the lock TTL and back-offs). Every delivery of a locked task is journaled."""
    base = os.environ.get("CSL_REDIS_URL_BASE", "redis://127.0.0.1:6399")
    app = Celery(name, broker=f"{base}/0", backend=f"{base}/1")
    app.conf.update(
        singleton_lock_url=os.environ.get("CSL_LOCK_URL", f"{base}/2"),
        singleton_lock_retry_backoff_max=1.0,
        worker_prefetch_multiplier=1,
        result_expires=None,
        broker_transport_options={"unacked_restore_interval": 1, "unacked_restore_throttle": 1,
                                  "visibility_timeout": 3600},
        **conf,
    )
    journal = redis.Redis.from_url(f"{base}/3")
    journal_deliveries(journal)
    return app, journal
