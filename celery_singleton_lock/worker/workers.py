"""A worker process's threads: this process's sweeper starts with the worker process (and the lock
Redis is checked for persistence once), and the sweeper and the watchdog stop with it.

Connected to Celery's signals when :mod:`celery_singleton_lock.delivery.task` is imported.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import worker_process_init, worker_process_shutdown, worker_ready, worker_shutdown

from ..engine import exchange, persistence
from ..engine import sweeper as sweeping
from ..engine.backend import LockBackend
from ..exceptions import LockKeyError
from ..watchdog.process import shutdown_watchdog

logger = logging.getLogger("celery_singleton_lock")


def watch_app(app: Any) -> None:
    """Start this process's sweeper on the servers of ``app``'s LockedTasks (worker start-up), and set
    whether its reads spin first (``singleton_lock_spin``)."""
    from ..delivery.task import LockedTask

    exchange.spin(bool(app.conf.get("singleton_lock_spin", True)))
    seen: set[tuple[LockBackend, str]] = set()
    for task in list(app.tasks.values()):
        if not isinstance(task, LockedTask):
            continue
        try:
            settings = task.lock_settings()
            server = task.lock_server()
        except (ValueError, LockKeyError) as exc:
            logger.warning("task %s: no sweeping of its waiting line: %s", task.name, exc)
            continue
        if server.supports_line and (server, settings.index) not in seen:  # a line to sweep
            seen.add((server, settings.index))
            if server.may_lose_data:  # (etcd's data is not lost to a restart)
                persistence.check_once(server)
            sweeping.get_sweeper().watch(server, settings.index)


@worker_process_init.connect(weak=False)
def _sweep_in_child(**_: Any) -> None:
    from celery import current_app

    watch_app(current_app)


@worker_ready.connect(weak=False)
def _sweep_in_main(sender: Any = None, **_: Any) -> None:
    # prefork's children sweep (worker_process_init); the other pools run tasks in this process
    app = getattr(sender, "app", None)
    pool = getattr(getattr(sender, "pool", None), "__class__", type(None)).__module__
    if app is not None and "prefork" not in pool:
        watch_app(app)


@worker_process_shutdown.connect(weak=False)
@worker_shutdown.connect(weak=False)
def _stop_threads(**_: Any) -> None:
    shutdown_watchdog()
    sweeping.shutdown_sweeper()
