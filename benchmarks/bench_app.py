"""The Celery app the benchmark workers run, one task per variant.

Configured from the environment (the harness sets it before starting a worker
or importing this module on the client side):

``BENCH_BROKER_URL``   broker (its own redis-server, never the lock server)
``BENCH_LOCK_URL``     the lock server: every lock of every variant lives here
``BENCH_RECORD_DIR``   where each worker process appends one line per finished task
``BENCH_OURS_LOCK_URL``  ours only, if set (the footprint run: another server than a peer's)
``BENCH_REDELIVERY_WINDOW``  singleton_lock_redelivery_window, if set (the footprint run)
``BENCH_SPIN``         singleton_lock_spin: "0" off (spin.py's A/B), else on

Every variant's task has the same trivial body and takes one distinct integer,
so nothing is ever deduplicated and the only difference between variants is
the locking. Variants whose peer package is not installed are left out (the
smoke run needs no peers).

The completion record is written from a ``task_postrun`` receiver connected
AFTER ours (celery-singleton-lock connects its release receiver at import,
and Celery calls receivers in connection order), so it comes after every
variant's release: celery-once releases in ``after_return``,
celery-singleton in ``on_success``, the cookbook in the body.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import redis
from celery import Celery
from celery.signals import task_postrun, worker_ready

from celery_singleton_lock import LockedTask

BROKER_URL = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6399/0")
LOCK_URL = os.environ.get("BENCH_LOCK_URL", "redis://127.0.0.1:6398/0")
RECORD_DIR = os.environ.get("BENCH_RECORD_DIR", "")

app = Celery("bench_app", broker=BROKER_URL, set_as_current=True)
app.conf.update(
    # ours (the footprint run points it elsewhere for a peer's worker: our sweeper would leave its
    # epoch key and script on the peer's lock server)
    singleton_lock_url=os.environ.get("BENCH_OURS_LOCK_URL") or LOCK_URL,
    # celery-once (QueueOnce, Redis backend)
    ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": LOCK_URL, "default_timeout": 3600}},
    # celery-singleton
    singleton_backend_url=LOCK_URL,
    # no result backend: Celery's default, and no result traffic to blur the lock's cost
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    worker_send_task_events=False,
    # spin.py's A/B: each worker process's reads spin first ("1", the default) or sleep at once ("0")
    singleton_lock_spin=os.environ.get("BENCH_SPIN", "1") != "0",
)

VARIANTS: dict[str, object] = {}
"""variant name -> its task, in display order."""


@app.task(name="bench.plain")
def plain(i: int) -> int:
    return i


VARIANTS["plain"] = plain


@app.task(name="bench.ours", base=LockedTask)
def ours(i: int) -> int:
    return i


VARIANTS["ours"] = ours


@app.task(name="bench.ours_join", base=LockedTask, lock_publish="join")
def ours_join(i: int) -> int:
    """Ours with the check at publish (issue 20): one round trip per publish, beside the peers'."""
    return i


VARIANTS["ours-join"] = ours_join

try:
    from celery_once import QueueOnce
except ImportError:  # the smoke run installs no peers
    QueueOnce = None
if QueueOnce is not None:

    @app.task(name="bench.once", base=QueueOnce)
    def once(i: int) -> int:
        return i

    VARIANTS["celery-once"] = once

try:
    from celery_singleton import Singleton
except ImportError:
    Singleton = None
if Singleton is not None:

    @app.task(name="bench.singleton", base=Singleton)
    def singleton(i: int) -> int:
        return i

    VARIANTS["celery-singleton"] = singleton


# -- the Celery cookbook's lock, taken in the task body --------------------------
# "Ensuring a task is only executed one at a time": add the key if absent with an
# expiry, run, delete it. Here on Redis: SET NX EX, then a token-checked release
# (the task id is the token), run as one script.

COOKBOOK_EXPIRE = 60
COOKBOOK_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
_cookbook_redis = redis.Redis.from_url(LOCK_URL)
_cookbook_release = _cookbook_redis.register_script(COOKBOOK_RELEASE)


@app.task(name="bench.cookbook", bind=True)
def cookbook(self, i: int) -> int | None:
    lock_id = "cookbook-lock-" + hashlib.md5(f"{self.name}:{i}".encode()).hexdigest()
    token = self.request.id
    if not _cookbook_redis.set(lock_id, token, nx=True, ex=COOKBOOK_EXPIRE):
        return None  # a duplicate: skipped
    try:
        return i
    finally:
        _cookbook_release(keys=[lock_id], args=[token])


VARIANTS["cookbook"] = cookbook


# -- for the footprint: a locked task acked late (it keeps a done record for the window) ------

if os.environ.get("BENCH_REDELIVERY_WINDOW"):
    app.conf.singleton_lock_redelivery_window = float(os.environ["BENCH_REDELIVERY_WINDOW"])


@app.task(name="bench.ours_late", base=LockedTask, acks_late=True)
def ours_late(i: int) -> int:
    return i


# -- for the renewal check: a locked task that runs for a given time ---------------


@app.task(name="bench.ours_sleep", base=LockedTask, lock_ttl=1.5)
def ours_sleep(i: int, seconds: float) -> int:
    time.sleep(seconds)
    return i


TASK_VARIANT = {task.name: name for name, task in VARIANTS.items()}
TASK_VARIANT[ours_sleep.name] = "ours_sleep"
TASK_VARIANT[ours_late.name] = "ours_late"

# -- completion records: one line per finished task, one file per process -----------

