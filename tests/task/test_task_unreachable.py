"""The lock's Redis unreachable at acquire: the body never runs unlocked; the task retries
with back-off (RETRY) and, once lock_max_retries is spent, FAILS with LockBackendUnavailable
(a LockError). The broker and results stay on the private Redis."""

from __future__ import annotations

import time
import uuid

import pytest
from _apps import make_app
from _fault_proxy import FaultProxy
from _task_support import TIMEOUT, EagerLine, Runs, locked
from celery.signals import task_retry

from celery_singleton_lock import LockBackendUnavailable, LockError
from celery_singleton_lock.testing.servers import free_port

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("collect_results")]


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


def test_an_eager_run_gives_up_after_the_eager_timeout_naming_the_url(redis_server):
    """An eager run waits in place for an unreachable lock Redis, but not through the whole re-send
    budget (50 tries with back-off: minutes, a test that seems to hang): after singleton_lock_eager_timeout
    it fails with LockBackendUnavailable naming the URL and the setting. A bad value is refused by name."""
    app, secret = unreachable_app(redis_server)
    app.conf.singleton_lock_max_retries = 50
    app.conf.singleton_lock_eager_timeout = 1.0
    runs = Runs()

    @locked(app)
    def guarded(self, x):
        runs.begin(str(x), self.request.id)
        return x

    started = time.monotonic()
    result = guarded.apply((1,))
    took = time.monotonic() - started
    assert result.state == "FAILURE" and isinstance(result.result, LockBackendUnavailable), result.result
    message = str(result.result)
    assert "127.0.0.1:" in message and "singleton_lock_eager_timeout=1s" in message and secret not in message
    assert runs.all == []
    # the budget is 1 s; a connect refused at once on loopback; a generous tolerance for a busy host
    assert took < 1.0 + 10.0, took
    app.conf.singleton_lock_eager_timeout = "soon"

    @locked(app, name=f"bad-timeout-{uuid.uuid4().hex[:6]}")  # (a task's settings are resolved once)
    def later(self, x):
        return x

    with pytest.raises(ValueError, match="singleton_lock_eager_timeout.*'soon'"):
        later.apply((2,)).get()


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


def test_an_eager_run_waiting_in_line_rides_out_a_blip(redis_server):
    """An eager "retry" duplicate waits in line behind a holder; meanwhile every connection to the lock
    Redis is closed and new ones refused for 1 s. It used to fail with LockBackendUnavailable at once;
    it now waits on within ``singleton_lock_eager_timeout``, and runs once the holder lets go."""
    proxy = FaultProxy(redis_server.port)
    try:
        app = make_app(redis_server, singleton_lock_url=proxy.url(2), singleton_lock_eager_timeout=20.0)
        line = EagerLine(app, redis_server.client(2), "eager-blip")
        proxy.blackout(1.0)
        time.sleep(1.2)  # (the fault itself: the blip lasts 1 s, while the waiter waits)
        assert line.let_go().get(timeout=TIMEOUT) == "waiter"
        assert [tag for tag, _ in line.ran] == ["holder", "waiter"]
    finally:
        proxy.close()
