"""The line keeps each call's identity through every redelivery and every recovery: a call waits
once, runs once, and ends in its own state, whatever was killed or lost.

Real ``celery worker`` subprocesses (prefork, acks_late + reject_on_worker_lost, so a SIGKILLed
child's message goes back to the broker and is redelivered), a real Redis broker, and real faults:
SIGKILL at a named point (CSL_TEST_KILL_AT, once per worker with CSL_TEST_KILL_ONCE) or by PID,
a real broker redelivery through kombu's restore, FLUSHDB of the test's own lock Redis.

* a parked delivery whose ack was lost is redelivered: it finds its entry and parks no second one;
* a hand-off copy SIGKILLed mid-body is redelivered: it runs again, once, to its end;
* a process SIGKILLed after the release and before Celery stored the result: the redelivery stores
  the recorded value and sends the chain, without running the body again;
* two messages carrying one ``singleton_lock_token`` never both hold the lock;
* the lock Redis flushed under a line of 40, or just before a burst of parks: no waiter lost, none
  run twice; and the lock Redis's persistence, checked at worker start;
* at the line's edges: the redelivered parked message of a turn that failed, the holder's
  redelivered copy, a release retried after its first try ran, a requeued message that never ran,
  a crashed plain waiter.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from _apps import make_app
from _line_support import Nodes, events, open_gate, parks, starts, wait_starts, worker_nodes
from _task_support import (
    RESTORE_FAST,
    TIMEOUT,
    Gates,
    Runs,
    TaskEvents,
    assert_no_overlap,
    load_worker_app,
    locked,
    redeliver,
)
from celery import chain

from celery_singleton_lock import LockServer
from celery_singleton_lock.engine.lock import Release
from celery_singleton_lock.testing.servers import wait_until

pytestmark = [pytest.mark.timeout(150), pytest.mark.usefixtures("collect_results")]

LOCK_TTL = 3.0
LATE = {"CSL_LOCK_TTL": str(LOCK_TTL), "CSL_JOURNAL_HANDOFF": "1", "CSL_ACKS_LATE": "1", "CSL_REJECT_ON_LOST": "1"}


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


# -- the lock Redis loses its data -----------------------------------------------------------------


@pytest.fixture(scope="module")
def flushable(redis_server, tmp_path_factory):
    """Two prefork workers x 2 children whose locks live on a Redis of their own (which the tests
    FLUSHDB); broker and results stay on the session's Redis."""
    from celery_singleton_lock.testing.servers import RedisServer

    n = Nodes()
    n.wa = load_worker_app(redis_server)
    n.queue = f"csl-li-flush-{uuid.uuid4().hex[:8]}"
    with RedisServer() as lock_redis:
        n.lock_redis, n.locks = lock_redis, lock_redis.client(0)
        env = {"CSL_LOCK_TTL": str(LOCK_TTL), "CSL_JOURNAL_HANDOFF": "1", "CSL_LOCK_URL": lock_redis.url(0)}
        specs = {f"flush{i}": (n.queue, 2, env) for i in range(2)}
        with worker_nodes(redis_server, tmp_path_factory.mktemp("flush"), specs) as started:
            n.workers = list(started.values())
            yield n


