"""A turn's record and the sweepers' part in the line (section 6 of the line-under-load tests).

6. A copy whose turn passed on while it travelled (the turn timeout) goes back to the head of the
   line, not ahead of it, and is never dropped as "already ran"; its record lives as long as its
   reservation, and ends at its deadline. A worker consumes the turns queue of each of its queues;
   a sweeper leaves alone the waiters of a task its process cannot send; a park lost with the data
   whose send fails is sent again at the next look.

Against a real Redis, and real ``celery worker`` subprocesses where a worker takes part.
"""

from __future__ import annotations

import uuid

import pytest
from _apps import make_app
from _backlog_support import SWEEP_SLACK, WORKER_ENV, last_deadline_ms, line_of, looks_left_to_others, server_ms
from _task_support import TIMEOUT, load_worker_app, locked, start_worker_process
from celery import Celery

from celery_singleton_lock import LockedTask, LockServer, LockWaitTimeout, held
from celery_singleton_lock.delivery.turns import SUFFIX, TurnsConsumer
from celery_singleton_lock.engine import line as queue
from celery_singleton_lock.engine.line import SWEEP_INTERVAL
from celery_singleton_lock.engine.lock import Handoff, Lock, slot_safe
from celery_singleton_lock.testing.servers import Monitor, wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("collect_results")]


# -- 6. a sent turn's record, in the engine (a real Redis, no worker) -----------------------------------


def test_a_sent_turn_keeps_its_record_and_reservation_then_ends_at_its_deadline(plain_server):
    """A turn sent and confirmed: the key stays reserved for it up to the turn timeout, and its record
    lives at least as long (before: one lock TTL, and the record could expire with the waiters hash
    while the copy travelled: "already ran", WAITING forever). Once the turn timeout passed the key on,
    the record stays out of the line until its lock_max_wait deadline, when the sweep fails it
    ("expired"; before: nothing ever timed it out)."""
    server = plain_server
    name = f"record-{uuid.uuid4().hex[:8]}"
    key = slot_safe(name)
    client = server.client
    holder = server.acquire(name, 5, owner_id="holder")
    assert queue.park(server, name, "e1", kind="t", wait=60, ttl=5, owner_id="w1", message=b"m").place == 1
    [turn] = server.release(holder).handoffs  # no sender here: reserved, not yet sent
    assert turn.entry == "e1"
    server.turn_timeout = 120.0
    assert server.confirm(name, "e1")
    assert client.pttl(key) > 100_000, "reserved for the sent turn up to the turn timeout"
    assert client.pttl(key + ":w") > 120_000, "its record outlives the reservation"

    name = f"record-late-{uuid.uuid4().hex[:8]}"
    key = slot_safe(name)
    holder = server.acquire(name, 5, owner_id="holder")
    queue.park(server, name, "e2", kind="t", wait=1.5, ttl=0.2, owner_id="w2", message=b"m")
    server.turn_timeout = 0.4
    server.release(holder)
    assert server.confirm(name, "e2")
    wait_until(lambda: not client.exists(key), 5, 0.05, "the turn timeout to pass the key on")
    next_ms, handoffs = queue.sweep(server, name)
    assert handoffs == () and next_ms > 0 and client.hexists(key + ":w", "e2"), "kept until its deadline"
    expired = wait_until(lambda: queue.sweep(server, name)[1], 5, 0.1, "the deadline")
    assert [(h.what, h.owner_id) for h in expired] == [("expired", "w2")]
    assert not client.exists(key + ":w", key + ":q")


