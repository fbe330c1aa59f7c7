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

from apps import worker_settings  # the app's settings, from the environment the tests set
from celery_singleton_lock import LockedTask
from celery_singleton_lock.delivery.headers import described

BASE = os.environ.get("CSL_REDIS_URL_BASE", "redis://127.0.0.1:6399")

app = Celery("worker_app", broker=f"{BASE}/0", backend=f"{BASE}/1")
worker_settings.base(app, BASE)

journal = redis.Redis.from_url(f"{BASE}/3")

from apps import kill_points  # noqa: E402 - the crash tests' kill points (CSL_TEST_KILL_AT), if asked

kill_points.install()


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


def sleep_recorded(name: str, key: str, seconds: float, tag: str) -> dict:
    """Sleep ``seconds``, record the interval under ``name``; the pid and the tag."""
    start = time.time()
    time.sleep(seconds)
    record(name, key, start, time.time())
    return {"pid": os.getpid(), "tag": tag}


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="retry")
def hold_retry(self, key: str, seconds: float, tag: str = "") -> dict:
    return sleep_recorded("hold_retry", key, seconds, tag)


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="skip")
def hold_skip(self, key: str, seconds: float, tag: str = "") -> dict:
    return sleep_recorded("hold_skip", key, seconds, tag)


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="raise")
def hold_raise(self, key: str, seconds: float, tag: str = "") -> dict:
    return sleep_recorded("hold_raise", key, seconds, tag)


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="skip")
def watchdog_hold(self, key: str, seconds: float, tag: str = "") -> dict:
    """For tests/task/test_watchdog_workers.py: hold the lock ``seconds`` (I/O-style sleeps, so it
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
    """For tests/task/test_watchdog_workers.py: CPU-bound, never yields. Under gevent/eventlet it
    starves the watchdog greenlet (the documented limit); the loss must still be reported."""
    deadline = time.monotonic() + seconds
    spins = 0
    while time.monotonic() < deadline:
        spins += 1
    return {"pid": os.getpid(), "lost": self.lock.lost, "spins": spins}


# -- for tests/task/test_task_*.py (LockedTask exit paths, crashes, redelivery) ----------------


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


def _gated(name: str, key: str, tag: str, gate: bool) -> dict:
    """With ``gate``, hold on until the test opens gate:<key>; records the interval as ``name``'s."""
    start = time.time()
    if gate:
        _wait_gate(key)
    record(name, key, start, time.time())
    return {"pid": os.getpid(), "tag": tag}


def _journaled_gate(task, key: str, tag: str, gate: bool) -> None:
    """Journal start and end under journaled:<key>; with ``gate``, hold on until gate:<key> in between."""
    _journal_event(key, "start", task, tag=tag)
    if gate:
        _wait_gate(key)
    _journal_event(key, "end", task, tag=tag)


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="skip")
def gated_skip(self, key: str, tag: str = "", gate: bool = False) -> dict:
    """With ``gate``, hold the lock until the test opens gate:<key>; records its interval."""
    return _gated("gated_skip", key, tag, gate)


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="raise")
def gated_raise(self, key: str, tag: str = "", gate: bool = False) -> dict:
    """As gated_skip, with on_duplicate="raise"."""
    return _gated("gated_raise", key, tag, gate)


# -- for tests/line/test_handoff.py (the FIFO line and its hand-offs) --------------------------

if os.environ.get("CSL_LOCK_URL"):
    # the locks on a Redis of their own (a lock-Redis restart must not take the broker with it)
    app.conf.singleton_lock_url = os.environ["CSL_LOCK_URL"]


