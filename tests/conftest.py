"""Shared fixtures: a private redis-server, Celery apps on it, and workers.

Tests never touch the machine's own Redis (127.0.0.1:6379): every server here
is started by the fixture on a free port and stopped by PID.
"""

from __future__ import annotations

import gc
import os
import shutil
from collections.abc import Iterator

import pytest
from _apps import ROOT, make_app, server_binaries
from _backends import BACKENDS, LockBackendUnderTest, backend_of, lock_store
from _etcd_servers import EtcdCluster, find_etcd, running_etcd
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_singleton_lock.testing.servers import RedisServer, WorkerProcess


@pytest.fixture
def collect_results() -> Iterator[None]:
    """After the test, collect its garbage while the Redis server still runs: AsyncResult's __del__
    unsubscribes from the result backend, and fails noisily once the server is gone. Modules whose
    tests hold results use it: ``pytestmark = [..., pytest.mark.usefixtures("collect_results")]``."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One private redis-server for the session (db 0 broker, 1 results, 2 locks, 3 journal)."""
    with RedisServer() as server:
        yield server


@pytest.fixture(params=server_binaries(), ids=lambda p: p[0])
def any_redis(request) -> Iterator[RedisServer]:
    """A fresh private redis-server, once per server version available (7.x and 6.2)."""
    with RedisServer(binary=request.param[1]) as server:
        yield server


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdCluster]:
    """One private etcd member for the session (the etcd backend's contract tests); skipped, with the
    same one line for every test, where no etcd binary exists."""
    with running_etcd(members=1) as cluster:
        yield cluster


@pytest.fixture(params=BACKENDS)
def lock_backend(request, redis_server: RedisServer) -> Iterator[LockBackendUnderTest]:
    """The lock backend a contract test runs on (tests/_backends.py): its name, URL and store."""
    name, etcd_url = backend_of(request)
    url, store = lock_store(name, redis_server, etcd_url)
    yield LockBackendUnderTest(name, url, store)
    store.close()


@pytest.fixture
def fresh_redis() -> Iterator[RedisServer]:
    """A private redis-server of the test's own, for fault tests (pause, restart, stop)."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def lock_url(redis_server: RedisServer) -> str:
    return redis_server.url(2)


@pytest.fixture
def app(redis_server: RedisServer) -> Celery:
    """A Celery app whose broker, results and locks all live on the private redis-server."""
    return make_app(redis_server)


@pytest.fixture
def run_worker():
    """Start an in-process worker for an app: ``with run_worker(app, pool="threads"): ...``."""
    def _start(app: Celery, pool: str = "threads", concurrency: int = 4, **kwargs):
        return start_worker(
            app, pool=pool, concurrency=concurrency, perform_ping_check=False,
            loglevel="WARNING", shutdown_timeout=30, **kwargs,
        )
    return _start


@pytest.fixture
def worker_processes(redis_server: RedisServer, tmp_path):
    """Start real ``celery worker`` subprocesses running tests/apps/worker_app.py; stopped at the end."""
    started: list[WorkerProcess] = []

    def _start(pool: str = "prefork", concurrency: int = 2, env: dict | None = None, **kwargs) -> WorkerProcess:
        worker_env = {
            "CSL_REDIS_URL_BASE": f"redis://127.0.0.1:{redis_server.port}",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
            **(env or {}),
        }
        w = WorkerProcess(
            "apps.worker_app", pool=pool, concurrency=concurrency, env=worker_env,
            cwd=ROOT / "tests", logfile=str(tmp_path / f"worker{len(started)}.log"), **kwargs,
        )
        started.append(w.start())
        return w

    yield _start
    for w in started:
        w.stop()


@pytest.fixture
def worker_app(redis_server: RedisServer):
    """The subprocess workers' app module, configured for the private redis-server, on the client side."""
    from _task_support import load_worker_app  # one loader for every test module

    module = load_worker_app(redis_server)
    for db in (0, 1, 2, 3):
        redis_server.client(db).flushdb()  # our own private server only
    return module


def pytest_report_header(config):
    return [f"redis-server: {b} ({name})" for name, b in server_binaries()] + [
        f"celery: {__import__('celery').__version__}; redis-py: {__import__('redis').__version__}",
        f"rabbitmq on 5672: {'yes' if shutil.which('rabbitmqctl') else 'unknown'}",
        f"etcd: {find_etcd() or 'none (the etcd tests are skipped)'}",
    ]