def test_start_worker_consumes_the_turns_queue_of_each_of_its_queues(redis_server, run_worker):
    """celery.contrib.testing.worker.start_worker (as `celery worker -Q`) with a LockedTask: the
    worker also consumes <queue>.singleton_turns for each queue it consumes, and no more."""
    app = make_app(redis_server)
    queues = [f"csl-tq-{uuid.uuid4().hex[:8]}", f"csl-tq-{uuid.uuid4().hex[:8]}"]

    @locked(app, lock_key=["k"], on_duplicate="retry")
    def job(self, k):
        return k

    with run_worker(app, pool="threads", concurrency=1, queues=queues) as worker:
        assert sorted(app.amqp.queues.consume_from) == sorted(queues)  # the task channel: as asked
        step = next(s for s in worker.consumer.steps if isinstance(s, TurnsConsumer))
        (consumer,) = step.consumers  # the turns queues: a consumer and channel of their own
        assert sorted(q.name for q in consumer.queues) == sorted(q + SUFFIX for q in queues)
        assert consumer.channel is not worker.consumer.task_consumer.channel
        assert job.apply_async(("x",), queue=queues[1]).get(timeout=TIMEOUT) == "x"


def test_a_late_copy_never_takes_a_free_key_ahead_of_live_waiters(plain_server):
    """A's turn was sent, its reservation passed on to B, and B's (never sent) ran out too: the key is
    free, B waits at the head. A's late copy does not take the key ahead of B (before: it did, as its
    entry was out of the line); it goes back to the head (it is the oldest), and the sweep hands it
    the key in its turn."""
    server = plain_server
    name = f"late-fifo-{uuid.uuid4().hex[:8]}"
    key = slot_safe(name)
    client = server.client
    holder = server.acquire(name, 5, owner_id="holder")
    queue.park(server, name, "ea", kind="t", wait=60, ttl=0.2, owner_id="a", message=b"m")
    queue.park(server, name, "eb", kind="t", wait=60, ttl=0.2, owner_id="b", message=b"m")
    [turn] = server.release(holder).handoffs
    assert turn.owner_id == "a" and server.confirm(name, "ea")  # sent: reserved up to the turn timeout
    client.pexpire(key, 1)  # ... which ran out: the key passes on (a purged or very slow queue)
    wait_until(lambda: not client.exists(key), 5, 0.01, "A's reservation to run out")
    _, handed = queue.sweep(server, name)
    assert [h.owner_id for h in handed] == ["b"]  # B's turn, never sent (no sender here)
    wait_until(lambda: not client.exists(key), 5, 0.01, "B's reservation to run out")
    late = server.acquire(name, 5, owner_id="a", entry="ea")
    assert not isinstance(late, Lock), "A's late copy took the key ahead of B"
    assert late.queued  # free, but waiters are in line
    assert queue.park(server, name, "ea", kind="t", wait=50, ttl=0.2, owner_id="a", message=b"m", first=True,
                      again=True).found is queue.Park.PARKED  # its own copy (it carries the entry) parks anew
    _, handed = queue.sweep(server, name)
    assert [h.owner_id for h in handed] == ["a"], "the oldest waiter first"


