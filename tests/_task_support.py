"""Helpers shared by the test files, the task hooks' (tests/task/) first (not a test module itself).

* ``Recorder``: collects our signals (and task_postrun) for one app, thread-safe, with waits.
* ``Gates``: named threading.Events that task bodies wait on, so a test decides when a
  holder ends instead of sleeping.
* ``Runs``: the execution intervals of in-process task bodies.
* ``locked(app, **opts)``: ``app.task(base=LockedTask, bind=True, shared=False, ...)``;
  ``shared=False`` matters: a shared task is added to every app finalized later in the
  session, and an earlier test's function would then win over a same-named later one.
* subprocess workers (real ``celery worker`` running tests/apps/worker_app.py) that a
  whole module can share, so their start-up is paid once.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from celery.signals import task_postrun

from celery_singleton_lock import LockedTask
from celery_singleton_lock.signals import duplicate_skipped, lock_acquired, lock_released
from celery_singleton_lock.testing.servers import RedisServer, WorkerProcess, wait_until

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 30.0  # generous: two cores, other developers' tests running beside ours


@pytest.fixture(autouse=True)
def collect_results():
    """After each test, collect its garbage while the Redis server still runs: AsyncResult's
    __del__ unsubscribes from the result backend, and fails noisily once the server is gone."""
    yield
    gc.collect()


def locked(app, **opts):
    """Decorator: a bound LockedTask on ``app`` only (``shared=False``)."""
    opts.setdefault("bind", True)
    return app.task(base=LockedTask, shared=False, **opts)


@dataclass
class Event:
    kind: str  # acquired | released | duplicate | postrun
    task_id: str
    key: str | None = None
    at: float = field(default_factory=time.time)
    data: dict[str, Any] = field(default_factory=dict)


class Recorder:
    """Our signals, for the tasks of one app, as a list of Events."""

    def __init__(self, app) -> None:
        self.app = app
        self.events: list[Event] = []
        self._cond = threading.Condition()
        self._receivers = [
            (lock_acquired, self._acquired),
            (lock_released, self._released),
            (duplicate_skipped, self._duplicate),
            (task_postrun, self._postrun),
        ]

    def __enter__(self) -> Recorder:
        for signal, receiver in self._receivers:
            signal.connect(receiver, weak=False)
        return self

    def __exit__(self, *exc: object) -> None:
        for signal, receiver in self._receivers:
            signal.disconnect(receiver)

    def _ours(self, sender) -> bool:
        return getattr(sender, "app", None) is self.app

    def _add(self, event: Event) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def _acquired(self, sender=None, key=None, task_id=None, lock=None, **_):
        if self._ours(sender):
            self._add(Event("acquired", task_id, key, data={"lock": lock}))

    def _released(self, sender=None, key=None, task_id=None, state=None, deleted=None, **_):
        if self._ours(sender):
            self._add(Event("released", task_id, key, data={"state": state, "deleted": deleted}))

    def _duplicate(self, sender=None, key=None, task_id=None, holder_task_id=None, policy=None, **_):
        if self._ours(sender):
            self._add(Event("duplicate", task_id, key, data={"holder": holder_task_id, "policy": policy}))

    def _postrun(self, sender=None, task_id=None, state=None, **_):
        if self._ours(sender):
            self._add(Event("postrun", task_id, data={"state": state}))

    def of(self, kind: str, task_id: str | None = None) -> list[Event]:
        with self._cond:
            return [e for e in self.events if e.kind == kind and (task_id is None or e.task_id == task_id)]

    def wait(self, kind: str, task_id: str | None = None, count: int = 1, timeout: float = TIMEOUT) -> list[Event]:
        """Wait until ``count`` events of ``kind`` (for ``task_id``) were seen; return them."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [e for e in self.events if e.kind == kind and (task_id is None or e.task_id == task_id)]
                if len(found) >= count:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"timed out after {timeout}s waiting for {count} {kind} event(s) of {task_id}")
                self._cond.wait(left)


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
    """Execution intervals of in-process bodies: ``with runs.body(key, task_id): ...``."""

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

    def of(self, key: str | None = None, task_id: str | None = None) -> list[Run]:
        with self._cond:
            return [r for r in self.all if (key is None or r.key == key) and (task_id is None or r.task_id == task_id)]

    def wait_started(self, key: str, count: int = 1, timeout: float = TIMEOUT) -> list[Run]:
        return wait_until(
            lambda: len(self.of(key)) >= count and self.of(key), timeout, 0.01, f"{count} run(s) of {key}"
        )


def assert_no_overlap(intervals: list[tuple[float, float]], what: str = "runs") -> None:
    """No two [start, end] intervals overlap (they are sorted here)."""
    ordered = sorted(intervals)
    for (s1, e1), (s2, e2) in zip(ordered, ordered[1:], strict=False):
        assert e1 <= s2, f"{what} overlap: [{s1}, {e1}] and [{s2}, {e2}]"


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
