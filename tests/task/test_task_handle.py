"""self.lock: the running execution's handle (.key, .token, .fencing_token, .lost, .ensure());
None outside an execution; each thread of a threads-pool worker sees its own."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from _apps import make_app
from _task_support import TIMEOUT, locked

from celery_singleton_lock import Lock, LockLost

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("collect_results")]


def test_handle_inside_and_outside_an_execution(redis_server, run_worker):
    app = make_app(redis_server, task_default_queue=f"q-{uuid.uuid4().hex[:8]}")
    locks = redis_server.client(2)

    @locked(app, lock_key=["k"], lock_ttl=20)
    def inspect_handle(self, k):
        lock = self.lock
        assert isinstance(lock, Lock)
        lock.ensure()  # held: no error
        stored = locks.get(lock.key).decode()
        return {
            "key": lock.key, "token": lock.token, "fence": lock.fencing_token, "lost": lock.lost,
            "stored_token": stored.split(" ", 1)[0], "ttl_ms": locks.pttl(lock.key),
            "expected_key": self.lock_key_for((k,), {}),
        }

    assert inspect_handle.lock is None  # outside any execution
    with run_worker(app, pool="threads", concurrency=2):
        k = f"h-{uuid.uuid4().hex[:8]}"
        first = inspect_handle.delay(k).get(timeout=TIMEOUT)
        second = inspect_handle.delay(k).get(timeout=TIMEOUT)
    assert first["key"] == first["expected_key"]
    assert first["token"] == first["stored_token"] and len(first["token"]) == 32
    assert first["lost"] is False and 0 < first["ttl_ms"] <= 20_000
    assert second["token"] != first["token"]
    assert second["fence"] > first["fence"] > 0  # fencing tokens only go up
    assert inspect_handle.lock is None


def test_lost_and_ensure():
    lock = Lock(server=None, key="k", token="t" * 32, fencing_token=1, ttl=60.0, confirmed_at=time.monotonic())
    lock.ensure()
    assert lock.mark_lost("expired") is True and lock.lost
    with pytest.raises(LockLost, match="expired"):
        lock.ensure()


def test_each_thread_sees_its_own_handle(redis_server, run_worker):
    """One task instance serves every thread; the handle lives on the per-thread request."""
    app = make_app(redis_server, task_default_queue=f"q-{uuid.uuid4().hex[:8]}")
    both_inside = threading.Barrier(2, timeout=TIMEOUT)

    @locked(app, lock_key=["k"])
    def twin(self, k):
        before = self.lock
        both_inside.wait()  # the two executions overlap here, on two threads
        after = self.lock
        both_inside.wait()
        return {"same": before is after, "key": after.key, "token": after.token,
                "expected": self.lock_key_for((k,), {}), "instance": id(self)}

    with run_worker(app, pool="threads", concurrency=2):
        a, b = twin.delay("a"), twin.delay("b")
        ra, rb = a.get(timeout=TIMEOUT), b.get(timeout=TIMEOUT)
    assert ra["instance"] == rb["instance"]  # one shared task instance ...
    assert ra["same"] and rb["same"]  # ... yet each thread kept its own handle
    assert ra["key"] == ra["expected"] and rb["key"] == rb["expected"] and ra["key"] != rb["key"]
    assert ra["token"] != rb["token"]
