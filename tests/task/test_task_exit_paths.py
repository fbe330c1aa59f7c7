"""Every way an execution ends lets its lock go (once, token-checked), and a fresh
duplicate then runs at once. In-process workers on the threads and solo pools; the
prefork-only paths (time limits, a killed child) are in test_task_crash.py.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest
from _apps import make_app
from _backends import backend_of, lock_store
from _task_support import TIMEOUT, Gates, Runs, TaskEvents, in_process_worker, locked
from celery.exceptions import Ignore, Reject
from celery.signals import after_task_publish

from celery_singleton_lock import LockKeyError
from celery_singleton_lock.testing.servers import wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("collect_results")]


PICKLED = {"task_serializer": "pickle", "accept_content": ["pickle", "json"], "result_serializer": "json",
           "result_accept_content": ["json"]}
"""Messages in pickle: a test sends an argument that cannot be keyed (a complex number)."""


class Env:
    """One app, its tasks and one in-process worker, shared by a module's tests (per pool)."""


@pytest.fixture(scope="module", params=[("threads", "redis"), ("solo", "redis"), ("threads", "etcd")],
                ids=lambda p: "-".join(p))
def env(request, redis_server):
    backend, etcd_url = backend_of(request)
    url, store = lock_store(backend, redis_server, etcd_url)
    # a queue of its own (module-wide worker)
    app = make_app(redis_server, singleton_lock_url=url, task_default_queue=f"q-{uuid.uuid4().hex[:8]}", **PICKLED)
    e = Env()
    e.app, e.pool, e.runs, e.gates, e.backend = app, request.param[0], Runs(), Gates(), backend
    e.locks = store
    runs = e.runs

    @locked(app, lock_key=["k"], max_retries=3, default_retry_delay=0)
    def path(self, k, mode="ok"):
        run = runs.begin(k, self.request.id, mode=mode, token=self.lock.token)
        try:
            if mode == "ok":
                return "ok"
            if mode == "exc":
                raise ValueError("boom")
            if mode == "retry":
                if self.request.retries == 0:
                    raise self.retry(countdown=0)
                return "retried"
            if mode == "ignore":
                raise Ignore()
            if mode == "reject":
                raise Reject("rejected", requeue=False)
            if mode == "takeover":
                # someone else's token took the key meanwhile (as after an expiry)
                e.locks.set(self.lock.key, "0" * 32 + ' 1 {"owner":"intruder"}', px=60_000)
                return "taken over"
            raise AssertionError(mode)
        finally:
            runs.end(run)

    @locked(app, lock_key=["k"], autoretry_for=(KeyError,), max_retries=2, default_retry_delay=0)
    def auto(self, k):
        run = runs.begin(k, self.request.id)
        try:
            if len(runs.of(k, self.request.id)) == 1:
                raise KeyError("first run fails")
            return "auto ok"
        finally:
            runs.end(run)

    @locked(app, lock_key=["k"], acks_late=True)  # Reject(requeue=True) needs acks_late
    def requeue(self, k):
        run = runs.begin(k, self.request.id, token=self.lock.token)
        try:
            if len(runs.of(k, self.request.id)) == 1:
                raise Reject("again", requeue=True)
            return "requeued"
        finally:
            runs.end(run)

    e.path, e.auto, e.requeue = path, auto, requeue
    with in_process_worker(app, e.gates, pool=e.pool, concurrency=4 if e.pool == "threads" else 1):
        yield e


def fresh_key() -> str:
    return f"k-{uuid.uuid4().hex[:10]}"


