"""The same lock for code that is not a Celery task: ``with held(url, name, ttl): ...``.

It takes the lock (waiting up to ``wait`` seconds), has the process's
watchdog renew it while the block runs, and releases it however the block
ends. Inside, ``lock.ensure()`` and ``lock.fencing_token`` work as in a task.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from .exceptions import LockContended
from .lock import Holder, Lock, LockServer
from .watchdog import get_watchdog

_servers: dict[str, LockServer] = {}
_servers_lock = threading.Lock()


def _server(url: str) -> LockServer:
    with _servers_lock:
        if url not in _servers:
            _servers[url] = LockServer.from_url(url)
        return _servers[url]


@contextmanager
def held(
    server: LockServer | str,
    name: str,
    ttl: float = 30.0,
    *,
    wait: float = 0.0,
    owner_id: str | None = None,
) -> Iterator[Lock]:
    """Hold lock ``name`` for the block; raise :class:`LockContended` if it stays busy ``wait`` s."""
    if isinstance(server, str):
        server = _server(server)
    deadline = time.monotonic() + wait
    pause, attempts = 0.02, 0
    while True:
        attempts += 1
        outcome = server.acquire(name, ttl, owner_id=owner_id)
        if isinstance(outcome, Lock):
            break
        holder = outcome.owner_id if isinstance(outcome, Holder) else owner_id
        left = deadline - time.monotonic()
        if left <= 0:
            raise LockContended(outcome.key if isinstance(outcome, Holder) else name, holder, attempts)
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.5)
    watchdog = get_watchdog()
    watchdog.track(outcome)
    try:
        yield outcome
    finally:
        watchdog.forget(outcome)
        server.release(outcome)
