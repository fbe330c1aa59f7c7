"""Reports of lost locks, off the renewal thread.

A ``lock_lost`` receiver may be slow (a pager call, a log shipper), and the
watchdog must never wait for one: a slow receiver on the renewal thread would
make other, healthy locks of the process miss their renewals. So what the
watchdog finds is handed to this module's own thread, started on first use
(and anew in a forked child), which logs the ERROR line and runs the
callbacks in order. A loss found by the task's own thread (``.lost``,
``.ensure()``, the release) is reported on that thread, synchronously: the
signal has fired before ``LockLost`` propagates.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

logger = logging.getLogger("celery_singleton_lock")

_jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
_thread: threading.Thread | None = None
_pid = os.getpid()
_start_lock = threading.Lock()


def submit(job: Callable[[], None]) -> None:
    """Run ``job`` on the reporter thread, after every job submitted before it."""
    _ensure_thread()
    _jobs.put(job)


def _ensure_thread() -> None:
    global _thread
    if _thread is not None and _thread.is_alive() and _pid == os.getpid():
        return
    with _start_lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name=f"celery-singleton-lock-reporter-{os.getpid()}", daemon=True)
            _thread.start()


def _run() -> None:
    while True:
        job = _jobs.get()
        if job is None:
            return
        try:
            job()
        except Exception:
            logger.exception("celery-singleton-lock: a lost-lock report failed")


def drain(timeout: float = 5.0) -> bool:
    """Wait until every report submitted so far has run (for shutdown and tests)."""
    if _thread is None or not _thread.is_alive():
        return True
    done = threading.Event()
    _jobs.put(done.set)
    return done.wait(timeout)


def _after_fork() -> None:
    # the parent's thread does not exist here, and its pending reports are the parent's
    global _jobs, _thread, _pid, _start_lock
    _jobs, _thread, _pid, _start_lock = queue.SimpleQueue(), None, os.getpid(), threading.Lock()


os.register_at_fork(after_in_child=_after_fork)