def assert_free_then_fresh_runs(env, rec, task, k):
    """No key is left behind, and a new call of the same task with the same key runs at once:
    its first execution takes the lock (no duplicate), and it ends in SUCCESS."""
    key = task.lock_key_for((k,), {})
    assert env.locks.exists(key) == 0, f"{key} left behind"
    fresh = task.delay(k, "ok") if task is env.path else task.delay(k)
    fresh.get(timeout=TIMEOUT)
    assert fresh.state == "SUCCESS"
    # its first execution took the lock at once (a task that retries itself may meet its own
    # lock later: that is the redelivery case, not a leftover)
    first = next(e for e in rec.events if e.task_id == fresh.id and e.signal in ("lock_acquired", "duplicate_skipped"))
    assert first.signal == "lock_acquired" and first.key == key
    assert env.runs.of(k, fresh.id)
    released = rec.wait_for("lock_released", task_id=fresh.id, count=len(env.runs.of(k, fresh.id)))
    # one run SUCCEEDED (a task that retries or requeues itself also released once before; in the
    # threads pool the two release signals may be recorded in either order)
    states = [e.kwargs["state"] for e in released]
    assert states.count("SUCCESS") == 1, states
    assert env.locks.exists(key) == 0


def assert_released_once_per_run(env, rec, task_id):
    """lock_released fires exactly once per execution that took the lock, and deleted it."""
    runs = env.runs.of(task_id=task_id)
    released = rec.wait_for("lock_released", task_id=task_id, count=len(runs))
    assert len(runs) >= 1, "the body never ran"
    assert len(released) == len(runs) == len(rec.of("lock_acquired", task_id=task_id))
    assert all(e.kwargs["deleted"] for e in released), released


@pytest.mark.parametrize(
    "mode, state, value",
    [
        ("ok", "SUCCESS", "ok"),
        ("exc", "FAILURE", ValueError),
        ("retry", "SUCCESS", "retried"),
    ],
)
def test_exit_path_with_result(env, rec, mode, state, value):
    k = fresh_key()
    result = env.path.delay(k, mode)
    if isinstance(value, type):
        with pytest.raises(value):
            result.get(timeout=TIMEOUT)
    else:
        assert result.get(timeout=TIMEOUT) == value
    assert result.state == state
    rec.wait_for("task_postrun", task_id=result.id, count=2 if mode == "retry" else 1)
    assert len(env.runs.of(k, result.id)) == (2 if mode == "retry" else 1)
    assert_released_once_per_run(env, rec, result.id)
    if mode == "retry":  # the first run ended RETRY, the second SUCCESS; each released its own lock
        assert sorted(e.kwargs["state"] for e in rec.of("lock_released", task_id=result.id)) == ["RETRY", "SUCCESS"]
    assert_free_then_fresh_runs(env, rec, env.path, k)


@pytest.mark.parametrize("task, value, states, order", [
    # sorted: in the threads pool the second run may take the key the instant the first run's
    # release frees it and report its own release before the first run's signal is recorded
    ("auto", "auto ok", ["RETRY", "SUCCESS"], sorted),
    # Reject(requeue=True): the lock is let go, and the requeued message (same id) runs
    ("requeue", "requeued", ["REJECTED", "SUCCESS"], list),
])
def test_exit_path_whose_message_runs_twice(env, rec, task, value, states, order):
    """autoretry_for (the first run fails: RETRY), and Reject(requeue=True) (the first run: REJECTED):
    each run released its own lock, once, and a fresh call then runs at once."""
    k = fresh_key()
    result = getattr(env, task).delay(k)
    assert result.get(timeout=TIMEOUT) == value
    assert len(env.runs.of(k, result.id)) == 2
    assert_released_once_per_run(env, rec, result.id)
    assert order(e.kwargs["state"] for e in rec.of("lock_released", task_id=result.id)) == states
    assert_free_then_fresh_runs(env, rec, getattr(env, task), k)


@pytest.mark.parametrize("mode, postrun_state", [("ignore", "IGNORED"), ("reject", "REJECTED")])
def test_exit_path_ignore_and_reject(env, rec, mode, postrun_state):
    """after_return is not called for IGNORED/REJECTED; task_postrun is, and releases."""
    k = fresh_key()
    result = env.path.delay(k, mode)
    [post] = rec.wait_for("task_postrun", task_id=result.id)
    assert post.kwargs["state"] == postrun_state
    assert len(env.runs.of(k, result.id)) == 1
    assert_released_once_per_run(env, rec, result.id)
    assert rec.of("lock_released", task_id=result.id)[0].kwargs["state"] == postrun_state
    if mode == "ignore":
        assert result.state == "PENDING"  # Celery's Ignore: nothing is stored
    else:  # Celery stores Reject(requeue=False) as FAILURE
        assert wait_until(lambda: result.state != "PENDING" and result.state, TIMEOUT) == "FAILURE"
    assert_free_then_fresh_runs(env, rec, env.path, k)


