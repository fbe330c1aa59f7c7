"""Our Celery signals. Connect to them like Celery's own::

    from celery_singleton_lock import lock_lost

    @lock_lost.connect
    def page_someone(sender, key, task_id, reason, **kwargs): ...

``sender`` is always the task.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

lock_acquired = Signal(name="lock_acquired")
"""Sent when an execution took its lock: ``key``, ``task_id``, ``lock`` (the handle)."""

lock_released = Signal(name="lock_released")
"""Sent when an execution let its lock go: ``key``, ``task_id``, ``state`` (the task's end
state), ``deleted`` (False when the lock was no longer ours, e.g. it had expired)."""

duplicate_skipped = Signal(name="duplicate_skipped")
"""Sent when a duplicate did not run: ``key``, ``task_id``, ``holder_task_id``, ``policy``
("skip", "retry", "raise" or "redelivery")."""

lock_lost = Signal(name="lock_lost")
"""Sent (from the watchdog's thread) when a running execution's lock is gone: ``key``,
``task_id``, ``reason``."""

__all__ = ["lock_acquired", "lock_released", "duplicate_skipped", "lock_lost"]
