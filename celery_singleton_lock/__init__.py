"""celery-singleton-lock: a task with given arguments never runs twice at once.

    from celery_singleton_lock import LockedTask

    @app.task(base=LockedTask, bind=True, lock_key=["sku"], on_duplicate="retry")
    def deduct(self, sku, qty): ...

The engine underneath (:class:`LockServer`, :class:`Lock`) and the watchdog
work without Celery too; see :func:`held`.
"""

from .delivery.task import LockedTask
from .engine.lock import Holder, Lock, Release, Released
from .engine.server import LockServer
from .exceptions import (
    AlreadyQueued,
    DuplicateTask,
    LockBackendRefused,
    LockBackendUnavailable,
    LockContended,
    LockError,
    LockKeyError,
    LockLost,
    LockWaitTimeout,
    SelfDeadlock,
)
from .ops import control as _control  # noqa: F401  (registers the `celery inspect locks` command)
from .results import WAITING, DuplicateSkipped
from .signals import duplicate_coalesced, duplicate_skipped, lock_acquired, lock_lost, lock_released, publish_joined
from .topologies.plain import held
from .watchdog.process import get_watchdog
from .watchdog.renewer import Watchdog
from .worker import revoke as _revoke  # noqa: F401 - takes revoked tasks out of the lines (a worker bootstep)
from .worker import workers as _workers  # noqa: F401 - starts and stops this process's threads with the worker

__all__ = [
    "LockedTask",
    "LockLost",
    "DuplicateTask",
    "AlreadyQueued",
    "DuplicateSkipped",
    "LockContended",
    "LockError",
    "LockKeyError",
    "LockBackendUnavailable",
    "LockBackendRefused",
    "LockWaitTimeout",
    "SelfDeadlock",
    "WAITING",
    "Release",
    "Released",
    "Lock",
    "LockServer",
    "Holder",
    "held",
    "Watchdog",
    "get_watchdog",
    "lock_acquired",
    "lock_released",
    "duplicate_skipped",
    "duplicate_coalesced",
    "publish_joined",
    "lock_lost",
]

__version__ = "0.3.0.dev0"  # the one place: pyproject.toml reads it (tool.setuptools.dynamic)
