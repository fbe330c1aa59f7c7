"""The engine's fixtures: ``backend``, the contract tests' lock store (tests/engine/test_lock*.py); and
the watchdog tests' ``server`` (a LockServer on ``fresh_redis``) and ``wd`` (a Watchdog shut down
after the test: tests/engine/test_watchdog*.py)."""

from __future__ import annotations

import pytest
from _apps import server_binaries
from _backends import EtcdStore, LockBackendUnderTest
from _lock_support import DB

from celery_singleton_lock.engine.server import LockServer
from celery_singleton_lock.testing.servers import RedisServer
from celery_singleton_lock.watchdog.renewer import Watchdog


@pytest.fixture(params=[*(name for name, _ in server_binaries()), "etcd"])
def backend(request):
    """The contract tests' lock store: each redis-server we have (as ``any_redis``), and etcd."""
    if request.param == "etcd":
        url = request.getfixturevalue("etcd_server").url()
        store = EtcdStore(url)
        yield LockBackendUnderTest("etcd", url, store)
        store.close()
        return
    with RedisServer(binary=dict(server_binaries())[request.param]) as server:
        yield LockBackendUnderTest("redis", server.url(DB), server.client(DB))


@pytest.fixture
def server(fresh_redis: RedisServer) -> LockServer:
    return LockServer.from_url(fresh_redis.url(2))


@pytest.fixture
def wd():
    dog = Watchdog()
    yield dog
    dog.shutdown()
