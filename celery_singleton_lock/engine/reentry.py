"""Reentrancy: the locks this thread holds, so the same owner taking the same key again nests.

redlock-py's ``ReentrantRedLock`` (see docs/how-to/beat.md) counts how
often one lock object was acquired and releases at the last release. We keep
that idea, with the owner made explicit and scoped to one thread:

* every lock this process takes for a ``held(...)`` block or a task execution
  is registered here, in a registry of the *current thread* (a
  ``threading.local``, so under gevent/eventlet one per greenlet), by
  ``(server, key, owner id)``;
* ``held(server, key, owner_id=X)`` while this thread already holds ``key`` on
  that server for owner ``X`` gets the same :class:`~celery_singleton_lock.engine.lock.Lock`
  back with ``depth`` + 1, without a round trip; leaving a nested block takes
  one off; only the outermost exit releases;
* another thread with the same owner id finds nothing here and takes the lock
  the ordinary way: it waits or is refused. Two threads running at once under one
  owner id are two executions, and the lock exists to keep executions apart;
* a lock without an owner id (``owner_id=None``) is nobody's to re-enter by
  name: each anonymous ``held()`` is an owner of its own. :meth:`Lock.reenter`
  re-enters a handle explicitly.

Pure bookkeeping: no Redis, no Celery.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

from ..exceptions import LockError


class Held(Protocol):
    """What the registry needs of a lock handle (:class:`~celery_singleton_lock.engine.lock.Lock`).

    Typed here rather than by importing lock.py: lock.py imports this module (``Lock.reenter``),
    and the registry needs nothing of the handle but these."""

    server: Any
    key: str
    owner_id: str | None
    token: str
    released: bool
    pid: int
    depth: int

    def ensure(self) -> None: ...


H = TypeVar("H", bound=Held)

_local = threading.local()

Slot = tuple[str, str, str | None]
"""(where the server is, lock key, owner id)."""


def _where(server: Any) -> str:
    """The server's identity for the registry: its (redacted) URL, i.e. host, port and db.

    Two LockServer objects on the same Redis database (a task's, and one that
    ``held(url, ...)`` made from the same URL) hold the same locks.
    """
    return str(getattr(server, "url", None) or id(server))


def _held() -> dict[Slot, Held]:
    table: dict[Slot, Held] | None = getattr(_local, "held", None)
    if table is None:
        table = _local.held = {}
    return table


def _live(lock: Held) -> bool:
    return not lock.released and lock.pid == os.getpid()


_PRUNE_AT = 64
"""A thread's registry is swept of released locks when it grows past this (a lock released by
some other way out than its holder's exit must not stay registered for ever)."""


def register(lock: Held) -> None:
    """``lock`` was just taken by this thread: it can be re-entered from now on (depth 1)."""
    lock.depth = 1
    table = _held()
    if len(table) >= _PRUNE_AT:
        for slot in [slot for slot, held in table.items() if not _live(held)]:
            del table[slot]
    table[(_where(lock.server), lock.key, lock.owner_id)] = lock


def unregister(lock: Held) -> None:
    """``lock`` is being released by this thread (its outermost exit)."""
    table = _held()
    slot = (_where(lock.server), lock.key, lock.owner_id)
    if table.get(slot) is lock:
        del table[slot]


def find(server: Any, key: str, owner_id: str | None) -> Held | None:
    """This thread's live lock on ``key`` for ``owner_id`` (never for an anonymous owner)."""
    if owner_id is None:
        return None
    table = _held()
    slot = (_where(server), key, owner_id)
    lock = table.get(slot)
    if lock is not None and not _live(lock):
        del table[slot]  # released by another way out, or a parent's lock after a fork
        return None
    return lock


def held_here(key: str, token: str) -> Held | None:
    """The live lock this thread holds on ``key`` with ``token`` (whatever the server's URL):
    how a "held" answer from Redis is recognised as this thread's own lock."""
    for (_srv, k, _owner), lock in list(_held().items()):
        if k == key and lock.token == token and _live(lock):
            return lock
    return None


def holds_key(key: str) -> bool:
    """Does this thread hold any live lock named ``key`` (on any server, for any owner)?"""
    return any(k == key and _live(lock) for (_srv, k, _owner), lock in _held().items())


@contextmanager
def again(lock: H) -> Iterator[H]:
    """Hold ``lock`` once more for the block (depth + 1); the block's end takes one off.

    Only in the thread that holds it. Raises :class:`~celery_singleton_lock.exceptions.LockLost`
    at once if the lock is already known lost: a nested critical section must not start
    under a lock that is gone.
    """
    here = _held().get((_where(lock.server), lock.key, lock.owner_id))
    if here is not lock or not _live(lock):
        raise LockError(
            f"lock {lock.key!r} (owner {lock.owner_id}) is not held by this thread: only the thread that took "
            "a lock can re-enter it; another thread must take it (and wait) like any other owner"
        )
    lock.ensure()
    lock.depth += 1
    try:
        yield lock
    finally:
        lock.depth -= 1


__all__ = ["register", "unregister", "find", "held_here", "holds_key", "again"]
