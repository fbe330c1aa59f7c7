"""The same lock for code that is not a Celery task: ``with held(url, name, ttl): ...``.

It takes the lock, waiting up to ``wait`` seconds in the key's line (woken by
the release that hands it the key, first come first served; on etcd it watches
the lock key and tries again when it changes, on a quorum it backs off), has the
process's watchdog renew it while the block runs, and releases it however the
block ends. Inside, ``lock.ensure()`` and ``lock.fencing_token`` work as in a task.

With an ``owner_id`` it is reentrant within one thread: the same owner taking
the same key again nests (``lock.depth``) instead of waiting for itself; see
:mod:`celery_singleton_lock.engine.reentry` and docs/how-to/beat.md.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast

from ..engine import reentry
from ..engine.backend import LockBackend
from ..engine.line import wait_turn
from ..engine.lock import Done, Holder, Lock, Verdict, slot_safe
from ..exceptions import LockContended
from ..watchdog.process import get_watchdog
from .servers import shared


def _server(url: str) -> LockBackend:
    """The process's LockServer for ``url`` (one Redis, a Cluster or a quorum; Sentinel: pass a LockServer),
    the same one a task on that URL uses."""
    return shared(url)


@contextmanager
def held(
    server: LockBackend | str,
    name: str,
    ttl: float = 30.0,
    *,
    wait: float = 0.0,
    owner_id: str | None = None,
) -> Iterator[Lock]:
    """Hold lock ``name`` for the block; raise :class:`LockContended` if it stays busy ``wait`` s.

    Reentrant for the same owner in the same thread: if this thread already
    holds ``name`` (on this server) for ``owner_id`` (a ``held`` block further
    up, or the running task's own lock with ``owner_id=self.request.id``), the
    block gets that same handle with ``depth`` + 1, at once and without a round
    trip, and only the outermost exit releases it. ``ttl`` and ``wait`` are then
    the outer hold's. Another owner, or the same owner id in another thread,
    waits or is refused as usual (even when this very thread holds the key:
    ``wait`` is honoured, and can only run out then).
    """
    if isinstance(server, str):
        server = _server(server)
    key = slot_safe(name)
    mine = cast("Lock | None", reentry.find(server, key, owner_id))  # the registry holds only Locks
    if mine is not None:  # the same owner, up this thread's stack: nest
        with reentry.again(mine) as lock:
            yield lock
        return
    outcome: Lock | Holder | Verdict | Done | None = None
    if wait <= 0 or reentry.holds_key(key):  # else wait_turn's first try is the only round trip
        outcome = server.acquire(name, ttl, owner_id=owner_id)
    if isinstance(outcome, Holder) and not outcome.queued:
        # held up this very stack (e.g. the same Redis reached through another URL spelling)?
        ours = cast("Lock | None", reentry.held_here(key, token=outcome.raw.partition(" ")[0]))
        if ours is not None:
            if owner_id is not None and ours.owner_id == owner_id:
                with reentry.again(ours) as lock:
                    yield lock
                return
    if not isinstance(outcome, Lock) and wait > 0:
        if server.supports_slot_wait:  # it can block a waiter in its line, woken by the release (one Redis)
            outcome = wait_turn(server, name, ttl, owner_id=owner_id, wait=wait)
        else:  # no line (a quorum), or none that holds plain code (etcd): try again when it changes
            outcome = _poll(server, name, ttl, owner_id, wait)
    if not isinstance(outcome, Lock):
        holder = outcome.owner_id if isinstance(outcome, Holder) else None
        raise LockContended(outcome.key if isinstance(outcome, Holder) else name, holder, 1)
    watchdog = get_watchdog()
    watchdog.track(outcome)
    reentry.register(outcome)
    try:
        yield outcome
    finally:
        reentry.unregister(outcome)
        if outcome.pid == os.getpid():  # a forked child leaves its parent's lock alone
            watchdog.forget(outcome)
            server.release(outcome)


def _poll(
    server: LockBackend, name: str, ttl: float, owner_id: str | None, wait: float,
) -> Lock | Holder | Verdict | Done:
    """Try again each time the key may have changed hands (etcd watches it), until ``wait`` runs out;
    where nothing tells (a quorum), every 20 ms doubling to 0.5 s."""
    deadline = time.monotonic() + wait
    pause = 0.02
    while True:
        outcome = server.acquire(name, ttl, owner_id=owner_id)
        left = deadline - time.monotonic()
        if isinstance(outcome, Lock) or left <= 0:
            return outcome
        if isinstance(outcome, Holder) and server.wait_for_change(name, outcome, left):
            continue
        time.sleep(min(pause, left) * random.uniform(0.5, 1.0))
        pause = min(pause * 2, 0.5)
