"""Helpers shared by the test files, the task hooks' (tests/task/) first (not a test module itself).

* ``TaskEvents``: the shipped ``LockEvents`` for one app's tasks, plus Celery's task_postrun.
* ``Gates``: named threading.Events that task bodies wait on, so a test decides when a
  holder ends instead of sleeping.
* ``Runs``: the execution intervals of in-process task bodies (``Runs.gated``: the common body).
* ``in_process_worker(app, gates)``: the one in-process worker a module's ``env`` runs for its app.
* ``locked(app, **opts)``: ``app.task(base=LockedTask, bind=True, shared=False, ...)``;
  ``shared=False`` matters: a shared task is added to every app finalized later in the
  session, and an earlier test's function would then win over a same-named later one.
* subprocess workers (real ``celery worker`` running tests/apps/worker_app.py) that a
  whole module can share, so their start-up is paid once.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery.signals import task_postrun

from celery_singleton_lock import LockedTask
from celery_singleton_lock.testing.events import LockEvents
from celery_singleton_lock.testing.servers import RedisServer, WorkerProcess, wait_until

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 30.0  # generous: two cores, other developers' tests running beside ours


def locked(app, **opts):
    """Decorator: a bound LockedTask on ``app`` only (``shared=False``)."""
    opts.setdefault("bind", True)
    return app.task(base=LockedTask, shared=False, **opts)


class TaskEvents(LockEvents):
    """The shipped :class:`LockEvents` for one app's tasks, with :data:`TIMEOUT` deadlines, that
    also records Celery's ``task_postrun`` (not our signal) as ``"task_postrun"`` (``e.kwargs["state"]``)."""

    POSTRUN = "task_postrun"

    def __init__(self, app, timeout: float = TIMEOUT) -> None:
        super().__init__(timeout, app=app)

    def start(self) -> None:
        if self._receivers:
            return
        super().start()
        receiver = self._receiver(self.POSTRUN)
        task_postrun.connect(receiver, weak=False)
        self._receivers.append((task_postrun, receiver))

    @property
    def signal_names(self) -> list[str]:
        return [*super().signal_names, self.POSTRUN]


class Gates:
    """Named events a task body waits on; every wait has a deadline."""

    def __init__(self) -> None:
        self._events: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def __getitem__(self, name: str) -> threading.Event:
        with self._lock:
            return self._events.setdefault(name, threading.Event())

    def wait(self, name: str, timeout: float = TIMEOUT) -> None:
        if not self[name].wait(timeout):
            raise TimeoutError(f"gate {name!r} was not opened within {timeout}s")

    def open(self, name: str) -> None:
        self[name].set()

    def open_all(self) -> None:
        with self._lock:
            for event in self._events.values():
                event.set()


@dataclass
class Run:
    key: str
    task_id: str
    start: float
    end: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


class Runs:
    """Execution intervals of in-process bodies: ``runs.begin(...)`` then ``runs.end(run)``, or
    :meth:`gated` for the common body."""

    def __init__(self) -> None:
        self.all: list[Run] = []
        self._cond = threading.Condition()

    def begin(self, key: str, task_id: str, **info: Any) -> Run:
        run = Run(key, task_id, time.time(), info=dict(info))
        with self._cond:
            self.all.append(run)
            self._cond.notify_all()
        return run

    def end(self, run: Run) -> None:
        with self._cond:
            run.end = time.time()
            self._cond.notify_all()

    def gated(self, key: str, task_id: str, tag: str, gates: Gates, fail: str = "", **info: Any) -> str:
        """The common test body: recorded from start to end (with ``info``); the ``"holder"`` waits on its
        key's gate first (the test decides when it ends); ``fail``: the tag that raises RuntimeError instead."""
        run = self.begin(key, task_id, tag=tag, **info)
        try:
            if tag == "holder":
                gates.wait(key)
            if tag == fail:
                raise RuntimeError(fail)
            return tag
        finally:
            self.end(run)

    def of(self, key: str | None = None, task_id: str | None = None) -> list[Run]:
        with self._cond:
            return [r for r in self.all if (key is None or r.key == key) and (task_id is None or r.task_id == task_id)]

    def wait_started(self, key: str, count: int = 1, timeout: float = TIMEOUT) -> list[Run]:
        return wait_until(
            lambda: len(self.of(key)) >= count and self.of(key), timeout, 0.01, f"{count} run(s) of {key}"
        )


class EagerLine:
    """An eager "retry" task on ``app``: a "holder" call (in a thread) holds the key until :meth:`let_go`,
    and a "waiter" call (in another thread) is parked behind it in the line (``lines``: a client of the
    lock Redis's db); ``ran`` lists (tag, monotonic time) of each body's start."""

    def __init__(self, app, lines, prefix: str) -> None:
        self.gate, began = threading.Event(), threading.Event()
        self.ran: list[tuple[str, float]] = []

        @locked(app, lock_key=["k"], on_duplicate="retry", lock_max_wait=30)
        def eager_line(task, k, tag):
            self.ran.append((tag, time.monotonic()))
            if tag == "holder":
                began.set()
                assert self.gate.wait(TIMEOUT)
            return tag

        k = f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.holder = threading.Thread(target=lambda: eager_line.apply((k, "holder")), daemon=True)
        self.holder.start()
        assert began.wait(TIMEOUT)
        self.waiter: dict[str, Any] = {}
        self.thread = threading.Thread(target=lambda: self.waiter.setdefault("r", eager_line.apply((k, "waiter"))),
                                       daemon=True)
        self.thread.start()
        key = eager_line.lock_key_for((k, "x"), {})
        wait_until(lambda: lines.llen(key + ":q") == 1, TIMEOUT, what="the waiter to park")

    def let_go(self) -> Any:
        """The holder ends; the waiter's result, once it ended."""
        self.gate.set()
        self.thread.join(TIMEOUT)
        self.holder.join(TIMEOUT)
        return self.waiter["r"]


