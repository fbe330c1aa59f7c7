"""A delivery whose task id equals the holder's is a redelivery of the running task, not a
duplicate: it never runs beside the holder, never touches the holder's result, and is not
lost. (The whole-worker-killed case is in test_task_crash.py; self.retry() racing its own
release is in test_task_exit_paths.py.)

In-process threads worker with ``task_track_started=True``: Celery's tracer stores STARTED
before ``before_start``, so LockedTask must take that store over, or a redelivery would
write STARTED over the holder's state.
"""

from __future__ import annotations

import gc
import logging
import os
import uuid

import pytest
from _task_support import (
    TIMEOUT,
    Gates,
    Recorder,
    Runs,
    collect_results,  # noqa: F401 - autouse: gc while Redis runs
    locked,
)
from conftest import make_app

from celery_singleton_lock.testing import wait_until

pytestmark = pytest.mark.timeout(120)


class Env:
    pass


@pytest.fixture(scope="module")
def env(redis_server):
    from celery.contrib.testing.worker import start_worker

    app = make_app(redis_server, task_track_started=True, task_default_queue=f"q-{uuid.uuid4().hex[:8]}")
    e = Env()
    e.app, e.runs, e.gates, e.locks = app, Runs(), Gates(), redis_server.client(2)

    @locked(app, lock_key=["k"])
    def job(self, k, mode="ok"):
        run = e.runs.begin(k, self.request.id, mode=mode, hostname=self.request.hostname)
        try:
            if mode == "gate":
                e.gates.wait(k)
            if mode == "fail":
                raise ValueError("holder failed")
            return f"{mode} by {self.request.id}"
        finally:
            e.runs.end(run)

    e.job = job
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False, loglevel="WARNING",
                      shutdown_timeout=30):
        try:
            yield e
        finally:
            e.gates.open_all()
    gc.collect()


@pytest.fixture
def rec(env):
    with Recorder(env.app) as r:
        yield r


@pytest.fixture
def info_log(caplog):
    caplog.set_level(logging.INFO, logger="celery_singleton_lock")
    return caplog


def logged(caplog, *parts):
    return [r.getMessage() for r in caplog.records if all(p in r.getMessage() for p in parts)]


def test_track_started_is_stored_by_the_holder_only(env, rec):
    """STARTED is still stored (by LockedTask, after the lock is taken), with pid and hostname."""
    k = f"started-{uuid.uuid4().hex[:8]}"
    holder = env.job.delay(k, "gate")
    [run] = env.runs.wait_started(k)
    meta = env.app.backend.get_task_meta(holder.id)
    assert meta["status"] == "STARTED"
    # what Celery's tracer stores: the pid, and the hostname the request carries
    assert meta["result"] == {"pid": os.getpid(), "hostname": run.info["hostname"]}
    assert env.job.track_started is False and env.job.lock_track_started is True
    env.gates.open(k)
    assert holder.get(timeout=TIMEOUT) == f"gate by {holder.id}"


def test_redelivery_while_holder_runs_waits_and_keeps_its_state(env, rec, info_log):
    k = f"running-{uuid.uuid4().hex[:8]}"
    key = env.job.lock_key_for((k,), {})
    holder = env.job.delay(k, "gate")
    env.runs.wait_started(k)
    # mark the holder's STARTED state, to see whether anything writes over it
    marker = {"pid": -1, "hostname": "holder-marker"}
    env.app.backend.store_result(holder.id, marker, "STARTED")
    copy = env.job.apply_async((k, "gate"), task_id=holder.id)
    assert copy.id == holder.id
    # the copy met the running holder, was deferred (re-queued), met it again: never ran
    events = rec.wait("duplicate", holder.id, count=2)
    assert all(e.data == {"holder": holder.id, "policy": "redelivery"} and e.key == key for e in events)
    assert len(env.runs.of(k)) == 1
    meta = env.app.backend.get_task_meta(holder.id)
    assert (meta["status"], meta["result"]) == ("STARTED", marker)
    assert logged(info_log, holder.id, "is being redelivered", key)
    # the holder ends well: its own value is the result, and the deferred copy is dropped
    env.gates.open(k)
    assert holder.get(timeout=TIMEOUT) == f"gate by {holder.id}"
    wait_until(lambda: logged(info_log, holder.id, "redelivery is dropped"), TIMEOUT, what="the copy to be dropped")
    assert len(env.runs.of(k)) == 1  # the body ran once
    assert env.app.AsyncResult(holder.id).get(timeout=TIMEOUT) == f"gate by {holder.id}"
    assert env.app.AsyncResult(holder.id).state == "SUCCESS"
    assert env.locks.exists(key) == 0
    assert len(rec.of("released", holder.id)) == 1


def test_redelivery_after_success_is_dropped(env, rec, info_log):
    k = f"done-{uuid.uuid4().hex[:8]}"
    holder = env.job.delay(k, "ok")
    assert holder.get(timeout=TIMEOUT) == f"ok by {holder.id}"
    rec.wait("released", holder.id)
    env.job.apply_async((k, "ok"), task_id=holder.id)
    [event] = rec.wait("duplicate", holder.id)
    assert event.data["policy"] == "redelivery"
    wait_until(lambda: logged(info_log, holder.id, "redelivery is dropped"), TIMEOUT, what="the drop")
    rec.wait("postrun", holder.id, count=2)
    assert len(env.runs.of(k)) == 1
    meta = env.app.backend.get_task_meta(holder.id)
    assert (meta["status"], meta["result"]) == ("SUCCESS", f"ok by {holder.id}")
    # a new task (new id) with the same key is no redelivery: it runs
    assert env.job.delay(k, "ok").get(timeout=TIMEOUT).startswith("ok by")
    assert len(env.runs.of(k)) == 2


def test_redelivery_after_failure_runs_again(env, rec):
    """Only a SUCCESS is final: a copy of a FAILED task id runs (at least once, like Celery's
    own worker_deduplicate_successful_tasks), after the holder, never beside it."""
    k = f"failed-{uuid.uuid4().hex[:8]}"
    holder = env.job.delay(k, "fail")
    with pytest.raises(ValueError):
        holder.get(timeout=TIMEOUT)
    rec.wait("released", holder.id)
    env.job.apply_async((k, "ok"), task_id=holder.id)
    # (get() would answer with the stored FAILURE at once: wait for the copy's own end)
    rec.wait("released", holder.id, count=2)
    meta = wait_until(lambda: (m := env.app.backend.get_task_meta(holder.id))["status"] == "SUCCESS" and m, TIMEOUT)
    assert meta["result"] == f"ok by {holder.id}"
    first, second = env.runs.of(k, holder.id)
    assert first.end <= second.start
