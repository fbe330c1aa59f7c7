"""Identity before policy: a delivery of a task id that ran before is not somebody's duplicate.

Every redelivery here is a REAL one: the message goes through kombu's own restore of unacked
messages (``_task_support.redeliver``), so the worker sees ``delivery_info["redelivered"]``.

* a redelivery of the running task waits first in line: dropped if the holder succeeds, run
  after it if the holder fails; it never runs beside it, never touches its state, and is
  delivered once (no re-send loop);
* a redelivery of a task id that already succeeded here (acks_late) is dropped, whoever holds
  the key now, under every policy, without touching its stored result;
* a redelivery of a task that did not succeed, and the task's own retry, wait their turn,
  even under "skip";
* a fresh message or an eager run that reuses a finished task id is new work: it runs.

In-process threads worker with ``task_track_started=True``: Celery's tracer stores STARTED
before ``before_start``, so LockedTask must take that store over, or a redelivery would
write STARTED over the holder's state.
"""

from __future__ import annotations

import logging
import os
import uuid

import pytest
from _apps import make_app
from _backends import BACKENDS, backend_of, lock_store
from _task_support import RESTORE_FAST, TIMEOUT, Gates, Runs, in_process_worker, locked, redeliver

from celery_singleton_lock.engine import line as lines
from celery_singleton_lock.testing.servers import wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("collect_results")]


class Env:
    pass


@pytest.fixture(scope="module", params=BACKENDS)
def env(request, redis_server):
    backend, etcd_url = backend_of(request)
    url, store = lock_store(backend, redis_server, etcd_url)
    queue = f"q-{uuid.uuid4().hex[:8]}"
    app = make_app(redis_server, task_track_started=True, task_default_queue=queue,
                   broker_transport_options=RESTORE_FAST, singleton_lock_url=url)
    e = Env()
    e.app, e.queue, e.runs, e.gates, e.locks, e.backend = app, queue, Runs(), Gates(), store, backend
    e.broker = redis_server.client(0)
    e.failures: dict[str, int] = {}

    def body(self, k, mode):
        run = e.runs.begin(k, self.request.id, mode=mode, hostname=self.request.hostname,
                           retries=self.request.retries)
        try:
            if mode.startswith("gate"):
                e.gates.wait(k)
            if mode == "gate-fail-once" and not e.failures.get(k):
                e.failures[k] = 1
                raise ValueError("holder failed")
            if mode == "retry-once" and self.request.retries == 0:
                raise self.retry(countdown=3.0)  # room for C to take the key first, even on a slow machine
            return f"{mode} by {self.request.id}"
        finally:
            e.runs.end(run)

    e.job = locked(app, lock_key=["k"], name="redeliv.job")(body)
    e.late = locked(app, lock_key=["k"], acks_late=True, name="redeliv.late")(body)
    e.late_skip = locked(app, lock_key=["k"], acks_late=True, on_duplicate="skip", name="redeliv.late_skip")(body)
    e.late_raise = locked(app, lock_key=["k"], acks_late=True, on_duplicate="raise", name="redeliv.late_raise")(body)
    with in_process_worker(app, e.gates):
        yield e


@pytest.fixture
def info_log(caplog):
    caplog.set_level(logging.INFO, logger="celery_singleton_lock")
    return caplog


def logged(caplog, *parts):
    return [r.getMessage() for r in caplog.records if all(p in r.getMessage() for p in parts)]


def waits(env, policy: str) -> str:
    """The policy a waiting delivery reports: its own (both backends keep a line)."""
    return policy


def waiting_state(env) -> set[str]:
    """What a waiting delivery's state reads: WAITING, in the key's line."""
    return {"WAITING"}


