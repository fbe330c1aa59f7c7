"""At the line's edges, each call keeps its identity: the redelivered parked message of a turn that
failed keeps its failure, the holder's redelivered copy is dropped wherever it stands, a release
retried after its first try ran says deleted and returns the hand-off, a requeued message that never
ran meets the skip policy, and a crashed plain waiter stops blocking the key within its lease.

In-process Celery workers, real broker redeliveries, and a plain waiter SIGKILLed by PID.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from _apps import make_app
from _task_support import RESTORE_FAST, TIMEOUT, Gates, Runs, TaskEvents, locked, redeliver

from celery_singleton_lock import LockServer
from celery_singleton_lock.engine.lock import Release
from celery_singleton_lock.testing.servers import wait_until

pytestmark = [pytest.mark.timeout(150), pytest.mark.usefixtures("collect_results")]


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
