"""What a LockedTask's result can hold beyond Celery's own: the WAITING state, and the error a skipped
duplicate's result raises. Public, and at this path for good: Celery rebuilds a stored error by its
module and class name."""

from __future__ import annotations

from celery.exceptions import TaskRevokedError

from .exceptions import DuplicateTask

WAITING = "WAITING"
"""The result state of a task parked in a key's line (not ready; it becomes the task's own end state
once its turn came and it ran)."""


class DuplicateSkipped(TaskRevokedError, DuplicateTask):
    """A duplicate skipped (``on_duplicate="skip"``): its result is REVOKED, and ``result.get()`` raises
    this, naming the ``key`` and the task that held it (``holder_task_id``). A ``TaskRevokedError`` (code
    that catches that keeps working), and a :class:`DuplicateTask`, as the "raise" policy's error is."""

    def __str__(self) -> str:
        return f"duplicate: lock {self.key} is held by task {self.holder_task_id}"
