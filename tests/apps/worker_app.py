"""The Celery app that real `celery worker` subprocesses in the tests run.

Its Redis comes from the environment (CSL_REDIS_URL_BASE, e.g.
redis://127.0.0.1:PORT), with separate databases for broker (0), results (1)
and locks (2). Tasks record their execution intervals in Redis db 3 so the
tests can check that no two bodies with one key overlapped.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

from celery_singleton_lock import LockedTask

BASE = os.environ.get("CSL_REDIS_URL_BASE", "redis://127.0.0.1:6399")

app = Celery("worker_app", broker=f"{BASE}/0", backend=f"{BASE}/1")
app.conf.update(
    singleton_lock_url=f"{BASE}/2",
    singleton_lock_ttl=float(os.environ.get("CSL_LOCK_TTL", "5")),
    singleton_lock_retry_backoff=0.1,
    singleton_lock_retry_backoff_max=0.5,
    worker_prefetch_multiplier=1,
    task_acks_late=os.environ.get("CSL_ACKS_LATE") == "1",
    broker_transport_options={"visibility_timeout": float(os.environ.get("CSL_VISIBILITY", "3600"))},
    worker_max_tasks_per_child=int(os.environ.get("CSL_MAX_TASKS_PER_CHILD", "0")) or None,
)

journal = redis.Redis.from_url(f"{BASE}/3")


def record(name: str, key: str, start: float, end: float) -> None:
    """Append one execution interval (wall clock, same machine) to the journal."""
    journal.rpush(f"runs:{name}:{key}", f"{start}:{end}:{os.getpid()}")


@app.task(base=LockedTask, bind=True, lock_ttl=None)
def hold(self, key: str, seconds: float, tag: str = "") -> dict:
    """Hold the lock for ``seconds``, recording the interval and the fencing token."""
    start = time.time()
    journal.rpush(f"started:{key}", f"{self.request.id}:{os.getpid()}")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.02)
    lock = self.lock
    end = time.time()
    record("hold", key, start, end)
    return {"pid": os.getpid(), "fence": lock.fencing_token, "lost": lock.lost, "tag": tag}


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="retry")
def hold_retry(self, key: str, seconds: float, tag: str = "") -> dict:
    start = time.time()
    time.sleep(seconds)
    record("hold_retry", key, start, time.time())
    return {"pid": os.getpid(), "tag": tag}


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="skip")
def hold_skip(self, key: str, seconds: float, tag: str = "") -> dict:
    start = time.time()
    time.sleep(seconds)
    record("hold_skip", key, start, time.time())
    return {"pid": os.getpid(), "tag": tag}


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="raise")
def hold_raise(self, key: str, seconds: float, tag: str = "") -> dict:
    start = time.time()
    time.sleep(seconds)
    record("hold_raise", key, start, time.time())
    return {"pid": os.getpid(), "tag": tag}


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="skip")
def watchdog_hold(self, key: str, seconds: float, tag: str = "") -> dict:
    """For tests/test_watchdog_workers.py: hold the lock ``seconds`` (I/O-style sleeps, so it
    also suits gevent/eventlet), then insist it was never lost. Records its interval."""
    start = time.time()
    journal.rpush(f"started:watchdog_hold:{key}", f"{self.request.id}:{os.getpid()}")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
    self.lock.ensure()  # raises LockLost if the watchdog could not keep it
    record("watchdog_hold", key, start, time.time())
    return {"pid": os.getpid(), "lost": self.lock.lost, "fence": self.lock.fencing_token, "tag": tag}


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="skip")
def watchdog_busy(self, key: str, seconds: float) -> dict:
    """For tests/test_watchdog_workers.py: CPU-bound, never yields. Under gevent/eventlet it
    starves the watchdog greenlet (the documented limit); the loss must still be reported."""
    deadline = time.monotonic() + seconds
    spins = 0
    while time.monotonic() < deadline:
        spins += 1
    return {"pid": os.getpid(), "lost": self.lock.lost, "spins": spins}


# -- for tests/test_task_*.py (LockedTask exit paths, crashes, redelivery) -------------------


def _journal_event(key: str, event: str, task, **extra) -> None:
    import json

    lock = task.lock
    journal.rpush(f"journaled:{key}", json.dumps({
        "event": event, "id": task.request.id, "pid": os.getpid(), "at": time.time(),
        "fence": lock.fencing_token if lock is not None else None, **extra,
    }))


@app.task(base=LockedTask, bind=True, lock_key=["key"])
def journaled(self, key: str, seconds: float = 0.0, tag: str = "") -> dict:
    """Journal start and end (task id, pid, fencing token) under journaled:<key>; hold ``seconds``."""
    _journal_event(key, "start", self, tag=tag)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.02)
    _journal_event(key, "end", self, tag=tag)
    return {"pid": os.getpid(), "tag": tag, "fence": self.lock.fencing_token}


@app.task(base=LockedTask, bind=True, lock_key=["key"], lock_ttl=60, soft_time_limit=1, time_limit=30)
def soft_limited(self, key: str) -> None:
    """Runs into its soft time limit (SoftTimeLimitExceeded, prefork only). A long lock_ttl:
    only the release can free the key soon."""
    _journal_event(key, "start", self)
    deadline = time.monotonic() + 25
    while time.monotonic() < deadline:
        time.sleep(0.02)


class _FailureJournaledTask(LockedTask):
    """Journals what on_failure sees: after a hard time limit it runs in the MAIN process,
    with an empty request (no lock handle, no id)."""

    def on_failure(self, exc, task_id, args, kwargs, einfo):
        import json

        journal.rpush("on_failure", json.dumps({
            "task_id": task_id, "request_id": self.request.id, "lock": repr(self.lock),
            "pid": os.getpid(), "exc": type(exc).__name__,
        }))


@app.task(base=_FailureJournaledTask, bind=True, lock_key=["key"], time_limit=1)
def hard_limited(self, key: str) -> None:
    """Runs into its hard time limit: the child is killed; the lock expires with its ttl."""
    _journal_event(key, "start", self)
    deadline = time.monotonic() + 25
    while time.monotonic() < deadline:
        time.sleep(0.02)


def _wait_gate(key: str, limit: float = 60.0) -> None:
    """Wait until the test sets gate:<key> in the journal (at most ``limit`` seconds)."""
    deadline = time.monotonic() + limit
    while not journal.exists(f"gate:{key}") and time.monotonic() < deadline:
        time.sleep(0.02)


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="skip")
def gated_skip(self, key: str, tag: str = "", gate: bool = False) -> dict:
    """With ``gate``, hold the lock until the test opens gate:<key>; records its interval."""
    start = time.time()
    if gate:
        _wait_gate(key)
    record("gated_skip", key, start, time.time())
    return {"pid": os.getpid(), "tag": tag}


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="raise")
def gated_raise(self, key: str, tag: str = "", gate: bool = False) -> dict:
    """As gated_skip, with on_duplicate="raise"."""
    start = time.time()
    if gate:
        _wait_gate(key)
    record("gated_raise", key, start, time.time())
    return {"pid": os.getpid(), "tag": tag}
