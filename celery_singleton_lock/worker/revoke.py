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

Every worker does it, under one request id per look (the first one takes the
task out; the others, within the half minute a reply is kept, are answered as it
was), so it works while any worker that received the broadcast runs, even one
whose look came after the remover died.
A revoke that lands while the task is being delivered, before it parked,
finds nothing: each id is looked for again ``AGAIN`` seconds later.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from dataclasses import dataclass, field
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
RETRY, TRIES = 2.0, 10
"""A look that a lock Redis did not answer is tried again every ``RETRY`` seconds, ``TRIES`` times at
most: within the time a kept reply lives (``kept.KEEP_MS``)."""


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
            look_for(c, Look(task_id))
            c.timer.call_after(AGAIN, look_for, (c, Look(task_id, again=True)))


@dataclass
class Look:
    """One look for a revoked task id in every line. A look that could not finish (a lock Redis did not
    answer) is tried again with its ``request_id`` and what it has found: a LEAVE that ran and whose
    answer was lost then answers as it did (else the waiter it took out would stay WAITING for ever).

    The request id is the same on every worker (made from the task id, and ``again`` for the look
    ``AGAIN`` seconds later): a worker whose look comes after another's LEAVE ran is answered as that
    one was, and stores REVOKED even if the worker that removed the waiter died before it could."""

    task_id: str
    again: bool = False
    answered: dict[tuple[int, str], dict[str, int | None]] = field(default_factory=dict)
    tries: int = TRIES
    own_id: str = field(default_factory=lambda: secrets.token_hex(8))
    """This worker's own request id, for what only one worker may do: take the merged calls to send."""

    @property
    def request_id(self) -> str:
        seed = f"revoke\n{self.task_id}\n{2 if self.again else 1}"
        return hashlib.sha1(seed.encode()).hexdigest()[:16]  # noqa: S324 (a name, not a secret)


def look_for(c: Any, look: Look) -> None:
    """:func:`take_out`, tried again ``RETRY`` seconds later while a server does not answer."""
    if take_out(c.app, look) is None and look.tries > 1:
        look.tries -= 1
        c.timer.call_after(RETRY, look_for, (c, look))


def take_out(app: Any, look: Look | str) -> list[str] | None:
    """Take the task out of every waiting line of ``app``'s lock servers, and store it REVOKED if it was
    in one. Returns the keys it left, None if a server could not be asked (``look`` keeps what was
    found). Never raises: a worker's event loop calls it."""
    look = Look(look) if isinstance(look, str) else look
    left: list[str] = []
    complete = True
    for server, index in _lines_of(app):
        try:
            own = queue.own_line(server)
            answered = look.answered.setdefault((id(server), index), {})
            if own is not None:  # (a look tried again also finds what a lost try took out: see etcd_line)
                keys = own.remove(look.task_id, look.request_id)
            else:
                keys = line_ops.remove_everywhere(server, index, look.task_id, look.request_id, answered)
            for key in keys:  # a coalescing waiter's merged calls did not run: they go again
                coalescing.send_again(app, server, key, look.task_id, look.own_id)
            left += keys
        except LockError as exc:
            complete = False
            logger.warning("revoke of task %s: could not look for it in the waiting lines: %s", look.task_id, exc)
        except Exception:
            logger.exception("revoke of task %s: looking for it in the waiting lines failed", look.task_id)
    if left:
        logger.info("revoked task %s left the line of lock %s", look.task_id, ", ".join(left))
        try:
            app.backend.mark_as_revoked(look.task_id, f"revoked while waiting in line for lock {left[0]}")
        except Exception:
            logger.exception("revoke of task %s: storing REVOKED failed", look.task_id)
    return left if complete else None


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
