"""How a delivery parked in a key's line ends: how long it may still wait, and the end of a delivery
whose call now waits in line (WAITING stored, logged, signalled, and Ignore raised).
"""

from __future__ import annotations

import logging
import time
from typing import Any, NoReturn

from celery.exceptions import Ignore

from ..engine import kept
from ..engine import line as queue
from ..engine.backend import LockBackend
from ..exceptions import LockWaitTimeout
from ..results import WAITING
from ..signals import duplicate_skipped
from . import config
from .compat import get_actual_ignore_result
from .headers import turn_of

logger = logging.getLogger("celery_singleton_lock")


def wait_left(request: Any, settings: config.LockSettings, server: LockBackend, key: str, entry: str | None) -> float:
    """How long this delivery may still wait in line: ``lock_max_wait``, counted from a waiting task's
    FIRST park; none left: :class:`LockWaitTimeout` (its old place, if it still has one, goes)."""
    wait = settings.max_wait
    parked_at = turn_of(request.headers).parked_at  # (this delivery is a copy of a waiting call)
    if parked_at is not None:
        wait -= time.time() - parked_at
        if wait <= 0:
            if entry:  # the line moves on
                # tried again in place: a call that failed with its place still in line would be handed
                # the key in its turn, and run after its failure
                kept.tried(lambda rid: queue.leave(server, key, entry, rid))
            raise LockWaitTimeout(key, settings.max_wait)
    return wait


def ends_waiting(task: Any, request: Any, key: str, place: int, holder_id: str | None, entry: str | None, same: bool,
           already: bool) -> NoReturn:
    """The delivery ends, its call waiting in line: WAITING stored (unless it is a copy of the running
    call), logged, :data:`duplicate_skipped` sent, and Ignore raised."""
    own = holder_id == request.id
    if not own and not get_actual_ignore_result(task, request):
        task.backend.store_result(
            request.id, {"key": key, "place": place, "holder": holder_id, "entry": entry}, WAITING, request=request
        )
    logger.info(
        "task %s[%s] waits in line for lock %s (place %d, held by %s)%s%s",
        task.name, request.id, key, place, holder_id,
        " as a redelivered copy of the running task" if same else "",
        ": it was parked already, this delivery ends" if already else "",
    )
    duplicate_skipped.send(
        sender=task, key=key, task_id=request.id, holder_task_id=holder_id,
        policy="redelivery" if own else "retry",
    )
    raise Ignore(f"waiting in line for lock {key}")
