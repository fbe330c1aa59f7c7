"""The line keeps each call's identity through every redelivery: a call waits once, runs once, and
ends in its own state, whatever was killed.

Real ``celery worker`` subprocesses (prefork, acks_late + reject_on_worker_lost, so a SIGKILLed
child's message goes back to the broker and is redelivered), a real Redis broker, and real faults:
SIGKILL at a named point (CSL_TEST_KILL_AT, once per worker with CSL_TEST_KILL_ONCE) or by PID,
a real broker redelivery through kombu's restore.

* a parked delivery whose ack was lost is redelivered: it finds its entry and parks no second one;
* a hand-off copy SIGKILLed mid-body is redelivered: it runs again, once, to its end;
* a process SIGKILLed after the release and before Celery stored the result: the redelivery stores
  the recorded value and sends the chain, without running the body again;
* two messages carrying one ``singleton_lock_token`` never both hold the lock.

The lock Redis's data lost is in test_line_data_loss.py; the line's edges in test_line_edges.py.
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
import uuid

import pytest
from _apps import make_app
from _line_support import events, open_gate, parks, starts, wait_starts, worker_nodes
from _recovery_support import LATE, LOCK_TTL
from _task_support import RESTORE_FAST, TIMEOUT, Gates, Runs, TaskEvents, assert_no_overlap, locked, redeliver
from celery import chain

from celery_singleton_lock.testing.servers import wait_until

pytestmark = [pytest.mark.timeout(150), pytest.mark.usefixtures("collect_results")]


@pytest.fixture(scope="module")
def nodes(lock_nodes, redis_server, tmp_path_factory):
    """One acks_late node (2 children) on ``queue``, and two single-child acks_late workers that die
    once each at a named point: right after a park, right after a release; their locks on Redis or
    on etcd."""
    n = lock_nodes
    late = {**LATE, "CSL_LOCK_URL": n.url}
    tag = uuid.uuid4().hex[:8]
    n.queue, n.q_parked, n.q_released = f"csl-li-{tag}", f"csl-li-parked-{tag}", f"csl-li-released-{tag}"
    logdir = tmp_path_factory.mktemp("identity")
    specs = {"node": (n.queue, 2, late)}
    for point, queue in (("parked", n.q_parked), ("released", n.q_released)):
        specs[f"kill-{point}"] = (queue, 1, {**late, "CSL_TEST_KILL_AT": point,
                                             "CSL_TEST_KILL_ONCE": str(logdir / f"killed-{point}")})
    with worker_nodes(redis_server, logdir, specs) as started:
        n.node, n.kill_parked, n.kill_released = started["node"], started["kill-parked"], started["kill-released"]
        yield n


@pytest.mark.slow
def test_parked_delivery_redelivered_after_its_ack_was_lost_parks_once_and_runs_once(nodes):
    """A child SIGKILLed right after PARK, before its delivery was acked: the broker
    redelivers the message; it finds its entry in the line (entries are derived from the task id)
    and ends, so the task waits ONCE and runs once, in its turn."""
    n, wa = nodes, nodes.wa
    k, key, holder = n.gated_holder("park-twice")
    try:
        wait_starts(wa, k, 1)
        victim = wa.in_line.apply_async((k, 0.0, "victim"), queue=n.q_parked)
        # the first delivery died right after its park; the redelivery is the one that signals
        wait_until(lambda: parks(wa, victim.id), TIMEOUT, 0.05, "the redelivered copy to end")
        assert n.line_len(key) == 1, "it parked a second entry"
        assert n.backend != "redis" or n.locks.hlen(key + ":w") == 1, "it parked a second entry"
    finally:
        open_gate(wa, k)
    assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
    assert victim.get(timeout=TIMEOUT)["tag"] == "victim"
    ran = [e["id"] for e in starts(wa, k)]
    assert ran == [holder.id, victim.id], "the victim ran once, after the holder"
    n.nothing_left(key)


@pytest.mark.slow
def test_hand_off_copy_killed_mid_body_is_redelivered_and_runs_again_to_its_end(nodes):
    """The claim deleted the waiter's entry; its copy's child is SIGKILLed mid-body. The
    broker redelivers that copy (entry header and all): it must run again, not be dropped as
    "entry gone" (its body never finished)."""
    n, wa = nodes, nodes.wa
    k = f"handoff-killed-{uuid.uuid4().hex[:8]}"
    key = wa.in_line_gated.lock_key_for((k, "x"), {})
    holder = wa.in_line_gated.apply_async((k, "holder"), queue=n.queue)
    wait_starts(wa, k, 1)
    waiter = wa.in_line_gated.apply_async((k, "w"), queue=n.queue)
    wait_until(lambda: n.line_len(key) == 1, TIMEOUT, 0.02, "the waiter to park")
    open_gate(wa, f"{k}:holder")
    assert holder.get(timeout=TIMEOUT)["tag"] == "holder"
    second = wait_starts(wa, k, 2)[1]
    assert second["id"] == waiter.id
    os.kill(second["pid"], signal.SIGKILL)  # the pool child running the hand-off copy, by PID
    open_gate(wa, f"{k}:w")  # its next run passes at once
    assert waiter.get(timeout=TIMEOUT + LOCK_TTL)["tag"] == "w"
    ran = starts(wa, k)
    assert [e["id"] for e in ran] == [holder.id, waiter.id, waiter.id]
    ends = [e["id"] for e in events(wa, k) if e["event"] == "end"]
    assert ends == [holder.id, waiter.id]  # the killed run never ended; the second ran to its end once
    n.nothing_left(key)


@pytest.mark.slow
def test_killed_after_the_release_the_redelivery_stores_the_result_and_sends_the_chain(nodes):
    """The child dies after the release wrote the done record and before Celery stored
    the result and sent the chain. The redelivery finds "already succeeded" and no SUCCESS in the
    result backend: it stores the recorded value and sends the chain; the body does not run again."""
    n, wa = nodes, nodes.wa
    k = f"released-{uuid.uuid4().hex[:8]}"
    key = wa.in_line_append.lock_key_for(([], k, "x"), {})
    result = chain(
        wa.in_line_append.s([], k, "a").set(queue=n.q_released),
        wa.plain_append.s("c").set(queue=n.queue),
    ).apply_async()
    assert result.get(timeout=TIMEOUT) == ["a", "c"], "the chain's next step was never sent"
    first = result.parent
    # (Celery sends a chain's next step before it stores the result: the chain can end first)
    meta = wait_until(lambda: (m := wa.app.backend.get_task_meta(first.id, cache=False))["status"] != "PENDING" and m,
                      TIMEOUT, what="the redelivery to store the first step's result")
    assert (meta["status"], meta["result"]) == ("SUCCESS", ["a"])
    assert [e["id"] for e in starts(wa, k)] == [first.id], "the body ran again"
    assert "already succeeded but its result was never stored" in n.kill_released.log()
    n.nothing_left(key)


# -- one token, two messages ---------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_two_messages_with_one_token_never_both_hold_the_lock(redis_server, run_worker):
    """A re-send carrying singleton_lock_token takes back the orphan lock its lost attempt
    left; a broker redelivery of that same message (same header) while the first copy runs must not
    be granted the lock too: it waits as a redelivered copy of the running task, and is dropped
    when it succeeds."""
    queue = f"q-{uuid.uuid4().hex[:8]}"
    app = make_app(redis_server, task_default_queue=queue, broker_transport_options=RESTORE_FAST)
    gates, runs = Gates(), Runs()
    second_started = threading.Event()

    @locked(app, lock_key=["k"], lock_ttl=30, name=f"li_token_{uuid.uuid4().hex[:6]}.job")
    def job(self, k):
        run = runs.begin(k, self.request.id, token=self.lock.token)
        if len(runs.of(k)) > 1:
            second_started.set()
        try:
            gates.wait(k)
            return k
        finally:
            runs.end(run)

    k = f"k-{uuid.uuid4().hex[:8]}"
    task_id = str(uuid.uuid4())
    old = secrets.token_hex(16)
    # the orphan: an attempt whose acquire ran on Redis though its reply was lost
    orphan = job.lock_server().acquire(job.lock_key_for((k,)), 30, owner_id=task_id, token=old)
    assert orphan.token == old
    headers = {"singleton_lock_token": old, "singleton_lock_unreachable": 1}
    with TaskEvents(app) as rec, run_worker(app, pool="threads", concurrency=3):
        first = job.apply_async((k,), task_id=task_id, headers=headers)
        runs.wait_started(k)
        redeliver(redis_server.client(0), job, (k,), task_id, queue, headers=headers)
        wait_until(lambda: second_started.is_set() or rec.of("duplicate_skipped", task_id=task_id), TIMEOUT, 0.02,
                   "the redelivery to be decided")
        gates.open(k)
        assert first.get(timeout=TIMEOUT) == k
        wait_until(lambda: not redis_server.client(2).exists(job.lock_key_for((k,)) + ":q"), TIMEOUT, 0.05,
                   "the redelivered copy to leave the line")
    assert len(runs.of(k)) == 1, "two messages with one token both held the lock"
    assert runs.of(k)[0].info["token"] != old  # taken back under a new token
    assert [e.policy for e in rec.of("duplicate_skipped", task_id=task_id)] == ["redelivery"]
    assert_no_overlap([(r.start, r.end) for r in runs.of(k)])