def _each_ran_once(wa, k: str, ids: list[str]) -> None:
    ran = [e["id"] for e in starts(wa, k)]
    twice = sorted({i for i in ran if ran.count(i) > 1})
    assert not twice, f"{len(twice)} task(s) ran more than once: {twice}"
    assert sorted(ran) == sorted(ids), f"{len(set(ids) - set(ran))} task(s) never ran"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_flush_during_a_line_of_40_loses_no_waiter_and_runs_none_twice(flushable):
    """40 waiters parked on one key behind a holder, from two nodes; the lock Redis is
    flushed (a restart without persistence). Every waiter runs exactly once and succeeds."""
    n, wa = flushable, flushable.wa
    k, key, holder = n.gated_holder("flush-line")
    try:
        wait_starts(wa, k, 1)
        waiters = [wa.in_line.apply_async((k, 0.05, f"w{i}"), queue=n.queue) for i in range(40)]
        wait_until(lambda: n.locks.llen(key + ":q") == 40, 60, 0.05, "40 waiters in line")
        n.locks.flushdb()  # the test's own lock Redis: the lock, the line and the parked messages go
    finally:
        open_gate(wa, k)
    holder.get(timeout=TIMEOUT)
    tags = sorted(w.get(timeout=90)["tag"] for w in waiters)
    assert tags == sorted(f"w{i}" for i in range(40))
    wait_until(lambda: len(starts(wa, k)) >= 41, TIMEOUT, 0.05, "every body")
    _each_ran_once(wa, k, [holder.id, *(w.id for w in waiters)])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_flush_before_a_burst_of_parks_runs_none_twice(flushable):
    """The lock Redis is flushed in a lull; a burst of 30 calls of one key follows at
    once, before the sweepers noticed the loss: each runs exactly once (the parks made after the
    loss are not sent again, and a copy whose entry already ran is not run again)."""
    n, wa = flushable, flushable.wa
    warm = f"flush-warm-{uuid.uuid4().hex[:8]}"
    assert wa.in_line.apply_async((warm, 0.0, "warm"), queue=n.queue).get(timeout=TIMEOUT)["tag"] == "warm"
    for w in n.workers:  # every process's sweeper has looked at the index (it learnt the epoch)
        wait_until(lambda w=w: n.locks.exists("singleton_lock:{waiting}:epoch"), TIMEOUT, 0.05, "an epoch")
    k = f"flush-burst-{uuid.uuid4().hex[:8]}"
    n.locks.flushdb()
    calls = [wa.in_line.apply_async((k, 0.1, f"c{i}"), queue=n.queue) for i in range(30)]
    tags = sorted(c.get(timeout=90)["tag"] for c in calls)
    assert tags == sorted(f"c{i}" for i in range(30))
    wait_until(lambda: len(starts(wa, k)) >= 30, TIMEOUT, 0.05, "every body")
    time.sleep(3 * 1.25)  # a wrong re-send would show within a few sweeper rounds: give it the chance
    _each_ran_once(wa, k, [c.id for c in calls])
    assert_no_overlap(list(_spans(wa, k).values()), "bodies of one key")


def _spans(wa, k: str) -> dict[str, tuple[float, float]]:
    out: dict[str, list[float]] = {}
    for e in events(wa, k):
        out.setdefault(e["id"], [0.0, 0.0])[0 if e["event"] == "start" else 1] = e["at"]
    return {i: (s, e) for i, (s, e) in out.items()}


# -- the lock Redis's persistence, checked at worker start -------------------------------------------


@pytest.mark.timeout(30)
def test_persistence_check_warns_on_a_redis_that_forgets_and_tolerates_config_disabled(caplog):
    """At worker start each lock server is checked once: a Redis with no AOF and no RDB save points
    gets a WARNING; one with appendonly on does not; one whose CONFIG is disabled (managed Redis)
    is left alone, without an error."""
    import logging

    from celery_singleton_lock.engine import persistence
    from celery_singleton_lock.testing.servers import RedisServer

    caplog.set_level(logging.WARNING, logger="celery_singleton_lock")
    with RedisServer() as forgets, RedisServer(extra_args=["--rename-command", "CONFIG", ""]) as managed:
        server = LockServer.from_url(forgets.url(0))
        assert persistence.check_once(server) is False
        assert any("keeps no data across a restart" in r.getMessage() for r in caplog.records)
        assert persistence.check_once(server) is None  # once per server and process
        forgets.client(0).config_set("appendonly", "yes")
        assert persistence.persistent(forgets.client(0)) is True
        caplog.clear()
        assert persistence.check_once(LockServer.from_url(managed.url(0))) is None
        assert not caplog.records


# -- at the line's edges: a failed turn's message, the holder's copy, a retried release, a crashed waiter --


@contextlib.contextmanager
def held_by_a_gated_call(redis_server, run_worker, prefix: str, conf: dict | None = None,
                         **opts) -> Iterator[SimpleNamespace]:
    """An ``app`` of its own (its own ``queue``, kombu restoring unacked messages every second, ``conf``
    on top); its ``job`` on ``k`` (with the options ``opts``), whose runs ``runs`` records: a mode
    "gate..." holds the key until the test opens ``gates``' gate of that name, "fail" raises
    ValueError; an in-process threads worker; and a ``holder`` of a new key ``k`` in mode "gate-1",
    running. ``rec``: the app's TaskEvents."""
    queue = f"q-{uuid.uuid4().hex[:8]}"
    app = make_app(redis_server, task_default_queue=queue, broker_transport_options=RESTORE_FAST, **(conf or {}))
    gates, runs = Gates(), Runs()

    @locked(app, lock_key=["k"], name=f"{prefix}_{uuid.uuid4().hex[:6]}.job", **opts)
    def job(self, k, mode):
        run = runs.begin(k, self.request.id, mode=mode)
        try:
            if mode.startswith("gate"):
                gates.wait(mode)
            if mode == "fail":
                raise ValueError("the waiter's run failed")
            return mode
        finally:
            runs.end(run)

    k = f"k-{uuid.uuid4().hex[:8]}"
    with TaskEvents(app) as rec, run_worker(app, pool="threads", concurrency=3):
        scene = SimpleNamespace(app=app, queue=queue, gates=gates, runs=runs, job=job, k=k, rec=rec)
        scene.holder = job.delay(k, "gate-1")
        runs.wait_started(k)
        yield scene


