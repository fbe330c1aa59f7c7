"""The app that tests/features/test_dedupe.py's real ``celery worker`` subprocesses run: the dedupe
options (lock_publish, coalesce, lock_cooldown).

Its Redis comes from CSL_REDIS_URL_BASE: broker db 0, results db 1, locks db 2, and a journal
in db 3 where bodies record what they ran with (start, end, arguments), so the tests can count
runs and check that no two bodies of one key overlapped.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery

from celery_singleton_lock import LockedTask
from celery_singleton_lock.delivery.headers import described
from celery_singleton_lock.engine.sweeper import get_sweeper

BASE = os.environ.get("CSL_REDIS_URL_BASE", "redis://127.0.0.1:6399")

app = Celery("dedupe_app", broker=f"{BASE}/0", backend=f"{BASE}/1")
app.conf.update(
    singleton_lock_url=f"{BASE}/2",
    singleton_lock_ttl=5.0,
    worker_prefetch_multiplier=1,
    result_expires=None,
)

journal = redis.Redis.from_url(f"{BASE}/3")


def _run(task, key: str, seconds: float, tag: str) -> dict:
    start = time.time()
    journal.rpush(f"started:{key}", json.dumps({"id": task.request.id, "tag": tag}))
    time.sleep(seconds)
    end = time.time()
    journal.rpush(f"runs:{key}", json.dumps({"id": task.request.id, "tag": tag, "start": start, "end": end,
                                               "pid": os.getpid()}))
    return {"tag": tag, "pid": os.getpid()}


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="coalesce")
def refresh(self, key: str, seconds: float = 0.0, tag: str = "") -> dict:
    """Refresh work: a burst of calls while one runs makes ONE more run, with the latest tag."""
    return _run(self, key, seconds, tag)


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="coalesce")
def refresh_fails(self, key: str, seconds: float = 0.0, tag: str = "") -> dict:
    """As refresh, but a run tagged "boom" fails."""
    result = _run(self, key, seconds, tag)
    if tag == "boom":
        raise ValueError(f"boom for {key}")
    return result


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="skip", lock_cooldown=2.0)
def cool_skip(self, key: str, seconds: float = 0.0, tag: str = "") -> dict:
    return _run(self, key, seconds, tag)


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="retry", lock_cooldown=2.0)
def cool_retry(self, key: str, seconds: float = 0.0, tag: str = "") -> dict:
    return _run(self, key, seconds, tag)


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="coalesce", lock_cooldown=2.0)
def cool_coalesce(self, key: str, seconds: float = 0.0, tag: str = "") -> dict:
    return _run(self, key, seconds, tag)


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="skip", lock_cooldown=2.0)
def cool_fails(self, key: str, tag: str = "") -> dict:
    """Always fails: no cooldown after it (lock_cooldown_on_failure is off)."""
    _run(self, key, 0.0, tag)
    raise ValueError("fails")


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="skip", lock_publish="join")
def joined(self, key: str, seconds: float = 0.0, tag: str = "") -> dict:
    return _run(self, key, seconds, tag)


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="skip", lock_publish="raise",
          lock_publish_ttl=2.0)
def refused(self, key: str, seconds: float = 0.0, tag: str = "") -> dict:
    return _run(self, key, seconds, tag)


@app.task
def echo_tag(result: dict, to: str) -> dict:
    """A link or chain step after a coalesced call: journals that it fired, and for which call."""
    journal.rpush(f"links:{to}", json.dumps(result))
    return result


@app.task
def errback_log(request, exc, traceback) -> None:
    journal.rpush("errbacks", json.dumps({"id": request.id, "exc": type(exc).__name__}))


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="retry", lock_wait_in_slot=5.0)
def in_slot_long(self, key: str, seconds: float = 0.0, tag: str = "") -> dict:
    """As in_slot, waiting up to 5 s in its worker slot (longer than a third of the 5 s TTL): journals
    whether its call was sent again (the header that counts those sends)."""
    result = _run(self, key, seconds, tag)
    journal.rpush(f"sent-again:{key}", json.dumps({"tag": tag, "sent_again": described(
        self.request.headers).get("unreachable")}))
    return result


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="retry", lock_wait_in_slot=1.0)
def in_slot(self, key: str, seconds: float = 0.0, tag: str = "") -> dict:
    """A "retry" duplicate first waits up to 1 s in its worker slot: journals whether it came as a turn."""
    result = _run(self, key, seconds, tag)
    journal.rpush(f"entries:{key}", json.dumps({"tag": tag, "entry": described(
        self.request.headers).get("entry"), "kept": sorted(get_sweeper().kept_entries())}))
    return result