if os.environ.get("CSL_JOURNAL_HANDOFF") == "1":
    # Every publish and every park made in a worker, journaled, so a test can count them:
    # a waiter must park ONCE and be sent ONCE when its turn comes (no re-sends, no polling).
    import json as _json

    from celery.signals import before_task_publish

    from celery_singleton_lock.signals import duplicate_skipped

    @before_task_publish.connect(weak=False)
    def _journal_publish(sender=None, headers=None, **_):
        headers = headers or {}
        journal.rpush("handoff:publishes", _json.dumps({
            "id": headers.get("id"), "task": sender, "pid": os.getpid(), "at": time.time(),
            **{f"singleton_lock_{k}": v for k, v in described(headers).items()},
        }))

    @duplicate_skipped.connect(weak=False)
    def _journal_park(sender=None, key=None, task_id=None, holder_task_id=None, policy=None, **_):
        journal.rpush("handoff:parks", _json.dumps({
            "id": task_id, "key": key, "holder": holder_task_id, "policy": policy, "pid": os.getpid(),
            "at": time.time(),
        }))


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="retry")
def in_line(self, key: str, seconds: float = 0.0, tag: str = "", gate: bool = False) -> dict:
    """Waits its turn in the key's line; journals start and end under journaled:<key>. With
    ``gate``, holds until the test sets gate:<key>."""
    _journal_event(key, "start", self, tag=tag, entry=described(self.request.headers).get("entry"))
    if gate:
        _wait_gate(key)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.01)
    lost = self.lock.lost
    _journal_event(key, "end", self, tag=tag, lost=lost)
    return {"pid": os.getpid(), "tag": tag, "fence": self.lock.fencing_token, "lost": lost}


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="retry", lock_max_wait=2.0)
def in_line_short_wait(self, key: str, tag: str = "", gate: bool = False) -> dict:
    """As in_line, but a waiter gives up after 2 s in line (LockWaitTimeout)."""
    _journaled_gate(self, key, tag, gate)
    return {"pid": os.getpid(), "tag": tag}


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="retry")
def in_line_append(self, prev: list, key: str, tag: str, gate: bool = False) -> list:
    """For chains and chords: ``prev + [tag]``, under the key's lock, waiting its turn."""
    _journaled_gate(self, key, tag, gate)
    return [*prev, tag]


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="retry")
def in_line_gated(self, key: str, tag: str) -> dict:
    """As in_line, each call held until the test opens gate:<key>:<tag> (journals under journaled:<key>)."""
    _journal_event(key, "start", self, tag=tag, redelivered=bool((self.request.delivery_info or {}).get("redelivered")))
    _wait_gate(f"{key}:{tag}")
    _journal_event(key, "end", self, tag=tag)
    return {"pid": os.getpid(), "tag": tag}


@app.task
def plain_append(prev: list, tag: str) -> list:
    """No lock: a chain's other links."""
    return [*prev, tag]


@app.task
def collect(results: list) -> list:
    """A chord's body: what the header gave it."""
    return results


@app.task
def errback_journal(request, exc, traceback) -> None:
    """A link_error: journals which task failed and with what (runs in the failing worker)."""
    import json

    journal.rpush("handoff:errbacks", json.dumps({"id": request.id, "exc": type(exc).__name__, "msg": str(exc)}))


# -- for tests/task/test_task_faults.py --------------------------------------------------------

from celery.signals import task_prerun  # noqa: E402 - this section is appended for one test module

from celery_singleton_lock import LockLost, lock_lost  # noqa: E402


@lock_lost.connect(weak=False)
def _journal_lock_lost(sender=None, key=None, task_id=None, reason=None, **_) -> None:
    """Every lock_lost signal of this worker, under lost_signal:<task id>: the test counts them."""
    import json

    journal.rpush(f"lost_signal:{task_id}", json.dumps({"key": key, "reason": reason, "pid": os.getpid()}))