def test_exception_in_before_start_fails_task_and_worker_lives_on(env, rec):
    """An argument that cannot be keyed: FAILURE with LockKeyError naming it; nothing held."""
    result = env.path.apply_async(args=(complex(1, 2), "ok"))
    with pytest.raises(LockKeyError) as info:
        result.get(timeout=TIMEOUT)
    assert result.state == "FAILURE"
    message = str(info.value)
    assert "argument k " in message and "builtins.complex" in message, message
    assert env.runs.of(task_id=result.id) == []  # the body never ran
    [post] = rec.wait_for("task_postrun", task_id=result.id)
    assert post.kwargs["state"] == "FAILURE"
    assert rec.of("lock_acquired", task_id=result.id) == [] and rec.of("lock_released", task_id=result.id) == []
    # the worker lives on and runs the next task
    k = fresh_key()
    assert env.path.delay(k, "ok").get(timeout=TIMEOUT) == "ok"
    assert_free_then_fresh_runs(env, rec, env.path, k)


def test_release_is_token_checked(env, rec):
    """If another token holds the key at release, the release leaves it alone (and says so)."""
    k = fresh_key()
    result = env.path.delay(k, "takeover")
    assert result.get(timeout=TIMEOUT) == "taken over"
    [released] = rec.wait_for("lock_released", task_id=result.id)
    assert released.kwargs["deleted"] is False
    key = env.path.lock_key_for((k,), {})
    assert env.locks.get(key).startswith(b"0" * 32 + b" ")  # the other holder's value is intact
    env.locks.delete(key)
    assert len(rec.of("lock_released", task_id=result.id)) == 1


@pytest.mark.parametrize("which", ["self.retry", "autoretry_for"])
def test_retry_message_arriving_before_release_runs_after(env, rec, request, which):
    """self.retry() (and autoretry_for) publish the same task id while the old run still holds the lock.

    An after_task_publish receiver holds the old run right after it published the
    retry message (the lock is released only when Retry leaves the body) until the
    new message has arrived and been deferred as a redelivery; the retried run then
    happens after the release, never beside it.
    """
    if env.pool != "threads":
        pytest.skip("needs two executions at once in one worker (threads pool)")
    task = env.path if which == "self.retry" else env.auto
    args, expected = ((None, "retry"), "retried") if which == "self.retry" else ((None,), "auto ok")
    k = fresh_key()
    args = (k, *args[1:])
    task_id = str(uuid.uuid4())
    held = []
    first_only = threading.Lock()

    def hold_old_run(sender=None, headers=None, **_):
        # only the retry message (retries >= 1), published from the old run's thread
        # (the deferred copy's own re-publish looks the same: only the first one holds)
        if sender == task.name and headers.get("id") == task_id and headers.get("retries", 0) >= 1 \
                and first_only.acquire(blocking=False):
            rec.wait_for("duplicate_skipped", task_id=task_id)  # the retried message arrived meanwhile ...
            held.append(len(env.runs.of(k, task_id)))  # ... and did not run
            held.append(time.time())

    after_task_publish.connect(hold_old_run, weak=False)
    request.addfinalizer(lambda: after_task_publish.disconnect(hold_old_run))
    result = task.apply_async(args, task_id=task_id)
    assert result.get(timeout=TIMEOUT) == expected
    runs_during_hold, hold_ended = held
    assert runs_during_hold == 1
    dup = rec.of("duplicate_skipped", task_id=task_id)[0]
    assert dup.policy == "redelivery"  # the early copy waits its turn in line
    assert dup.holder_task_id == task_id
    first, second = env.runs.of(k, task_id)
    assert second.start >= max(hold_ended, first.end)  # after the old run (and its release), not beside it
    assert_released_once_per_run(env, rec, task_id)
    assert_free_then_fresh_runs(env, rec, task, k)