@pytest.mark.timeout(60)
def test_redelivery_of_a_parked_message_whose_turn_ran_and_failed_keeps_its_failure(redis_server, run_worker):
    """A waiter parks, takes its turn and FAILS; then the broker redelivers its original (parked)
    message, its ack lost, while another call holds the key. The redelivery must not park again: its
    WAITING would overwrite the FAILURE, and it would run a second time. It ends at once."""
    with held_by_a_gated_call(redis_server, run_worker, "li_fail", on_duplicate="retry", acks_late=True) as s:
        job, k, rec, holder = s.job, s.k, s.rec, s.holder
        waiter = job.delay(k, "fail")
        rec.wait_for("duplicate_skipped", task_id=waiter.id)  # parked
        s.gates.open("gate-1")
        with pytest.raises(ValueError):
            waiter.get(timeout=TIMEOUT)
        assert holder.get(timeout=TIMEOUT) == "gate-1"
        other = job.delay(k, "gate-2")
        wait_until(lambda: s.runs.of(k, other.id), TIMEOUT, 0.02, "another call to hold the key")
        redeliver(redis_server.client(0), job, (k, "fail"), waiter.id, s.queue)
        rec.wait_for("duplicate_skipped", task_id=waiter.id, count=2)
        meta = s.app.backend.get_task_meta(waiter.id, cache=False)
        assert meta["status"] == "FAILURE", f"the redelivery overwrote the FAILURE with {meta['status']}"
        s.gates.open("gate-2")
        assert other.get(timeout=TIMEOUT) == "gate-2"
        rec.wait_for("task_postrun", task_id=other.id)
    assert [r.task_id for r in s.runs.of(k)] == [holder.id, waiter.id, other.id], "the waiter ran twice"


@pytest.mark.timeout(30)
def test_a_redelivered_copy_of_the_holder_is_dropped_wherever_it_stands(plain_server):
    """Engine, real Redis: the running holder's redelivered copy waits in line (kind "s"), and
    another waiter went ahead of it (a copy re-parked at the head). The holder succeeds: its copy
    leaves the line at once, wherever it stands (before: only when it reached the head, and it was
    handed the key and ran the holder's body a second time)."""
    from celery_singleton_lock.engine import line as queue
    from celery_singleton_lock.engine.lock import slot_safe

    server = plain_server
    name = f"s-anywhere-{uuid.uuid4().hex[:8]}"
    key = slot_safe(name)
    holder = server.acquire(name, 5, owner_id="H")
    copy = queue.entry_for("H", 2)  # the holder's request had been retried twice
    assert queue.park(server, name, copy, kind="s", wait=60, ttl=5, owner_id="H",
                      message=b"m", first=True).place == 1
    assert queue.park(server, name, "ex", kind="t", wait=60, ttl=5, owner_id="X",
                      message=b"m", first=True).place == 1
    assert server.client.lrange(key + ":q", 0, -1) == [b"ex", copy.encode()]
    [turn] = server.release(holder, succeeded=True, retries=2).handoffs
    assert turn.owner_id == "X"
    # the handed waiter stays first until it claims; the holder's copy is gone from line and records
    assert server.client.lrange(key + ":q", 0, -1) == [b"ex"] and not server.client.hexists(key + ":w", copy)