_fd: int | None = None
_fd_pid = 0


@task_postrun.connect(weak=False)
def _record(sender=None, args=None, **_) -> None:
    """``<variant> <seq> <monotonic ns> <pid>``: one append, no Redis, same for every variant."""
    global _fd, _fd_pid
    if not RECORD_DIR:
        return
    now = time.monotonic_ns()  # CLOCK_MONOTONIC: one clock for every process on the machine
    pid = os.getpid()
    if _fd is None or _fd_pid != pid:
        _fd = os.open(os.path.join(RECORD_DIR, f"rec-{pid}.txt"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        _fd_pid = pid
    variant = TASK_VARIANT.get(getattr(sender, "name", ""), "other")
    seq = args[0] if args else -1
    os.write(_fd, f"{variant} {seq} {now} {pid}\n".encode())


@worker_ready.connect(weak=False)
def _ready(sender=None, **_) -> None:
    if RECORD_DIR:
        Path(RECORD_DIR, f"ready-{os.getpid()}").write_text("ready\n")


# -- the breakdown (BENCH_BREAKDOWN=1): wall time inside each piece of our worker path ------
# Wrappers with perf_counter_ns, installed in the worker only when asked, written out
# at shutdown. They add well under a microsecond per call. Each call is filed under its
# path of wrapped callers ("LockedTask.before_start > LockServer.acquire > ..."), so one
# function met on two paths (LockServer.run in acquire and in release) is two rows.
# Only the thread that runs the tasks is timed (not the watchdog's or the sweeper's).

BREAKDOWN: dict[str, list[int]] = {}
"""path of wrapped pieces, " > "-separated -> [ns, calls]"""


def _timer():
    """``timed(label, fn)``: ``fn`` wrapped to add its wall time and a call to BREAKDOWN under its path of
    timed callers; only in the main thread (the one that runs the tasks), and with ``only_inside`` only
    when called inside another timed piece."""
    import functools
    import threading

    clock = time.perf_counter_ns
    main_ident = threading.main_thread().ident
    stack: list[str] = []

    def timed(label: str, fn, *, only_inside: bool = False):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if (only_inside and not stack) or threading.get_ident() != main_ident:
                return fn(*args, **kwargs)
            path = stack[-1] + " > " + label if stack else label
            slot = BREAKDOWN.get(path)
            if slot is None:
                slot = BREAKDOWN[path] = [0, 0]
            stack.append(path)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                slot[0] += clock() - t0
                slot[1] += 1
                stack.pop()
        return wrapper

    return timed


def _install_breakdown() -> None:
    import json

    from celery.signals import worker_process_shutdown, worker_shutdown
    from redis.connection import AbstractConnection

    from celery_singleton_lock import signals as csl_signals
    from celery_singleton_lock.delivery import keys as csl_keys
    from celery_singleton_lock.delivery import releasing as csl_releasing
    from celery_singleton_lock.delivery import task as csl_task
    from celery_singleton_lock.engine import exchange as csl_exchange
    from celery_singleton_lock.engine import server as csl_server
    from celery_singleton_lock.engine import wire as csl_wire
    from celery_singleton_lock.watchdog import process as csl_process
    from celery_singleton_lock.watchdog import renewer as csl_watchdog

    timed = _timer()
    LockedTask.before_start = timed("LockedTask.before_start", LockedTask.before_start)
    # before_start derives the key through the task's KeyMaker (derive with the per-task part done once)
    csl_keys.KeyMaker.__call__ = timed("keys.derive", csl_keys.KeyMaker.__call__)
    Server = csl_server.LockServer
    Server.acquire = timed("LockServer.acquire", Server.acquire)
    Server.release = timed("LockServer.release", Server.release)
    Server.run = timed("LockServer.run", Server.run)
    Server._call = timed("LockServer._call (pack, send, read the reply)", Server._call)
    csl_wire.pack = timed("wire.pack (the EVALSHA in RESP)", csl_wire.pack)
    csl_exchange.read = timed("socket wait for the reply (exchange.read: spin, then sleep)", csl_exchange.read)
    # the socket wait, only inside a timed piece (not the broker connection's reads)
    AbstractConnection.read_response = timed("socket wait for the reply (read_response)",
                                             AbstractConnection.read_response, only_inside=True)
    LockedTask._run_with = timed("LockedTask._run_with", LockedTask._run_with)
    csl_task.get_watchdog = timed("get_watchdog()", csl_process.get_watchdog)
    csl_watchdog.Watchdog.track = timed("Watchdog.track", csl_watchdog.Watchdog.track)
    csl_watchdog.Watchdog.forget = timed("Watchdog.forget", csl_watchdog.Watchdog.forget)
    for name in ("lock_acquired", "lock_released"):
        sig = getattr(csl_signals, name)
        sig.send = timed(f"signal {name}.send", sig.send)
    LockedTask.__call__ = timed("LockedTask.__call__ (body, then release)", LockedTask.__call__)
    LockedTask.release_lock = timed("LockedTask.release_lock", LockedTask.release_lock)
    csl_releasing.release = timed("releasing.release (short-timeout twin, 2 tries)", csl_releasing.release)

    def dump(**_) -> None:
        if RECORD_DIR:
            Path(RECORD_DIR, f"breakdown-{os.getpid()}.json").write_text(json.dumps(BREAKDOWN))

    worker_shutdown.connect(dump, weak=False)
    worker_process_shutdown.connect(dump, weak=False)


if os.environ.get("BENCH_BREAKDOWN") == "1":
    _install_breakdown()
