"""``celery inspect locks``: what each worker's processes hold right now, and how their watchdogs fare.

Each worker answers with the locks its processes hold (key, task id, held for,
last renewal confirmed N s ago, fencing token) and each process's watchdog
figures (locks tracked, rounds, the last round's latency, failed rounds,
losses). The answer comes from the watchdogs themselves, not from Redis: it is
what the worker *believes* it holds, which is what an operator compares with
``celery locks list`` (what Redis says).

Where the locks live depends on the pool:

* threads, gevent, eventlet: in the worker's main process, which is the one
  that answers remote-control commands; it reads its own watchdog.
* solo: in the main process too, but a solo worker runs its task in the thread
  that answers remote control: it answers nothing while a task runs (Celery's
  own limit, ``inspect ping`` included), only between tasks.
* prefork: in the child processes, which a remote-control command never
  reaches. Each child that takes a lock starts a writer thread that keeps a JSON snapshot of
  its watchdog in a file, ``<tmp>/celery-singleton-lock-<uid>/<main pid>/<child
  pid>.json`` (a directory only this user can enter). It rewrites the file
  when the child's set of locks changes (woken by ``lock_acquired`` /
  ``lock_released`` / ``lock_lost``, at most once per watchdog tick) and, while
  it holds locks, once a second so that renewals show; an idle child writes
  nothing. The main process answers by reading the files of its live children
  (and deletes those of children that are gone). Times in the file are wall
  clock, so a child that hangs shows a "confirmed ago" that keeps growing; the
  reply also gives each snapshot's age.

A file rather than a socket or a pipe: answering never waits for a child
(a child stuck in a C call holding the GIL answers nothing, and the main
process's event loop must not wait for it), and it costs nothing on the
task's path (the signal receivers only set an event).

Importing this module registers the command (``celery.worker.control`` is
already loaded in a worker, and cheap to import elsewhere); the package's
``__init__`` imports it, so every process that loads the app's tasks has it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from celery.signals import worker_init, worker_process_init, worker_process_shutdown, worker_shutdown
from celery.worker.control import inspect_command

from ..signals import lock_acquired, lock_lost, lock_released
from .snapshots import SnapshotWriter, process_snapshot, read_children, snapshot_dir

logger = logging.getLogger("celery_singleton_lock")

COMMAND = "locks"
"""The remote-control command's name: ``celery inspect locks``."""

_main_pid: int | None = None
"""The worker's main process (set at worker_init, inherited by the prefork children)."""


# -- the reply -------------------------------------------------------------------------


def worker_report(pool: Any) -> dict[str, Any]:
    """The ``locks`` reply of this worker (its main process), given its task pool."""
    now = time.time()
    kind = type(pool).__module__.rsplit(".", 1)[-1] if pool is not None else "unknown"
    kind = {"thread": "threads"}.get(kind, kind)  # as `celery worker --pool` spells it
    children: list[int] = []
    if pool is not None and kind == "prefork":
        try:
            children = [int(pid) for pid in (pool.info.get("processes") or [])]
        except Exception:  # a pool being restarted
            children = []
    main = dict(process_snapshot(), snapshot_age=0.0)
    processes: list[dict[str, Any]] = []
    errors: list[str] = []
    if kind != "prefork" or main["tracked"]:
        processes.append(main)  # prefork's main process runs no tasks: shown only if it holds something
    if kind == "prefork":
        found, errors = read_children(snapshot_dir(os.getpid()), children, now)
        processes.extend(found)
    locks = []
    for proc in processes:
        for lock in proc.pop("locks"):
            taken = lock.get("taken_at")  # (the holder's host clock at its acquire)
            held_for = max(0.0, now - taken) if taken else None
            locks.append({"pid": proc["pid"], "held_for": None if held_for is None else round(held_for, 3), **lock})
    locks.sort(key=lambda lock: -(lock["held_for"] or 0.0))
    return {"pool": kind, "pid": os.getpid(), "locks": locks, "processes": processes, "errors": errors}


@inspect_command(name=COMMAND)
def locks(state: Any, **kwargs: Any) -> dict[str, Any]:
    """The locks this worker's processes hold now, and their watchdogs' figures (celery-singleton-lock)."""
    return worker_report(getattr(state.consumer, "pool", None))


def inspect_locks(app: Any, *, timeout: float = 1.0, destination: list[str] | None = None) -> dict[str, Any]:
    """``celery inspect locks`` from Python: ``{worker node name: its reply}``.

    (Celery's ``Inspect`` has a method per built-in command only; this is the
    same request, through the public ``broadcast``.)
    """
    replies = app.control.broadcast(COMMAND, reply=True, timeout=timeout, destination=destination)
    out: dict[str, Any] = {}
    for reply in replies or []:
        out.update(reply)
    return out


# -- the worker's life cycle -----------------------------------------------------------

_writer: SnapshotWriter | None = None


@worker_init.connect(weak=False)
def _note_main(**_: Any) -> None:
    """The main process (before the pool forks): remember its pid, clear what an earlier worker left."""
    global _main_pid
    _main_pid = os.getpid()
    directory = snapshot_dir(_main_pid)
    if directory.exists():
        for path in directory.glob("*"):
            path.unlink(missing_ok=True)


@worker_process_init.connect(weak=False)
def _start_writer(**_: Any) -> None:
    """A prefork child: start its snapshot writer (solo sends this signal in the main process: nothing to do)."""
    global _writer
    if _main_pid is None or os.getpid() == _main_pid:
        return
    _writer = SnapshotWriter(snapshot_dir(_main_pid))  # its thread starts with the first lock
    for signal in (lock_acquired, lock_released, lock_lost):
        signal.connect(_writer.poke, weak=False, dispatch_uid="celery_singleton_lock.control")


@worker_process_shutdown.connect(weak=False)
def _stop_writer(**_: Any) -> None:
    global _writer
    if _writer is not None:
        _writer.stop()
        _writer = None


@worker_shutdown.connect(weak=False)
def _remove_dir(**_: Any) -> None:
    if _main_pid is None or os.getpid() != _main_pid:
        return
    directory = snapshot_dir(_main_pid)
    try:
        for path in directory.glob("*"):
            path.unlink(missing_ok=True)
        directory.rmdir()
    except OSError:
        pass


def _forget_parent_writer() -> None:
    # a child of a child (a task that forks) does not inherit its parent's thread
    global _writer
    _writer = None


os.register_at_fork(after_in_child=_forget_parent_writer)
