"""The task fault tests' shared helpers (tests/task/test_task_faults.py, test_task_refusals.py,
test_task_delivery_faults.py): fresh names, an app on a queue of its own, the signals a task sent,
and the log lines a logger wrote."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from _apps import make_app

from celery_singleton_lock.testing.servers import RedisServer

LOGGER = "celery_singleton_lock"
WD_LOGGER = "celery_singleton_lock.watchdog"


def fresh(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def app_on(redis_server: RedisServer, lock_url: str | None = None, **conf):
    """An app on the session's server with a queue of its own (no other test's worker takes its
    messages), its locks at ``lock_url`` if given."""
    app = make_app(redis_server, task_default_queue=fresh("q"), **conf)
    if lock_url is not None:
        app.conf.singleton_lock_url = lock_url
    return app


@contextmanager
def catching(sig, app) -> Iterator[list[dict]]:
    """Every ``sig`` sent by a task of ``app``, as the keyword arguments it was sent with."""
    got: list[dict] = []

    def receiver(sender=None, **kwargs):
        if getattr(sender, "app", None) is app:
            got.append({"sender": sender, **kwargs})

    sig.connect(receiver, weak=False)
    try:
        yield got
    finally:
        sig.disconnect(receiver)


def records(caplog, logger: str, *parts: str, level: int = logging.DEBUG) -> list[str]:
    return [
        r.getMessage() for r in list(caplog.records)
        if r.name == logger and r.levelno >= level and all(p in r.getMessage() for p in parts)
    ]