def assert_no_overlap(intervals: list[tuple[float, float]], what: str = "runs") -> None:
    """No two [start, end] intervals overlap (they are sorted here)."""
    ordered = sorted(intervals)
    for (s1, e1), (s2, e2) in zip(ordered, ordered[1:], strict=False):
        assert e1 <= s2, f"{what} overlap: [{s1}, {e1}] and [{s2}, {e2}]"


@contextlib.contextmanager
def in_process_worker(app, gates: Gates, pool: str = "threads", concurrency: int = 4) -> Iterator[None]:
    """A module's in-process worker for ``app`` (celery.contrib.testing's): every gate opened before it
    stops (no body holds its shutdown up), and the garbage collected after, while the servers run
    (AsyncResult.__del__ unsubscribes)."""
    from celery.contrib.testing.worker import start_worker

    with start_worker(app, pool=pool, concurrency=concurrency, perform_ping_check=False, loglevel="WARNING",
                      shutdown_timeout=30):
        try:
            yield
        finally:
            gates.open_all()
    gc.collect()


# -- real redeliveries ------------------------------------------------------------------------

RESTORE_FAST = {"unacked_restore_interval": 1, "unacked_restore_throttle": 1}
"""broker_transport_options for a worker whose kombu restores unacked messages every second."""


def redeliver(broker, task, args, task_id: str, queue: str, kwargs=None, headers=None) -> None:
    """A REAL broker redelivery of ``task(*args)`` under ``task_id`` to ``queue``.

    The message goes through kombu's own restore of unacked messages, as after a
    visibility timeout or a lost worker: it is put in kombu's ``unacked`` hash as
    if a consumer had held it for ages, and the worker's periodic restore (see
    RESTORE_FAST) moves it back to its queue with ``delivery_info["redelivered"]``
    True. (Publishing the same task id again is not a redelivery.)
    """
    hold = f"csl-hold-{uuid.uuid4().hex[:8]}"  # nobody consumes it: just to get the exact message
    task.apply_async(args, kwargs, task_id=task_id, queue=hold, headers=headers)
    raw = wait_until(lambda: broker.lpop(hold), 10, what="the message to capture")
    payload = json.loads(raw)
    payload["properties"]["delivery_info"] = {"exchange": "", "routing_key": queue}
    tag = uuid.uuid4().hex
    broker.hset("unacked", tag, json.dumps([payload, "", queue]))
    broker.zadd("unacked_index", {tag: time.time() - 10 * 24 * 3600})


# -- subprocess workers ---------------------------------------------------------------------


def worker_env(server: RedisServer, **extra: str) -> dict[str, str]:
    return {
        "CSL_REDIS_URL_BASE": f"redis://127.0.0.1:{server.port}",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
        **extra,
    }


def load_worker_app(server: RedisServer):
    """tests/apps/worker_app.py on the client side, configured for ``server`` (no flush)."""
    base = f"redis://127.0.0.1:{server.port}"
    os.environ["CSL_REDIS_URL_BASE"] = base
    loaded = sys.modules.get("apps.worker_app")
    if loaded is not None and getattr(loaded, "BASE", None) == base:
        return loaded  # a reload would register its (shared) tasks once more in every later app
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        if loaded is not None:
            return importlib.reload(loaded)
        return importlib.import_module("apps.worker_app")
    finally:
        sys.path.remove(str(ROOT / "tests"))


def start_worker_process(
    server: RedisServer,
    logdir: Path,
    *,
    pool: str = "prefork",
    concurrency: int = 2,
    env: dict[str, str] | None = None,
    extra: tuple[str, ...] = (),
    name: str = "worker",
) -> WorkerProcess:
    w = WorkerProcess(
        "apps.worker_app",
        pool=pool,
        concurrency=concurrency,
        env=worker_env(server, **(env or {})),
        cwd=ROOT / "tests",
        logfile=str(logdir / f"{name}.log"),
        extra=extra,
    )
    return w.start()


def rabbit_up() -> bool:
    """Whether something accepts connections on RabbitMQ's port on this machine (127.0.0.1:5672)."""
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=2):
            return True
    except OSError:
        return False


def within(seconds: float, fn, *args, **kwargs):
    """Run ``fn`` in a daemon thread; its value, or AssertionError if it is not done in ``seconds``.

    A hang (an eager self-deadlock) must fail the test, not hang the suite.
    """
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the test's thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise AssertionError(f"{getattr(fn, '__name__', fn)} did not finish within {seconds}s (deadlock?)")
    if "error" in box:
        raise box["error"]
    return box["value"], time.monotonic() - started


def messages(caplog, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]
