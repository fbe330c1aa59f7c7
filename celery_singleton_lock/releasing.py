"""Letting a lock go at the end of an execution, in a way that never fails the finished task.

A short socket timeout of its own (a stalled Redis must not hold the task's end), two tries,
and every answer turned into a status the task side reports: deleted, already gone, another's,
refused.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Task

from . import config
from .exceptions import LockBackendRefused, LockBackendUnavailable, LockError
from .lock import Lock
from .server import LockServer

logger = logging.getLogger("celery_singleton_lock")


def release(lock: Lock, settings: config.LockSettings, *, succeeded: bool, remember: float) -> int | None:
    """Release with a short timeout, twice at most; the status (1 deleted, 0 gone, -1 another's, -3 refused), None if
    Redis never answered. A retry after a timed-out try that did execute finds the key gone: that counts
    as deleted, since the key is then nobody's."""
    server = release_twin(lock.server, settings.release_timeout)
    for attempt in (1, 2):
        try:
            status = server.release(lock, succeeded=succeeded, remember=remember).status
            return 1 if status == 0 and attempt == 2 else status
        except LockBackendUnavailable as exc:
            logger.warning("releasing lock %s failed (try %d of 2): %s", lock.key, attempt, exc)
        except LockError as exc:  # a refusal: the task keeps its outcome
            logger.warning("releasing lock %s was refused: %s; it expires within %gs", lock.key, exc, lock.ttl)
            return -3 if isinstance(exc, LockBackendRefused) else None
        except Exception as exc:  # e.g. a soft time limit landing here: the body has ended, keep its outcome
            logger.warning("releasing lock %s was interrupted (%r); it expires within %gs", lock.key, exc, lock.ttl)
            return None
    logger.error("lock %s could not be released; it expires within %gs", lock.key, lock.ttl)
    return None


_twins: dict[tuple[LockServer, float], LockServer] = {}


def release_twin(server: LockServer, timeout: float) -> LockServer:
    """The server's twin with the release's short socket timeout (a stalled Redis must not hold the task)."""
    twin = _twins.get((server, timeout))
    if twin is None:
        twin = _twins[(server, timeout)] = server.with_timeout(timeout)
    return twin


def may_be_redelivered(task: Task, request: Any) -> bool:
    """Can the broker deliver this message again after it succeeded? Only if it is acked late."""
    return bool(getattr(request, "acks_late", None) or task.acks_late or task.reject_on_worker_lost)