def fresh(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_track_started_is_stored_by_the_holder_only(env, rec):
    """STARTED is still stored (by LockedTask, after the lock is taken), with pid and hostname."""
    k = fresh("started")
    holder = env.job.delay(k, "gate")
    [run] = env.runs.wait_started(k)
    meta = env.app.backend.get_task_meta(holder.id)
    assert meta["status"] == "STARTED"
    # what Celery's tracer stores: the pid, and the hostname the request carries
    assert meta["result"] == {"pid": os.getpid(), "hostname": run.info["hostname"]}
    assert env.job.track_started is False and env.job.lock_track_started is True
    env.gates.open(k)
    assert holder.get(timeout=TIMEOUT) == f"gate by {holder.id}"


def test_redelivery_while_holder_runs_waits_first_and_is_dropped_when_it_succeeds(env, rec, info_log):
    """The copy waits first in line, and the holder's successful release drops it (on etcd too: the
    release deletes its waiter key before it hands the key on)."""
    k = fresh("running")
    key = env.job.lock_key_for((k, "x"), {})
    holder = env.job.delay(k, "gate")
    env.runs.wait_started(k)
    # mark the holder's STARTED state, to see whether anything writes over it
    marker = {"pid": -1, "hostname": "holder-marker"}
    env.app.backend.store_result(holder.id, marker, "STARTED")
    redeliver(env.broker, env.job, (k, "gate"), holder.id, env.queue)
    [event] = rec.wait_for("duplicate_skipped", task_id=holder.id)
    assert (event.holder_task_id, event.policy) == (holder.id, waits(env, "redelivery")) and event.key == key
    assert logged(info_log, holder.id, "waits in line", "redelivered copy of the running task")
    assert lines.line(env.job.lock_server(), key) == [holder.id]
    assert len(env.runs.of(k)) == 1
    meta = env.app.backend.get_task_meta(holder.id)
    assert (meta["status"], meta["result"]) == ("STARTED", marker)
    env.gates.open(k)
    assert holder.get(timeout=TIMEOUT) == f"gate by {holder.id}"
    # the copy is dropped at the holder's release
    expected = 1
    wait_until(lambda: not lines.line(env.job.lock_server(), key), TIMEOUT, what="the copy to be dropped")
    wait_until(lambda: not env.locks.exists(key, key + ":q", key + ":w"), TIMEOUT, what="nothing left")
    assert len(env.runs.of(k)) == 1  # the body ran once
    assert env.app.AsyncResult(holder.id).state == "SUCCESS"
    assert len(rec.of("lock_released", task_id=holder.id)) == 1
    assert len(rec.of("duplicate_skipped", task_id=holder.id)) == expected  # no re-send loop


def test_redelivery_while_holder_runs_runs_after_it_when_the_holder_fails(env, rec):
    k = fresh("holder-fails")
    holder = env.job.delay(k, "gate-fail-once")
    env.runs.wait_started(k)
    redeliver(env.broker, env.job, (k, "gate-fail-once"), holder.id, env.queue)
    rec.wait_for("duplicate_skipped", task_id=holder.id)
    env.gates.open(k)
    released = rec.wait_for("lock_released", task_id=holder.id, count=2)
    # the failed run let the key go, then the copy ran and succeeded. (Which of the two outcomes the
    # result backend keeps is Celery's race: both runs store under one task id; see README, Limits.)
    # (the signals' order is not the runs' order: the failed run signals after its hand-off's publish)
    assert sorted(e.kwargs["state"] for e in released) == ["FAILURE", "SUCCESS"]
    first, second = env.runs.of(k, holder.id)
    assert first.end <= second.start  # after the failed holder, never beside it


def test_redelivery_after_success_is_dropped_even_after_another_call_ran(env, rec, info_log):
    """A succeeds, B (same key) succeeds, then a redelivery of A arrives: it is dropped. The done
    record is per task id, not "the last one", and it is checked whoever holds the key."""
    k = fresh("a-then-b")
    a = env.late.delay(k, "ok")
    assert a.get(timeout=TIMEOUT) == f"ok by {a.id}"
    b = env.late.delay(k, "ok")
    assert b.get(timeout=TIMEOUT) == f"ok by {b.id}"
    redeliver(env.broker, env.late, (k, "ok"), a.id, env.queue)
    [event] = rec.wait_for("duplicate_skipped", task_id=a.id)
    assert event.policy == "redelivery"
    assert logged(info_log, a.id, "dropped", "already succeeded")
    # and while C holds the key, a redelivery of A is dropped at once, not queued behind C
    c = env.late.delay(k, "gate")
    wait_until(lambda: env.runs.of(k, c.id), TIMEOUT, what="C to hold the key")
    redeliver(env.broker, env.late, (k, "ok"), a.id, env.queue)
    rec.wait_for("duplicate_skipped", task_id=a.id, count=2)
    key = env.late.lock_key_for((k, "x"), {})
    assert not env.locks.exists(key + ":q")
    env.gates.open(k)
    assert c.get(timeout=TIMEOUT) == f"gate by {c.id}"
    rec.wait_for("task_postrun", task_id=a.id, count=3)
    assert [r.task_id for r in env.runs.of(k)] == [a.id, b.id, c.id]  # A ran once
    assert env.app.backend.get_task_meta(a.id, cache=False)["result"] == f"ok by {a.id}"


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_redelivery_of_a_success_never_meets_the_duplicate_policy(env, rec, policy):
    """Under skip/raise, a redelivered copy of a finished task used to overwrite its SUCCESS with
    REVOKED or FAILURE. It is dropped instead, and the stored result stays."""
    task = env.late_skip if policy == "skip" else env.late_raise
    k = fresh(f"policy-{policy}")
    a = task.delay(k, "ok")
    assert a.get(timeout=TIMEOUT) == f"ok by {a.id}"
    c = task.delay(k, "gate")
    wait_until(lambda: env.runs.of(k, c.id), TIMEOUT, what="C to hold the key")
    redeliver(env.broker, task, (k, "ok"), a.id, env.queue)
    [event] = rec.wait_for("duplicate_skipped", task_id=a.id)
    assert event.policy == "redelivery"
    rec.wait_for("task_postrun", task_id=a.id, count=2)
    meta = env.app.backend.get_task_meta(a.id, cache=False)  # what is stored now, not what a.get() saw
    assert (meta["status"], meta["result"]) == ("SUCCESS", f"ok by {a.id}")
    env.gates.open(k)
    assert c.get(timeout=TIMEOUT) == f"gate by {c.id}"
    assert [r.task_id for r in env.runs.of(k)] == [a.id, c.id]


def test_a_redelivered_task_that_never_finished_waits_its_turn_even_under_skip(env, rec):
    """A redelivery of a task that has not succeeded (its worker died, say) is not a duplicate to
    skip: it waits in line behind the current holder and runs after it."""
    k = fresh("unfinished")
    c = env.late_skip.delay(k, "gate")
    wait_until(lambda: env.runs.of(k, c.id), TIMEOUT, what="C to hold the key")
    lost_id = str(uuid.uuid4())  # a task whose first delivery never finished
    # its run had started: with track_started, STARTED is what it left (a task that never started
    # leaves nothing, and then its redelivery meets the policy: see test_line_recovery)
    env.app.backend.store_result(lost_id, {"pid": -1, "hostname": "died"}, "STARTED")
    redeliver(env.broker, env.late_skip, (k, "ok"), lost_id, env.queue)
    event = rec.wait_for("duplicate_skipped", task_id=lost_id)[0]
    assert event.policy == waits(env, "retry")  # waiting (or backing off), not skipped
    assert env.app.AsyncResult(lost_id).state in waiting_state(env)
    env.gates.open(k)
    assert c.get(timeout=TIMEOUT) == f"gate by {c.id}"
    assert env.app.AsyncResult(lost_id).get(timeout=TIMEOUT) == f"ok by {lost_id}"
    assert [r.task_id for r in env.runs.of(k)] == [c.id, lost_id]


def test_the_tasks_own_retry_waits_its_turn_even_under_skip(env, rec):
    """A self.retry() message that arrives while another call holds the key used to be REVOKED
    under "skip": the retry was lost. It waits its turn instead."""
    k = fresh("own-retry")
    a = env.late_skip.delay(k, "retry-once")
    rec.wait_for("lock_released", task_id=a.id)  # its first run ended with self.retry(countdown=3)
    c = env.late_skip.delay(k, "gate")
    wait_until(lambda: env.runs.of(k, c.id), TIMEOUT, what="C to hold the key")
    rec.wait_for("duplicate_skipped", task_id=a.id)  # the retry met C ...
    # ... and waits in line, not REVOKED
    assert env.app.AsyncResult(a.id).state in waiting_state(env)
    env.gates.open(k)
    assert c.get(timeout=TIMEOUT) == f"gate by {c.id}"
    assert a.get(timeout=TIMEOUT) == f"retry-once by {a.id}"
    runs = env.runs.of(k)
    assert [r.task_id for r in runs] == [a.id, c.id, a.id] and runs[2].info["retries"] == 1


def test_a_fresh_message_reusing_a_finished_task_id_runs(env, rec):
    """Celery re-sends task ids on purpose (re-applying a frozen chord): a fresh message is new
    work even when that id already succeeded here, acks_late or not."""
    k = fresh("resend")
    a = env.late.delay(k, "ok")
    assert a.get(timeout=TIMEOUT) == f"ok by {a.id}"
    env.late.apply_async((k, "again"), task_id=a.id)
    [_, post] = rec.wait_for("task_postrun", task_id=a.id, count=2)  # (Celery keeps the first SUCCESS it stored)
    assert post.kwargs["state"] == "SUCCESS"
    assert [r.info["mode"] for r in env.runs.of(k, a.id)] == ["ok", "again"]


def test_an_eager_run_reusing_a_finished_task_id_runs(env, rec):
    """An eager run is never a redelivery: it runs, and EagerResult.get() returns its value (not None)."""
    k = fresh("eager-reuse")
    a = env.late.delay(k, "ok")
    assert a.get(timeout=TIMEOUT) == f"ok by {a.id}"
    eager = env.late.apply((k, "eager"), task_id=a.id)
    assert eager.get() == f"eager by {a.id}"
