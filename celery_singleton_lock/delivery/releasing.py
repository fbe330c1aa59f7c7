"""Letting a lock go at the end of an execution, in a way that never fails the finished task.

A short socket timeout of its own (a stalled Redis must not hold the task's end), two tries,
and every answer turned into a status the task side reports: deleted, already gone, another's,
refused.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any, cast

from celery import Task
from celery.states import FAILURE, SUCCESS
from kombu.serialization import dumps, loads

from ..engine import layout
from ..engine import line as queue
from ..engine.backend import LockBackend
from ..engine.lock import Lock, Release
from ..exceptions import LockBackendRefused, LockBackendUnavailable, LockError
from ..signals import lock_released
from . import config
from .compat import get_actual_ignore_result

logger = logging.getLogger("celery_singleton_lock")


def release(lock: Lock, settings: config.LockSettings, *, succeeded: bool, remember: float,
            value: bytes = b"", retries: int = 0, cooldown: float = 0.0, presend: float = 0.0) -> Release | None:
    """Release with a short timeout, twice at most; what it found (REFUSED too), None if
    Redis never answered. The retry carries the first try's request id: a first try that ran and lost its
    reply answers it as it would have (its hand-offs are sent now: the next waiter, one sent ahead, those
    timed out). A first try of the fresh path keeps no reply: the retry finds the key gone, or handed by
    that try (RELEASE knows its own hand-off), and counts it deleted."""
    server = lock.server.with_timeout(settings.release_timeout)  # a stalled Redis must not hold the task
    request_id = secrets.token_hex(8)  # one for both tries: a first try that ran answers the second
    for attempt in (1, 2):
        try:
            status = server.release(lock, succeeded=succeeded, remember=remember, value=value,
                                    again=attempt == 2, retries=retries, cooldown=cooldown,
                                    presend=presend, request_id=request_id).status
            return Release.DELETED if status is Release.GONE and attempt == 2 else status
        except LockBackendUnavailable as exc:
            logger.warning("releasing lock %s failed (try %d of 2): %s", lock.key, attempt, exc)
        except LockError as exc:  # a refusal: the task keeps its outcome
            logger.warning("releasing lock %s was refused: %s; it expires within %gs", lock.key, exc, lock.ttl)
            return Release.REFUSED if isinstance(exc, LockBackendRefused) else None
        except Exception as exc:  # e.g. a soft time limit landing here: the body has ended, keep its outcome
            logger.warning("releasing lock %s was interrupted (%r); it expires within %gs", lock.key, exc, lock.ttl)
            return None
    logger.error("lock %s could not be released; it expires within %gs", lock.key, lock.ttl)
    return None


def at_end(task: Any, request: Any, lock: Lock, state: str | None, value: Any) -> None:
    """The execution of ``request`` ended in ``state``: release its lock (with the done record an
    acks_late success needs, and the task's cooldown), and report what Redis found."""
    settings = task.lock_settings()
    redeliverable = state == SUCCESS and may_be_redelivered(task, request)
    remember = settings.redelivery_window if redeliverable else 0.0
    packed = pack_value(task, value) if remember and not get_actual_ignore_result(task, request) else b""
    cooldown = settings.cooldown if state == SUCCESS or (state == FAILURE and settings.cooldown_on_failure) else 0.0
    status = release(lock, settings, succeeded=state == SUCCESS, remember=remember, value=packed,
                     retries=request.retries or 0, cooldown=cooldown, presend=settings.wait_in_slot)
    if cooldown and status is Release.DELETED:
        after_cooldown(lock, settings)
    ended = f"task {request.id} ended {state}"
    if status is Release.TAKEN and not lock.lost:
        lock.mark_lost(f"found at release: another holder has the key ({ended})")
    elif status is Release.GONE and not lock.lost:
        lock.mark_lost(f"found at release: the key had expired ({ended})")
    elif status is Release.REFUSED and not lock.lost:  # e.g. WRONGTYPE: the key holds something that is not our lock
        lock.mark_lost(f"found at release: Redis refused the release ({ended})")
    if status in (Release.GONE, Release.TAKEN):
        logger.warning("lock %s was no longer held by task %s at release", lock.key, request.id)
    lock_released.send(sender=task, key=lock.key, task_id=request.id, state=state, deleted=status is Release.DELETED)


def after_cooldown(lock: Lock, settings: config.LockSettings) -> None:
    """The key was kept for a cooldown: have the sweepers look at it, so whoever waits in its line is
    handed the key when the cooldown runs out (the release could not hand it on)."""
    server = cast(LockBackend, lock.server)  # (a task's lock: its server is a whole backend)
    if not server.supports_line:
        return  # a quorum keeps no line
    try:
        queue.announce(server, settings.index, lock.key)
    except LockError as exc:
        logger.warning("lock %s: could not tell the sweepers about its cooldown: %s", lock.key, exc)


def may_be_redelivered(task: Task, request: Any) -> bool:
    """Can the broker deliver this message again after it succeeded? Only if it is acked late."""
    return bool(getattr(request, "acks_late", None) or task.acks_late or task.reject_on_worker_lost)


def pack_value(task: Task, value: Any) -> bytes:
    """What the body returned, serialised with the task's result serializer, for the done record
    (b"" when it cannot be: then a redelivery that finds no stored result is only dropped)."""
    try:
        return packed(value, task.backend.serializer or task.app.conf.result_serializer)
    except Exception as exc:
        logger.warning("task %s: its return value cannot be kept with its done record (%r)", task.name, exc)
        return b""


def packed(value: Any, serializer: str) -> bytes:
    """``value`` as Redis keeps it (a parked message, a merged call, a done record's value):
    ``"<content type>\n<encoding>\n<data>"``, serialised with ``serializer``."""
    content_type, encoding, data = dumps(value, serializer=serializer)
    if isinstance(data, str):
        data = data.encode("utf-8")
    return f"{content_type}\n{encoding}\n".encode() + bytes(data)


def unpack_value(raw: bytes) -> Any:
    """What :func:`packed` made, read back."""
    content_type, encoding, data = layout.split_message(raw)
    return loads(data, content_type, encoding, accept=[content_type])
