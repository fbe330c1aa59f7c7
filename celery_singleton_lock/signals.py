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
("skip", "retry", "raise", "backoff", "coalesce" or "redelivery")."""

lock_lost = Signal(name="lock_lost")
"""Sent (from the watchdog's thread) when a running execution's lock is gone: ``key``,
``task_id``, ``reason``."""

duplicate_coalesced = Signal(name="duplicate_coalesced")
"""Sent when a duplicate merged into the waiter last in line (``on_duplicate="coalesce"``): ``key``,
``task_id`` (the merged call), ``into_task_id`` (the waiter whose run covers it)."""

publish_joined = Signal(name="publish_joined")
"""Sent at publish (``lock_publish``) when a call was not published because its key has one: ``key``,
``task_id`` (the call found), ``state`` ("queued", "waiting" or "running"), ``mode`` ("join" or "raise")."""

__all__ = ["lock_acquired", "lock_released", "duplicate_skipped", "lock_lost", "duplicate_coalesced",
           "publish_joined"]