@pytest.mark.slow
@pytest.mark.long
def test_a_sweeper_leaves_alone_the_waiters_of_a_task_its_process_cannot_send(redis_server, tmp_path_factory):
    """Two apps share one lock Redis and prefix. Only app A's process sweeps while app B's waiter runs
    out of lock_max_wait: A's sweeper must leave B's line alone (before: it timed the waiter out,
    could not send B's task, and the waiter stayed WAITING for ever). Once a worker of B runs again,
    its own sweeper fails the waiter with LockWaitTimeout."""
    from celery_singleton_lock.engine import sweeper as sweeping

    logdir = tmp_path_factory.mktemp("foreign-sweeper")
    wa = load_worker_app(redis_server)
    queue_b = f"csl-fs-{uuid.uuid4().hex[:8]}"
    k = f"foreign-{uuid.uuid4().hex[:8]}"
    key = wa.in_line_wait6.lock_key_for((k,), {})
    client = Celery(f"client-{uuid.uuid4().hex[:6]}", broker=redis_server.url(0), backend=redis_server.url(1),
                    set_as_current=False)
    client.conf.update(result_expires=None)
    # app A, in this process, on the same lock Redis and prefix (a database of their own, so that no
    # other test's workers sweep it): its sweeper watches the index
    lock_url = redis_server.url(5)
    app_a = make_app(redis_server)
    app_a.conf.singleton_lock_url = lock_url

    @app_a.task(base=LockedTask, shared=False, name=f"a.job_{uuid.uuid4().hex[:6]}")
    def a_job(n):
        return n

    server_a = a_job.lock_server()
    sweeping.get_sweeper().watch(server_a, a_job.lock_settings().index)
    # this process stands for app A alone: forget B's task if an earlier test here ever locked with it
    from celery_singleton_lock.delivery import handoff

    handoff._apps.pop(wa.in_line_wait6.name, None)
    handoff._heads.discard(f"{wa.in_line_wait6.lock_settings().prefix}:{wa.in_line_wait6.name}")
    plain = LockServer.from_url(lock_url)
    env = {**WORKER_ENV, "CSL_LOCK_TTL": "5", "CSL_LOCK_URL": lock_url}
    worker = start_worker_process(redis_server, logdir, concurrency=1, env=env, extra=("-Q", queue_b), name="b1")
    try:
        worker.wait_ready(90)
        with held(plain, key, ttl=30):  # the key is held (by plain code here) for the whole test
            late = client.send_task("apps.worker_app.in_line_wait6", (k, "late"), queue=queue_b)
            wait_until(lambda: late.state == "WAITING", TIMEOUT, 0.05, "B's task to wait in the line")
            deadline_ms = last_deadline_ms(plain.client, key)
            worker.stop()  # no process of B left: only A's sweeper looks at the line
            # past the waiter's deadline, with several looks of A's sweeper
            wait_until(lambda: server_ms(plain.client) > deadline_ms, 6 + TIMEOUT, 0.05, "B's waiter's deadline")
            with Monitor(redis_server, db=5) as mon:
                wait_until(lambda: looks_left_to_others(mon, key) >= 3, SWEEP_INTERVAL * 1.25 * 3 + TIMEOUT, 0.05,
                           "three looks of A's sweeper at B's line")
            assert line_of(plain.client, key) == [late.id], "A's sweeper took B's waiter out of the line"
            worker = start_worker_process(redis_server, logdir, concurrency=1, env=env, extra=("-Q", queue_b),
                                          name="b2")
            worker.wait_ready(90)
            with pytest.raises(LockWaitTimeout):
                late.get(timeout=SWEEP_SLACK + 10)
    finally:
        worker.stop()
        plain.close()


def test_a_park_lost_with_the_data_whose_send_fails_is_sent_again_at_the_next_look(plain_server):
    """The lock Redis lost its data while the broker is unreachable: the sweeper's send of the lost park
    raises. It keeps the park and sends it at its next look (it used to forget it: the call was lost)."""
    from celery_singleton_lock.engine.sweeper import Sweeper

    server = plain_server
    name = f"lost-{uuid.uuid4().hex[:8]}"
    assert isinstance(server.acquire(name, 30, owner_id="holder"), Lock)
    entry = queue.new_entry()
    assert queue.park(server, name, entry, kind="t", wait=60, ttl=5, owner_id="waiter", message=b"msg").place == 1
    sent: list[Handoff] = []

    def send(srv, handoff):
        sent.append(handoff)
        if len(sent) == 1:
            raise ConnectionError("the broker is unreachable")
        return True

    server.send_handoff = send
    sweeper = Sweeper(interval=0.2)
    try:
        sweeper.remember(server, name, entry, "waiter", 5, b"msg")
        server.client.flushdb()  # the lock db's data is lost
        wait_until(lambda: len(sent) >= 2, 10, 0.02, "the lost park to be sent again after the failed send")
        assert [(h.what, h.entry, h.owner_id) for h in sent[:2]] == [("recovered", entry, "waiter")] * 2
        wait_until(lambda: sweeper.parked_count() == 0, 5, 0.02, "the sent park to be forgotten")
        assert len(sent) == 2
    finally:
        sweeper.stop()
