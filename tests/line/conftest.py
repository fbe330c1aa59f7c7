"""The line's fixtures. The fault tests share one worker cluster per module (``env``):
tests/apps/slot_faults_app.py on two prefork nodes, the lock Redis behind the fault proxy
(tests/_clusters.py). The tests of apps/worker_app.py's nodes start theirs on ``lock_nodes``; the
line-under-load tests (test_line_backlog.py, test_line_waiters.py, test_line_turns.py) theirs on
``redis_nodes`` (one pair per module) or ``amqp_nodes`` (tests/line/_backlog_support.py)."""

import pytest
from _backends import BACKENDS, backend_of, lock_store
from _backlog_support import start_nodes
from _clusters import worker_cluster
from _line_support import Nodes
from _task_support import load_worker_app, rabbit_up

from celery_singleton_lock import LockServer
from celery_singleton_lock.topologies.etcd import EtcdLockServer


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with worker_cluster("slot_faults_app", tmp_path_factory.mktemp("line"), lock_proxy=True) as module:
        yield module


@pytest.fixture(scope="module", params=BACKENDS)
def lock_nodes(request, redis_server):
    """:class:`Nodes` (tests/_line_support.py) whose locks live on the backend under test: the session's
    Redis (db 2) or etcd, at ``url``; results, locks and journal flushed (the broker db keeps its
    bindings). The module's own fixture starts its workers with CSL_LOCK_URL set to ``url``."""
    backend, etcd_url = backend_of(request)
    url, store = lock_store(backend, redis_server, etcd_url)
    n = Nodes()
    n.wa, n.locks, n.backend, n.url = load_worker_app(redis_server), store, backend, url
    for db in (1, 2, 3):
        redis_server.client(db).flushdb()  # our private server
    n.server = LockServer.from_url(url) if backend == "redis" else EtcdLockServer.from_url(url)
    try:
        yield n
    finally:
        n.server.close()


@pytest.fixture
def plain_server(redis_server):
    """A lock server on the session's Redis (db 2), for the engine's own calls; closed after."""
    server = LockServer.from_url(redis_server.url(2))
    yield server
    server.close()


@pytest.fixture(scope="module")
def redis_nodes(redis_server, tmp_path_factory):
    with start_nodes(redis_server, tmp_path_factory, "redis") as n:
        yield n


@pytest.fixture
def amqp_nodes(redis_server, tmp_path_factory):
    if not rabbit_up():
        pytest.skip("RabbitMQ: nothing accepts connections on 127.0.0.1:5672")
    with start_nodes(redis_server, tmp_path_factory, "amqp") as n:
        yield n
