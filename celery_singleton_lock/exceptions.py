"""The package's errors.

Every error here keeps all of its constructor arguments in ``self.args``, and
only JSON-friendly values in them (strings, numbers, None). That is what lets a
Celery result backend store one and rebuild it on the other side, with pickle
or with JSON: Celery re-creates an exception as ``cls(*args)``. An exception that
cannot be rebuilt that way kills the worker that tries (celery-singleton #55).
"""

from __future__ import annotations


class LockError(Exception):
    """Base class of every error this package raises on purpose."""


def _server_at(url: str) -> str:
    """What the lock server at ``url`` is, in an error's words: etcd, or a Redis (one, Sentinel's,
    a Cluster's, a quorum's members)."""
    return "etcd" if url.startswith(("etcd://", "etcds://")) else "Redis"


class LockBackendUnavailable(LockError):
    """The lock server (a Redis, or etcd) could not be reached (connection refused, timeout, ...).

    ``url`` is shown without its password.
    """

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(url, reason)
        self.url = url
        self.reason = reason

    def __str__(self) -> str:
        return f"cannot reach the lock's {_server_at(self.url)} at {self.url}: {self.reason}"


class LockBackendRefused(LockError):
    """The lock server refused in a way that trying again cannot fix: a wrong password
    or ACL, a server that is not Redis, a key holding something that is not our lock.

    ``url`` is shown without its password; ``reason`` says what to fix.
    """

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(url, reason)
        self.url = url
        self.reason = reason

    def __str__(self) -> str:
        return f"the lock's {_server_at(self.url)} at {self.url} refused: {self.reason}"


class LockLost(LockError):
    """The lock this execution held is gone: expired, deleted or taken by another."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(key, reason)
        self.key = key
        self.reason = reason

    def __str__(self) -> str:
        return f"lock {self.key!r} was lost: {self.reason}"


class DuplicateTask(LockError):
    """Raised (``on_duplicate="raise"``) when another execution holds the key."""

    def __init__(self, key: str, holder_task_id: str | None) -> None:
        super().__init__(key, holder_task_id)
        self.key = key
        self.holder_task_id = holder_task_id

    def __str__(self) -> str:
        return f"lock {self.key!r} is held by task {self.holder_task_id}"


class LockContended(LockError):
    """The lock stayed held for all the retries a duplicate was allowed."""

    def __init__(self, key: str, holder_task_id: str | None, attempts: int) -> None:
        super().__init__(key, holder_task_id, attempts)
        self.key = key
        self.holder_task_id = holder_task_id
        self.attempts = attempts

    def __str__(self) -> str:
        return (
            f"lock {self.key!r} was still held by task {self.holder_task_id} "
            f"after {self.attempts} attempts"
        )


class LockKeyError(LockError, TypeError):
    """The task's arguments cannot be turned into a lock key."""


class LockWaitTimeout(LockContended):
    """A duplicate waited in the key's line longer than its ``lock_max_wait``: the line did not move."""

    def __init__(self, key: str, max_wait: float) -> None:
        LockError.__init__(self, key, max_wait)
        self.key = key
        self.max_wait = max_wait
        self.holder_task_id = None
        self.attempts = 0

    def __str__(self) -> str:
        return f"waited in line for lock {self.key!r} longer than lock_max_wait ({self.max_wait:g}s)"


class SelfDeadlock(LockError):
    """An eager call would wait for a lock that its own caller, up the same call stack, holds.

    Under ``task_always_eager`` (or ``apply()``), a LockedTask that calls another call
    with the same key from inside its body can never get the lock: the caller waits
    for the call, and the call would wait for the caller.
    """

    def __init__(self, key: str, holder_task_id: str | None) -> None:
        super().__init__(key, holder_task_id)
        self.key = key
        self.holder_task_id = holder_task_id

    def __str__(self) -> str:
        return (
            f"lock {self.key!r} is held by task {self.holder_task_id}, which is up this call stack: waiting "
            "for it would deadlock (an eager call of the same key from inside the locked task)"
        )


class AlreadyQueued(LockError):
    """Raised at publish (``lock_publish="raise"``) when a call of the same key is queued, waiting or
    running: ``task_id`` names it, ``state`` says which. Nothing was published."""

    def __init__(self, key: str, task_id: str, state: str = "queued") -> None:
        super().__init__(key, task_id, state)
        self.key = key
        self.task_id = task_id
        self.state = state

    def __str__(self) -> str:
        return f"a call of lock {self.key!r} is already {self.state}: task {self.task_id} (nothing was published)"
