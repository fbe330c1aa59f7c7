"""Every exception of ours survives pickle, and Celery's JSON result serialisation through a
real Redis result backend (an exception that cannot be rebuilt kills the reader:
celery-singleton #55)."""

from __future__ import annotations

import pickle
import uuid

import pytest
from _apps import make_app
from _task_support import TIMEOUT, locked

from celery_singleton_lock import (
    DuplicateSkipped,
    DuplicateTask,
    LockBackendRefused,
    LockBackendUnavailable,
    LockContended,
    LockError,
    LockKeyError,
    LockLost,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("collect_results")]

EXCEPTIONS = [
    (DuplicateTask("singleton_lock:t:{ab}", "holder-id"),
     {"key": "singleton_lock:t:{ab}", "holder_task_id": "holder-id"}),
    (DuplicateTask("singleton_lock:t:{ab}", None), {"holder_task_id": None}),
    (LockContended("singleton_lock:t:{ab}", "holder-id", 51),
     {"key": "singleton_lock:t:{ab}", "holder_task_id": "holder-id", "attempts": 51}),
    (LockLost("singleton_lock:t:{ab}", "taken by another token"), {"key": "singleton_lock:t:{ab}",
                                                                   "reason": "taken by another token"}),
    (LockBackendUnavailable("redis://:***@127.0.0.1:1/2", "Connection refused"),
     {"url": "redis://:***@127.0.0.1:1/2", "reason": "Connection refused"}),
    (LockKeyError("cannot derive a lock key from argument k of type builtins.complex: (1+2j)."), {}),
    (DuplicateSkipped("singleton_lock:t:{ab}", "holder-id"),
     {"key": "singleton_lock:t:{ab}", "holder_task_id": "holder-id"}),
]
IDS = [type(e).__name__ + str(i) for i, (e, _) in enumerate(EXCEPTIONS)]


def check_same(got, original, attrs):
    assert type(got) is type(original)
    assert isinstance(got, LockError)
    assert got.args == original.args
    assert str(got) == str(original)
    for name, value in attrs.items():
        assert getattr(got, name) == value


@pytest.mark.parametrize("exc, attrs", EXCEPTIONS, ids=IDS)
def test_pickle_round_trip(exc, attrs):
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        check_same(pickle.loads(pickle.dumps(exc, protocol)), exc, attrs)


def test_a_server_error_names_the_kind_of_server_it_could_not_reach():
    """etcd's errors say etcd, not Redis."""
    assert str(LockBackendUnavailable("etcd://127.0.0.1:1", "refused")).startswith(
        "cannot reach the lock's etcd at etcd://127.0.0.1:1")
    assert "the lock's etcd at etcds://h:1 refused" in str(LockBackendRefused("etcds://h:1", "auth"))
    assert "the lock's Redis at redis://h:1/0 refused" in str(LockBackendRefused("redis://h:1/0", "auth"))


def test_lock_key_error_is_a_type_error():
    assert issubclass(LockKeyError, TypeError)


@pytest.mark.parametrize("exc, attrs", EXCEPTIONS, ids=IDS)
def test_json_result_backend_round_trip(redis_server, exc, attrs):
    app = make_app(redis_server, result_serializer="json", result_accept_content=["json"])
    task_id = str(uuid.uuid4())
    app.backend.mark_as_failure(task_id, exc)
    result = app.AsyncResult(task_id)
    assert result.state == "FAILURE"
    check_same(result.result, exc, attrs)
    with pytest.raises(type(exc)) as info:
        result.get(timeout=TIMEOUT)
    check_same(info.value, exc, attrs)


def test_raised_in_a_worker_and_read_through_json(redis_server, run_worker):
    """End to end: a task raises each of them; the JSON backend rebuilds each for the caller."""
    app = make_app(redis_server, result_serializer="json", result_accept_content=["json"],
                   task_default_queue=f"q-{uuid.uuid4().hex[:8]}")

    @locked(app)
    def boom(self, which):
        exc, _ = EXCEPTIONS[which]
        raise exc

    with run_worker(app, pool="threads", concurrency=2):
        results = [boom.delay(i) for i in range(len(EXCEPTIONS))]
        for result, (exc, attrs) in zip(results, EXCEPTIONS, strict=True):
            with pytest.raises(type(exc)) as info:
                result.get(timeout=TIMEOUT)
            check_same(info.value, exc, attrs)
