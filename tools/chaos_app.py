"""The app that tools/line_chaos.py's workers run: an inventory deduction that waits in line, a
read that a running one makes pointless (skipped), a refresh whose duplicates coalesce into one
follow-up run, and a restock whose duplicate publishes join the call already published.

Broker and results on one private Redis (``CSL_CHAOS_BROKER``, dbs 0 and 1), the lock on
ANOTHER private Redis (``CSL_CHAOS_LOCK``) so that the chaos can flush or restart the lock
Redis without touching the broker. Every body writes its start and end to a journal in the
broker Redis (db 3), which survives the lock Redis's losses.
"""

from __future__ import annotations

import os
import random
import time

import redis
from celery import Celery

from celery_singleton_lock import LockedTask, LockLost

BROKER = os.environ.get("CSL_CHAOS_BROKER", "redis://127.0.0.1:6399")
LOCK = os.environ.get("CSL_CHAOS_LOCK", "redis://127.0.0.1:6398")

app = Celery("chaos_app", broker=f"{BROKER}/0", backend=f"{BROKER}/1")
app.conf.update(
    singleton_lock_url=f"{LOCK}/0",
    singleton_lock_ttl=float(os.environ.get("CSL_CHAOS_TTL", "3")),
    singleton_lock_max_wait=600,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    broker_transport_options={"visibility_timeout": 8, "unacked_restore_interval": 1, "unacked_restore_throttle": 1},
    result_expires=None,
)

journal = redis.Redis.from_url(f"{BROKER}/3")


def fence_of(task) -> object:
    """The running lock's fencing token; "lost" when the lock was lost before it was first read (a fresh
    task's token is drawn then): the lock Redis lost its data right after the take. The body goes on,
    as a body that never reads the token would (the loss is reported, and counted apart)."""
    try:
        return task.lock.fencing_token
    except LockLost:
        return "lost"


@app.task(base=LockedTask, bind=True, lock_key=["sku"], on_duplicate="retry")
def deduct(self, sku: str, order: str, body_ms: int = 40) -> str:
    journal.rpush(f"start:{sku}", f"{order} {time.time()} {os.getpid()} {fence_of(self)}")
    time.sleep(body_ms / 1000 * random.uniform(0.5, 1.5))
    journal.rpush(f"end:{sku}", f"{order} {time.time()} {os.getpid()}")
    journal.hincrby("done", order, 1)
    return order


@app.task(base=LockedTask, bind=True, lock_key=["sku"], on_duplicate="skip")
def peek(self, sku: str, order: str, body_ms: int = 20) -> str:
    """A read of the SKU that a running one makes pointless: a duplicate is skipped (REVOKED). Its lock
    is its own (the key names the task), so its bodies are journalled apart from deduct's."""
    journal.rpush(f"start:{sku}:peek", f"{order} {time.time()} {os.getpid()} {fence_of(self)}")
    time.sleep(body_ms / 1000 * random.uniform(0.5, 1.5))
    journal.rpush(f"end:{sku}:peek", f"{order} {time.time()} {os.getpid()}")
    journal.hincrby("done", order, 1)
    return order


def _journalled(task, kind: str, sku: str, order: str, body_ms: int) -> list[str]:
    """A body journalled under its task id, not its ``order``: a coalescing run runs with the arguments
    of the latest call merged into it, so ``order`` may be another call's. Returns [its task id, the
    order it ran with], which is also the result of every call it covered."""
    run = task.request.id
    journal.rpush(f"start:{sku}:{kind}", f"{run} {time.time()} {os.getpid()} {fence_of(task)}")
    time.sleep(body_ms / 1000 * random.uniform(0.5, 1.5))
    journal.rpush(f"end:{sku}:{kind}", f"{run} {time.time()} {os.getpid()}")
    journal.hincrby("done", run, 1)
    return [run, order]


@app.task(base=LockedTask, bind=True, lock_key=["sku"], on_duplicate="coalesce")
def refresh(self, sku: str, order: str, body_ms: int = 40) -> list[str]:
    """Refresh work: duplicates that come while one waits merge into it, and share its result."""
    return _journalled(self, "refresh", sku, order, body_ms)


@app.task(base=LockedTask, bind=True, lock_key=["sku"], on_duplicate="retry", lock_publish="join")
def restock(self, sku: str, order: str, body_ms: int = 40) -> list[str]:
    """Published with ``delay()``: a publish while the SKU has a call queued, waiting or running
    returns that call's AsyncResult (its task id is not ours to choose)."""
    return _journalled(self, "restock", sku, order, body_ms)


@app.task
def filler(ms: int = 5) -> None:
    """Other work in the same queue: the backlog a busy production queue has."""
    time.sleep(ms / 1000)
