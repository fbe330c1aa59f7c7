"""Revoking a waiting task: ``AsyncResult.revoke()`` / ``celery revoke`` take it out of its line.

Celery revokes by broadcast: each worker's main process adds the task id to
``celery.worker.state.revoked`` and drops the task's message when it comes.
A parked task has no message anywhere (it lives in the key's line), so
nothing would happen until its turn came, and it would hold the key for its
turn. :class:`RevokeWatch` is a consumer bootstep (installed on every worker
at start, from the ``worker_init`` signal, through ``app.steps["consumer"]``:
no patching of Celery) that looks at that set once a second in the worker's
own event loop; for each newly revoked id it takes the task out of every
line of the app's lock servers (:func:`line_ops.remove_everywhere`: the key
passes on at once if it was reserved for it) and stores REVOKED for it. The calls
merged into it (``on_duplicate="coalesce"``) are sent again, as they were.

Every worker does it (the first one finds the task; the others find
nothing), so it works while any worker that received the broadcast runs.
A revoke that lands while the task is being delivered, before it parked,
finds nothing: each id is looked for again ``AGAIN`` seconds later.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps
from celery.signals import worker_init
from celery.worker import state

from ..delivery import coalescing
from ..engine import line as queue
from ..engine import line_ops
from ..exceptions import LockError

logger = logging.getLogger("celery_singleton_lock")

INTERVAL = 1.0
"""Seconds between two looks at the worker's revoked task ids."""
AGAIN = 5.0
"""Seconds after which a revoked id is looked for once more (a delivery may have been parking)."""


class RevokeWatch(bootsteps.StartStopStep):
    """Takes revoked task ids out of the waiting lines (see the module doc)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.seen: set[str] = set()
        self.tref: Any = None

    def start(self, c: Any) -> None:
        self.seen = set(state.revoked)  # revoked before this start (a state db): Celery drops their messages
        self.tref = c.timer.call_repeatedly(INTERVAL, self.tick, (c,), priority=10)

    def stop(self, c: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None

    def tick(self, c: Any) -> None:
        now = set(state.revoked)
        new = now - self.seen
        self.seen = now
        for task_id in sorted(new):
            take_out(c.app, task_id)
            c.timer.call_after(AGAIN, take_out, (c.app, task_id))


def take_out(app: Any, task_id: str) -> list[str]:
    """Take ``task_id`` out of every waiting line of ``app``'s lock servers, and store it REVOKED if
    it was in one. Returns the keys it left. Never raises: a worker's event loop calls it."""
    left: list[str] = []
    try:
        for server, index in _lines_of(app):
            own = queue.own_line(server)
            keys = own.remove(task_id) if own is not None else line_ops.remove_everywhere(server, index, task_id)
            for key in keys:  # a coalescing waiter's merged calls did not run: they go again
                coalescing.send_again(app, server, key, task_id)
            left += keys
    except LockError as exc:
        logger.warning("revoke of task %s: could not look for it in the waiting lines: %s", task_id, exc)
    except Exception:
        logger.exception("revoke of task %s: looking for it in the waiting lines failed", task_id)
    if left:
        logger.info("revoked task %s left the line of lock %s", task_id, ", ".join(left))
        try:
            app.backend.mark_as_revoked(task_id, f"revoked while waiting in line for lock {left[0]}")
        except Exception:
            logger.exception("revoke of task %s: storing REVOKED failed", task_id)
    return left


def _lines_of(app: Any) -> list[tuple[Any, str]]:
    """(server, sweeper index) of every LockedTask of ``app`` whose server keeps lines."""
    from ..delivery.task import LockedTask

    found: dict[tuple[int, str], tuple[Any, str]] = {}
    for task in list(app.tasks.values()):
        if not isinstance(task, LockedTask):
            continue
        try:
            settings, server = task.lock_settings(), task.lock_server()
        except Exception:  # a misconfigured task: its workers say so
            continue
        if server.supports_line:
            found.setdefault((id(server), settings.index), (server, settings.index))
    return list(found.values())


@worker_init.connect(weak=False)
def _install(sender: Any = None, **_: Any) -> None:
    from ..delivery.turns import has_locked_tasks

    app = getattr(sender, "app", None)
    if app is not None and has_locked_tasks(app):  # the worker imported its task modules already
        app.steps["consumer"].add(RevokeWatch)
