"""A task under faults of its broker or its own lock_key: a visibility timeout, a raising key, a task
id used again. None ends in a body run twice or a call dropped. One section each, numbered on from
test_task_refusals.py:

7. an acks_late task held past the visibility timeout is delivered O(1) times;
8. a raising lock_key callable fails the task with LockKeyError;
9. only true redeliveries are dropped: eager reuse of an id, a re-applied frozen chord
   and a chain sent then applied eagerly all run.

Against real redis-servers and real Celery workers.
"""

from __future__ import annotations

import json

import pytest
from _faults_support import app_on, catching, fresh
from _task_support import TIMEOUT, Runs, locked
from celery import chain, chord, group
from celery.signals import task_failure

from celery_singleton_lock import LockKeyError
from celery_singleton_lock.testing.servers import wait_until

pytestmark = pytest.mark.usefixtures("collect_results")


# -- 7. redeliveries are not amplified ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.long
def test_acks_late_task_held_past_the_visibility_timeout_is_delivered_o1_times(
    worker_app, worker_processes, redis_server
):
    """acks_late, visibility timeout 2 s, kombu restoring unacked messages every second: a task
    holding its key 10 s is redelivered meanwhile. Those copies must not bounce in a re-send
    loop: a handful of deliveries, the body once, SUCCESS, and nothing left in the key's line."""
    worker = worker_processes(pool="prefork", concurrency=2, env={"CSL_ACKS_LATE": "1", "CSL_VISIBILITY": "2"})
    worker.wait_ready(60)
    task = worker_app.redelivery_probe
    key = fresh("redeliv")
    result = task.apply_async((key, 10.0))
    assert result.get(timeout=60)["key"] == key
    journal = worker_app.journal

    def deliveries() -> list[dict]:
        return [json.loads(d) for d in journal.lrange(f"deliveries:{result.id}", 0, -1)]

    # a few seconds more: no copy keeps coming back after the end either
    count = len(deliveries())
    with pytest.raises(TimeoutError):
        wait_until(lambda: len(deliveries()) > count, 3.0, what="another delivery")
    seen = deliveries()
    assert any(d["redelivered"] for d in seen), seen  # the broker did redeliver it while it ran
    assert len(seen) <= 4, f"{len(seen)} deliveries of one task id: {seen}"
    assert journal.llen(f"runs:redelivery_probe:{key}") == 1  # the body ran once
    assert result.state == "SUCCESS"
    name = task.lock_key_for((key, 10.0))
    locks = redis_server.client(2)
    assert not locks.exists(name, name + ":q", name + ":w"), (
        locks.lrange(name + ":q", 0, -1), locks.hkeys(name + ":w"),
    )
    assert "LOST" not in worker.log()


# -- 8. a raising lock_key callable ---------------------------------------------------------------


@pytest.mark.timeout(60)
def test_raising_lock_key_callable_fails_the_task_with_lock_key_error(redis_server, run_worker):
    app = app_on(redis_server)
    runs = Runs()

    def broken_key(x):
        raise ValueError(f"no key for {x!r}")

    @locked(app, lock_key=broken_key, name="faults.broken_key")
    def job(self, x):
        runs.begin(str(x), self.request.id)
        return x

    with catching(task_failure, app) as failures, run_worker(app, pool="threads", concurrency=2):
        result = job.delay(7)
        with pytest.raises(LockKeyError) as info:
            result.get(timeout=TIMEOUT)
    message = str(info.value)
    assert "faults.broken_key" in message and "lock_key" in message, message
    assert "ValueError" in message and "no key for 7" in message, message
    [failure] = failures
    exc = failure["exception"]
    assert isinstance(exc, LockKeyError) and isinstance(exc.__cause__, ValueError)  # chained
    assert runs.all == []


# -- 9. only true redeliveries are dropped ------------------------------------------------------


@pytest.mark.timeout(60)
def test_eager_run_or_fresh_message_reusing_a_finished_task_id_runs(redis_server, run_worker):
    """An acks_late task keeps a done record for its redeliveries; an eager run, or a fresh
    message, under the same task id is new work all the same."""
    app = app_on(redis_server)
    runs = Runs()

    @locked(app, acks_late=True, name="faults.reused_id")
    def job(self, x):
        runs.begin(str(x), self.request.id)
        return [x, self.request.id]

    k = fresh("reuse")
    with run_worker(app, pool="threads", concurrency=2):
        first = job.apply_async((k,))
        assert first.get(timeout=TIMEOUT) == [k, first.id]
        name = job.lock_key_for((k,))
        assert redis_server.client(2).zscore(name + ":d", first.id) is not None  # the done record
        eager = job.apply((k,), task_id=first.id)
        assert eager.state == "SUCCESS" and eager.result == [k, first.id]
        again = job.apply_async((k,), task_id=first.id)
        wait_until(lambda: len(runs.of(k, first.id)) == 3, TIMEOUT, what="the fresh message to run")
        assert again.get(timeout=TIMEOUT) == [k, first.id]
    assert len(runs.of(k, first.id)) == 3


@pytest.mark.timeout(60)
def test_reapplying_a_frozen_chord_runs_its_header_and_body_again(redis_server, run_worker):
    """After Celery's t/integration test_reapplying_frozen_chord_dispatches_body_again, with
    acks_late LockedTasks: the same task ids again are fresh messages, not redeliveries."""
    app = app_on(redis_server)
    runs = Runs()

    @locked(app, acks_late=True, name="faults.add")
    def add(self, a, b):
        runs.begin(f"add-{a}-{b}", self.request.id)
        return a + b

    @locked(app, acks_late=True, name="faults.tsum")
    def tsum(self, values):
        runs.begin("tsum", self.request.id)
        return sum(values)

    sig = chord(group(add.s(1, 2), add.s(3, 4)), tsum.s())
    sig.freeze()
    with run_worker(app, pool="threads", concurrency=4):
        first = sig.apply_async()
        assert first.get(timeout=TIMEOUT) == 10
        sig.apply_async()
        wait_until(lambda: len(runs.of("tsum")) == 2, TIMEOUT, what="the chord body to run again")
    assert len({r.task_id for r in runs.of("tsum")}) == 1  # the same frozen body id, run twice
    assert len(runs.of("add-1-2")) == len(runs.of("add-3-4")) == 2


@pytest.mark.timeout(60)
def test_chain_sent_then_applied_eagerly_returns_its_value(redis_server, run_worker):
    """After Celery's t/integration test_chain_in_chain_with_args, with acks_late LockedTasks."""
    app = app_on(redis_server)
    runs = Runs()

    @locked(app, acks_late=True, name="faults.identity")
    def identity(self, x):
        runs.begin(f"identity-{x}", self.request.id)
        return x

    c1 = chain(chain(identity.s(), identity.s()))
    with run_worker(app, pool="threads", concurrency=2):
        sent = c1.apply_async(args=(1,))
        assert sent.get(timeout=TIMEOUT) == 1
        assert len(runs.of("identity-1")) == 2
        applied = c1.apply(args=(1,))
        assert applied.get(timeout=TIMEOUT) == 1
    assert len(runs.of("identity-1")) == 4  # the eager run ran both links too
