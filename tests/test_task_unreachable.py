"""The lock's Redis unreachable at acquire: the body never runs unlocked; the task retries
with back-off (RETRY) and, once lock_max_retries is spent, FAILS with LockBackendUnavailable
(a LockError). The broker and results stay on the private Redis."""

from __future__ import annotations

import uuid

import pytest
from _task_support import (
    TIMEOUT,
    Runs,
    collect_results,  # noqa: F401 - autouse: gc while Redis runs
    locked,
)
from celery.signals import task_retry
from conftest import make_app

from celery_singleton_lock import LockBackendUnavailable, LockError
from celery_singleton_lock.testing.servers import free_port

pytestmark = pytest.mark.timeout(90)


def unreachable_app(redis_server):
    secret = f"pw{uuid.uuid4().hex[:6]}"
    dead_url = f"redis://:{secret}@127.0.0.1:{free_port()}/0"  # nothing listens there
    app = make_app(
        redis_server, singleton_lock_max_retries=2,
        singleton_lock_redis_options={"socket_connect_timeout": 2},
        task_default_queue=f"q-{uuid.uuid4().hex[:8]}",
    )
    app.conf.singleton_lock_url = dead_url
    return app, secret


def test_worker_retries_then_fails_with_lock_backend_unavailable(redis_server, run_worker, request):
    app, secret = unreachable_app(redis_server)
    runs = Runs()

    @locked(app, max_retries=0)  # the task's own retry budget is not what is spent here
    def guarded(self, x):
        runs.begin(str(x), self.request.id)
        return x

    retries = []

    def on_retry(sender=None, request=None, reason=None, **_):
        if getattr(sender, "app", None) is app:
            retries.append((request.id, reason.exc))

    task_retry.connect(on_retry, weak=False)
    request.addfinalizer(lambda: task_retry.disconnect(on_retry))
    with run_worker(app, pool="threads", concurrency=2):
        result = guarded.delay(1)
        with pytest.raises(LockBackendUnavailable) as info:
            result.get(timeout=TIMEOUT)
    assert result.state == "FAILURE"
    assert isinstance(info.value, LockError)
    assert "cannot reach the lock's Redis" in str(info.value)
    assert secret not in str(info.value) and ":***@" in info.value.url
    assert runs.all == []  # never ran unlocked
    assert [tid for tid, _ in retries] == [result.id] * 2  # lock_max_retries=2 re-queues, then the failure
    assert all(isinstance(exc, LockBackendUnavailable) for _, exc in retries)


def test_eager_run_retries_in_place_then_fails(redis_server):
    app, secret = unreachable_app(redis_server)
    runs = Runs()

    @locked(app)
    def guarded(self, x):
        runs.begin(str(x), self.request.id)
        return x

    result = guarded.apply((1,))
    assert result.state == "FAILURE"
    assert isinstance(result.result, LockBackendUnavailable)
    assert secret not in str(result.result)
    assert runs.all == []