@app.task(base=LockedTask, bind=True, lock_key=["key"], lock_ttl=2, on_duplicate="skip")
def lost_probe(self, key: str, tag: str) -> dict:
    """Tag "stopped": spin (never reading self.lock) until this process notices it was stopped for
    more than 3 s (the test SIGSTOPs it), then report its FIRST read of self.lock.lost and what
    ensure() did. Any other tag: hold the key until the test opens gate:<key>:<tag>."""
    import json

    journal.rpush(f"started:lost_probe:{key}", json.dumps({"id": self.request.id, "pid": os.getpid(), "tag": tag}))
    if tag != "stopped":
        _wait_gate(f"{key}:{tag}")
        return {"tag": tag, "pid": os.getpid(), "lost": self.lock.lost}
    # Spin (holding the GIL, no sleep) until the clock jumps: the process was frozen. On SIGCONT this
    # thread then runs on at once and reads .lost before any other thread of the process gets to run.
    begun = prev = time.monotonic()
    while prev - begun < 60:
        now = time.monotonic()
        if now - prev > 3.0:
            break
        prev = now
    first_read = self.lock.lost
    try:
        self.lock.ensure()
        ensured = "returned"
    except LockLost as exc:
        ensured = type(exc).__name__
    return {"tag": tag, "pid": os.getpid(), "first_read": first_read, "ensure": ensured,
            "reason": self.lock.lost_reason}


@app.task(base=LockedTask, bind=True, lock_key=["key"])
def redelivery_probe(self, key: str, seconds: float) -> dict:
    """Hold the key ``seconds`` (acks_late workers with a short visibility timeout redeliver it
    meanwhile); journals each body run under runs:redelivery_probe:<key>."""
    start = time.time()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.02)
    record("redelivery_probe", key, start, time.time())
    return {"pid": os.getpid(), "key": key}


@task_prerun.connect(weak=False)
def _journal_delivery(sender=None, task_id=None, **_) -> None:
    """Every delivery of redelivery_probe that reached a pool process, under deliveries:<task id>."""
    if getattr(sender, "name", None) != redelivery_probe.name:
        return
    import json

    request = sender.request
    journal.rpush(f"deliveries:{task_id}", json.dumps({
        "redelivered": bool((request.delivery_info or {}).get("redelivered")),
        "headers": sorted(k for k in (request.headers or {}) if k.startswith("singleton_lock")),
        "pid": os.getpid(), "at": time.time(),
    }))

# -- for tests/ops/test_cli.py (`celery locks release`) ----------------------------------------


@app.task(base=LockedTask, bind=True, lock_key=["key"])
def hold_until_lost(self, key: str, limit: float = 30.0) -> dict:
    """Hold the lock until this process learns it is gone (a force release, found at the next
    renewal), journal that, then call ensure(): it raises LockLost and the task FAILS with it."""
    _journal_event(key, "start", self)
    deadline = time.monotonic() + limit
    while not self.lock.lost and time.monotonic() < deadline:
        time.sleep(0.02)
    _journal_event(key, "lost" if self.lock.lost else "timeout", self, reason=self.lock.lost_reason)
    self.lock.ensure()
    return {"pid": os.getpid(), "lost": False}

# -- for tests/line/test_line_backlog.py and its sibling modules (the line under a backlog, a slow
# broker, revoke); CSL_BROKER_URL, CSL_EXTRA_CONF, CSL_PREFETCH, ... are read here, as they always were

worker_settings.from_test_env(app)


@app.task
def busy(seconds: float) -> None:
    """Other work in the same queue: the backlog a waiting task must not queue behind twice."""
    time.sleep(seconds)


@app.task(bind=True)
def journaled_filler(self, key: str, seconds: float) -> None:
    """Other work that says when it started, under journaled:<key>, beside a key's bodies."""
    import json

    journal.rpush(f"journaled:{key}", json.dumps({"event": "filler", "id": self.request.id, "at": time.time()}))
    time.sleep(seconds)


@app.task(base=LockedTask, bind=True, lock_key=["key"], on_duplicate="retry", lock_max_wait=6.0)
def in_line_wait6(self, key: str, tag: str = "", gate: bool = False) -> dict:
    """As in_line, but a waiter gives up 6 s after it first parked (LockWaitTimeout)."""
    _journaled_gate(self, key, tag, gate)
    return {"pid": os.getpid(), "tag": tag}
