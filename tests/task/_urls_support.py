"""The lock URL tests' shared helpers (tests/task/test_urls*.py): an app connected to nothing, what
redis-py makes of a URL, a password to look for, and ``_no_celery_env``, the autouse fixture each of
those modules imports (Celery reads its environment before app.conf)."""

from __future__ import annotations

import uuid

import pytest
import redis
from celery import Celery


def bare_app(**conf) -> Celery:
    """An app that is never connected to anything."""
    app = Celery(f"urls{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.update(**conf)
    return app


@pytest.fixture(autouse=True)
def _no_celery_env(monkeypatch):
    """Celery reads these before app.conf: a developer's shell must not change the results."""
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "CELERY_BROKER_READ_URL", "CELERY_BROKER_WRITE_URL"):
        monkeypatch.delenv(name, raising=False)


def kwargs_of(url: str) -> dict:
    """What redis-py makes of a URL, without connecting."""
    return redis.Redis.from_url(url).connection_pool.connection_kwargs


SECRET = "s3cretpw"
