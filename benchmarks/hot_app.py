"""The Celery app of the hot-key benchmarks: many deductions on ONE key, three ways to wait.

Configured from the environment, like bench_app (the harness sets it before
starting a worker or importing this module on the client side):

``BENCH_HOT_BROKER_URL``   broker (a redis-server of its own)
``BENCH_HOT_LOCK_URL``     the lock server (a redis-server of its own)
``BENCH_RECORD_DIR``       where each worker process appends its records
``BENCH_HOT_QUEUE``        the task queue (default ``celery``; backlog.py gives each run its own)
``BENCH_HOT_LOCK_TTL``     the lock TTL (default: the package's)

The tasks all take ``(sku, seq, body_s, ...)``, sleep ``body_s`` under a lock on
``sku`` and record when their body started and ended:

``hot.ours``      LockedTask, ``lock_key=["sku"]``, ``on_duplicate="retry"`` and nothing
                  else tuned: a duplicate parks in the key's line and is handed the key
``hot.ours_slot`` the same with ``lock_wait_in_slot=0.05``: a duplicate first waits 50 ms in its
                  worker slot, woken there by the release (the hot-key fast path)
``hot.plain``     no lock at all: Celery's own publish -> body start latency (the baseline)
``hot.backoff``   LockedTask, ``on_duplicate="backoff"`` with its defaults: the old
                  policy, re-published with jittered exponential back-off
``hot.filler``    no lock, no record: the other short work of a busy queue (backlog.py)
``hot.rlock``     a plain task holding redis-py's ``Lock(timeout=30, sleep=0.1)`` with
                  ``blocking_timeout``: it keeps its worker slot while it sleep-polls

Records (``hot-<pid>.txt``, one line each, ``CLOCK_MONOTONIC`` ns, one clock for
every process of the machine):

``body <variant> <seq> <start> <end> <pid> <waited>``   a body ran (``waited``: ns
                  the rlock task spent in ``acquire``; 0 for the others)
``gave-up <variant> <seq> <t> <pid>``                   rlock: ``blocking_timeout`` ran out
``gate <seq> <t> <pid>``                                the gate task started holding the key
``park <task id> <t> <pid> <policy>``                   a duplicate did not run now
                  (our ``duplicate_skipped`` signal: parked, or re-sent with back-off)
``pub <task name> <task id> <t> <pid> <why>``           a worker published a task message
                  (``why``: entry = a hand-off, backoff = a back-off re-send, expired,
                  recovered, or other)
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import redis
from celery import Celery
from celery.signals import after_task_publish, worker_ready

from celery_singleton_lock import LockedTask, duplicate_skipped
from celery_singleton_lock.delivery.headers import described

BROKER_URL = os.environ.get("BENCH_HOT_BROKER_URL", "redis://127.0.0.1:6397/0")
LOCK_URL = os.environ.get("BENCH_HOT_LOCK_URL", "redis://127.0.0.1:6396/0")
RECORD_DIR = os.environ.get("BENCH_RECORD_DIR", "")

app = Celery("hot_app", broker=BROKER_URL, set_as_current=True)
app.conf.update(
    singleton_lock_url=LOCK_URL,
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    worker_send_task_events=False,
)
if os.environ.get("BENCH_HOT_QUEUE"):
    app.conf.task_default_queue = os.environ["BENCH_HOT_QUEUE"]
if os.environ.get("BENCH_HOT_LOCK_TTL"):
    app.conf.singleton_lock_ttl = float(os.environ["BENCH_HOT_LOCK_TTL"])
if os.environ.get("BENCH_HOT_SLOT_WAIT"):  # lock_wait_in_slot for hot.ours (the hot-key fast path)
    app.conf.singleton_lock_wait_in_slot = float(os.environ["BENCH_HOT_SLOT_WAIT"])

_fd: int | None = None
_fd_pid = 0


def record(line: str) -> None:
    """Append one line to this process's record file (one write, no Redis)."""
    global _fd, _fd_pid
    if not RECORD_DIR:
        return
    pid = os.getpid()
    if _fd is None or _fd_pid != pid:
        _fd = os.open(os.path.join(RECORD_DIR, f"hot-{pid}.txt"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        _fd_pid = pid
    os.write(_fd, (line + "\n").encode())


def _body(variant: str, seq: int, body_s: float, gate: str, waited: int = 0) -> int:
    start = time.monotonic_ns()
    if gate:  # hold the key until the harness has seen every duplicate park
        record(f"gate {seq} {start} {os.getpid()}")
        deadline = time.monotonic() + 120
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.002)
    time.sleep(body_s)
    end = time.monotonic_ns()
    record(f"body {variant} {seq} {start} {end} {os.getpid()} {waited}")
    return seq


@app.task(name="hot.ours", base=LockedTask, lock_key=["sku"], on_duplicate="retry")
def hot_ours(sku: str, seq: int, body_s: float, gate: str = "") -> int:
    return _body("ours", seq, body_s, gate)


@app.task(name="hot.ours_slot", base=LockedTask, lock_key=["sku"], on_duplicate="retry", lock_wait_in_slot=0.05)
def hot_ours_slot(sku: str, seq: int, body_s: float, gate: str = "") -> int:
    """As hot.ours, with ``lock_wait_in_slot=0.05``: a duplicate first waits 50 ms in its worker slot."""
    return _body("ours-slot", seq, body_s, gate)


@app.task(name="hot.plain")
def hot_plain(sku: str, seq: int, body_s: float, gate: str = "") -> int:
    """No lock: Celery's own dispatch latency, the baseline of the hand-off latency."""
    return _body("plain", seq, body_s, gate)


@app.task(name="hot.backoff", base=LockedTask, lock_key=["sku"], on_duplicate="backoff")
def hot_backoff(sku: str, seq: int, body_s: float, gate: str = "") -> int:
    return _body("backoff", seq, body_s, gate)


@app.task(name="hot.filler")
def hot_filler(body_s: float) -> None:
    """The other work of a busy queue: no lock, no record."""
    time.sleep(body_s)


_rl_client: redis.Redis | None = None
_rl_pid = 0


@app.task(name="hot.rlock")
def hot_rlock(sku: str, seq: int, body_s: float, blocking_timeout: float = 60.0) -> int | None:
    """redis-py's blocking Lock, the way its docs show it, held around the body."""
    global _rl_client, _rl_pid
    if _rl_client is None or _rl_pid != os.getpid():
        _rl_client, _rl_pid = redis.Redis.from_url(LOCK_URL), os.getpid()
    arrived = time.monotonic_ns()
    lock = _rl_client.lock(f"hot-rlock:{sku}", timeout=30, sleep=0.1, blocking_timeout=blocking_timeout)
    # the token names the task, so MONITOR shows whose SET NX each attempt is
    if not lock.acquire(token=f"seq-{seq}"):
        record(f"gave-up rlock {seq} {time.monotonic_ns()} {os.getpid()}")
        return None
    try:
        return _body("rlock", seq, body_s, "", time.monotonic_ns() - arrived)
    finally:
        lock.release()


@duplicate_skipped.connect(weak=False)
def _parked(sender=None, task_id=None, policy=None, **_) -> None:
    record(f"park {task_id} {time.monotonic_ns()} {os.getpid()} {policy}")


_WHY = ("recovered", "entry", "backoff", "expired")


@after_task_publish.connect(weak=False)
def _published(sender=None, headers=None, **_) -> None:
    said = described(headers)
    why = next((label for label in _WHY if said.get(label)), "other")
    headers = headers or {}
    record(f"pub {sender} {headers.get('id')} {time.monotonic_ns()} {os.getpid()} {why}")


@worker_ready.connect(weak=False)
def _ready(sender=None, **_) -> None:
    if RECORD_DIR:
        Path(RECORD_DIR, f"ready-{os.getpid()}").write_text("ready\n")