def test_skip_logs_at_info(env, rec, caplog):
    """A skipped duplicate is logged at INFO with the key, the task id and the holder."""
    caplog.set_level(logging.INFO, logger="celery_singleton_lock")
    k = fresh_key()
    key = env.path.lock_key_for((k,), {})
    # a foreign holder, so the duplicate is skipped without a second worker slot
    env.locks.set(key, "f" * 32 + ' 1 {"owner":"holder-123"}', px=60_000)
    try:
        result = env.path.delay(k, "ok")
        rec.wait_for("task_postrun", task_id=result.id)
    finally:
        env.locks.delete(key)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "duplicate" in r.getMessage()]
    assert any(key in line and result.id in line and "holder-123" in line for line in lines), lines
    assert env.runs.of(k) == []


# -- eager runs and direct calls (no worker) -----------------------------------------------


def eager_tasks(app, runs):
    @locked(app, lock_key=["k"], max_retries=3, default_retry_delay=0)
    def eager(self, k, mode="ok"):
        run = runs.begin(k, self.request.id, mode=mode, lock=self.lock)
        try:
            if mode == "exc":
                raise ValueError("eager boom")
            if mode == "retry" and self.request.retries == 0:
                raise self.retry(countdown=0)
            if mode == "ignore":
                raise Ignore()
            return mode
        finally:
            runs.end(run)

    return eager


@pytest.mark.parametrize("mode, state", [("ok", "SUCCESS"), ("exc", "FAILURE"), ("retry", "SUCCESS"),
                                         ("ignore", "IGNORED")])
def test_eager_apply_locks_and_leaves_no_key(app, redis_server, mode, state):
    runs = Runs()
    eager = eager_tasks(app, runs)
    locks = redis_server.client(2)
    k = fresh_key()
    key = eager.lock_key_for((k,), {})
    with TaskEvents(app) as rec:
        result = eager.apply((k, mode))
        assert result.state == state
        executions = runs.of(k)
        assert len(executions) == (2 if mode == "retry" else 1)
        for run in executions:  # each execution held the lock while it ran
            assert run.info["lock"] is not None and run.info["lock"].key == key
        assert len(rec.of("lock_released")) == len(rec.of("lock_acquired")) == len(executions)
        assert all(e.kwargs["deleted"] for e in rec.of("lock_released"))
        assert locks.exists(key) == 0
        assert eager.apply((k, "ok")).get() == "ok"  # a fresh duplicate runs at once
    assert locks.exists(key) == 0


def test_task_always_eager_propagating_exception_releases(redis_server):
    app = make_app(redis_server, task_always_eager=True, task_eager_propagates=True)
    runs = Runs()
    eager = eager_tasks(app, runs)
    locks = redis_server.client(2)
    k = fresh_key()
    with TaskEvents(app) as rec:
        with pytest.raises(ValueError, match="eager boom"):
            eager.delay(k, "exc")
        assert len(runs.of(k)) == 1
        [released] = rec.of("lock_released")
        # released as the body raised (the tracer itself re-raises before it sets a state)
        assert released.kwargs["state"] == "FAILURE" and released.kwargs["deleted"]
        assert locks.exists(eager.lock_key_for((k,), {})) == 0
        assert eager.delay(k, "ok").get() == "ok"
        assert len(rec.of("lock_released")) == 2
    assert locks.exists(eager.lock_key_for((k,), {})) == 0


def test_direct_call_takes_no_lock_and_leaks_none(app, redis_server):
    """task(x) runs no Celery hooks: no lock is taken (none can leak), self.lock is None."""
    runs = Runs()
    eager = eager_tasks(app, runs)
    locks = redis_server.client(2)
    k = fresh_key()
    with TaskEvents(app) as rec:
        assert eager(k, "ok") == "ok"
        with pytest.raises(ValueError):
            eager(k, "exc")
        assert rec.events == []
    assert [r.info["lock"] for r in runs.of(k)] == [None, None]
    assert locks.exists(eager.lock_key_for((k,), {})) == 0
    assert eager.lock is None  # outside any execution