@pytest.mark.timeout(30)
def test_release_retried_after_its_first_try_ran_says_deleted_and_returns_the_hand_off(plain_server):
    """Engine, real Redis: a release whose reply was lost (its first try ran: it deleted the lock and
    reserved the key for the parked waiter) is tried again (what releasing.release does after a
    timeout). The retry recognises its own hand-off: "deleted" (no false lock_lost), and it returns
    the waiter, to be sent now rather than when the reservation (one lock TTL) runs out."""
    from celery_singleton_lock.engine import line as queue

    server = plain_server
    sent: list = []
    server.send_handoff = lambda srv, handoff: sent.append(handoff) or True
    name = f"release-again-{uuid.uuid4().hex[:8]}"
    holder = server.acquire(name, 30, owner_id="H")
    assert queue.park(server, name, "ew", kind="t", wait=60, ttl=30, owner_id="W", message=b"m").place == 1
    server.send_handoff = None  # the first try's reply is lost: nobody sends its hand-off
    first = server.release(holder)
    assert first.status is Release.DELETED and [h.owner_id for h in first.handoffs] == ["W"]
    server.send_handoff = lambda srv, handoff: sent.append(handoff) or True
    again = server.release(holder, again=True)
    assert again.status is Release.DELETED, "the retry took its own hand-off for another holder's lock"
    assert [h.owner_id for h in again.handoffs] == ["W"] and [h.owner_id for h in sent] == ["W"]
    # a retry by a token that handed nothing on still finds the key another's
    other = server.acquire(f"{name}-2", 30, owner_id="O")
    stranger = type(other)(server, other.key, "not-the-token", 0, 30.0)
    assert server.release(stranger, again=True).status is Release.TAKEN


@pytest.mark.timeout(60)
@pytest.mark.parametrize("acks_late", [False, True])
def test_a_redelivery_that_never_ran_meets_the_skip_policy(redis_server, run_worker, acks_late):
    """A message requeued unstarted (prefetched when its worker restarted: kombu restores it with
    the redelivered flag) is no continuation of anything: under "skip" it is skipped (REVOKED), it
    does not bypass the policy. Provably unstarted: an early-acked task (acked as it starts), or an
    acks_late one with track_started and no state stored."""
    with held_by_a_gated_call(redis_server, run_worker, "li_prefetch", {"task_track_started": True},
                              on_duplicate="skip", acks_late=acks_late) as s:
        unstarted = str(uuid.uuid4())
        redeliver(redis_server.client(0), s.job, (s.k, "ok"), unstarted, s.queue)
        [event] = s.rec.wait_for("duplicate_skipped", task_id=unstarted)
        assert event.policy == "skip", f"a never-run redelivery bypassed skip ({event.policy})"
        wait_until(lambda: s.app.AsyncResult(unstarted).state == "REVOKED", TIMEOUT, 0.05, "REVOKED")
        s.gates.open("gate-1")
        assert s.holder.get(timeout=TIMEOUT) == "gate-1"
        s.rec.wait_for("task_postrun", task_id=unstarted)
    assert [r.task_id for r in s.runs.of(s.k)] == [s.holder.id]


PLAIN_WAITER = """
import sys, time
from celery_singleton_lock import LockServer, held
with held(LockServer.from_url(sys.argv[1]), sys.argv[2], ttl=2, wait=60):
    time.sleep(120)
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.long
def test_a_crashed_plain_waiter_stops_blocking_the_key_within_its_lease(redis_server):
    """A process waiting in held(..., wait=60) is SIGKILLed. It keeps its place alive only while it
    lives (PLAIN_LEASE), so the next waiter gets the key within that lease after the release, not
    after the dead one's whole 60 s wait (plain parks are not indexed for the sweepers)."""
    import subprocess
    import sys

    from _task_support import ROOT

    from celery_singleton_lock import held
    from celery_singleton_lock.engine.line import PLAIN_LEASE
    from celery_singleton_lock.engine.lock import slot_safe

    server = LockServer.from_url(redis_server.url(2))
    name = f"plain-dead-waiter-{uuid.uuid4().hex[:8]}"
    key = slot_safe(name)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    got: list = []

    def patient() -> None:
        try:
            with held(server, name, ttl=30, wait=40):
                got.append(time.monotonic())
        except Exception as exc:
            got.append(exc)

    proc = None
    try:
        with held(server, name, ttl=30):
            proc = subprocess.Popen([sys.executable, "-c", PLAIN_WAITER, redis_server.url(2), name], env=env)
            wait_until(lambda: server.client.llen(key + ":q") == 1, TIMEOUT, 0.02, "the doomed waiter to park")
            os.kill(proc.pid, signal.SIGKILL)  # our own subprocess, by PID
            proc.wait(10)
            killed_at = time.monotonic()
            thread = threading.Thread(target=patient, daemon=True)
            thread.start()
            wait_until(lambda: server.client.llen(key + ":q") == 2, TIMEOUT, 0.02, "the patient waiter to park")
        thread.join(45)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        server.close()
    assert got and isinstance(got[0], float), f"the live waiter never got the key: {got}"
    assert got[0] - killed_at <= PLAIN_LEASE + 2 + 3.0  # its lease, the dead one's reservation (ttl 2), slack
