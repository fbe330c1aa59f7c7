"""Dedupe at publish (``lock_publish="join"`` or ``"raise"``): a call whose key already has a call
queued, waiting or running is not published again.

celery-once raises ``AlreadyQueued`` and celery-singleton returns the AsyncResult of the call
already queued; this does both, as the task chooses, with one lock-server round trip per
publish (:func:`engine.dedupe.mark`), and a result-backend read when it finds a call to join
(has it ended?), and none when it is off (the default).

What is checked: ``delay()`` and ``apply_async()`` of the task itself, with no ``task_id`` of
the caller's and no canvas around it. A call that carries its own task id is a retry, a
``replace()``, one of our re-sends or a frozen signature, and joining another id would break
it; a call with links or a chain would lose them if it joined another call. Those are published
as they are, and ``send_task`` cannot be intercepted at all: what protects all of them is the
lock taken at execution, which every delivery goes through.

If the lock server cannot be reached at publish, the call is published unchecked, with a
WARNING: the lock taken at execution (which waits for the server) still applies.

The mark lives until the call's delivery starts (:func:`started`: it took the lock, parked, or
was refused; from then on the lock or the line shows the call), until the call is revoked
while queued, or for ``lock_publish_ttl`` seconds at most: a message lost in the broker
blocks publishes of its key for no longer than that. A publish never joins a call the result backend
says has ended (:func:`_mark`).
"""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import task_revoked
from celery.states import READY_STATES
from celery.utils import uuid

from ..engine import dedupe
from ..engine.lock import ms
from ..engine.server import LockServer
from ..exceptions import AlreadyQueued, LockBackendUnavailable, LockError
from ..signals import publish_joined
from .headers import MARKED

logger = logging.getLogger("celery_singleton_lock")

_CANVAS = ("link", "link_error", "chain", "chord", "group_id")
"""Options that put a call in a canvas: published as is (joining would drop them)."""


def checked(task: Any, task_id: str | None, options: dict[str, Any]) -> bool:
    """Does this publish go through the check? (see the module doc)"""
    return task_id is None and not any(options.get(name) for name in _CANVAS) \
        and not task.app.conf.task_always_eager


def publish(task: Any, args: Any, kwargs: Any, options: dict[str, Any], send: Any) -> Any:
    """Publish ``task(*args, **kwargs)`` through ``send`` (Celery's ``apply_async``), unless its key
    has a call: then that call's AsyncResult ("join") or :class:`AlreadyQueued` ("raise")."""
    settings = task.lock_settings()
    server = task.lock_server()
    if not server.supports_publish:
        raise LockError(f"task {task.name!r}: lock_publish={settings.publish!r} needs one Redis, Sentinel or "
                        f"Cluster as its lock server; {type(server).__name__} keeps no publish marks")
    key = task.lock_key_for(args, kwargs)
    task_id = uuid()
    options["headers"] = {**(options.get("headers") or {}), MARKED: "1"}
    try:
        found = _mark(task, server, key, task_id, ms(settings.publish_ttl))
    except LockBackendUnavailable as exc:  # the execution lock still applies: publish, unchecked
        logger.warning("task %s: lock_publish could not check lock %s (%s); published unchecked", task.name,
                       key, exc)
        # still MARKED: if the mark was set and only the reply was lost, its delivery deletes it
        return send(args, kwargs, task_id=task_id, **options)
    if found is not None:
        publish_joined.send(sender=task, key=key, task_id=found.task_id, state=found.state, mode=settings.publish)
        if settings.publish == "raise":
            raise AlreadyQueued(key, found.task_id, found.state)
        logger.debug("task %s: a call of lock %s is %s (task %s): joined it", task.name, key, found.state,
                     found.task_id)
        return task.AsyncResult(found.task_id)
    try:
        return send(args, kwargs, task_id=task_id, **options)
    except BaseException:
        _forget(server, key, task_id)  # not published: the next publish must not join it
        raise


def started(task: Any, request: Any, key: str, server: Any) -> None:
    """The delivery of a marked call has taken the lock, parked or been refused: its mark goes."""
    if (request.headers or {}).get(MARKED) and server.supports_publish:
        _forget(server, key, request.id)


def queued_again(task: Any, request: Any, key: str, server: Any) -> None:
    """A marked call re-sent with back-off is queued again: marked again (unless another call is), so
    a publish meanwhile joins it rather than making a second call."""
    if not (request.headers or {}).get(MARKED) or not server.supports_publish:
        return
    try:
        dedupe.remark(server, key, request.id, ms(task.lock_settings().publish_ttl))
    except LockError as exc:
        logger.warning("lock %s: could not mark task %s again: %s", key, request.id, exc)


def _mark(task: Any, server: LockServer, key: str, task_id: str, ttl_ms: int) -> dedupe.Pending | None:
    """The call to join, or None (``task_id`` is marked): :func:`.dedupe.mark`, passing over calls that
    have ended. A delivery that could not reach the lock Redis to delete its mark, or a release that
    could not (both tries met a restart, say), leaves a mark or a lock naming a finished call, which
    every publish would join until it expires: the joiner's work would never run. At most three are
    passed over (the mark, the last waiter, the lock), so this ends."""
    ended: tuple[str, ...] = ()
    while True:
        found = dedupe.mark(server, key, task_id, ttl_ms, ended)
        if found is None or len(ended) == 3 or not _ended(task, found.task_id):
            return found
        ended += (found.task_id,)


def _ended(task: Any, task_id: str) -> bool:
    """Has the call ended (a final state stored)? Asked only before joining it. Without a result
    backend: False (joined, as before)."""
    try:
        return task.AsyncResult(task_id).state in READY_STATES
    except Exception:  # (no result backend, or it did not answer)
        return False


def _forget(server: LockServer, key: str, task_id: str) -> None:
    try:
        dedupe.unmark(server, key, task_id)
    except LockError as exc:  # it expires within lock_publish_ttl
        logger.warning("lock %s: could not delete the publish mark of task %s: %s", key, task_id, exc)


@task_revoked.connect(weak=False)
def _revoked_before_start(sender: Any = None, request: Any = None, **_: Any) -> None:
    """A marked call revoked while queued never starts: its mark goes now, not at its expiry."""
    if not getattr(sender, "singleton_lock", False) or request is None:
        return
    headers = getattr(request, "headers", None) or {}
    if not headers.get(MARKED):
        return
    try:
        key = sender.lock_key_for(request.args, request.kwargs)
        server = sender.lock_server()
    except Exception:  # bad arguments: its key was never marked
        return
    if server.supports_publish:
        _forget(server, key, request.id)
